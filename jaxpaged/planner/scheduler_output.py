"""What one `Scheduler.schedule()` decides (SchedulerOutput) and what a commit changed (UpdateOutput).

Every field is commented: these two records are the planner's whole contract with the engine.
Pure Python (no jax).
"""

from __future__ import annotations

import dataclasses

from jaxpaged.planner.sequence import Sequence


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    # The sequences scheduled this step, in batch order: running ones first, then newly admitted.
    seqs: list[Sequence]
    # Per sequence, tokens computed this step (>= 1): token indices
    # [seq.num_computed_tokens, seq.num_computed_tokens + n) of seq.token_ids. A sequence samples
    # this step when num_computed_tokens + n == len(seq.token_ids).
    num_new_tokens: list[int]
    # Copy-on-write (src_page_id, dst_page_id) page copies the device performs BEFORE this step's
    # K/V writes (a forked sequence about to write into a page it shares).
    copies: list[tuple[int, int]]
    # Sequences preempted while planning this step: their pages are freed (and may already be handed
    # to others in `seqs`), they are back at the front of the waiting queue with num_computed_tokens 0.
    preempted: list[Sequence]
    # sum(num_new_tokens) <= max_num_batched_tokens.
    num_batched_tokens: int
    # Per sequence, whether it samples a token this step: its scheduled tokens reach the end of
    # token_ids (num_computed_tokens + n == len(token_ids)); a chunk of a longer prompt does not.
    # The one place this rule is decided.
    samples: list[bool] = dataclasses.field(default_factory=list)
    # Set by advance(): (sequence, sampler row) for every token sampled this step, forked children
    # included, in row-assignment order.
    sampled: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    # Host transfers, issued by the engine before this step's copies and K/V writes, swap-outs first:
    # (device page, host page) copies to host (swapped victims' pages, and device prefix-cache pages
    # evicted into the host tier), and (host page, device page) copies back (swapped sequences
    # readmitted, host-tier prefix hits). Planned even in a step that schedules no sequence.
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Hybrid models (planner/state_pool.py): (src, dst) recurrent-state slot copies of forks made since the
    # last step, done by the device before this step (even one that schedules no sequence).
    state_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Hybrid models under swap preemption: (device slot, host state slot) states of swapped-out sequences and
    # (host state slot, device slot) states of swapped-in ones, moved after `state_copies`, before this step.
    state_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Speculative decoding (jaxpaged/spec_decode/speculator.py): which sequences verify proposals
    # this step and their logits rows; None in a step without proposals.
    spec_plan: object = None


@dataclasses.dataclass(slots=True)
class UpdateOutput:
    appended: list[tuple[Sequence, int]]  # (sequence, token appended this step), in batch order
    finished: list[Sequence]  # sequences finished by a token-level stop rule this step (pages freed)
    forked: list[Sequence]  # children created this step from multi-sample entries (see update())
    rows: list[int] = dataclasses.field(default_factory=list)  # sampler row of each `appended` token
