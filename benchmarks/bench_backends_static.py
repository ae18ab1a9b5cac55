"""Triton ("pallas") against Mosaic GPU ("mosaic") on the H100 static profile: which GPU default (issue 49).

    python -m benchmarks.bench_backends_static            # ~10 min on 2 cores: 12 step compiles
    python -m benchmarks.bench_backends_static --quick    # Qwen3-0.6B batch 256, context 1024 only

The same decode steps compiled for an H100 with each backend (jaxpaged/static_profile/step_profile.py),
bf16 KV (Mosaic's only KV dtype), and the rule EngineConfig applies to `attention_backend="auto"` on a
GPU: Mosaic where its launches and HBM bytes are at most Triton's in every case. Needs the toolchain
(scripts/install_h100_toolchain.sh). EVERY FIGURE IS AN ESTIMATE read from the compiled program.
JSON: benchmarks/results/backends_static_jax<version>.json (one per JAX version: the lowering differs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, h100_child_rows

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FIELDS = ("launches", "hbm_bytes", "bytes_to_ideal", "floor_ms", "temp_bytes")


def cases(quick: bool) -> list[dict]:
    shapes = [("qwen3-0.6b", 256, 1024)]
    if not quick:
        shapes += [("qwen3-0.6b", b, ctx) for b, ctx in ((1, 1024), (16, 1024), (64, 1024), (256, 4096))]
        shapes += [("llama3-8b", 64, 2048)]
    return [dict(model=m, kv_cache_dtype="auto", num_seqs=b, context=ctx) for m, b, ctx in shapes]


def child(args) -> None:
    from jaxpaged.static_profile.step_profile import StepCase, profile

    rows = []
    for case in cases(args.quick):
        row = dict(case)
        for backend in ("pallas", "mosaic"):
            figures = profile(StepCase(backend=backend, **case), kernels=False)
            row[backend] = {k: figures[k] for k in FIELDS}
        row["mosaic_at_least_triton"] = all(row["mosaic"][k] <= row["pallas"][k] for k in ("launches", "hbm_bytes"))
        print(_line(row), flush=True)
        rows.append(row)
    with open(args.child_out, "w") as f:
        json.dump(rows, f)


def _line(r: dict) -> str:
    p, m = r["pallas"], r["mosaic"]
    return (f"{r['model']:<11} b={r['num_seqs']:<4} ctx={r['context']:<5} launches pallas {p['launches']:>4} mosaic "
            f"{m['launches']:>4} | HBM GB pallas {p['hbm_bytes'] / 1e9:8.4f} mosaic {m['hbm_bytes'] / 1e9:8.4f} | "
            f"floor ms pallas {p['floor_ms']:7.3f} mosaic {m['floor_ms']:7.3f} | mosaic >= triton: "
            f"{r['mosaic_at_least_triton']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Qwen3-0.6B batch 256, context 1024 only")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_out:
        child(args)
        return 0
    import jax

    os.makedirs(args.out, exist_ok=True)
    rows = h100_child_rows("benchmarks.bench_backends_static", ["--quick"] if args.quick else [], args.out,
                           "backends_static")
    result = {"environment": environment(), "label": "ESTIMATES from the compiled H100 program; nothing ran on a GPU",
              "mosaic_at_least_triton_everywhere": all(r["mosaic_at_least_triton"] for r in rows), "rows": rows}
    if not args.quick:
        with open(os.path.join(args.out, f"backends_static_jax{jax.__version__}.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("\n(estimates) jax", jax.__version__)
    for r in rows:
        print(_line(r))
    print("mosaic at least triton in every case:", result["mosaic_at_least_triton_everywhere"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
