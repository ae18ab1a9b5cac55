"""The state pool of hybrid models (Qwen3-Next): one fixed-size recurrent-state slot per running sequence,
beside its KV pages, owned by the block manager as pages are. Pure Python (no jax).

A linear-attention layer keeps no K/V per token: it keeps one state per sequence (the causal conv's
last inputs and the gated delta rule's matrix, models/qwen3_next.py), in slot `seq.state_slot` of
the device's state arrays. Slot 0 is the padding slot, never handed out (padding rows read and write
it), so slot ids run 1..num_slots.

    admission (allocate)   a slot, plus n - 1 reserved for the children of a request with n > 1
                           that has not sampled yet (its forks at the first token take them)
    fork                   the child takes a reserved (else a free) slot; (parent slot, child slot) is
                           queued in `state_copies`, which the device copies before the next step runs
    free                   finished, aborted or preempted: the slot and any reservation go back
    preemption (recompute) a readmitted sequence starts again from position 0, and a row whose step
                           starts at position 0 starts from a zero state (whatever its slot held),
                           so a slot never needs clearing
    preemption (swap)      the slot's state goes to a host state slot beside its host pages
                           (`state_swap_out`, device slot -> host slot) and the device slot is freed;
                           swapped in, it takes a device slot and the host state comes back
                           (`state_swap_in`, host slot -> device slot) before the step that reads it
    beam search            a search of width k holds k slots while it lives (`open_fork_group`): its
                           beams' slots and a reserve. A dropped, finished or preempted beam's slot
                           goes back to the reserve, a fork or a readmitted beam takes one from it,
                           so a fork always finds a slot; the reserve returns to the pool when the
                           search closes its group (`close_fork_group`)

Chunked prefill needs nothing here: a later chunk continues from its slot.

Prefix caching (vLLM's "align" idea): a cached page is only a usable hit if the recurrent state at its end
is kept too. Snapshot slots num_state_slots+1 .. num_state_slots+num_snapshot_slots of the same device
arrays hold such states, one per cached page (keyed by its block hash), at most num_snapshot_slots:

    align       a prompt chunk that crosses a page boundary (of its prompt) ends on the last one it
                crosses (`aligned_chunk`), so prompts end chunks on page boundaries
    save        at dispatch (`snapshot_state`, from Scheduler.advance), a chunk that ended on prompt page
                k's end, page k registered and with no snapshot: a snapshot slot (the least recently
                used one is dropped when none is free) and the copy (seq slot -> snapshot slot)
    hit         only up to the deepest matched page that has a snapshot (`_cached_prefix`); admission
                queues (snapshot slot -> seq slot): the KV pages used and the state agree on the
                number of computed tokens, and never a page past the snapshot is used
    evict       a page leaving the cache (handed out fresh, or reset_prefix_cache) frees its snapshot

All state copies (saves, restores, forks) go to the device in one list, in the order they were planned
(saves at one dispatch before the next schedule()'s restores); the runner applies them in list order.
A snapshot saved at one step's dispatch is read no earlier than the next step's copies.
"""

from __future__ import annotations

import collections

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.sequence import Sequence


def num_snapshot_slots(config) -> int:
    """State snapshot slots of a hybrid model's prefix cache (beside its max_num_seqs running slots)."""
    return config.max_num_seqs if config.enable_prefix_caching else 0


def refuse_hybrid_features(config) -> list[str]:
    """ValueError naming the first EngineConfig field a hybrid (linear-attention) model cannot serve; else the
    warnings for what is turned off (none today)."""
    refusals = [
        (bool(config.host_cache_bytes), "host_cache_bytes", "leave it None"),
        (config.speculative_config is not None, "speculative_config",
         "leave it None (a rejected proposal would have to roll the recurrent state back)"),
        (config.kv_cache_dtype != "auto", f"kv_cache_dtype={config.kv_cache_dtype!r}", "use 'auto'"),
        (config.tensor_parallel_size > 1, f"tensor_parallel_size={config.tensor_parallel_size}", "use 1"),
        (bool(config.batch_invariant), "batch_invariant", "leave it off"),
        (config.enable_return_routed_experts, "enable_return_routed_experts", "leave it off"),
    ]
    for refused, name, fix in refusals:
        if refused:
            raise ValueError(f"{name} is not supported for hybrid linear-attention models (Qwen3-Next); {fix}")
    return []


class StatePool:
    """Slot ids first_slot..first_slot + num_slots - 1; `take` the lowest free one (deterministic), `release` it
    back."""

    def __init__(self, num_slots: int, first_slot: int = 1):
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be >= 1")
        self.num_slots = num_slots
        self.first_slot = first_slot
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # popped from the end: lowest first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot; check num_free first")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not self.first_slot <= slot < self.first_slot + self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not a used slot of this pool")
        self._free.append(slot)
        self._free.sort(reverse=True)


