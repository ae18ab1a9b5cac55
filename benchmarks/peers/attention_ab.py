"""Two versions of the CPU attention (jaxpaged/ops/attention.py) side by side in one process.

    git show <rev>:jaxpaged/ops/attention.py > /tmp/attention_before.py
    python -m benchmarks.peers.attention_ab /tmp/attention_before.py [--engine-args '{"quantization": "gguf"}']
        # writes benchmarks/results/cpu_attention_ab.json; ~8 min on 2 cores

"before" is `chunked_paged_attention_from_buffer` of the given file, "after" the working tree's.
Measured interleaved (before, after, before, ...), so both see the same machine from minute to minute:
  1. alone: decode attention of 16 sequences through 30 layers (a lax.scan, SmolLM2's 3 KV heads x
     3 query heads of 64), over a 4096-page buffer, at 64-512 keys;
  2. in the engine: two LLMs (the same engine arguments, each compiled with its own attention), the
     decode step of 16 sequences at 128 and 768 keys (`runner.execute`, as profile_cpu_decode does),
     and the greedy tokens of one generate call, which must agree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

import numpy as np

from benchmarks.common import environment, format_table
from benchmarks.peers.profile_cpu_decode import decode_step_input

ROUNDS = 14


def _load(path: str):
    spec = importlib.util.spec_from_file_location("attention_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chunked_paged_attention_from_buffer


def _interleaved(calls: dict, rounds: int = ROUNDS) -> dict:
    """{name: (best ms, median ms)} of zero-argument calls that block, run in turn `rounds` times."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return {name: (min(v) * 1e3, float(np.median(v)) * 1e3) for name, v in times.items()}


def alone(fns: dict, contexts=(64, 128, 256, 512)) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxpaged.ops.attention import reference_paged_attention

    layers, kv_heads, group, head_dim, page_size, num_pages, batch = 30, 3, 3, 64, 16, 4096, 16
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal((layers, 2, kv_heads, num_pages, page_size, head_dim), np.float32))
    q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, head_dim), np.float32))
    query_start_loc = jnp.arange(batch + 1, dtype=jnp.int32)
    rows = []
    for context in contexts:
        pages = -(-context // page_size)
        tables = np.zeros((batch, 128), np.int32)
        for i in range(batch):
            tables[i, :pages] = 1 + i * pages + np.arange(pages)
        tables, seq_lens = jnp.asarray(tables), jnp.full((batch,), context, jnp.int32)
        want = reference_paged_attention(q, kv[5, 0], kv[5, 1], tables[:, :pages], seq_lens, query_start_loc, scale=0.125)

        def through_layers(fn):
            def body(x, layer):
                out = fn(x, kv, tables, seq_lens, query_start_loc, layer_idx=layer, scale=0.125, decode_only=True)
                return x + out * 1e-3, None

            run = jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(layers, dtype=jnp.int32))[0])
            run(q).block_until_ready()
            return lambda: run(q).block_until_ready()

        errors = {name: float(jnp.max(jnp.abs(fn(q, kv, tables, seq_lens, query_start_loc, layer_idx=jnp.int32(5),
                                                    scale=0.125, decode_only=True) - want)))
                  for name, fn in fns.items()}
        timed = _interleaved({name: through_layers(fn) for name, fn in fns.items()})
        rows.append({"where": f"alone, {context} keys", **{f"{n}_best_ms": t[0] for n, t in timed.items()},
                     **{f"{n}_median_ms": t[1] for n, t in timed.items()},
                     **{f"{n}_max_err_vs_reference": e for n, e in errors.items()}})
        print(rows[-1], flush=True)
    return rows


def in_engine(before_fn, engine_args: dict, contexts=(128, 768)) -> tuple[list[dict], bool]:
    import jaxpaged.ops.attention as attention
    from jaxpaged import LLM, SamplingParams

    after_fn = attention.chunked_paged_attention_from_buffer
    llms = {"after": LLM(enable_prefix_caching=False, **engine_args)}
    attention.chunked_paged_attention_from_buffer = before_fn  # what device/backends.py hands the next build
    try:
        llms["before"] = LLM(enable_prefix_caching=False, **engine_args)
    finally:
        attention.chunked_paged_attention_from_buffer = after_fn
    rows = []
    for context in contexts:
        calls = {}
        for name, llm in llms.items():
            runner = llm.engine.runner
            step = decode_step_input(runner, 16, context)
            runner.execute(step).block_until_ready()
            calls[name] = lambda r=runner, s=step: r.execute(s).block_until_ready()
        timed = _interleaved(calls)
        rows.append({"where": f"engine step, batch 16, {context} keys", **{f"{n}_best_ms": t[0] for n, t in timed.items()},
                     **{f"{n}_median_ms": t[1] for n, t in timed.items()}})
        print(rows[-1], flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, 100).tolist() for _ in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {name: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] for name, llm in llms.items()}
    return rows, tokens["before"] == tokens["after"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="a version of jaxpaged/ops/attention.py (git show REV:jaxpaged/ops/attention.py)")
    parser.add_argument("--engine-args", default='{"quantization": "gguf"}', help="JSON of LLM keyword arguments")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "cpu_attention_ab.json"))
    args = parser.parse_args()
    from jaxpaged.ops.attention import chunked_paged_attention_from_buffer

    before = _load(args.before)
    rows = alone({"before": before, "after": chunked_paged_attention_from_buffer})
    engine_rows, same_tokens = in_engine(before, json.loads(args.engine_args))
    rows += engine_rows
    for row in rows:
        row["after_over_before_best"] = row["after_best_ms"] / row["before_best_ms"]
    report = {"benchmark": "attention_ab", "environment": environment(), "before": args.before,
              "engine_args": json.loads(args.engine_args), "rounds": ROUNDS, "rows": rows,
              "greedy_tokens_identical": same_tokens}
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(format_table(rows, [("decode attention", "where"), ("before best ms", "before_best_ms"),
                              ("after best ms", "after_best_ms"), ("after/before", "after_over_before_best"),
                              ("before median", "before_median_ms"), ("after median", "after_median_ms")]))
    print(f"greedy tokens identical: {same_tokens}")


if __name__ == "__main__":
    main()
