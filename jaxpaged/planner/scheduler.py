"""The planner: which sequences compute which tokens this step, and what happens after.

One `schedule()` per engine step, no separate prefill and decode phases: a step mixes decodes
(1 token), chunks of long prompts and newly admitted prompts, within a token budget. When pages run
out, the most recently arrived running sequence is preempted by recompute. Pure Python (no jax).

A step's life on the host, with the device's sampled tokens arriving one step late:

    schedule()          which sequences compute which tokens
    advance(out, rows)  at dispatch: num_computed_tokens += n; each sampling sequence gets a
                        placeholder for its not-yet-known token (sampler row `row`), n > 1 forks here
    ... the next step may be scheduled and dispatched here, its decodes reading the placeholders ...
    commit(out, tokens) the tokens landed: placeholders filled, token-level stop rules, prefix cache

`update(out, sampled)` is advance + commit back to back (synchronous stepping, tests).

A request with a structured-output grammar is added with status WAITING_FOR_GRAMMAR: the scheduler
holds it (it counts as unfinished, can be aborted) but plans nothing for it until the engine calls
`grammar_ready(seq)`; only then does it take its place in the FIFO queue.
"""

from __future__ import annotations

import collections

from jaxpaged.config import PREEMPTION_MODES
from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.request import check_fits_pool, check_prompt_fits, placeholder_token_id, token_stop_reason
from jaxpaged.planner.scheduler_output import SchedulerOutput, UpdateOutput
from jaxpaged.planner.sequence import Sequence, SequenceStatus, new_seq_id, num_live_slots
from jaxpaged.planner.sliding_window import SlidingWindowBlockManager
from jaxpaged.planner.state_pool import HybridBlockManager, num_snapshot_slots

RUNNING = SequenceStatus.RUNNING
FINISHED = SequenceStatus.FINISHED
SWAPPED = SequenceStatus.SWAPPED
WAITING_FOR_GRAMMAR = SequenceStatus.WAITING_FOR_GRAMMAR


