"""One MoE layer's routed experts compiled for an H100 on this CPU, three ways, and read (static profile).

    python -m benchmarks.bench_moe_static

For Qwen3-Next-80B-A3B's experts (512, top-10, D 2048, F 512) and gpt-oss-20b's (32, top-4, D 2880,
F 2880), bf16, at 1 and 64 tokens (decode) and 4096 tokens (a prefill), models/moe.py grouped_experts
with its projections as:

    ragged_dot  `jax.lax.ragged_dot`, XLA:GPU's lowering (the CPU path's form)
    kernel      ops/grouped_matmul.py's Pallas (Triton) kernel (the GPU path: models/moe.py experts_for)
    take        pure XLA: each (token, expert) pair's weights gathered (`jnp.take`) and one batched dot
                per projection; reads and copies T*k weight matrices, so decode sizes only

Each row: launches, HBM bytes (hlo_accounting: a Pallas kernel is charged its operands whole, so the
kernel's rows count every expert's weight although its programs load only the routed experts': an
upper bound), the ideal (the experts some token is routed to under uniform routing, read once, plus the
rows in and out), XLA's executed matmul FLOPs (a Pallas kernel's are not in the HLO: its upper bound
`kernel_flops_bound` = 2 x tile rows x K x N over its grid) against the useful 2 x T x k x 3 x D x F.

EVERY FIGURE IS AN ESTIMATE read from the compiled program; nothing ran on a GPU.
JSON: benchmarks/results/h100_static_moe.json.
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
MODELS = {"qwen3-next-80b-a3b": dict(experts=512, top_k=10, dim=2048, ffn=512),
          "gpt-oss-20b": dict(experts=32, top_k=4, dim=2880, ffn=2880)}
TOKENS = (1, 64, 4096)


def take_experts(x, expert_ids, weights, w_gate, w_up, w_down, *, act: str):
    """The pure-XLA alternative: every pair's expert weights gathered, then batched dots (no sort)."""
    import jax.numpy as jnp

    from jaxpaged.models.moe import gated

    gate = jnp.einsum("TD,TKDF->TKF", x, jnp.take(w_gate, expert_ids, axis=0))
    up = jnp.einsum("TD,TKDF->TKF", x, jnp.take(w_up, expert_ids, axis=0))
    out = jnp.einsum("TKF,TKFD->TKD", gated(act, gate, up).astype(x.dtype), jnp.take(w_down, expert_ids, axis=0),
                     preferred_element_type=jnp.float32)
    return jnp.einsum("TKD,TK->TD", out, weights).astype(x.dtype)


def child(out_path: str) -> None:
    import jax.numpy as jnp

    from jaxpaged.models import moe
    from jaxpaged.ops import grouped_matmul as gm
    from jaxpaged.static_profile.hlo_accounting import account
    from jaxpaged.static_profile.target import compile_for_h100, spec

    rows = []
    for model, s in MODELS.items():
        e, k, d, f = s["experts"], s["top_k"], s["dim"], s["ffn"]
        for t in TOKENS:
            args = (spec((t, d), jnp.bfloat16), spec((t, k), jnp.int32), spec((t, k), jnp.float32),
                    spec((e, d, f), jnp.bfloat16), spec((e, d, f), jnp.bfloat16), spec((e, f, d), jnp.bfloat16))
            touched = e * (1 - (1 - k / e) ** t)  # experts some token is routed to (uniform routing)
            ideal = touched * 3 * d * f * 2 + 2 * t * d * 2 + t * k * 8
            useful = 2 * t * k * 3 * d * f
            variants = {"ragged_dot": moe.grouped_experts, "kernel": moe.experts_for("cuda")}
            if t * k <= 640:
                variants["take"] = take_experts
            for name, fn in variants.items():
                try:
                    out = compile_for_h100(lambda *a, fn=fn: fn(*a, act="silu"), args)
                except Exception as err:  # report the case, keep going
                    rows.append(dict(model=model, tokens=t, variant=name, error=f"{type(err).__name__}: {str(err)[:300]}"))
                    continue
                acc = account(out.hlo_text)
                row = dict(model=model, tokens=t, variant=name, launches=acc.num_launches, hbm_bytes=acc.hbm_bytes,
                           ideal_bytes=int(ideal), bytes_to_ideal=round(acc.hbm_bytes / ideal, 3),
                           xla_matmul_flops=acc.flops, useful_flops=useful,
                           xla_flops_to_useful=round(acc.flops / useful, 3), by_kind=acc.by_kind(),
                           temp_bytes=out.compiled.memory_analysis().temp_size_in_bytes,
                           compile_s=round(out.compile_seconds, 2))
                if name == "kernel":
                    bm, _, _, tiles = gm.tiles(t * k, e, d, f)
                    row["kernel_flops_bound"] = 2 * tiles * bm * 3 * d * f
                    row["kernel_flops_bound_to_useful"] = round(row["kernel_flops_bound"] / useful, 3)
                rows.append(row)
                print(_line(row), flush=True)
    with open(out_path, "w") as fh:
        json.dump(rows, fh)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<20} T={r['tokens']:<5} {r['variant']:<10} ERROR {r['error']}"
    bound = f" kernel_flops_bound_x={r['kernel_flops_bound_to_useful']}" if "kernel_flops_bound" in r else ""
    return (f"{r['model']:<20} T={r['tokens']:<5} {r['variant']:<10} launches={r['launches']:<4} "
            f"GB={r['hbm_bytes'] / 1e9:8.3f} ideal_GB={r['ideal_bytes'] / 1e9:7.3f} x_ideal={r['bytes_to_ideal']:8.3f} "
            f"xla_matmul_flops_x={r['xla_flops_to_useful']}{bound} temp_MB={r['temp_bytes'] / 1e6:.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_out:
        child(args.child_out)
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows = h100_child_rows("benchmarks.bench_moe_static", [], args.out, "h100_static_moe")
    result = {"environment": environment(), "label": "ESTIMATES from the compiled H100 program of one MoE layer's "
              "experts; a Pallas kernel is charged its operands whole (an upper bound for the grouped kernel, whose "
              "programs load only routed experts' weights). Nothing here ran on a GPU.", "rows": rows}
    with open(os.path.join(args.out, "h100_static_moe.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print("\n(estimates from the compiled H100 program)")
    for r in rows:
        print(_line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
