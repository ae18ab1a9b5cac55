"""One step on the device: a SchedulerOutput in, a `StepResult` out (prepare + execute + sample).

    SchedulerOutput ──► host KV moves (swap-outs, swap-ins: kv_transfer.py), before anything else
                    ──► StepInput (step_input.py: the one host->device contract; block-table rows
                        kept on the host between steps)
                    ──► copy-on-write page copies ──► ModelRunner.execute (runner.py): logits
                    ──► StepSampler.sample (sample/step_sampler.py): tokens, logprobs, kept on the
                        device; prompt logprobs
                    ──► StepResult: dispatched, not awaited

Nothing here waits for the device: the engine reads a StepResult's tokens back when it commits the
step, one step later under asynchronous scheduling. The previous step's result is an input: its
sampled tokens (still on the device) are the next step's decode inputs. Optional features hook in
through `StepFeature` (engine/features.py); this module names none of them.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jaxpaged.device.kv_transfer import HostKVStore, HostStateStore
from jaxpaged.device.runner import ModelRunner
from jaxpaged.device.step_input import BlockTableRows
from jaxpaged.planner.scheduler_output import SchedulerOutput
from jaxpaged.planner.sequence import Sequence
from jaxpaged.sample.logprobs import PromptChunk, prompt_targets
from jaxpaged.sample.step_sampler import StepSampler


@dataclasses.dataclass
class StepResult:
    """A step on the device whose sampled tokens the host has not read yet."""

    idx: int  # engine step number
    out: SchedulerOutput  # after advance(): out.sampled names each token's sampler row
    tokens: jax.Array | np.ndarray | None = None  # int32 [num_rows padded], None if nothing sampled; numpy: a
    # constrained step's tokens fixed on the host (committed at once, never an input of the next step)
    logprobs: dict | None = None  # sample/logprobs.py token_logprobs' arrays, None unless some row asked
    # Per scheduled sequence: None, its sampler row, or the n rows of an n > 1 request's first token.
    entries: list = dataclasses.field(default_factory=list)
    fan_out_slots: list[list[int]] = dataclasses.field(default_factory=list)  # token-state slots per fan-out
    fits_next_input: bool = True  # its tokens fit the next step's prev_tokens input (else commit at once)
    constrained: bool = False  # some row has a structured-output grammar
    # Beam search: (logits row, beam) of every beam the sampler left to its search (engine/beam_search.py).
    beam_seqs: list[tuple[int, Sequence]] = dataclasses.field(default_factory=list)
    # Prompt logprobs: every token's token_logprobs arrays, and which requests' prompt positions they fill.
    prompt_logprobs: dict | None = None
    prompt_chunks: list[PromptChunk] = dataclasses.field(default_factory=list)
    pending: dict = dataclasses.field(default_factory=dict)  # per feature name: what its commit reads

    def read_tokens(self) -> list[int] | None:
        """The sampled tokens as Python ints: waits for the device."""
        return None if self.tokens is None else np.asarray(self.tokens).tolist()


class StepRunner:
    """Prepares, executes and samples the engine's steps on one `ModelRunner`."""

    def __init__(self, model: ModelRunner, host_kv: HostKVStore, sampler: StepSampler, *, max_num_seqs: int,
                 features: list, timings: dict, host_states: HostStateStore | None = None):
        self.model, self.host_kv, self.sampler = model, host_kv, sampler
        self.host_states = host_states  # a hybrid model's swapped recurrent states (None: no swap)
        self.features = features  # engine/features.py, called in order
        self.timings = timings  # seconds per phase, shared with the engine ("prepare", "postprocess")
        self.block_table_rows = BlockTableRows(2 * max_num_seqs, model.pages_per_seq)
        self.num_steps = 0

    def run(self, out: SchedulerOutput, owner: dict, previous: StepResult | None) -> StepResult | None:
        """Dispatches `out` (None when it schedules no sequence; its host KV moves are made anyway).
        `owner`: seq_id -> (request, sample index) of every sampling sequence; `previous`: the step
        still in flight, whose tokens this step's decodes read on the device."""
        if out.swap_out:  # before this step's writes reuse the pages (swap-outs before swap-ins)
            self.host_kv.swap_out(out.swap_out)
        if out.swap_in:  # before this step reads them
            self.host_kv.swap_in(out.swap_in)
        if out.state_copies:  # a hybrid model's forks: before any step advances the parent's state
            self.model.copy_states(out.state_copies)
        if out.state_swap_out:  # after the copies (a child swapped out before its copy ran), before the step
            self.host_states.swap_out(out.state_swap_out)
        if out.state_swap_in:
            self.host_states.swap_in(out.state_swap_in)
        if not out.seqs:
            return None
        self.num_steps += 1
        step = StepResult(idx=self.num_steps, out=out)
        t0 = time.perf_counter()
        prepare_args = {}
        for feature in self.features:
            prepare_args |= feature.before_execute(out)
        step_input = self.model.prepare(out, self.block_table_rows, **prepare_args)
        targets, step.prompt_chunks = prompt_targets(out, owner, step_input.num_tokens)
        if targets is not None:  # some request wants prompt logprobs: the step's program that gives them
            step_input = dataclasses.replace(step_input, prompt_logprob_targets=targets)
        self.timings["prepare"] += time.perf_counter() - t0
        if out.copies:
            self.model.copy_pages(out.copies)
        prev_tokens = previous.tokens if previous is not None else None
        result = self.model.execute(step_input, prev_tokens)
        for feature in self.features:
            result = feature.after_execute(step, step_input, prev_tokens, result)
        logits = result
        if targets is not None:
            logits, step.prompt_logprobs = result
            for array in step.prompt_logprobs.values():
                array.copy_to_host_async()

        t1 = time.perf_counter()
        sample_args = {}
        for feature in self.features:
            sample_args |= feature.sample_args(out)
        # Rows to sample: one per sampling sequence; a request with n > 1 draws n rows from its
        # parent's logits row at its first token, and advance() forks the parent n-1 times.
        sampled, step.beam_seqs = self.sampler.sample(out, logits, owner, **sample_args)
        step.tokens, step.logprobs, step.entries = sampled.tokens, sampled.logprobs, sampled.entries
        step.fan_out_slots, step.constrained = sampled.fan_out_slots, sampled.constrained
        step.fits_next_input = sampled.num_rows <= self.model.num_prev_token_rows
        for feature in self.features:
            feature.after_sample(step, logits)
        self.timings["postprocess"] += time.perf_counter() - t1
        return step
