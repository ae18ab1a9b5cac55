"""One uniform per row -> one token: the inverse-CDF draw the sampler ends with, in two forms.

Both return the first token whose cumulative probability reaches u * total. `full_cdf_draw` builds
the whole [rows, vocab] cumulative sum. `blocked_draw` finds the block first, then the token inside it:

    probs    0.1 0.0 | 0.6 0.3 | 0.0 0.0        u * total = 0.5, block = 2 tokens
    block sums   0.1 |     0.9 |     0.0        block cdf 0.1, 1.0, 1.0  -> block 1 (first to reach 0.5)
    inside block 1: 0.5 - 0.1 = 0.4 left; cumsum 0.6, 0.9                 -> its token 0 = token 2

A cumulative sum over the vocabulary is a log-depth scan on XLA:CPU: ~1.6 ms of a 2-core step at
16 x 49152, most of the sampler's cost at temperature > 0. The blocked form sums blocks (one pass)
and scans only the block totals and one block per row. Same distribution; the float rounding of the
partial sums differs, so a u within rounding of a token boundary may pick its neighbour. The sampler
uses the blocked form on the CPU only (device/sampler.py `_inverse_cdf_draw`): GPU draws are unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

BLOCK = 256  # tokens per block: SmolLM2's 49152 vocabulary is 192 blocks


def full_cdf_draw(
    probs: Float[Array, "num_rows vocab_size"], u: Float[Array, "num_rows"]
) -> Int[Array, "num_rows"]:
    """The first token whose cumulative probability reaches u (of the row's total)."""
    cdf = jnp.cumsum(probs, axis=1)
    threshold = u[:, None] * cdf[:, -1:]  # the total is 1 up to rounding
    drawn = jnp.sum(cdf < threshold, axis=1).astype(jnp.int32)
    return jnp.minimum(drawn, probs.shape[1] - 1)


def blocked_draw(
    probs: Float[Array, "num_rows vocab_size"], u: Float[Array, "num_rows"], block: int = BLOCK
) -> Int[Array, "num_rows"]:
    """`full_cdf_draw` by block totals, then a cumulative sum inside the one block each row lands in.
    The token is always one of positive probability when the row has any (rounding is clamped to the
    block's first / last such token)."""
    num_rows, vocab_size = probs.shape
    num_blocks = -(-vocab_size // block)
    padded = jnp.pad(probs, ((0, 0), (0, num_blocks * block - vocab_size)))  # zeros: never drawn
    blocks = padded.reshape(num_rows, num_blocks, block)  # [R, nb, B]
    block_sums = jnp.sum(blocks, axis=2)  # [R, nb]
    block_cdf = jnp.cumsum(block_sums, axis=1)
    threshold = u * block_cdf[:, -1]  # [R]
    block_idx = jnp.minimum(jnp.sum(block_cdf < threshold[:, None], axis=1), num_blocks - 1)  # [R]
    rows = jnp.arange(num_rows)
    before = block_cdf[rows, block_idx] - block_sums[rows, block_idx]  # mass of the blocks before it
    inside = blocks[rows, block_idx]  # [R, B]
    idx = jnp.sum(jnp.cumsum(inside, axis=1) < (threshold - before)[:, None], axis=1)
    positive = inside > 0
    first = jnp.argmax(positive, axis=1)
    last = block - 1 - jnp.argmax(positive[:, ::-1], axis=1)
    idx = jnp.clip(idx, first, last)
    return jnp.minimum(block_idx * block + idx, vocab_size - 1).astype(jnp.int32)