class HybridBlockManager(BlockManager):
    """A `BlockManager` whose sequences also hold a state slot (see the module docstring)."""

    def __init__(self, *args, num_state_slots: int, num_host_state_slots: int = 0, num_snapshot_slots: int = 0,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if self.enable_prefix_caching and num_snapshot_slots < 1:
            raise ValueError("prefix caching on a hybrid linear-attention model needs num_snapshot_slots >= 1 "
                             "(the states at cached page ends); pass enable_prefix_caching=False or some")
        if self.host_cache.num_pages:
            raise ValueError("the host prefix-cache tier cannot serve a hybrid linear-attention model (no state "
                             "snapshots there); pass num_host_cache_pages=0")
        self.state_pool = StatePool(num_state_slots)
        self._reserved: dict[int, list[int]] = {}  # seq_id -> slots kept for its forks at the first token
        self.state_copies: list[tuple[int, int]] = []  # (src slot, dst slot), taken by the next schedule()
        # Swap preemption: host state slots (ids 1..num_host_state_slots), one per swapped sequence.
        self.host_state_pool = StatePool(num_host_state_slots) if num_host_state_slots else None
        self.host_state_slot: dict[int, int] = {}  # seq_id of a swapped sequence -> its host state slot
        self.state_swap_out: list[tuple[int, int]] = []  # (device slot, host slot), taken by the next schedule()
        self.state_swap_in: list[tuple[int, int]] = []  # (host slot, device slot)
        self._host_slots_in_transit: list[int] = []  # read by a planned swap-in: free after take_transfers()
        # Beam searches (fork groups): group id -> k (beam_width), the group of each member, its reserve.
        self._group_width: dict[int, int] = {}
        self._group_of: dict[int, int] = {}
        self._group_reserve: dict[int, list[int]] = {}  # filled at the group's first admission
        # Prefix caching: slots after the running ones hold the state at a cached page's end (module docstring).
        self.snapshot_pool = (StatePool(num_snapshot_slots, first_slot=num_state_slots + 1)
                              if self.enable_prefix_caching else None)
        self.snapshots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # page hash -> slot, LRU first
        self.aligns_chunks = self.enable_prefix_caching  # Scheduler: prompt chunks end on page boundaries
        self.num_snapshot_saves = 0
        self.num_snapshot_restores = 0
        self.num_snapshot_drops = 0  # dropped for room in the snapshot pool (their pages stay cached, unusable)
        self.num_snapshot_evictions = 0  # freed with their page, evicted from the prefix cache

    def _slots_needed(self, seq: Sequence) -> int:
        """Free pool slots admitting `seq` takes."""
        group = self._group_of.get(seq.seq_id)
        if group is not None:  # a beam: k slots at the search's first admission, later from its reserve
            return 0 if group in self._group_reserve else self._group_width[group]
        # A request with n > 1 forks n - 1 children when it samples its first token.
        return seq.sampling_params.n if not seq.output_token_ids else 1

    def _take_slot(self, seq: Sequence) -> int:
        group = self._group_of.get(seq.seq_id)
        if group is None:
            return self.state_pool.take()
        if group not in self._group_reserve:  # the group's first admission: its k slots leave the pool together
            self._group_reserve[group] = [self.state_pool.take() for _ in range(self._group_width[group])]
        return self._group_reserve[group].pop()

    def _release_slot(self, seq: Sequence) -> None:
        if seq.state_slot:
            group = self._group_of.get(seq.seq_id)
            if group is None:
                self.state_pool.release(seq.state_slot)
            else:
                self._group_reserve[group].append(seq.state_slot)
            seq.state_slot = 0

    def open_fork_group(self, seq: Sequence, width: int) -> None:
        """`seq` (not admitted yet) starts a beam search of `width` beams: the search holds `width` slots from
        its first admission until `close_fork_group`; its forks join the group."""
        if width > self.state_pool.num_slots:
            raise ValueError(f"beam_width={width} needs {width} state slots but the pool has "
                             f"{self.state_pool.num_slots} (max_num_seqs); lower beam_width or raise max_num_seqs")
        self._group_width[seq.seq_id] = width
        self._group_of[seq.seq_id] = seq.seq_id

    def close_fork_group(self, seq: Sequence) -> None:
        """The search `seq` (any of its beams) belongs to has ended and its beams are freed: its slots go back."""
        group = self._group_of.get(seq.seq_id)
        if group is None:
            return
        for slot in self._group_reserve.pop(group, []):
            self.state_pool.release(slot)
        del self._group_width[group]
        for seq_id in [s for s, g in self._group_of.items() if g == group]:
            del self._group_of[seq_id]

    def check_admissible(self, seq: Sequence) -> None:
        needed = self._slots_needed(seq)
        if needed > self.state_pool.num_slots:
            raise ValueError(f"the request needs {needed} state slots (n={seq.sampling_params.n}) but the pool has "
                             f"{self.state_pool.num_slots} (max_num_seqs); lower n or raise max_num_seqs")

    def can_allocate(self, seq: Sequence) -> bool:
        return self.state_pool.num_free >= self._slots_needed(seq) and super().can_allocate(seq)

    def allocate(self, seq: Sequence) -> None:
        if self.state_pool.num_free < self._slots_needed(seq):
            raise RuntimeError(f"sequence {seq.seq_id} needs {self._slots_needed(seq)} state slots but "
                               f"{self.state_pool.num_free} are free; call can_allocate() first")
        needed = self._slots_needed(seq)
        super().allocate(seq)
        seq.state_slot = self._take_slot(seq)
        if needed > 1 and seq.seq_id not in self._group_of:
            self._reserved[seq.seq_id] = [self.state_pool.take() for _ in range(needed - 1)]
        if seq.num_cached_tokens:  # a prefix hit starts from the state at its end (a snapshot: _cached_prefix)
            page_hash = seq.page_hashes[seq.num_cached_tokens // self.page_size - 1]
            self.snapshots.move_to_end(page_hash)
            self.state_copies.append((self.snapshots[page_hash], seq.state_slot))
            self.num_snapshot_restores += 1

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._release_slot(seq)
        for slot in self._reserved.pop(seq.seq_id, []):
            self.state_pool.release(slot)
        host_slot = self.host_state_slot.pop(seq.seq_id, 0)
        if host_slot:  # a swapped sequence finished or aborted: nothing reads its host state
            self.host_state_pool.release(host_slot)

    def fork(self, parent: Sequence, child_seq_id: int | None = None) -> Sequence:
        group = self._group_of.get(parent.seq_id)
        if group is not None:  # a beam: from its search's reserve (k slots cover k live beams)
            if not self._group_reserve.get(group):
                raise RuntimeError(f"no state slot for a fork of beam {parent.seq_id}: its search's "
                                   f"{self._group_width[group]} slots are held; free dropped beams first")
            child = super().fork(parent, child_seq_id)
            self._group_of[child.seq_id] = group
            child.state_slot = self._group_reserve[group].pop()
            self.state_copies.append((parent.state_slot, child.state_slot))
            return child
        reserved = self._reserved.get(parent.seq_id)
        if not reserved and not self.state_pool.num_free:
            raise RuntimeError(f"no state slot for a fork of sequence {parent.seq_id}: the pool's "
                               f"{self.state_pool.num_slots} slots are held")
        child = super().fork(parent, child_seq_id)
        child.state_slot = reserved.pop() if reserved else self.state_pool.take()
        if reserved == []:
            del self._reserved[parent.seq_id]
        self.state_copies.append((parent.state_slot, child.state_slot))
        return child

    # ------------------------------------------------------------------ prefix caching: state snapshots

    def aligned_chunk(self, seq: Sequence, num_new: int) -> int:
        """`num_new` cut to end on the last prompt page boundary it crosses (unchanged if it crosses none or
        ends on one): the state there can be saved for the prefix cache."""
        start = seq.num_computed_tokens
        end = min(start + num_new, len(seq.prompt_token_ids)) // self.page_size * self.page_size
        return end - start if start < end < start + num_new else num_new

    def snapshot_state(self, seq: Sequence) -> None:
        """At dispatch of a step after which `seq` has computed `num_computed_tokens`: if that is the end of
        a registered prompt page with no snapshot yet, plan the save of its slot's state."""
        num_computed = seq.num_computed_tokens
        if (self.snapshot_pool is None or num_computed % self.page_size
                or num_computed > len(seq.prompt_token_ids) or not seq.state_slot):
            return
        page_idx = num_computed // self.page_size - 1
        if page_idx >= len(seq.page_hashes):
            return  # not hashed, so not registered (prompt pages are, when their step is planned)
        page_hash = seq.page_hashes[page_idx]
        if page_hash in self.snapshots or page_hash not in self.hash_to_page:
            return
        if not self.snapshot_pool.num_free:
            self.snapshot_pool.release(self.snapshots.popitem(last=False)[1])  # the least recently used
            self.num_snapshot_drops += 1
        slot = self.snapshot_pool.take()
        self.snapshots[page_hash] = slot
        self.state_copies.append((seq.state_slot, slot))
        self.num_snapshot_saves += 1

    def _drop_snapshot(self, page_hash: bytes) -> None:
        slot = self.snapshots.pop(page_hash, None)
        if slot is not None:
            self.snapshot_pool.release(slot)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        # Only up to the deepest hit page whose end state is kept: KV pages and state agree.
        hit_page_ids = super()._cached_prefix(seq)
        while hit_page_ids and seq.page_hashes[len(hit_page_ids) - 1] not in self.snapshots:
            hit_page_ids.pop()
        return hit_page_ids

    def _take_fresh_page(self) -> int:
        # The page the base class hands out (None: it raises) leaves the cache: its snapshot goes too.
        page_id = next(iter(self.free_page_ids), None)
        if page_id is not None and self.page_hash[page_id] in self.snapshots:
            self._drop_snapshot(self.page_hash[page_id])
            self.num_snapshot_evictions += 1
        return super()._take_fresh_page()

    def reset_prefix_cache(self) -> int:
        for page_hash in list(self.snapshots):
            self._drop_snapshot(page_hash)
        return super().reset_prefix_cache()

    def leaks(self) -> list[str]:
        """With no sequence holding pages: what is still held beyond the prefix cache (empty when nothing
        leaked). Every page is free, every running slot is free, no fork reservation is left, and the
        snapshot slots in use are exactly those of cached pages."""
        problems = []
        if self.num_free_pages != self.num_pages - 1:
            problems.append(f"{self.num_pages - 1 - self.num_free_pages} pages held")
        if self.state_pool.num_free != self.state_pool.num_slots:
            problems.append(f"{self.state_pool.num_slots - self.state_pool.num_free} state slots held")
        if self._reserved:
            problems.append(f"fork reservations left: {self._reserved}")
        if self.snapshot_pool is not None:
            if self.snapshot_pool.num_slots - self.snapshot_pool.num_free != len(self.snapshots):
                problems.append(f"{self.snapshot_pool.num_slots - self.snapshot_pool.num_free} snapshot slots held "
                                f"for {len(self.snapshots)} snapshots")
            if any(page_hash not in self.hash_to_page for page_hash in self.snapshots):
                problems.append("a snapshot outlived its cached page")
        return problems

    # ------------------------------------------------------------------ swapping

    # Swap: the state goes with the pages (the module docstring). The gather of `state_swap_out` is issued after
    # the step in flight, which advanced the state through the sequence's computed tokens, as the page
    # gathers are; a sequence that still holds reserved fork slots (n > 1 before its first token) is recomputed.

    def can_swap_out(self, seq: Sequence) -> bool:
        return (self.host_state_pool is not None and self.host_state_pool.num_free > 0
                and seq.seq_id not in self._reserved and super().can_swap_out(seq))

    def swap_out_seq(self, seq: Sequence) -> None:
        host_slot = self.host_state_pool.take()
        self.state_swap_out.append((seq.state_slot, host_slot))
        self.host_state_slot[seq.seq_id] = host_slot
        super().swap_out_seq(seq)
        self._release_slot(seq)

    def can_swap_in(self, seq: Sequence) -> bool:
        return self.state_pool.num_free >= self._slots_needed_to_swap_in(seq) and super().can_swap_in(seq)

    def _slots_needed_to_swap_in(self, seq: Sequence) -> int:
        return 0 if self._group_of.get(seq.seq_id) in self._group_reserve else 1

    def swap_in_seq(self, seq: Sequence) -> None:
        super().swap_in_seq(seq)
        seq.state_slot = self._take_slot(seq)
        host_slot = self.host_state_slot.pop(seq.seq_id)
        self.state_swap_in.append((host_slot, seq.state_slot))
        self._host_slots_in_transit.append(host_slot)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        for host_slot in self._host_slots_in_transit:  # the swap-ins that read them were issued
            self.host_state_pool.release(host_slot)
        self._host_slots_in_transit = []
        return super().take_transfers()

    def take_state_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        transfers = self.state_swap_out, self.state_swap_in
        self.state_swap_out, self.state_swap_in = [], []
        return transfers

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self.state_copies = self.state_copies, []
        return copies

    def stats(self) -> dict[str, int | float]:
        snapshot_stats = {} if self.snapshot_pool is None else {
            "num_state_snapshots": len(self.snapshots), "num_snapshot_saves": self.num_snapshot_saves,
            "num_snapshot_restores": self.num_snapshot_restores, "num_snapshot_drops": self.num_snapshot_drops,
            "num_snapshot_evictions": self.num_snapshot_evictions}
        return {**super().stats(), "num_free_state_slots": self.state_pool.num_free, **snapshot_stats}
