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
    preemption             recompute only: a readmitted sequence starts again from position 0, and
                           a row whose step starts at position 0 starts from a zero state (whatever
                           its slot held), so a slot never needs clearing. Swap is refused.

Chunked prefill needs nothing here: a later chunk continues from its slot. Prefix caching cannot be
served (a cached page would need the state at its boundary): the engine turns it off for hybrid models.
"""

from __future__ import annotations

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.sequence import Sequence


def refuse_hybrid_features(config) -> list[str]:
    """ValueError naming the first EngineConfig field a hybrid (linear-attention) model cannot serve; else the
    warnings for what is turned off (prefix caching)."""
    refusals = [
        (config.preemption_mode == "swap", "preemption_mode='swap'", "use preemption_mode='recompute'"),
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
    if config.enable_prefix_caching:
        return ["prefix caching is turned off for hybrid linear-attention models (Qwen3-Next): a cached page "
                "would need the recurrent state at its boundary, which jaxpaged does not snapshot"]
    return []


class StatePool:
    """Slot ids 1..num_slots; `take` the lowest free one (deterministic), `release` it back."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be >= 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots, 0, -1))  # popped from the end: lowest id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot; check num_free first")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not 1 <= slot <= self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not a used slot of this pool")
        self._free.append(slot)
        self._free.sort(reverse=True)


class HybridBlockManager(BlockManager):
    """A `BlockManager` whose sequences also hold a state slot (see the module docstring)."""

    def __init__(self, *args, num_state_slots: int, **kwargs):
        super().__init__(*args, **kwargs)
        if self.enable_prefix_caching:
            raise ValueError("prefix caching cannot serve a hybrid linear-attention model; pass "
                             "enable_prefix_caching=False")
        self.state_pool = StatePool(num_state_slots)
        self._reserved: dict[int, list[int]] = {}  # seq_id -> slots kept for its forks at the first token
        self.state_copies: list[tuple[int, int]] = []  # (src slot, dst slot), taken by the next schedule()

    @staticmethod
    def _slots_needed(seq: Sequence) -> int:
        # A request with n > 1 forks n - 1 children when it samples its first token.
        return seq.sampling_params.n if not seq.output_token_ids else 1

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
        super().allocate(seq)
        seq.state_slot = self.state_pool.take()
        if self._slots_needed(seq) > 1:
            self._reserved[seq.seq_id] = [self.state_pool.take() for _ in range(self._slots_needed(seq) - 1)]

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        if seq.state_slot:
            self.state_pool.release(seq.state_slot)
            seq.state_slot = 0
        for slot in self._reserved.pop(seq.seq_id, []):
            self.state_pool.release(slot)

    def fork(self, parent: Sequence, child_seq_id: int | None = None) -> Sequence:
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

    def can_swap_out(self, seq: Sequence) -> bool:
        return False  # refused for hybrid models (refuse_hybrid_features); recompute instead

    def take_state_copies(self) -> list[tuple[int, int]]:
        copies, self.state_copies = self.state_copies, []
        return copies

    def stats(self) -> dict[str, int | float]:
        return {**super().stats(), "num_free_state_slots": self.state_pool.num_free}
