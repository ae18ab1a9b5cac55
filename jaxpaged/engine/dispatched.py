"""`Dispatched`: a step on the device whose sampled tokens the host has not read yet (engine.py
dispatches it, commits it one step later under asynchronous scheduling)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxpaged.planner.scheduler_output import SchedulerOutput
from jaxpaged.planner.sequence import Sequence
from jaxpaged.sample.logprobs import PromptChunk


@dataclasses.dataclass
class Dispatched:
    """A step on the device whose sampled tokens the host has not read yet."""

    idx: int  # engine step number
    out: SchedulerOutput  # advanced: out.sampled names each token's sampler row
    tokens: jax.Array | np.ndarray | None  # int32 [num_rows padded], None if nothing sampled; numpy: a
    # constrained step's tokens fixed on the host (committed at once, never an input of the next step)
    logprobs: dict | None  # sample/logprobs.token_logprobs' arrays, None unless some row asked for logprobs
    next_can_read: bool  # its tokens fit the next step's prev_tokens input (else commit at once)
    # Beam search: (logits row, beam) of every beam that sampled, and their top candidates on the
    # device ((logprobs, token ids) [rows, C]). A step with beams is committed at once (see DESIGN.md).
    beam_seqs: list[tuple[int, Sequence]] = dataclasses.field(default_factory=list)
    beam_candidates: tuple[jax.Array, jax.Array] | None = None
    # Prompt logprobs: every token's token_logprobs arrays, and which requests' prompt positions they fill.
    prompt_logprobs: dict | None = None
    prompt_chunks: list[PromptChunk] = dataclasses.field(default_factory=list)
    routed: object = None  # RoutedStep (engine/routed_experts.py) with enable_return_routed_experts, else None
    spec: object = None  # SpecPending: the step's speculative verification (jaxpaged/spec_decode/), committed at once
