"""One request's state on the host: its tokens, how many have K/V in the page pool, and its pages.

Pure Python (no jax). The scheduler's hot loop reads these fields for every running sequence on
every step, so the class is slotted and `token_ids` is one list appended in place.
"""

from __future__ import annotations

import enum
import itertools
import sys
import time

from jaxpaged.planner.request import SamplingParams


class SequenceStatus(enum.Enum):
    # Held aside by the scheduler until `Scheduler.grammar_ready(seq)` (vLLM's WAITING_FOR_FSM): its
    # structured-output grammar compiles on a worker thread; it joins the FIFO queue, and arrives, then.
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds pages; scheduled on every step it fits in the budget
    PREEMPTED = "preempted"  # pages freed under memory pressure; queued again, recomputed from token 0
    SWAPPED = "swapped"  # preempted, its computed K/V copied to host pages (host_block_table); queued again
    FINISHED = "finished"  # done; pages freed; finish_reason says why


# Default ids for sequences created without one (the engine's requests, forks). The scheduler rejects
# duplicates, so callers may also choose their own ids.
_seq_id_counter = itertools.count()


def new_seq_id() -> int:
    return next(_seq_id_counter)


class Sequence:
    """Per-request state.

    Token layout (`num_computed_tokens` <= len(token_ids)):

        token_ids:  [ prompt_token_ids ........ | output_token_ids ... ]
                    [ K/V in pages: 0 .. num_computed_tokens-1 | not yet computed ]
                    [ num_cached_tokens: found in the prefix cache at admission ]

    While decoding, exactly the last token is not yet computed: num_computed_tokens == len(token_ids) - 1.

    Under asynchronous stepping the tail of `token_ids` may hold placeholders: tokens already sampled
    on the device but not yet read back (`num_placeholders` of them, at most 2, always the last ones).
    A placeholder is `placeholder_token_id(row)`, a negative id naming the sampler row that holds the
    token; `output_token_ids` holds only tokens the host knows.

        token_ids:  [ prompt ... | known outputs ... | -1-row ]     num_placeholders = 1
                      computed ------------------->  ^ input of the step in flight, gathered on device
    """

    __slots__ = (
        "seq_id",
        "prompt_token_ids",  # list[int], never changed
        "output_token_ids",  # list[int], generated tokens, appended in place
        "token_ids",  # list[int], prompt + output, appended in place (same tokens as the two above)
        "status",  # SequenceStatus
        "finish_reason",  # None | "stop" | "length" | "abort"
        "num_computed_tokens",  # tokens whose K/V are in this sequence's pages
        "num_cached_tokens",  # of those, tokens found in the prefix cache at the last admission
        "block_table",  # list[int]: logical page i -> physical page id
        "host_block_table",  # list[int]: while SWAPPED, logical page i -> host page id (else empty)
        "page_hashes",  # list[bytes]: chained digest of full page i of token_ids (a cache of the block manager)
        "sampling_params",  # SamplingParams
        "arrival_idx",  # order of arrival, set by Scheduler.add (forks share their parent's)
        "cache_salt",  # None | str | (str | None, weight epoch[, adapter]): separates tenants, weights and adapters in the prefix cache
        "eos_token_id",  # None | int: stops generation unless sampling_params.ignore_eos
        "lora_int_id",  # the LoRA adapter it runs under (LoRARequest.lora_int_id), 0: the base model
        # Stop rules folded for the scheduler's hot loop (derived from the fields above):
        "stop_token_set",  # frozenset: stop_token_ids, plus eos_token_id unless ignore_eos
        "max_num_tokens",  # finish "length" at this many tokens: prompt + max_tokens, capped by Scheduler.add
        "num_placeholders",  # trailing entries of token_ids sampled on device, not yet committed
        "arrival_time",  # time.monotonic() at creation (the request's arrival)
        "first_scheduled_time",  # time.monotonic() at its first admission to the running batch, or None
        "state_slot",  # hybrid models: its recurrent-state slot while it holds pages (planner/state_pool.py); 0: none
    )

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        seq_id: int | None = None,
        cache_salt: str | None | tuple = None,  # planner/prefix_cache.py Salt
        eos_token_id: int | None = None,
        lora_int_id: int = 0,
    ) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt has 0 tokens; give at least one token (e.g. the BOS token)")
        self.seq_id = new_seq_id() if seq_id is None else seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.host_block_table: list[int] = []
        self.page_hashes: list[bytes] = []
        self.sampling_params = SamplingParams() if sampling_params is None else sampling_params
        self.arrival_idx = -1
        self.cache_salt = cache_salt
        self.eos_token_id = eos_token_id
        self.lora_int_id = lora_int_id
        stop_token_ids = set(self.sampling_params.stop_token_ids)
        if eos_token_id is not None and not self.sampling_params.ignore_eos:
            stop_token_ids.add(eos_token_id)
        self.stop_token_set = frozenset(stop_token_ids)
        max_tokens = self.sampling_params.max_tokens  # None: only max_model_len stops it (Scheduler.add caps)
        self.max_num_tokens = len(self.prompt_token_ids) + (max_tokens if max_tokens is not None else sys.maxsize)
        self.num_placeholders = 0
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.state_slot = 0

    def admit(self) -> None:
        """Into the running batch (the scheduler's admission); the first one ends its queue time."""
        self.status = SequenceStatus.RUNNING
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed_tokens}, block_table={self.block_table})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def copy_for_fork(self, seq_id: int | None = None) -> Sequence:
        """A new sequence with this one's tokens and progress; pages are shared by the block manager."""
        child = Sequence.__new__(Sequence)
        child.seq_id = new_seq_id() if seq_id is None else seq_id
        child.prompt_token_ids = self.prompt_token_ids  # never mutated: safe to share
        child.output_token_ids = list(self.output_token_ids)
        child.token_ids = list(self.token_ids)
        child.status = self.status
        child.finish_reason = None
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.block_table = []  # filled by BlockManager.fork
        child.host_block_table = []
        child.page_hashes = list(self.page_hashes)
        child.sampling_params = self.sampling_params
        child.arrival_idx = self.arrival_idx
        child.cache_salt = self.cache_salt
        child.eos_token_id = self.eos_token_id
        child.lora_int_id = self.lora_int_id
        child.stop_token_set = self.stop_token_set
        child.max_num_tokens = self.max_num_tokens
        child.num_placeholders = self.num_placeholders
        child.arrival_time, child.first_scheduled_time = self.arrival_time, self.first_scheduled_time
        child.state_slot = 0  # its own, from the state pool (HybridBlockManager.fork)
        return child


def num_live_slots(seqs: list[Sequence], page_size: int) -> int:
    """Slots of used pages that hold a token of one of `seqs` (the sequences holding pages).

    A page shared by several sequences counts once, as full as its fullest holder. With
    `num_used_pages * page_size` slots allocated, the rest is fragmentation: the unfilled tail of
    each sequence's last page (what paging leaves of the dense cache's waste).
    """
    fill: dict[int, int] = {}
    ps = page_size
    for seq in seqs:
        num_tokens = len(seq.token_ids)
        for page_idx, page_id in enumerate(seq.block_table):
            filled = min(ps, max(0, num_tokens - page_idx * ps))
            if filled > fill.get(page_id, 0):
                fill[page_id] = filled
    return sum(fill.values())
