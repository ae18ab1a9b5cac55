"""SmolLM2's 210 layer projections alone: GGUF codes served as panels (gguf_panels) against GGUF's own
layout (gguf_matmul), interleaved in one process (issue 31).

    python -m benchmarks.peers.panels_projection_harness [--rows 1 4 8 16 64 256] [--rounds 7]
        # writes benchmarks/results/panels_projection_harness.json; ~3 min on 2 cores

The bundled Q4_1 file's projections, loaded as the engine loads them (quantization="gguf": 4-bit codes
packed two per byte), then converted as the CPU runner serves them (gguf_blocks.to_panels). One jitted
program per layout runs the 7 projections of all 30 layers on a fixed x (each reads its whole weight
once: 53 MB of codes plus 27 MB of scales and minimums either way); per row count, each round times one
call of each in turn, best and median kept. Both layouts' products of one layer are compared with a
float64 product (float32 summation order only).

    python -m benchmarks.peers.panels_projection_harness --q8-1 --out benchmarks/results/panels_projection_harness_q8_1.json
        # and the same panels against Q8_1 activations (gguf_panels_q8: gguf_activations="q8_1")
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

NAMES = [("attn", n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [("mlp", n) for n in ("gate_proj", "up_proj", "down_proj")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--q8-1", action="store_true",
                        help="also the panels against Q8_1 activations (gguf_panels_q8, gguf_activations='q8_1')")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "panels_projection_harness.json"))
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    from benchmarks.common import environment, format_table
    from jaxpaged.models import gguf_blocks
    from jaxpaged.models.weights import load_model
    from jaxpaged.ops import gguf_matmul, gguf_panels

    _, params, _ = load_model(None, "float32", "gguf")
    blocks = jax.tree.map(jnp.asarray, {"params": {"layers": {g: dict(params["params"]["layers"][g]) for g in ("attn", "mlp")}}})
    panels = gguf_blocks.to_panels(blocks)
    blocks, panels = blocks["params"]["layers"], panels["params"]["layers"]
    num_layers = blocks["attn"]["q_proj_codes"].shape[0]

    def inputs(x):  # each projection's x [M, in] from x [M, D]: only down_proj's in differs (the MLP width)
        f = blocks["mlp"]["down_proj_scales"].shape[1] * 32
        return {"down_proj": jnp.tile(x, (1, -(-f // x.shape[1])))[:, :f]}

    def run(layout):
        def fn(x):
            xs, total = inputs(x), jnp.float32(0)
            for layer in range(num_layers):
                for group, name in NAMES:
                    xi = xs.get(name, x)
                    if layout in ("panels", "panels_q8"):
                        leaves = (panels[group][name + s] for s in gguf_blocks.PANEL_SUFFIXES)
                        multiply = gguf_panels.gguf_panels_q8 if layout == "panels_q8" else gguf_panels.gguf_panels
                        y = multiply(xi, *leaves, layer)
                    else:
                        leaves = (blocks[group][name + s] for s in gguf_blocks.SUFFIXES)
                        y = gguf_matmul.gguf_matmul(xi, *leaves, layer)
                    total = total + y[:, :1].sum()  # keeps every call; reads a column of each product
            return total
        return jax.jit(fn)

    fns = {"panels": run("panels"), "blocks": run("blocks"), **({"panels_q8": run("panels_q8")} if args.q8_1 else {})}
    # One layer's up_proj both ways against float64.
    x1 = jnp.asarray(np.random.default_rng(1).standard_normal((5, 576)).astype(np.float32))
    want = np.asarray(x1, np.float64) @ np.asarray(gguf_matmul.reference(
        jnp.eye(576, dtype=jnp.float32), *(blocks["mlp"]["up_proj" + s] for s in gguf_blocks.SUFFIXES), 3), np.float64)
    errors = {"panels": float(np.abs(np.asarray(gguf_panels.gguf_panels(x1, *(panels["mlp"]["up_proj" + s] for s in
                                                                            gguf_blocks.PANEL_SUFFIXES), 3)) - want).max()),
              "blocks": float(np.abs(np.asarray(gguf_matmul.gguf_matmul(x1, *(blocks["mlp"]["up_proj" + s] for s in
                                                                             gguf_blocks.SUFFIXES), 3)) - want).max())}
    rows_out = []
    for m in args.rows:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((m, 576)).astype(np.float32))
        for f in fns.values():
            f(x).block_until_ready()
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                t = time.perf_counter()
                f(x).block_until_ready()
                times[k].append(time.perf_counter() - t)
        rows_out.append({"rows": m, **{f"{k}_best_ms": min(v) * 1e3 for k, v in times.items()},
                         **{f"{k}_median_ms": statistics.median(v) * 1e3 for k, v in times.items()},
                         "panels_over_blocks": min(times["panels"]) / min(times["blocks"]),
                         **({"q8_over_panels": min(times["panels_q8"]) / min(times["panels"])} if args.q8_1 else {})})
    nbytes = {k: sum(int(v.nbytes) for g in tree.values() for v in g.values()) for k, tree in
              (("panels", panels), ("blocks", blocks))}
    report = {"benchmark": "panels_projection_harness", "environment": environment(), "bytes": nbytes,
              "max_abs_error_one_layer": errors, "rounds": args.rounds, "rows": rows_out}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"bytes: panels {nbytes['panels'] / 1e6:.1f} MB, blocks {nbytes['blocks'] / 1e6:.1f} MB; one layer's "
          f"up_proj vs float64: panels {errors['panels']:.2e}, blocks {errors['blocks']:.2e}")
    print(format_table(rows_out, [("rows", "rows"), ("panels best ms", "panels_best_ms"), ("blocks best ms", "blocks_best_ms"),
                                  ("panels median", "panels_median_ms"), ("blocks median", "blocks_median_ms"),
                                  ("panels/blocks", "panels_over_blocks"),
                                  *([("q8_1 best ms", "panels_q8_best_ms"), ("q8_1/panels", "q8_over_panels")]
                                    if args.q8_1 else [])]))


if __name__ == "__main__":
    main()
