"""StepSampler: builds a step's sampler rows (one per token drawn) and picks which sampler runs.

    scheduled sequences ──► RowSpec per row (rows.py)         ──► sampler.sample      (plain)
                        └─► + PenaltyArrays / logprobs wanted ──► sampler.sample_ext  (else)

Only a step where some row asks for logprobs or uses penalties, logit_bias or allowed_token_ids
pays for the extended sampler; only a step where some row asks for logprobs copies them back.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from jaxpaged.planner.sequence import Sequence
from jaxpaged.sample.penalties import TokenSlots, host_slot_rows, init_slot, make_penalty_arrays
from jaxpaged.sample.rows import (
    beam_candidate_width, num_sample_rows, pad_logit_rows, resample_padded, row_spec, sample_first_padded, sample_padded,
    run_call, sampler_row_counts, sampler_warmup_jobs)
from jaxpaged.sample.sampler import LOGPROBS_MODES, RowSpec, beam_candidates, make_sampling_arrays, sample_ext

_NO_PENALTY = (-1, 0.0, 0.0, 1.0)


@dataclasses.dataclass
class SampledStep:
    tokens: jax.Array | np.ndarray | None  # int32 [num_out], None if nothing sampled; numpy: fixed on the host
    logprobs: dict | None  # logprobs.token_logprobs' device arrays, None unless some row asked
    entries: list  # per scheduled sequence: None, its sampler row, or n rows (fan-out)
    num_rows: int
    fan_out_slots: list[list[int]]  # per fan-out (in order): the token-state slot of each of its n rows
    constrained: bool = False  # some row has a structured-output grammar


class StepSampler:
    def __init__(self, runner, max_num_seqs: int, vocab_size: int, logprobs_mode: str):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: use one of {LOGPROBS_MODES}")
        self.runner, self.logprobs_mode, self.max_num_seqs = runner, logprobs_mode, max_num_seqs
        self.ordered = runner.batch_invariant  # logprobs' sums as jaxpaged.rl.token_logprobs orders them
        # One slot per running sequence is enough; twice that leaves room for the fan-out rows of a
        # step whose children are not yet running.
        place = lambda tree: jax.device_put(tree, runner.placement)  # committed as the logits are: jit keys on it
        self.slots = TokenSlots(2 * max_num_seqs, vocab_size, place)
        self._all_allowed_masks: dict[int, np.ndarray] = {}  # num_rows -> all-ones grammar mask

    def sample(self, out, logits, owner, beam_owner=(), step_mask_fn=None,
               plan=None) -> tuple[SampledStep, list[tuple[int, Sequence]]]:
        """Builds the rows of every sampling sequence of `out` and dispatches the sampler; returns
        the step's sampled arrays and the (logits row, beam) pairs left to beam search.

        `step_mask_fn(entries, num_rows, sample_first)`: the structured-output StepMask of the
        step's rows (structured/matchers.py: the draw's int32 [num_rows, ceil(vocab / 32)] mask and
        the rows to check after it), or None when no row has a grammar. `plan`: the step's
        speculative verification (out.spec_plan): sequences with drafts are verified, not sampled,
        and each sequence's logits row is plan.first[i]."""
        rows: list[RowSpec] = []
        penalty_rows: list[tuple] = []
        entries: list = [None] * len(out.seqs)
        fan_out_slots: list[list[int]] = []
        beam_seqs: list[tuple[int, Sequence]] = []
        want_logprobs = use_slots = False
        for i, seq in enumerate(out.seqs):
            if not out.samples[i] or (plan is not None and plan.drafts[i]):
                continue
            if seq.seq_id in beam_owner:  # no placeholder: the search picks its next token
                beam_seqs.append((i, seq))
                continue
            request, sample_idx = owner[seq.seq_id]
            params = request.params
            want_logprobs = want_logprobs or params.logprobs is not None
            step = len(seq.token_ids) - seq.num_prompt_tokens  # outputs before this one, landed or not
            row = plan.first[i] if plan is not None else i  # its logits row
            if params.needs_token_state and not use_slots:
                use_slots = True
                self.slots.release_stopped()
                penalty_rows = [_NO_PENALTY] * len(rows)
            if len(request.samples) < params.n:
                entries[i] = list(range(len(rows), len(rows) + params.n))
                rows += [row_spec(row, params, request.seed, j, seq, step) for j in range(params.n)]
                if params.needs_token_state:
                    slots = [self.slots.slot_of(seq)] + [self.slots.new_slot(seq) for _ in range(params.n - 1)]
                    fan_out_slots.append(slots)
                    penalty_rows += [_penalty_row(s, params) for s in slots]
                else:
                    fan_out_slots.append([])
                    if use_slots:
                        penalty_rows += [_NO_PENALTY] * params.n
            else:
                entries[i] = len(rows)
                rows.append(row_spec(row, params, request.seed, sample_idx, seq, step))
                if params.needs_token_state:
                    penalty_rows.append(_penalty_row(self.slots.slot_of(seq), params))
                elif use_slots:
                    penalty_rows.append(_NO_PENALTY)
        if not rows:
            return SampledStep(None, None, entries, 0, fan_out_slots), beam_seqs
        num_rows = num_sample_rows(len(rows), logits.shape[0])
        if num_rows > logits.shape[0]:  # n > 1 fan-out: the samplers' warmed shape (rows.pad_logit_rows)
            logits = pad_logit_rows(logits, num_rows=num_rows)
        num_out = max(num_rows, self.runner.num_prev_token_rows)
        # Rows drawn first and checked after need the plain sampler's redraw (logprobs keep the mask first).
        step_mask = step_mask_fn(entries, num_rows, not (want_logprobs or use_slots)) if step_mask_fn else None
        bitmask = step_mask.mask if step_mask is not None else None
        if bitmask is not None:
            rows = [r._replace(banned_ids=()) if r.banned_ids and _only_banned_allowed(bitmask[i], r.banned_ids) else r
                    for i, r in enumerate(rows)]
        arrays = make_sampling_arrays(rows, num_rows)
        logprobs = None
        if want_logprobs or use_slots:
            penalties = make_penalty_arrays(penalty_rows, num_rows) if use_slots else None
            # The extended sampler always takes a mask (all ones without a grammar): no extra variants.
            mask = bitmask if bitmask is not None else self._all_allowed(num_rows)
            tokens, logprobs, state = sample_ext(
                logits, arrays, penalties, self.slots.state if use_slots else None, mask,
                logprobs_mode=self.logprobs_mode, ordered=self.ordered, num_out=num_out)
            if use_slots:
                self.slots.state = state
            if want_logprobs:
                for array in logprobs.values():
                    array.copy_to_host_async()
            else:
                logprobs = None
        elif step_mask is not None and step_mask.deferred and bitmask is None and step_mask.state.candidates:
            # every grammar row drawn first: with candidates for the rejected ones
            tokens, candidates = sample_first_padded(logits, arrays, num_out=num_out)
            tokens = _redraw_rejected(logits, rows, arrays, tokens, step_mask, candidates)
        else:
            tokens, _ = sample_padded(logits, arrays, num_out=num_out, token_bitmask=bitmask)
            if step_mask is not None and step_mask.deferred:
                tokens = _redraw_rejected(logits, rows, arrays, tokens, step_mask)
        if isinstance(tokens, jax.Array):  # else fixed on the host: a constrained step, committed at once
            tokens.copy_to_host_async()  # lands while the host plans the next step
        return SampledStep(tokens, logprobs, entries, num_rows, fan_out_slots, step_mask is not None), beam_seqs

    def _all_allowed(self, num_rows: int) -> np.ndarray:
        """The extended sampler's mask where no row has a grammar: all ones, one read-only array per
        row count (JAX's CPU client may alias a numpy argument, so it must never change)."""
        mask = self._all_allowed_masks.get(num_rows)
        if mask is None:
            mask = self._all_allowed_masks[num_rows] = np.full((num_rows, -(-self.slots.vocab_size // 32)), -1, np.int32)
            mask.flags.writeable = False
        return mask

    def assign_children(self, out, entries, fan_out_slots, children) -> None:
        """After advance(): child j of each fan-out owns the slot of its row j."""
        children = iter(children)
        fan_outs = iter(fan_out_slots)
        for entry in entries:
            if isinstance(entry, list):
                slots = next(fan_outs)
                for j in range(1, len(entry)):
                    child = next(children)
                    if slots:
                        self.slots.assign(child, slots[j])

    def beam_candidates(self, logits):
        """The top candidates (logprobs, token ids) [rows, C] of every logits row, best first, at the
        one width warm-up compiled (rows.beam_candidate_width)."""
        return beam_candidates(logits, num_candidates=beam_candidate_width(self.max_num_seqs, logits.shape[-1]))

    def warmup(self, max_num_seqs: int, extra: tuple[int, ...] = ()) -> None:
        """Compiles every program a step's sampling can run: the plain sampler's variants and the beam
        top-k (rows.warmup_sampler), and sample_ext with and without penalties, for every row count
        (`extra`: more logits widths, a speculative verification's), and the slot write."""
        for job in self.warmup_jobs(max_num_seqs, extra):
            job()

    def warmup_jobs(self, max_num_seqs: int, extra: tuple[int, ...] = ()) -> list:
        """`warmup` as callables that may run side by side, on threads (compile_in_parallel): one per
        program that donates nothing, and one that writes the slot and runs the penalized sampler
        (which donates the slot state) for every row count, in order."""
        jobs = sampler_warmup_jobs(self.runner, max_num_seqs, extra)
        for logits, arrays, penalties, mask, kwargs in self._sample_ext_warmup_args(max_num_seqs, extra):
            if penalties is None:
                jobs.append(functools.partial(run_call, sample_ext, (logits, arrays, None, None, mask), kwargs))
        return [*jobs, functools.partial(self._warmup_penalized, max_num_seqs, extra)]

    def _warmup_penalized(self, max_num_seqs: int, extra: tuple[int, ...]) -> None:
        """The slot write, then sample_ext with penalties for every row count, threading the slot state."""
        self.slots.state = init_slot(self.slots.state, np.int32(0), *host_slot_rows(self.slots.vocab_size, [0], [], None, None))
        for logits, arrays, penalties, mask, kwargs in self._sample_ext_warmup_args(max_num_seqs, extra):
            if penalties is not None:
                tokens, logprobs, self.slots.state = sample_ext(logits, arrays, penalties, self.slots.state, mask, **kwargs)
                jax.block_until_ready((tokens, logprobs))

    def _sample_ext_warmup_args(self, max_num_seqs: int, extra: tuple[int, ...]) -> list[tuple]:
        """sample_ext's (logits, arrays, penalties, mask, kwargs) for every row count, without and with
        penalties (None: without); the slot state, threaded through the calls, is the caller's."""
        calls = []
        for num_rows in sampler_row_counts(self.runner, max_num_seqs, extra):
            logits = self.runner.zeros_logits(num_rows)
            arrays = make_sampling_arrays([RowSpec(row_idx=0, temperature=1.0, top_k=2, top_p=0.9)], num_rows)
            kwargs = {"logprobs_mode": self.logprobs_mode, "ordered": self.ordered,
                      "num_out": max(num_rows, self.runner.num_prev_token_rows)}
            for penalized in (False, True):
                penalties = make_penalty_arrays([], num_rows) if penalized else None
                calls.append((logits, arrays, penalties, self._all_allowed(num_rows), kwargs))
        return calls


def _redraw_rejected(logits, rows: list[RowSpec], arrays, tokens, step_mask, candidates=None):
    """Structured outputs' sample first: the rows drawn without their grammar mask are checked on the
    host (waiting for the step's tokens: a constrained step commits in this engine step anyway).
    A rejected row takes its grammar's forced token, or its first allowed candidate (`candidates`,
    rows.sample_first_padded: draws without replacement for temperature rows, none for greedy
    ones); only rows with neither draw again on the device, from the same logits under
    their mask, with an independent uniform. Greedy gives the argmax over the allowed tokens;
    sampling gives exactly p(t) / p(A) over the allowed set A (DESIGN.md). A step whose rejected
    rows are all fixed on the host returns those tokens as a host array, with no device call:
    a constrained step is committed in the engine step that dispatched it, so nothing on the
    device reads them (the next step's inputs come from the host)."""
    t0 = time.perf_counter()
    drawn = np.asarray(tokens)  # waits for the device
    candidates = np.asarray(candidates) if candidates is not None else None
    t1 = time.perf_counter()
    fix = step_mask.check(drawn, candidates)
    if fix is not None and fix.mask is None:  # every rejected row fixed on the host
        tokens = fix.tokens
    elif fix is not None:
        mask, rejected = fix.mask, fix.rejected
        lifted = [i for i in np.flatnonzero(rejected)
                  if i < len(rows) and rows[i].banned_ids and _only_banned_allowed(mask[i], rows[i].banned_ids)]
        if lifted:  # the grammar allows only the banned stop tokens: the ban yields (as with the mask first)
            rows = [r._replace(banned_ids=()) if i in lifted else r for i, r in enumerate(rows)]
            arrays = make_sampling_arrays(rows, step_mask.num_rows)
        tokens = resample_padded(logits, arrays, fix.tokens, mask, rejected, num_out=tokens.shape[0])
    step_mask.state.seconds["device"] += t1 - t0
    step_mask.state.seconds["redraw"] += time.perf_counter() - t1  # the check's seconds included
    return tokens


def _only_banned_allowed(mask_row: np.ndarray, banned_ids: tuple[int, ...]) -> bool:
    """Whether a grammar row allows nothing but the min_tokens ban's stop tokens (the grammar ended).
    There the ban is lifted and the sequence stops under min_tokens, as vLLM lets a terminal grammar
    stop: the grammar wins, since banning its only tokens would leave the row nothing to draw."""
    words = mask_row.view(np.uint32).copy()
    for token_id in banned_ids:
        words[token_id >> 5] &= np.uint32(~(1 << (token_id & 31)) & 0xFFFFFFFF)
    return not words.any()


def _penalty_row(slot: int, params) -> tuple[int, float, float, float]:
    return slot, params.presence_penalty, params.frequency_penalty, params.repetition_penalty
