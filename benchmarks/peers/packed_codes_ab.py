"""Side by side: the codes engine's decode step with 4-bit codes packed two per byte (the default)
and with one byte per code (as before), interleaved in one process.

    python -m benchmarks.peers.packed_codes_ab [--batches 1,4,8,16] [--context 128] [--rounds 12]
        # writes benchmarks/results/packed_codes_ab.json, prints one table; ~4 min on 2 cores

Both engines load the bundled SmolLM2 Q4_1 file with quantization="gguf"; for the second, packing is
switched off while it loads (`gguf_blocks.pack_nibbles` returns its input, under its own weights-cache
tag), so its tree holds [L, K/32, 32, N] codes and gguf_matmul takes its one-byte path. The rounds
alternate between every (layout, batch) pair, 3 steps each (`cpu_step_ab.interleave`). The greedy tokens
of one prompt are compared between the two. Internals used, read-only but for that switch:
`llm.engine.runner` (`execute`), `models.gguf_blocks.pack_nibbles`, `models.checkpoint.cached_params`,
`models.weights.load_model`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

from benchmarks.common import environment, format_table
from benchmarks.peers.cpu_step_ab import interleave
from benchmarks.peers.profile_cpu_decode import decode_step_input


@contextlib.contextmanager
def one_byte_per_code():
    """Loads with 4-bit codes left one per byte (and cached apart from the packed tree)."""
    from jaxpaged.models import checkpoint, gguf_blocks, weights

    pack, cached = gguf_blocks.pack_nibbles, checkpoint.cached_params
    gguf_blocks.pack_nibbles = lambda codes: codes
    checkpoint.cached_params = lambda files, dtype, convert, format_tag: cached(files, dtype, convert,
                                                                                format_tag=format_tag + "-one-byte")
    weights.load_model.cache_clear()
    try:
        yield
    finally:
        gguf_blocks.pack_nibbles, checkpoint.cached_params = pack, cached
        weights.load_model.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "packed_codes_ab.json"))
    args = parser.parse_args()
    import jax

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models import gguf_blocks

    batches = [int(b) for b in args.batches.split(",")]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    runs, tokens = [], {}
    for layout in ("packed", "one byte"):
        with one_byte_per_code() if layout == "one byte" else contextlib.nullcontext():
            llm = LLM(quantization="gguf", enable_prefix_caching=False, warmup=False)
        leaves = jax.tree_util.tree_flatten_with_path(llm.params)[0]
        codes = [leaf for path, leaf in leaves if gguf_blocks.leaf_name(path).endswith("_codes")]
        assert codes and all(gguf_blocks.is_packed(c) == (layout == "packed") for c in codes), [c.shape for c in codes]
        tokens[layout] = llm.generate(["The capital of France is"], greedy)[0].outputs[0].token_ids
        runner = llm.engine.runner  # internal, read-only
        for batch in batches:
            step_input = decode_step_input(runner, batch, args.context)
            runner.execute(step_input).block_until_ready()  # compiles
            runs.append({"layout": layout, "batch": batch, "codes_mb": sum(c.nbytes for c in codes) / 1e6,
                         "runner": runner, "input": step_input, "wall": []})
    load_start = os.getloadavg()
    interleave(runs, args.rounds)
    rows = [{"layout": r["layout"], "batch": r["batch"], "codes_mb": r["codes_mb"], "wall_best_ms": min(r["wall"]) * 1e3,
             "wall_median_ms": statistics.median(r["wall"]) * 1e3} for r in runs]
    report = {"benchmark": "packed_codes_ab", "environment": environment(),
              "loadavg": {"start": load_start, "end": os.getloadavg()},
              "workload": {"batches": batches, "context": args.context, "rounds": args.rounds, "steps_per_round": 3},
              "greedy_tokens_identical": tokens["packed"] == tokens["one byte"], "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"load {load_start[0]:.1f} -> {report['loadavg']['end'][0]:.1f}; greedy tokens identical: "
          f"{report['greedy_tokens_identical']}")
    print(format_table(rows, [(f"decode step, context {args.context}", "layout"), ("batch", "batch"), ("codes MB", "codes_mb"),
                              ("wall best ms", "wall_best_ms"), ("wall median", "wall_median_ms")]))


if __name__ == "__main__":
    main()
