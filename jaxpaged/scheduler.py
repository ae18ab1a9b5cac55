"""The planner: which sequences compute which tokens this step, and what happens after.

One `schedule()` per engine step, no separate prefill and decode phases: a step mixes decodes
(1 token), chunks of long prompts and newly admitted prompts, within a token budget. When pages run
out, the most recently arrived running sequence is preempted by recompute. Pure Python (no jax).
"""

from __future__ import annotations

import collections
import dataclasses

from jaxpaged.block_manager import BlockManager
from jaxpaged.sequence import Sequence, SequenceStatus, new_seq_id

RUNNING = SequenceStatus.RUNNING


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


@dataclasses.dataclass(slots=True)
class UpdateOutput:
    appended: list[tuple[Sequence, int]]  # (sequence, token appended this step), in batch order
    finished: list[Sequence]  # sequences finished by a token-level stop rule this step (pages freed)
    forked: list[Sequence]  # children created this step from multi-sample entries (see update())


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"{max_num_seqs=} must be >= 1")
        if max_num_batched_tokens < 1:
            raise ValueError(f"{max_num_batched_tokens=} must be >= 1")
        if max_model_len < 2:
            raise ValueError(f"{max_model_len=} must be >= 2 (one prompt token and one generated token)")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len

        # Invariant: running + waiting, read in that order, is sorted by arrival_idx.
        self.waiting: collections.deque[Sequence] = collections.deque()  # FIFO; preempted at the front
        self.running: list[Sequence] = []  # hold pages; in arrival order
        self._unfinished: dict[int, Sequence] = {}  # seq_id -> waiting or running sequence
        self._next_arrival_idx = 0

        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens thrown away by preemption (the prefix cache may save some)

    # ------------------------------------------------------------------ admission

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise ValueError if it could never run."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.name}; add only new sequences")
        if seq.seq_id in self._unfinished:
            raise ValueError(f"seq_id {seq.seq_id} is already queued or running; give each request its own id")
        num_prompt_tokens = len(seq.token_ids)
        if num_prompt_tokens + 1 > self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens but max_model_len={self.max_model_len} leaves no room "
                "for a generated token; raise max_model_len or shorten the prompt"
            )
        # The longest it may grow to must fit the whole pool, so that it can always finish alone.
        page_size = self.block_manager.page_size
        max_len = min(num_prompt_tokens + seq.sampling_params.max_tokens, self.max_model_len)
        num_pages_needed = -(-max_len // page_size)
        num_usable_pages = self.block_manager.num_pages - 1
        if num_pages_needed > num_usable_pages:
            raise ValueError(
                f"request may grow to {max_len} tokens = {num_pages_needed} pages of {page_size} tokens, but the "
                f"pool holds only {num_usable_pages} pages; give the KV cache more pages, lower max_tokens "
                "or shorten the prompt"
            )
        seq.max_num_tokens = max_len
        seq.arrival_idx = self._next_arrival_idx
        self._next_arrival_idx += 1
        self.waiting.append(seq)
        self._unfinished[seq.seq_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    # ------------------------------------------------------------------ planning a step

    def schedule(self) -> SchedulerOutput:
        # Constitution of a step:
        # 1. Every scheduled sequence computes n >= 1 tokens; sum(n) <= max_num_batched_tokens and
        #    len(seqs) <= max_num_seqs.
        # 2. Running sequences go first, in arrival order; then waiting ones, strictly FIFO (a request
        #    that does not fit blocks the ones behind it, so no request starves).
        # 3. After planning, each scheduled sequence's block table covers all its tokens, and no page it
        #    writes this step is shared: `copies` lists the private copies to make first.
        # 4. Out of pages, the running sequence that arrived last is preempted (it may be the one asking).
        #    An already scheduled sequence is never preempted: victims come from the tail of `running`,
        #    scheduled ones from its head. A step that preempts admits nothing new.
        budget = self.max_num_batched_tokens
        max_num_seqs = self.max_num_seqs
        block_manager = self.block_manager
        page_size = block_manager.page_size
        ref_counts = block_manager.ref_counts
        running = self.running
        num_new_tokens: list[int] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        # Running sequences are scheduled as a prefix of `running`: running[:num_scheduled]. Preemption
        # pops from the tail, so `limit` shrinks with it.
        num_scheduled = 0
        limit = min(len(running), max_num_seqs)
        while num_scheduled < limit and budget > 0:
            seq = running[num_scheduled]
            num_computed = seq.num_computed_tokens
            num_new = len(seq.token_ids) - num_computed
            if num_new > budget:
                num_new = budget  # a chunk of a long prompt; the rest runs next step
            # Fast path, the common decode: the slot for token `num_computed` lies inside a page this
            # sequence already holds alone (offset > 0, so the page exists; ref count 1, so no copy).
            if not (
                num_new == 1
                and num_computed % page_size
                and ref_counts[seq.block_table[num_computed // page_size]] == 1
            ):
                while not block_manager.can_append(seq):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
                limit = min(len(running), max_num_seqs)
                if seq.status is not RUNNING:
                    break  # `seq` preempted itself: it was the last running sequence
                copy = block_manager.append_slot(seq)
                if copy is not None:
                    copies.append(copy)
            num_new_tokens.append(num_new)
            budget -= num_new
            num_scheduled += 1
        seqs = running[:num_scheduled]

        waiting = self.waiting
        while waiting and not preempted and budget > 0 and len(running) < max_num_seqs:
            seq = waiting[0]
            if not block_manager.can_allocate(seq):
                break
            block_manager.allocate(seq)  # sets num_computed_tokens to the cached prefix
            waiting.popleft()
            seq.status = RUNNING
            running.append(seq)
            num_new = len(seq.token_ids) - seq.num_computed_tokens
            if num_new > budget:
                num_new = budget
            seqs.append(seq)
            num_new_tokens.append(num_new)
            budget -= num_new

        return SchedulerOutput(
            seqs=seqs,
            num_new_tokens=num_new_tokens,
            copies=copies,
            preempted=preempted,
            num_batched_tokens=self.max_num_batched_tokens - budget,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s pages and queue it again at the front; its tokens are recomputed as a prompt."""
        self.block_manager.free(seq)
        self.num_preemptions += 1
        self.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the device step

    def update(self, output: SchedulerOutput, sampled_token_ids) -> UpdateOutput:
        """Advance the scheduled sequences by what the device computed and append the sampled tokens.

        `sampled_token_ids[i]` belongs to `output.seqs[i]` and is ignored unless that sequence sampled
        this step. Pass Python ints (`array.tolist()`). For a request with n > 1 sampling its first
        token, the entry may be a list of n tokens: the sequence is forked n-1 times (children share
        all pages, copy-on-write on their next write), the parent gets the first token and child j the
        (j+1)-th. Sequences finished or aborted since schedule() are skipped.
        """
        block_manager = self.block_manager
        page_size = block_manager.page_size
        caching = block_manager.enable_prefix_caching
        appended: list[tuple[Sequence, int]] = []
        finished: list[Sequence] = []
        forked: list[Sequence] = []

        for seq, num_new, token_id in zip(output.seqs, output.num_new_tokens, sampled_token_ids):
            if seq.status is not RUNNING:
                continue
            num_computed_before = seq.num_computed_tokens
            num_computed = num_computed_before + num_new
            seq.num_computed_tokens = num_computed
            if caching and (num_new > 1 or num_computed % page_size == 0):
                block_manager.cache_computed_pages(seq, num_computed_before)  # a page may have filled up
            token_ids = seq.token_ids
            if num_computed < len(token_ids):
                continue  # a chunk of a longer prompt: nothing sampled

            children = None
            if type(token_id) is not int and (type(token_id) is list or type(token_id) is tuple):
                # Fork before the parent's token is appended (and before it may finish and free its pages).
                children = [self.fork(seq) for _ in range(len(token_id) - 1)]
                children_token_ids = token_id[1:]
                token_id = token_id[0]
            # Inlined self._append(seq, token_id, appended): this loop runs for every sequence, every step.
            output_token_ids = seq.output_token_ids
            output_token_ids.append(token_id)
            token_ids.append(token_id)
            appended.append((seq, token_id))
            if len(token_ids) >= seq.max_num_tokens:
                self._release(seq, "length")
                finished.append(seq)
            elif token_id in seq.stop_token_set and len(output_token_ids) >= seq.sampling_params.min_tokens:
                self._release(seq, "stop")
                finished.append(seq)
            if children:
                forked += children
                for child, child_token_id in zip(children, children_token_ids):
                    if self._append(child, child_token_id, appended):
                        finished.append(child)

        if finished:
            self.running = [seq for seq in self.running if seq.status is RUNNING]
        return UpdateOutput(appended=appended, finished=finished, forked=forked)

    def _append(self, seq: Sequence, token_id: int, appended: list[tuple[Sequence, int]]) -> bool:
        """Append one sampled token and apply the token-level stop rules; True if `seq` finished.

        Stop strings need text: the engine checks them and calls finish().
        """
        seq.append_token(token_id)
        appended.append((seq, token_id))
        # max_num_tokens = min(prompt + max_tokens, max_model_len); stop_token_set holds eos unless ignore_eos.
        if len(seq.token_ids) >= seq.max_num_tokens:
            self._release(seq, "length")
            return True
        if token_id in seq.stop_token_set and seq.num_output_tokens >= seq.sampling_params.min_tokens:
            self._release(seq, "stop")
            return True
        return False

    # ------------------------------------------------------------------ finishing, aborting, forking

    def _release(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and free its pages (it stays in `running` until the caller prunes it)."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.seq_id]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence now (the engine found a stop string). A finished sequence is left as is."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq, reason)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish the request with reason "abort" and free its pages; None if it is not unfinished."""
        seq = self._unfinished.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def fork(self, seq: Sequence) -> Sequence:
        """A RUNNING child of `seq` sharing all its pages, placed right after it in `running`.

        Call once the prompt is computed (at the step the first token is sampled); each child then gets
        its own tokens. Prefer passing a list of n tokens to update(), which forks for you.
        """
        if seq.status is not RUNNING:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.name}; fork only a running sequence")
        child = self.block_manager.fork(seq)
        while child.seq_id in self._unfinished:  # a caller-chosen id collided with a default one
            child.seq_id = new_seq_id()
        child.status = RUNNING
        # After the parent and its earlier children (same arrival_idx): running stays in arrival order.
        insert_idx = self.running.index(seq) + 1
        while insert_idx < len(self.running) and self.running[insert_idx].arrival_idx == seq.arrival_idx:
            insert_idx += 1
        self.running.insert(insert_idx, child)
        self._unfinished[child.seq_id] = child
        return child

    def stats(self) -> dict[str, int]:
        return {
            "num_waiting": len(self.waiting),
            "num_running": len(self.running),
            "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            # Slots of used pages holding a token: 1 - this / (used pages * page_size) is fragmentation.
            "num_live_slots": self.block_manager.num_live_slots(self.running),
        }
