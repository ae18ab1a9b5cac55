"""A step's sampler rows: one row per token drawn, the padded jitted calls, and their warm-up.

    scheduled sequences ──row_spec──► RowSpec per row ──make_sampling_arrays──► SamplingArrays (numpy)
    logits [bucket, vocab] + SamplingArrays ──sample_padded──► tokens [num_out] (stay on the device:
                                                               the next step gathers its inputs there)

The rules a row follows (seeds, the min_tokens ban) are the request's (planner/request.py); this
module only lays them out for the sampler (sampler.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sample.inverse_cdf import successive_draws
from jaxpaged.sample.sampler import (
    GREEDY_TEMPERATURE, RowSpec, beam_candidates, make_sampling_arrays, mask_banned, resolve_branch_free, row_uniforms,
    sample)
from jaxpaged.planner.request import SamplingParams, banned_token_ids, seed_for
from jaxpaged.planner.sequence import Sequence


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def row_spec(logits_row: int, params: SamplingParams, seed: int, sample_idx: int, seq: Sequence,
             num_output_tokens: int) -> RowSpec:
    """The sampler row of sample `sample_idx` of a request, drawing its output number num_output_tokens + 1."""
    return RowSpec(
        row_idx=logits_row, temperature=params.temperature, top_k=max(params.top_k, 0), top_p=params.top_p,
        min_p=params.min_p, seed=seed_for(seed, sample_idx), step=num_output_tokens,
        banned_ids=banned_token_ids(seq.stop_token_set, num_output_tokens, params.min_tokens),
    )


@functools.partial(jax.jit, static_argnames=("num_out",))
def sample_padded(logits, arrays, num_out: int, token_bitmask=None):
    """`sample`, with the tokens padded to `num_out` rows: the next step reads them at a fixed shape.
    token_bitmask: the structured-output grammar mask, int32 [rows, ceil(vocab / 32)], or None."""
    tokens, logprobs = sample(logits, arrays, token_bitmask=token_bitmask)
    return jnp.pad(tokens, (0, num_out - tokens.shape[0])), logprobs


# Structured outputs' sample first: each row's draw and this many - 1 more without replacement
# (uniforms 1..31 of its (seed, step)); a rejected row takes the first allowed one, so most
# rejections need no second pass of the sampler (step_sampler.py). SmolLM2, 64 JSON rows at
# T=1: 8 settle 1.3 of 3.2 rejected free rows a step, 32 settle 2.3 of 3.3, at the same device cost.
NUM_STRUCTURED_CANDIDATES = 32


@functools.partial(jax.jit, static_argnames=("num_out", "num_candidates"))
def sample_first_padded(logits, arrays, num_out: int, num_candidates: int = NUM_STRUCTURED_CANDIDATES):
    """`sample_padded` with no grammar mask, plus each row's candidates, int32 [rows, num_candidates]
    (-1: none), for the rows of structured outputs' sample first that draw at a temperature (no
    top-k, top-p or min-p): the row's draw, then draws without replacement at uniforms 1.. of its
    (seed, step) (inverse_cdf.successive_draws). The first allowed one is a draw from p restricted
    to the allowed set. Greedy rows have none (-1): they seldom draw a token the grammar rejects
    without forcing (3% of steps redraw, SmolLM2 JSON), and their 32 best logits (`top_k`) cost
    the CPU 3-6% of a 64-row step. Candidates of rows with top-k, top-p or min-p are not theirs
    (drawn without those filters): such rows take the mask before the draw and never read them."""
    if num_candidates > NUM_STRUCTURED_CANDIDATES:  # uniform NUM_STRUCTURED_CANDIDATES is the redraw's
        raise ValueError(f"{num_candidates=} must be at most {NUM_STRUCTURED_CANDIDATES=} (resample_padded's uniform)")
    tokens, _ = sample(logits, arrays)
    is_random = arrays.temperature >= GREEDY_TEMPERATURE
    none = jnp.full((tokens.shape[0], num_candidates), -1, jnp.int32)

    def drawn():
        allowed = mask_banned(logits.astype(jnp.float32)[arrays.row_idx], arrays.banned_ids)  # [R, V]
        temperature = jnp.where(is_random, arrays.temperature, 1.0)
        probs = jax.nn.softmax(allowed / temperature[:, None], axis=1)
        u = jax.vmap(lambda draw: row_uniforms(arrays, draw), out_axes=1)(jnp.arange(1, num_candidates))  # [R, C - 1]
        more = jax.lax.platform_dependent(  # the blocked scan on the CPU, as the sampler's own draw
            probs, tokens, u, cpu=functools.partial(successive_draws, blocked=True),
            default=functools.partial(successive_draws, blocked=False))
        return jnp.where(is_random[:, None], more, none)

    candidates = drawn() if resolve_branch_free(None) else jax.lax.cond(jnp.any(is_random), drawn, lambda: none)
    return jnp.pad(tokens, (0, num_out - tokens.shape[0])), candidates


@functools.partial(jax.jit, static_argnames=("num_out",))
def resample_padded(logits, arrays, tokens, token_bitmask, rejected, num_out: int):
    """Structured outputs' sample-first redraw: rows where `rejected` (bool [rows]) draw again from
    the same logits under `token_bitmask`, with a uniform independent of their first draw and of
    their candidates' (uniform NUM_STRUCTURED_CANDIDATES of (seed, step)); the others keep `tokens`
    (the step's tokens, padded to num_out). Exact (step_sampler.py)."""
    again, _ = sample(logits, arrays, token_bitmask=token_bitmask, draw=NUM_STRUCTURED_CANDIDATES)
    pad = num_out - again.shape[0]
    return jnp.where(jnp.pad(rejected, (0, pad)), jnp.pad(again, (0, pad)), tokens)


def num_sample_rows(num_rows: int, num_logits_rows: int) -> int:
    """Rows fit the step's logits bucket unless n > 1 fan-out adds more: then the next power of two."""
    return num_logits_rows if num_rows <= num_logits_rows else next_pow2(num_rows)


@functools.partial(jax.jit, static_argnames=("num_rows",))
def pad_logit_rows(logits, num_rows: int):
    """A fan-out step's logits, L rows, padded with zero rows to its num_rows sample rows, so the
    samplers run at a warmed (num_rows, num_rows) shape instead of compiling an (L, num_rows) pair;
    every sample row still reads its own logits row (row_idx < L)."""
    return jnp.pad(logits, ((0, num_rows - logits.shape[0]), (0, 0)))


def fan_out_pairs(row_counts: list[int]) -> list[tuple[int, int]]:
    """(logits rows, sample rows) of every fan-out `num_sample_rows` can give: a power of two above L."""
    return [(small, big) for small in row_counts for big in row_counts if big > small and big == next_pow2(big)]


def sampler_row_counts(runner, max_num_seqs: int, extra: tuple[int, ...] = ()) -> list[int]:
    """Every row count a step's sampler can have (`extra`: a speculative verification step's logits widths)."""
    row_counts = {min(b, max_num_seqs) for b in runner.buckets} | set(runner.decode_buckets) | set(extra)
    # n > 1 fan-out past a step's rows samples next_pow2(rows) rows: small decode buckets make that
    # likelier, so those counts are compiled too.
    row_counts |= {next_pow2(r) for r in row_counts}
    return sorted(row_counts)


def beam_candidate_width(max_num_seqs: int, vocab_size: int) -> int:
    """Candidates per logits row on every beam step: what the widest search this engine accepts
    needs (beam_width <= max_num_seqs, 2 x beam_width candidates with eos), as a power of two. One
    width for every search, so warm-up compiles the top-k once per row count; a narrower search
    reads the first of them (best first)."""
    return min(next_pow2(2 * max_num_seqs), vocab_size)


def sampler_warmup_calls(runner, max_num_seqs: int, extra: tuple[int, ...] = ()) -> list[tuple]:
    """(jitted function, args, kwargs) of every sampler program a step can run: the sampler and the
    beam top-k for every row count, with and without a grammar mask, the grammar's first draw and
    redraw, and the fan-out padding. None donates an argument, so the calls may run in any order,
    side by side (`sampler_warmup_jobs`)."""
    num_out = runner.num_prev_token_rows
    calls = []
    for num_rows in sampler_row_counts(runner, max_num_seqs, extra):
        logits = runner.zeros_logits(num_rows)  # placed as real logits are: no recompile later
        padded = max(num_rows, num_out)
        calls.append((beam_candidates, (logits,), {"num_candidates": beam_candidate_width(max_num_seqs, logits.shape[-1])}))
        rows = [RowSpec(row_idx=0, temperature=1.0, top_k=2, top_p=0.9, seed=0, step=0)]
        arrays = make_sampling_arrays(rows, num_rows)
        # Both variants: without a grammar mask, and with one (a step with a structured-output row).
        all_allowed = np.full((num_rows, (logits.shape[1] + 31) // 32), -1, np.int32)
        for token_bitmask in (None, all_allowed):
            calls.append((sample_padded, (logits, arrays), {"num_out": padded, "token_bitmask": token_bitmask}))
        calls.append((sample_first_padded, (logits, arrays), {"num_out": padded}))
        tokens, rejected = np.zeros(padded, np.int32), np.zeros(num_rows, np.bool_)  # the redraw reads host tokens
        calls.append((resample_padded, (logits, arrays, tokens, all_allowed, rejected), {"num_out": padded}))
    for small, big in fan_out_pairs(sampler_row_counts(runner, max_num_seqs, extra)):
        calls.append((pad_logit_rows, (runner.zeros_logits(small),), {"num_rows": big}))
    return calls


def sampler_warmup_jobs(runner, max_num_seqs: int, extra: tuple[int, ...] = ()) -> list:
    """One callable per call of `sampler_warmup_calls`: compiles its program and runs it once."""
    return [functools.partial(run_call, fn, args, kwargs) for fn, args, kwargs in
            sampler_warmup_calls(runner, max_num_seqs, extra)]


def run_call(fn, args: tuple, kwargs: dict) -> None:
    """fn(*args, **kwargs), waited for: its program compiled (or found compiled) and run."""
    jax.block_until_ready(fn(*args, **kwargs))


def warmup_sampler(runner, max_num_seqs: int, extra: tuple[int, ...] = ()) -> None:
    """Compiles and runs the sampler and the beam top-k for every row count a step can have, so
    serving never compiles."""
    for job in sampler_warmup_jobs(runner, max_num_seqs, extra):
        job()
