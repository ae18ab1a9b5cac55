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
uses the blocked form on the CPU only (sampler.py `_inverse_cdf_draw`): GPU draws are unchanged.
"""

from __future__ import annotations

import jax
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


def successive_draws(
    probs: Float[Array, "num_rows vocab_size"], first: Int[Array, "num_rows"], u: Float[Array, "num_rows num_more"],
    blocked: bool,
) -> Int[Array, "num_rows num_candidates"]:
    """`first` (a row's draw), then num_more draws WITHOUT replacement: draw j comes from probs with
    every earlier draw of its row set to 0, at uniform u[:, j - 1]. Column 0 is `first`. A draw that
    finds no mass left (fewer tokens of positive probability than candidates) is -1, as are those
    after it. Structured outputs' candidates (rows.sample_first_padded): the first of them in
    a grammar's allowed set A is a draw from probs restricted to A (each draw, given that every
    earlier one fell outside A, is probs restricted to the tokens not yet drawn, which contain A).

        probs  0.5 0.3 0.2    first = 0            draw 1 from (0, 0.3, 0.2) / 0.5 at u = 0.7:
                                                   0.7 * 0.5 = 0.35 > 0.3  ->  token 2

    `blocked` (the CPU): the block totals of `blocked_draw` are summed once, each draw sums its
    predecessor's block again without the tokens drawn, then scans one block; otherwise each draw is a full
    cumulative sum over the row with the earlier draws zeroed (the GPU's `full_cdf_draw`). One
    loop iteration per draw (`fori_loop`: the program does not grow with num_more).
    """
    num_rows, vocab_size = probs.shape
    num_candidates = u.shape[1] + 1
    rows = jnp.arange(num_rows)
    taken = jnp.full((num_rows, num_candidates), -1, jnp.int32).at[:, 0].set(first)  # -1 matches no token
    num_blocks = -(-vocab_size // BLOCK)
    blocks = jnp.pad(probs, ((0, 0), (0, num_blocks * BLOCK - vocab_size))).reshape(num_rows, num_blocks, BLOCK)
    in_block = jnp.arange(BLOCK)  # [B]

    def not_drawn(block_idx, taken):  # [R, B]: each row's block `block_idx`, its drawn tokens set to 0
        ids = block_idx[:, None] * BLOCK + in_block  # [R, B]
        return jnp.where(jnp.any(ids[:, :, None] == taken[:, None, :], axis=2), 0.0, blocks[rows, block_idx])

    def blocked_next(j, taken, block_sums):
        threshold = u[:, j - 1] * jnp.sum(block_sums, axis=1)
        block_cdf = jnp.cumsum(block_sums, axis=1)
        block_idx = jnp.minimum(jnp.sum(block_cdf < threshold[:, None], axis=1), num_blocks - 1)  # [R]
        before = block_cdf[rows, block_idx] - block_sums[rows, block_idx]
        inside = not_drawn(block_idx, taken)
        idx = jnp.sum(jnp.cumsum(inside, axis=1) < (threshold - before)[:, None], axis=1)
        positive = inside > 0
        idx = jnp.clip(idx, jnp.argmax(positive, axis=1), BLOCK - 1 - jnp.argmax(positive[:, ::-1], axis=1))
        return jnp.minimum(block_idx * BLOCK + idx, vocab_size - 1)

    def full_next(j, taken, _):
        left = probs.at[rows[:, None], jnp.where(taken < 0, vocab_size, taken)].set(0.0, mode="drop")
        return full_cdf_draw(left, u[:, j - 1])

    def body(j, carry):
        taken, block_sums = carry
        last = taken[:, j - 1]
        if blocked:  # the last draw's block summed again over its tokens not yet drawn: subtracting its
            # probability instead would leave float32 rounding of the old sum (~6e-8 of a dominant
            # token's ~1) where the rest of the block holds as little, and skew the next draws
            block_idx = jnp.maximum(last, 0) // BLOCK
            block_sums = block_sums.at[rows, block_idx].set(
                jnp.where(last >= 0, jnp.sum(not_drawn(block_idx, taken), axis=1), block_sums[rows, block_idx]))
        token = (blocked_next if blocked else full_next)(j, taken, block_sums)
        # Nothing left to draw (or rounding landed on a drawn or zero-probability token): -1 from here on.
        valid = (last >= 0) & (probs[rows, token] > 0) & ~jnp.any(token[:, None] == taken, axis=1)
        return taken.at[:, j].set(jnp.where(valid, token, -1)), block_sums

    block_sums = jnp.sum(blocks, axis=2) if blocked else jnp.zeros((num_rows, 1))  # [R, nb]; unused off the CPU
    return jax.lax.fori_loop(1, num_candidates, body, (taken, block_sums))[0]
