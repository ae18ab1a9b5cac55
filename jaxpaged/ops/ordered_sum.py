"""Row sums whose order of additions is fixed by the row's length alone (EngineConfig.batch_invariant).

XLA:CPU picks a reduction's loop by the size of the whole input: a [T, 64] row sum ran one order
below 4096 elements and another above (T = 64 for SmolLM2-like rows of 64; T = 8 for rows of 576),
so a token's RMSNorm, or a logits row's log_softmax, changed in the last bit with the batch it sat
in. Here the sum is written as elementwise adds, which no compiler reorders (float addition is not
associative, and XLA does not reassociate without fast math):

    x [..., n] -> zero-padded to C * G * 16 -> [..., C, G, 16]
    level 1  per chunk c: ((g0 + g1) + g2) + ...     G - 1 adds of [..., C, 16]
    level 2  ((c0 + c1) + c2) + ...                  C - 1 adds of [..., 16]
    lanes    halves added pairwise: 16 -> 8 -> 4 -> 2 -> 1

with C = 1 for n <= 16 * MAX_UNROLLED (SmolLM2's hidden size: 36 adds, then 4) and C about
sqrt(n / 16) above. Every row of every batch takes the same adds, on any backend. Rows longer than
16 * MAX_UNROLLED (a vocabulary) on the CPU are summed by the dense_matmul kernel instead, as x @ ones:
its order is fixed by n and the thread count alone (ops/dense_matmul.py), and it ran a 16 x 49152
log_softmax's sum in 0.8 ms against 2.9 ms for the adds (measured on the shared 2-core box, loaded).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpaged.ops import dense_matmul

LANES = 16
MAX_UNROLLED = 128  # groups of 16 summed in one level; longer rows take two


def ordered_sum(x: jax.Array) -> jax.Array:
    """The sum over the last axis of `x` (float), in an order that depends on x.shape[-1] only."""
    n = x.shape[-1]
    if n > LANES * MAX_UNROLLED and x.dtype == jnp.float32 and jax.default_backend() == "cpu" and dense_matmul.enabled():
        flat = x.reshape(-1, n)  # [rows, n] @ ones [n, 16]: every column the row's sum
        return dense_matmul.dense_matmul(flat, jnp.ones((n, LANES), jnp.float32))[:, 0].reshape(x.shape[:-1])
    groups = math.ceil(n / LANES)
    chunks = 1 if groups <= MAX_UNROLLED else math.ceil(math.sqrt(groups))
    per_chunk = math.ceil(groups / chunks)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, chunks * per_chunk * LANES - n)])
    blocks = padded.reshape(*x.shape[:-1], chunks, per_chunk, LANES)
    acc = blocks[..., 0, :]  # [..., C, 16]
    for g in range(1, per_chunk):
        acc = acc + blocks[..., g, :]
    total = acc[..., 0, :]  # [..., 16]
    for c in range(1, chunks):
        total = total + acc[..., c, :]
    width = LANES
    while width > 1:
        width //= 2
        total = total[..., :width] + total[..., width:]
    return total[..., 0]


def ordered_log_softmax(x: jax.Array) -> jax.Array:
    """jax.nn.log_softmax over the last axis, its sum taken by `ordered_sum` (max is exact in any order)."""
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(ordered_sum(jnp.exp(shifted)))[..., None]
