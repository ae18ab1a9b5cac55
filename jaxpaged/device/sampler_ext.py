"""The sampler with logprobs and penalties: `sample`'s draw, plus what RL loops and evals read.

Steps in which no row asks for logprobs or uses penalties / logit_bias / allowed_token_ids run
`sampler.sample` unchanged (nothing extra computed or copied back). Any other step runs
`sample_ext`, which draws exactly as `sample` does from the penalized logits:

    raw ─► + bias, penalties (token_state.py; only with `penalties`) ─► banned ids ─► sample's draw
    logprobs of every row under `dist`:
        "raw_logprobs":       log_softmax(raw)                       (the model's distribution)
        "processed_logprobs": log_softmax(what the row drew from)    (penalized, temperature-scaled,
                              top-k/top-p/min-p filtered, -inf outside the kept set; greedy rows:
                              penalized and banned, unscaled)
    chosen logprob, its 1-based rank (1 + #ids with a larger logprob), and the top NUM_TOP_LOGPROBS
    (values descending, ties: lower id first) of every row.

Fixed shapes: the top-k width is always NUM_TOP_LOGPROBS (the host slices each row to its k), so a
step compiles once per (rows, penalties or not) and the mode; the engine warms them all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.device.sampler import (
    GREEDY_TEMPERATURE, SamplingArrays, _branch_free, _inverse_cdf_draw, _mask_banned, _processed_logits,
    _row_uniforms, apply_token_bitmask,
)
from jaxpaged.device.token_state import PenaltyArrays, TokenState, add_tokens, apply_penalties

NUM_TOP_LOGPROBS = 20  # = planner.request.MAX_LOGPROBS: the width every row's top logprobs are taken at
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@functools.partial(jax.jit, static_argnames=("logprobs_mode", "num_out", "branch_free"), donate_argnames=("state",))
def sample_ext(
    logits: Float[Array, "num_seqs vocab_size"], params: SamplingArrays, penalties: PenaltyArrays | None,
    state: TokenState | None, token_bitmask: Int[Array, "num_rows num_words"], *, logprobs_mode: str, num_out: int,
    branch_free: bool | None = None,
):
    """Returns (tokens int32 [num_out] padded with 0, logprobs dict of device arrays, the updated state).

    logprobs: "chosen" f32 [R], "rank" int32 [R], "top_values" f32 [R, 20], "top_ids" int32 [R, 20].
    `penalties` None (and state None) skips the penalty path: a separate compiled program.
    `token_bitmask`: the structured-output mask (all ones for rows without a grammar), applied after
    the penalties and before the min_tokens ban, as `sample` applies it.
    """
    raw = logits.astype(jnp.float32)[params.row_idx]  # [R, V]
    x = raw if penalties is None else apply_penalties(raw, state, penalties)
    allowed = _mask_banned(apply_token_bitmask(x, token_bitmask), params.banned_ids)
    greedy_ids = jnp.argmax(allowed, axis=1).astype(jnp.int32)
    is_random = params.temperature >= GREEDY_TEMPERATURE
    branch_free = _branch_free(branch_free)

    def random_path():
        processed = _processed_logits(allowed, params, branch_free)
        drawn = _inverse_cdf_draw(processed, _row_uniforms(params))
        return jnp.where(is_random, drawn, greedy_ids), jnp.where(is_random[:, None], processed, allowed)

    if branch_free:
        token_ids, processed = random_path()
    else:
        token_ids, processed = jax.lax.cond(jnp.any(is_random), random_path, lambda: (greedy_ids, allowed))
    if penalties is not None:
        state = add_tokens(state, penalties.slot, token_ids)

    dist = raw if logprobs_mode == "raw_logprobs" else processed
    logprobs = jax.nn.log_softmax(dist, axis=1)
    out = token_logprobs(logprobs, token_ids)
    tokens = jnp.pad(token_ids, (0, num_out - token_ids.shape[0]))
    return tokens, out, state


def token_logprobs(logprobs: Float[Array, "rows vocab_size"], token_ids: Int[Array, "rows"]) -> dict:
    """The chosen ids' logprobs and 1-based ranks, and each row's top NUM_TOP_LOGPROBS."""
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=1)
    rank = 1 + jnp.sum(logprobs > chosen, axis=1).astype(jnp.int32)
    top_values, top_ids = jax.lax.top_k(logprobs, min(NUM_TOP_LOGPROBS, logprobs.shape[1]))
    return {"chosen": chosen[:, 0], "rank": rank, "top_values": top_values, "top_ids": top_ids.astype(jnp.int32)}


def with_every_token(logits_indices: Int[Array, "num_seqs"], targets: Int[Array, "num_tokens"] | None):
    """The model's logits rows: each sequence's last token, then (prompt logprobs) every token."""
    if targets is None:
        return logits_indices
    return jnp.concatenate([logits_indices, jnp.arange(targets.shape[0], dtype=jnp.int32)])


def split_prompt_logprobs(logits, num_seqs: int, targets: Int[Array, "num_tokens"] | None):
    """logits (no targets), or (the sequences' logits, token_logprobs of every token at its target)."""
    if targets is None:
        return logits
    per_token = jax.nn.log_softmax(logits[num_seqs:], axis=1)
    return logits[:num_seqs], token_logprobs(per_token, jnp.maximum(targets, 0))