def make_scheduler(config, *, num_pages: int, num_swap_pages: int = 0, num_host_cache_pages: int = 0,
                   sliding_window: int | None = None, num_state_slots: int = 0,
                   num_host_state_slots: int = 0) -> Scheduler:
    """The engine's scheduler over its page pool (`config`: a resolved EngineConfig). `sliding_window`:
    every layer of the model attends that far back (Mistral), so pages behind it are freed
    (sliding_window.py). `num_state_slots` > 0: a hybrid model's state pool (state_pool.py), with
    `num_host_state_slots` for swapped sequences' states."""
    pool = dict(num_pages=num_pages, page_size=config.page_size, enable_prefix_caching=config.enable_prefix_caching,
                num_swap_pages=num_swap_pages, num_host_cache_pages=num_host_cache_pages)
    if num_state_slots:
        block_manager = HybridBlockManager(**pool, num_state_slots=num_state_slots,
                                           num_host_state_slots=num_host_state_slots,
                                           num_snapshot_slots=num_snapshot_slots(config))
    else:
        block_manager = (BlockManager(**pool) if sliding_window is None
                         else SlidingWindowBlockManager(**pool, sliding_window=sliding_window))
    return Scheduler(block_manager, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
                     preemption_mode=config.preemption_mode, max_loras=config.max_loras if config.enable_lora else 0)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        preemption_mode: str = "recompute",
        max_loras: int = 0,
    ) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"{preemption_mode=}: use one of {PREEMPTION_MODES}")
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
        self.preemption_mode = preemption_mode
        self.max_loras = max_loras  # distinct LoRA adapters the running batch may hold (0: no adapters)

        # Invariant: running + waiting, read in that order, is sorted by arrival_idx.
        self.waiting: collections.deque[Sequence] = collections.deque()  # FIFO; preempted at the front
        self.running: list[Sequence] = []  # hold pages; in arrival order
        self._unfinished: dict[int, Sequence] = {}  # seq_id -> waiting or running sequence
        self.waiting_for_grammar: dict[int, Sequence] = {}  # seq_id -> sequence held until grammar_ready()
        self._next_arrival_idx = 0

        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens thrown away by preemption (the prefix cache may save some)
        # (sequence, num_computed_tokens before) for each advance() that completed a page: commit()
        # registers those pages in the prefix cache once their tokens are known.
        self._filled_pages: list[tuple[Sequence, int]] = []
        self.num_swaps_out = 0  # preemptions by swap (the rest recompute)
        self.num_swaps_in = 0

    # ------------------------------------------------------------------ admission

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise ValueError if it could never run. A sequence with status
        WAITING_FOR_GRAMMAR is held aside until `grammar_ready(seq)`."""
        if seq.status not in (SequenceStatus.WAITING, WAITING_FOR_GRAMMAR) or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.name}; add only new sequences")
        if seq.seq_id in self._unfinished:
            raise ValueError(f"seq_id {seq.seq_id} is already queued or running; give each request its own id")
        check_prompt_fits(len(seq.token_ids), self.max_model_len)
        max_len = min(seq.max_num_tokens, self.max_model_len)  # prompt + max_tokens (None: unbounded)
        check_fits_pool(max_len, self.block_manager.page_size, self.block_manager.num_pages - 1)
        self.block_manager.check_admissible(seq)
        seq.max_num_tokens = max_len
        self._unfinished[seq.seq_id] = seq
        if seq.status is WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar[seq.seq_id] = seq
        else:
            self._enqueue(seq)

    def grammar_ready(self, seq: Sequence) -> None:
        """`seq`'s grammar compiled: it joins the FIFO queue now (its arrival, for the order of rule 2)."""
        if self.waiting_for_grammar.pop(seq.seq_id, None) is not seq:
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.name}, not waiting for its grammar")
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.arrival_idx = self._next_arrival_idx
        self._next_arrival_idx += 1
        self.waiting.append(seq)

    @property
    def num_schedulable(self) -> int:
        """Unfinished sequences the scheduler may plan now (those waiting for a grammar excluded)."""
        return len(self._unfinished) - len(self.waiting_for_grammar)

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
        # 5. Prompt pages a step fills are registered as it is planned, so a later admission (this step
        #    or the next) hits them: the step writes them before any attention reads; rule 4 keeps it so.
        # 6. With max_loras, the running batch holds at most max_loras distinct adapters (the device's
        #    slots): a waiting request of another adapter blocks the queue until one drains (rule 2).
        budget = self.max_num_batched_tokens
        max_num_seqs = self.max_num_seqs
        block_manager = self.block_manager
        page_size = block_manager.page_size
        ref_counts = block_manager.ref_counts
        aligns_chunks = block_manager.aligns_chunks
        running = self.running
        num_new_tokens: list[int] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        # Running sequences are scheduled in order; preemption pops victims from the tail of `running`,
        # which is never before the sequence being scheduled.
        seqs: list[Sequence] = []
        samples: list[bool] = []
        idx = 0
        while idx < len(running) and len(seqs) < max_num_seqs and budget > 0:
            seq = running[idx]
            idx += 1
            num_computed = seq.num_computed_tokens
            num_tokens = len(seq.token_ids)
            num_new = num_tokens - num_computed
            if num_tokens >= seq.max_num_tokens or num_new == 0:
                # Its last token is still on the device (it finishes when that lands), or a beam that
                # reported its candidates waits for its search's decision (jaxpaged/engine/beam_search.py).
                continue
            samples_now = True
            if num_new > budget:
                num_new = budget  # a chunk of a long prompt; the rest runs next step
                samples_now = False
            if aligns_chunks and num_new > 1:  # a hybrid model's prefix cache: end on a page boundary
                num_new = block_manager.aligned_chunk(seq, num_new)
                samples_now = num_computed + num_new == num_tokens
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
                if seq.status is not RUNNING:
                    break  # `seq` preempted itself: it was the last running sequence
                copy = block_manager.append_slot(seq)
                if copy is not None:
                    copies.append(copy)
            if num_computed < len(seq.prompt_token_ids):  # a chunk of its prompt: findable from now on
                block_manager.cache_scheduled_prompt_pages(seq, num_new)
            seqs.append(seq)
            samples.append(samples_now)
            num_new_tokens.append(num_new)
            budget -= num_new

        waiting = self.waiting
        adapters = {s.lora_int_id for s in running if s.lora_int_id} if self.max_loras else set()
        while waiting and not preempted and budget > 0 and len(running) < max_num_seqs:
            seq = waiting[0]
            if seq.num_placeholders:
                break  # (a preempted sequence is admitted again only once its tokens have landed)
            if seq.lora_int_id and seq.lora_int_id not in adapters:
                if len(adapters) >= self.max_loras:
                    break  # rule 6: every device slot is held by an adapter of the running batch
                adapters.add(seq.lora_int_id)
            if seq.status is SWAPPED:
                if not block_manager.can_swap_in(seq):
                    break
                block_manager.swap_in_seq(seq)  # keeps num_computed_tokens: nothing is recomputed
                self.num_swaps_in += 1
            elif block_manager.can_allocate(seq):
                block_manager.allocate(seq)  # sets num_computed_tokens to the cached prefix
            else:
                break
            waiting.popleft()
            seq.admit()  # RUNNING; the first admission ends its time in the queue
            running.append(seq)
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if aligns_chunks and num_new > 1:
                num_new = block_manager.aligned_chunk(seq, num_new)
            samples.append(seq.num_computed_tokens + num_new == len(seq.token_ids))
            if seq.num_computed_tokens < len(seq.prompt_token_ids):  # later admissions hit its prompt pages
                block_manager.cache_scheduled_prompt_pages(seq, num_new)
            seqs.append(seq)
            num_new_tokens.append(num_new)
            budget -= num_new

        swap_out, swap_in = block_manager.take_transfers()
        state_swap_out, state_swap_in = block_manager.take_state_transfers()
        return SchedulerOutput(
            seqs=seqs,
            num_new_tokens=num_new_tokens,
            copies=copies,
            preempted=preempted,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            samples=samples,
            swap_out=swap_out,
            swap_in=swap_in,
            state_copies=block_manager.take_state_copies(),
            state_swap_out=state_swap_out,
            state_swap_in=state_swap_in,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s pages and queue it again at the front. In swap mode, when the host swap space
        has room, its computed K/V go to host pages and come back at readmission (SWAPPED); else its
        tokens are recomputed as a prompt (PREEMPTED).

        A sequence whose token is still on the device may be swapped: the step in flight wrote its
        last K/V into the buffer the swap-out copies from (ordered on the device); it is readmitted
        once its placeholders have landed. One with nothing left to compute (a beam waiting for its
        search) is recomputed, never swapped: readmitted it would have no token to schedule, while its
        search drops the report of a preempted beam and waits for a new one."""
        if (self.preemption_mode == "swap" and seq.num_computed_tokens < len(seq.token_ids)
                and self.block_manager.can_swap_out(seq)):
            self.block_manager.swap_out_seq(seq)
            self.num_preemptions += 1
            self.num_swaps_out += 1
            seq.status = SWAPPED
            self.waiting.appendleft(seq)
            return
        self.block_manager.free(seq)
        self.num_preemptions += 1
        self.num_recomputed_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the device step

    def advance(self, output: SchedulerOutput, rows) -> list[Sequence]:
        """At dispatch: the scheduled tokens count as computed, sampled tokens become placeholders.

        `rows[i]` is None unless `output.samples[i]`; then it is the sampler row holding that
        sequence's new token, or, for a request with n > 1 sampling its first token, a list of n rows:
        the sequence is forked n-1 times here (children share all pages, copy-on-write on their next
        write) and child j waits for row `rows[i][j+1]`. Returns the children, in order. A sequence
        finished or aborted since schedule() is skipped.
        """
        sampled = output.sampled = []
        filled = self._filled_pages
        page_size = self.block_manager.page_size
        snapshots = self.block_manager.aligns_chunks
        forked: list[Sequence] = []
        for seq, num_new, row in zip(output.seqs, output.num_new_tokens, rows):
            if seq.status is not RUNNING:
                continue
            num_before = seq.num_computed_tokens
            seq.num_computed_tokens = num_computed = num_before + num_new
            if num_before // page_size != num_computed // page_size:
                filled.append((seq, num_before))
                if snapshots:  # a hybrid model's state at a cached page's end (planner/state_pool.py)
                    self.block_manager.snapshot_state(seq)
            if row is None:
                continue
            if type(row) is list:
                # Fork before the parent's placeholder goes in: children copy the parent's tokens.
                children = [self.fork(seq) for _ in row[1:]]
                sampled.append((seq, row[0]))
                for child, child_row in zip(children, row[1:]):
                    child.token_ids.append(placeholder_token_id(child_row))
                    child.num_placeholders += 1
                    sampled.append((child, child_row))
                forked += children
                row = row[0]
            else:
                sampled.append((seq, row))
            seq.token_ids.append(placeholder_token_id(row))
            seq.num_placeholders += 1
        return forked

    def commit(self, output: SchedulerOutput, sampled_token_ids) -> UpdateOutput:
        """The tokens of an advanced step landed: fill each placeholder and apply the stop rules.

        `sampled_token_ids[row]` is the token of sampler row `row` (Python ints: `array.tolist()`).
        Token-level stop rules: max_tokens / max_model_len ("length"), eos unless ignore_eos and
        stop_token_ids once min_tokens are out ("stop"). A finished sequence frees its pages now and
        drops its later placeholder, if the next step already gave it one: that token is discarded.
        Then pages that became full and computed are registered in the prefix cache.
        """
        appended: list[tuple[Sequence, int]] = []
        rows: list[int] = []
        finished: list[Sequence] = []
        prune_running = False
        for seq, row in output.sampled:
            if seq.status is FINISHED:
                continue  # aborted, or stopped by the engine, while its token was in flight
            token_id = sampled_token_ids[row]
            token_ids = seq.token_ids
            token_idx = len(token_ids) - seq.num_placeholders  # the oldest placeholder
            token_ids[token_idx] = token_id
            seq.num_placeholders -= 1
            output_token_ids = seq.output_token_ids
            output_token_ids.append(token_id)
            appended.append((seq, token_id))
            rows.append(row)
            # A grammar row draws a stop under min_tokens only where its grammar allows nothing else (step_sampler.py)
            min_tokens = 0 if seq.sampling_params.structured_outputs is not None else seq.sampling_params.min_tokens
            reason = token_stop_reason(token_idx, token_id, len(output_token_ids), seq.max_num_tokens,
                                       seq.stop_token_set, min_tokens)
            if reason is not None:
                finished.append((seq, reason))

        block_manager = self.block_manager
        if block_manager.enable_prefix_caching:
            # Every token below num_computed_tokens is known now (the next step's input placeholder
            # was filled above), so pages filled by this step, or by the one already dispatched, hash.
            # Before the finished sequences release their pages: a request that ends in this step
            # (max_tokens=1, say) still leaves its prompt's full pages to the prefix cache. Only the
            # sequences advance() saw complete a page are looked at (not every scheduled one).
            for seq, num_before in self._filled_pages:
                if seq.status is RUNNING:
                    block_manager.cache_computed_pages(seq, num_before)
        self._filled_pages.clear()

        for seq, reason in finished:
            if seq.status is RUNNING:
                prune_running = True
            else:
                self.waiting.remove(seq)  # preempted while its token was in flight
            self._release(seq, reason)
        if prune_running:
            self.running = [seq for seq in self.running if seq.status is RUNNING]
        return UpdateOutput(appended=appended, finished=[seq for seq, _ in finished], forked=[], rows=rows)

    def update(self, output: SchedulerOutput, sampled_token_ids) -> UpdateOutput:
        """advance() and commit() back to back, for synchronous callers.

        `sampled_token_ids[i]` belongs to `output.seqs[i]` and is ignored unless that sequence samples
        this step; a list of n tokens forks the sequence n-1 times (see advance()).
        """
        rows: list = []
        tokens: list[int] = []
        for seq, samples, entry in zip(output.seqs, output.samples, sampled_token_ids):
            if not samples or seq.status is not RUNNING:
                rows.append(None)
            elif type(entry) is list or type(entry) is tuple:
                rows.append(list(range(len(tokens), len(tokens) + len(entry))))
                tokens += entry
            else:
                rows.append(len(tokens))
                tokens.append(entry)
        forked = self.advance(output, rows)
        result = self.commit(output, tokens)
        result.forked = forked
        return result

    # ------------------------------------------------------------------ finishing, aborting, forking

    def _release(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and free its pages (it stays in `running` until the caller prunes it)."""
        if seq.num_placeholders:  # tokens still on the device will be discarded
            del seq.token_ids[len(seq.token_ids) - seq.num_placeholders :]
            seq.num_placeholders = 0
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
        elif seq.status is WAITING_FOR_GRAMMAR:
            del self.waiting_for_grammar[seq.seq_id]
        else:
            self.waiting.remove(seq)
        self._release(seq, reason)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish the request with reason "abort" and free its pages; None if it is not unfinished."""
        seq = self._unfinished.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def lora_ids_in_use(self) -> set[int]:
        """The LoRA adapters (lora_int_id) of the unfinished sequences."""
        return {seq.lora_int_id for seq in self._unfinished.values() if seq.lora_int_id}

    def fork(self, seq: Sequence) -> Sequence:
        """A RUNNING child of `seq` sharing all its pages, placed right after it in `running`. Call once
        the prompt is computed; prefer passing a list of n tokens to update(), which forks for you."""
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
            "num_waiting": len(self.waiting) + len(self.waiting_for_grammar),  # vLLM counts both
            "num_waiting_for_grammar": len(self.waiting_for_grammar),
            "num_running": len(self.running),
            "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "num_swaps_out": self.num_swaps_out,
            "num_swaps_in": self.num_swaps_in,
            # Slots of used pages holding a token: 1 - this / (used pages * page_size) is fragmentation.
            "num_live_slots": num_live_slots(self.running, self.block_manager.page_size),
        }
