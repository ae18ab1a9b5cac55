"""The CPU matmul kernels alone: SmolLM2's seven layer projections over 30 stacked layers, as the model's
scan calls them, at a few row counts (issue 31; the peers README's ninth and tenth passes).

    python -m benchmarks.peers.matmul_kernel_harness --kernel dense [--rows 1,4,16,32] [--label new]
        # prints one JSON line: best ms of 15 calls per row count, 30 layers and one layer (in cache)

`--kernel dense`: float32 weights (ops/cpu/dense_matmul.cc); `gguf`: random 4-bit codes packed two per
byte (ops/cpu/gguf_matmul.cc). "30 layers" reads every layer's weights from memory, as a decode step
does; "one layer" multiplies layer 0 thirty times, its weights in cache: the kernel's arithmetic alone.
Two builds compare by running this from two checkouts in alternation (`git worktree add /tmp/old REV`,
then `PYTHONPATH=/tmp/old python -m ...` and `PYTHONPATH=. python -m ...`, a few times each): the
kernels are built per source, so the two do not share a library. Random weights; nothing is checked
here (tests/test_dense_matmul.py and tests/test_gguf_matmul.py do).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

LAYERS, HIDDEN, INTERMEDIATE = 30, 576, 1536
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, 192), (HIDDEN, 192), (HIDDEN, HIDDEN),  # q, k, v, o
          (HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]  # gate, up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=["dense", "gguf"], default="dense")
    parser.add_argument("--rows", default="1,4,16,32")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.gguf_blocks import pack_nibbles
    from jaxpaged.ops.dense_matmul import dense_matmul
    from jaxpaged.ops.gguf_matmul import gguf_matmul

    rng = np.random.default_rng(0)
    if args.kernel == "dense":
        weights = [(jnp.asarray(rng.standard_normal((LAYERS, k, n), dtype=np.float32) * 0.02),) for k, n in SHAPES]
        matmul = dense_matmul
    else:
        weights = [(jnp.asarray(pack_nibbles(rng.integers(0, 16, (LAYERS, k // 32, 32, n), dtype=np.uint8))),
                    jnp.asarray(rng.random((LAYERS, k // 32, n), dtype=np.float32) * 0.01),
                    jnp.asarray(-rng.random((LAYERS, k // 32, n), dtype=np.float32) * 0.05)) for k, n in SHAPES]
        matmul = gguf_matmul

    def layers(x, weights, one_layer: bool):
        def body(h, layer):
            at = 0 if one_layer else layer
            q, k, v = (matmul(h, *weights[i], at) for i in range(3))
            o = matmul(q, *weights[3], at)
            gate, up = matmul(h, *weights[4], at), matmul(h, *weights[5], at)
            down = matmul(jnp.tanh(gate) * up, *weights[6], at)
            return jnp.tanh(h + 0.01 * (o + down + jnp.tile(k + v, 3))), None

        return jax.lax.scan(body, x, jnp.arange(LAYERS))[0]

    run = jax.jit(layers, static_argnums=2)
    result = {"kernel": args.kernel, "label": args.label, "best_ms": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN)).astype(np.float32))
        for one_layer in (False, True):
            run(x, weights, one_layer).block_until_ready()
            times = []
            for _ in range(15):
                t = time.perf_counter()
                run(x, weights, one_layer).block_until_ready()
                times.append(time.perf_counter() - t)
            result["best_ms"][f"{rows} rows, {'one layer' if one_layer else '30 layers'}"] = round(min(times) * 1e3, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
