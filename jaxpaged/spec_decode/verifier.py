"""Verification on the device: which proposed tokens a sequence keeps, and the token after them.

Sequence s proposed d_0 .. d_{m-1} (m <= K) and the target step computed logits at its 1 + m
positions: position j predicts the token after d_{j-1} (position 0: after the last known token).

    greedy (temperature 0):  keep d_j while d_j == argmax(target_j); then argmax at the first
                             mismatch, or at position m (the bonus token) if all were kept.
    sampled:                 rejection sampling (Leviathan et al. 2023, Chen et al. 2023): keep d_j
                             with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
                             draw from norm(max(0, p_j - q_j)); if all m were kept, draw the bonus
                             token from p_m. q_j is the proposer's distribution: the draft model's
                             (`draft_probs`, d_j was drawn from it), or for n-gram proposals a point
                             mass at d_j, where the rule reads: keep d_j with probability p_j(d_j),
                             else draw from p_j without d_j, renormalized.

p_j is the distribution the non-speculative sampler draws from (temperature, top-k, top-p, min-p:
`jaxpaged.sample.sampler.sampling_logits`), so each output token is distributed exactly as without
speculation. Randomness: uniform u(seed, step + j, purpose) for the accept test at j and for the
final draw, a function of the request's seed and the token's output index only: a seeded request
draws the same tokens alone or in any batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt

from jaxpaged.sample.sampler import GREEDY_TEMPERATURE, PRNG_IMPL, SamplingArrays, sampling_logits

# Legend: S = verification rows (padded to max_num_seqs), K = num_speculative_tokens, V = vocab
_ACCEPT, _DRAW = 1, 2  # the `purpose` folded into a uniform's key
_Arr = Array | np.ndarray  # numpy on the host, jax inside the jitted verifier


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyArrays:
    """One row per sequence with proposals, padded to S rows (padding: num_drafts 0, greedy)."""

    first_row: Int[_Arr, "S"]  # logits row of position 0; positions j are rows first_row + j
    num_drafts: Int[_Arr, "S"]  # m, proposals of this sequence (0 <= m <= K)
    drafts: Int[_Arr, "S K"]  # proposed tokens; columns >= m pad with 0
    temperature: Float[_Arr, "S"]
    top_k: Int[_Arr, "S"]
    top_p: Float[_Arr, "S"]
    min_p: Float[_Arr, "S"]
    seed: UInt[_Arr, "S"]  # uint32
    step: Int[_Arr, "S"]  # the output index of the token at position 0


def make_verify_arrays(rows: list[tuple], num_rows: int, k: int) -> VerifyArrays:
    """rows: (first_row, drafts, temperature, top_k, top_p, min_p, seed, step), padded to num_rows."""
    out = VerifyArrays(
        first_row=np.zeros(num_rows, np.int32), num_drafts=np.zeros(num_rows, np.int32),
        drafts=np.zeros((num_rows, k), np.int32), temperature=np.zeros(num_rows, np.float32),
        top_k=np.zeros(num_rows, np.int32), top_p=np.ones(num_rows, np.float32),
        min_p=np.zeros(num_rows, np.float32), seed=np.zeros(num_rows, np.uint32), step=np.zeros(num_rows, np.int32),
    )
    for r, (first_row, drafts, temperature, top_k, top_p, min_p, seed, step) in enumerate(rows):
        out.first_row[r], out.num_drafts[r] = first_row, len(drafts)
        out.drafts[r, : len(drafts)] = drafts
        out.temperature[r], out.top_k[r], out.top_p[r], out.min_p[r] = temperature, top_k, top_p, min_p
        out.seed[r], out.step[r] = seed % 2**32, step
    return out


def uniforms(seed, step, purpose: int, num: int) -> Float[Array, "S num"]:
    """u(seed, step + j, purpose) in (0, 1) for j < num, per row."""

    def row(seed, step):
        key = jax.random.key(seed, impl=PRNG_IMPL)
        keys = jax.vmap(lambda j: jax.random.fold_in(jax.random.fold_in(key, step + j), purpose))(jnp.arange(num))
        return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32, jnp.finfo(jnp.float32).tiny, 1.0))(keys)

    return jax.vmap(row)(seed, step)


@functools.partial(jax.jit, static_argnames=("greedy_only", "always_accept"))
def verify(logits: Float[Array, "W V"], arrays: VerifyArrays, draft_probs: Float[Array, "S K V"] | None = None,
           *, greedy_only: bool = False, always_accept: bool = False):
    """Returns (tokens [S, K+1] int32: the kept proposals then the drawn token, padded with 0;
    num_accepted [S] int32: kept proposals a, so tokens[:, : a + 1] are the new tokens).

    `draft_probs`: q_j of each row's proposals (a draft model's, rows in `arrays` order, at least S
    rows); None for point-mass proposals (n-gram). Greedy rows never read it.
    `greedy_only` (static): every row is greedy, so no distribution is computed (argmax only); the
    host sets it per step. `always_accept` (static) keeps every proposal: a broken rule for the tests.
    """
    num_rows, k = arrays.drafts.shape
    positions = jnp.arange(k + 1, dtype=jnp.int32)
    rows = jnp.minimum(arrays.first_row[:, None] + positions, logits.shape[0] - 1)  # [S, K+1]
    # argmax of each logits row once, then gathered: the rows of padded verification rows repeat
    # real ones, so gathering [S, K+1, V] first would read the logits (K+1) x S / W times over.
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)[rows]  # [S, K+1]
    drafts = arrays.drafts
    if greedy_only:
        accept = drafts == greedy_ids[:, :k]
    else:
        flat = lambda x: jnp.repeat(x, k + 1)  # noqa: E731  per-row values at every position
        params = SamplingArrays(
            row_idx=rows.reshape(-1), temperature=flat(arrays.temperature), top_k=flat(arrays.top_k),
            top_p=flat(arrays.top_p), min_p=flat(arrays.min_p), seed=flat(arrays.seed),
            step=(arrays.step[:, None] + positions).reshape(-1),
            banned_ids=jnp.full((num_rows * (k + 1), 1), -1, jnp.int32),
        )
        vocab = logits.shape[-1]
        probs = jax.nn.softmax(sampling_logits(logits, params).reshape(num_rows, k + 1, vocab), axis=-1)
        is_random = (arrays.temperature >= GREEDY_TEMPERATURE)[:, None]  # [S, 1]
        p_draft = jnp.take_along_axis(probs[:, :k], drafts[:, :, None], axis=-1)[:, :, 0]  # [S, K]
        u_accept = uniforms(arrays.seed, arrays.step, _ACCEPT, k)
        if draft_probs is None:  # q_j(d_j) = 1
            keep = u_accept < p_draft
        else:  # u < p / q  <=>  u * q < p  (q(d_j) > 0: d_j was drawn from q_j)
            q_draft = jnp.take_along_axis(draft_probs[:num_rows], drafts[:, :, None], axis=-1)[:, :, 0]
            keep = u_accept * q_draft < p_draft
        accept = jnp.where(is_random, keep, drafts == greedy_ids[:, :k])
    if always_accept:
        accept = jnp.ones_like(accept)
    accept &= positions[None, :k] < arrays.num_drafts[:, None]
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [S]
    final = jnp.take_along_axis(greedy_ids, num_accepted[:, None], axis=1)[:, 0]

    if not greedy_only:  # the final draw at position a: norm(max(0, p_a - q_a)) after a rejection, else p_a
        p_final = jnp.take_along_axis(probs, num_accepted[:, None, None], axis=1)[:, 0]  # [S, V]
        was_rejected = num_accepted < arrays.num_drafts
        if draft_probs is None:  # q_a = point mass at the rejected proposal: p_a without it
            rejected = jnp.take_along_axis(drafts, jnp.minimum(num_accepted, k - 1)[:, None], axis=1)[:, 0]
            residual = jnp.where(jnp.arange(vocab)[None] == rejected[:, None], 0.0, p_final)
        else:
            q_final = jnp.take_along_axis(draft_probs[:num_rows], jnp.minimum(num_accepted, k - 1)[:, None, None],
                                          axis=1)[:, 0]
            residual = jnp.maximum(p_final - q_final, 0.0)
        p_final = jnp.where(was_rejected[:, None], residual, p_final)
        cdf = jnp.cumsum(p_final, axis=-1)
        u_draw = uniforms(arrays.seed, arrays.step + num_accepted, _DRAW, 1)[:, 0]
        drawn = jnp.minimum(jnp.sum(cdf < u_draw[:, None] * cdf[:, -1:], axis=-1), vocab - 1).astype(jnp.int32)
        final = jnp.where(is_random[:, 0], drawn, final)

    padded_drafts = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(positions[None] < num_accepted[:, None], padded_drafts, 0)
    tokens = jnp.where(positions[None] == num_accepted[:, None], final[:, None], tokens)
    return tokens, num_accepted.astype(jnp.int32)
