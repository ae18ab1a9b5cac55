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
sqrt(n / 16) above (a 49152-token vocabulary: 64 chunks of 48). Every row of every batch takes the
same adds, on any backend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LANES = 16
MAX_UNROLLED = 128  # groups of 16 summed in one level; longer rows take two


def ordered_sum(x: jax.Array) -> jax.Array:
    """The sum over the last axis of `x` (float), in an order that depends on x.shape[-1] only."""
    n = x.shape[-1]
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
