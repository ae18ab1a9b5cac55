"""The numpy half of the host -> device contract: `StepInput` and `prepare_step_input`.

    SchedulerOutput --prepare_step_input--> StepInput (padded int32 numpy arrays, shapes from a bucket)

This module imports no jax: the planner side of the engine can build and test step inputs without a
device. `jaxpaged.device.runner` registers `StepInput` as a pytree so it crosses `jax.jit` as one
argument, and owns the device half.
"""

import dataclasses
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Int

from jaxpaged.planner.request import placeholder_row


# numpy arrays on the host; the jitted step rebuilds a StepInput from jax arrays (tracers), which
# this module cannot name without importing jax: `Any` keeps the dtype and shape checks for both.
_Arr = Any


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One step's host -> device contract (DESIGN.md): padded int32 arrays, shapes from a bucket.

    A bucket `b` fixes num_tokens = b and num_seqs = min(b, max_num_seqs); a decode bucket `d`
    (every sequence has exactly one new token) fixes num_tokens = num_seqs = d and sets
    `decode_only`.
    """

    # Flat tokens of all scheduled chunks, in batch order; padding 0.
    token_ids: Int[_Arr, "num_tokens"]
    # Each token's position in its sequence (RoPE); padding 0.
    positions: Int[_Arr, "num_tokens"]
    # Slot receiving each token's K/V (page_id * page_size + offset); padding num_pages * page_size.
    slot_mapping: Int[_Arr, "num_tokens"]
    # Physical page ids of each sequence, at fixed width ceil(max_model_len / page_size); padding 0.
    block_tables: Int[_Arr, "num_seqs pages_per_seq"]
    # Context length of each sequence after this step (cached + new tokens); padding rows 0.
    seq_lens: Int[_Arr, "num_seqs"]
    # Sequence i owns tokens query_start_loc[i]:query_start_loc[i+1]; padding rows repeat the total.
    query_start_loc: Int[_Arr, "num_seqs_plus_1"]
    # Flat index of each sequence's last scheduled token (where logits are taken); padding rows 0.
    # A speculative verification step takes several per sequence (num_logits >= num_seqs rows).
    logits_indices: Int[_Arr, "num_logits"]
    # Per token, -1 if token_ids holds it; else the row of the previous step's sampled tokens (still
    # on the device) that holds it, and token_ids has 0 there. Asynchronous stepping only; padding -1.
    prev_token_rows: Int[_Arr, "num_tokens"] | None = None
    # Prompt logprobs (engine-filled, only in steps where some request asks): per token, the id whose
    # log-probability its logits give (the next prompt token), -1 where none is wanted. Its presence
    # makes the step also return every token's logprobs (runner.py): a compiled program of its own.
    prompt_logprob_targets: Int[_Arr, "num_tokens"] | None = None
    # Multi-LoRA (engine-filled when enable_lora): each token's adapter slot on the device, 0 for the
    # base model (device/lora_slots.py); padding 0. Present in every step of such an engine: one program.
    lora_slots: Int[_Arr, "num_tokens"] | None = None
    # Hybrid models only: each row's recurrent-state slot (planner/state_pool.py), padding rows 0.
    state_slots: Int[_Arr, "num_seqs"] | None = None
    # Static (pytree metadata, not an array): every real sequence has exactly one token and
    # num_tokens == num_seqs, so the model may run a decode kernel. Part of the compiled program's
    # identity: a decode bucket of d and a mixed bucket of d tokens are two programs.
    decode_only: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class BlockTableRows:
    """A persistent host copy of the scheduled sequences' block tables, updated incrementally.

    Rebuilding `[num_seqs, pages_per_seq]` from Python lists costs milliseconds at 256 sequences of
    4000 tokens; the lists barely change between steps. While a sequence runs its block table is
    append-only, except that copy-on-write replaces the entry of the page being written (only in a
    step with `copies`); preemption, finishing and forking give a sequence a new list object. So
    each step checks one length and one identity per sequence and copies only new entries.

        row of seq 7:  [ 12  4  9 | 31  0  0 ... ]   num_synced 3; block_table grew to 4: copy [31]
    """

    def __init__(self, num_rows: int, pages_per_seq: int):
        self.table = np.zeros((num_rows, pages_per_seq), np.int32)
        self._rows: dict[int, list] = {}  # seq_id -> [row, the block_table list synced, num_synced]
        self._free_rows = list(range(num_rows - 1, -1, -1))
        # The previous call's batch, for the fast path: same sequences, same block table lists.
        self._last_seqs: list = []
        self._last_tables: list = []
        self._last_rows = np.empty(0, np.int32)
        self._last_lens = np.empty(0, np.int32)
        self.num_fast = 0  # calls served by the fast path (tests check both paths run)

    def rows(self, seqs, page_size: int, resync_write_page: bool, tables=None, lens=None) -> np.ndarray:
        """Each sequence's row in `table`, synced to its current block table (`tables` and their
        lengths `lens`, int32, may be passed in if the caller has them).

        Fast path, the steady decode: the batch is the previous call's (same sequences in the same
        order, each with the same block table list) and no copy-on-write happened; then only the
        rows whose block table grew are touched (about 1 in page_size per step), found with numpy.
        """
        if tables is None:
            tables = [seq.block_table for seq in seqs]
        if (
            not resync_write_page
            and seqs == self._last_seqs  # identity: Sequence defines no __eq__
            and all(map(operator.is_, tables, self._last_tables))
        ):
            if lens is None:
                lens = np.fromiter(map(len, tables), np.int32, len(tables))
            grown = np.flatnonzero(lens != self._last_lens)
            if grown.size:
                entries, table = self._rows, self.table
                for i in grown.tolist():
                    block_table = tables[i]
                    entry = entries[seqs[i].seq_id]
                    table[entry[0], entry[2] : len(block_table)] = block_table[entry[2] :]
                    entry[2] = len(block_table)
                self._last_lens = lens
            self.num_fast += 1
            return self._last_rows
        rows = self._sync_all(seqs, page_size, resync_write_page)
        self._last_seqs, self._last_tables, self._last_rows = list(seqs), tables, rows
        self._last_lens = np.fromiter(map(len, tables), np.int32, len(tables)) if lens is None else lens
        return rows

    def _sync_all(self, seqs, page_size: int, resync_write_page: bool) -> np.ndarray:
        """The general path: one length and one identity check per sequence."""
        rows = np.empty(len(seqs), np.int32)
        entries = self._rows
        table = self.table
        for i, seq in enumerate(seqs):
            block_table = seq.block_table
            entry = entries.get(seq.seq_id)
            if entry is None:
                entry = entries[seq.seq_id] = [self._take_row(seqs), block_table, 0]
                table[entry[0]] = 0
            elif entry[1] is not block_table:  # a new list: preempted and readmitted, or forked
                entry[1], entry[2] = block_table, 0
                table[entry[0]] = 0
            num_synced = entry[2]
            if resync_write_page:  # copy-on-write may have replaced the page being written
                num_synced = min(num_synced, seq.num_computed_tokens // page_size)
            if num_synced != len(block_table):
                table[entry[0], num_synced : len(block_table)] = block_table[num_synced:]
                entry[2] = len(block_table)
            rows[i] = entry[0]
        return rows

    def _take_row(self, seqs) -> int:
        if not self._free_rows:  # forget every sequence not in this step (finished ones among them)
            keep = {seq.seq_id for seq in seqs}
            for seq_id in [seq_id for seq_id in self._rows if seq_id not in keep]:
                self._free_rows.append(self._rows.pop(seq_id)[0])
        return self._free_rows.pop()


_num_computed_tokens = operator.attrgetter("num_computed_tokens")
_block_table = operator.attrgetter("block_table")
_token_ids = operator.attrgetter("token_ids")


def default_buckets(max_num_batched_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to `max_num_batched_tokens` (always included)."""
    buckets = []
    b = smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return (*buckets, max_num_batched_tokens)


def default_decode_buckets(max_num_seqs: int, smallest: int = 1) -> tuple[int, ...]:
    """Decode buckets: powers of two from `smallest` up to `max_num_seqs` (always included)."""
    return default_buckets(max_num_seqs, smallest=min(smallest, max_num_seqs))


def prepare_step_input(
    scheduler_output,
    *,
    page_size: int,
    num_pages: int,
    pages_per_seq: int,
    max_num_seqs: int,
    buckets: Sequence[int],
    block_table_rows: BlockTableRows | None = None,
    decode_buckets: Sequence[int] = (),
    num_logits: np.ndarray | None = None,
    max_num_logits: int = 0,
    seq_lora_slots: np.ndarray | None = None,
    state_slots: bool = False,
) -> StepInput:
    """Turns the scheduler's step description into a padded `StepInput` of numpy int32 arrays.

    `scheduler_output` needs `.seqs` (each with `.token_ids`, `.num_computed_tokens`,
    `.block_table`) and `.num_new_tokens`. Worked example, page_size 4, two sequences:

        seq A: 5 tokens cached, 3 new (a prefill chunk), block_table [2, 7]
        seq B: 9 cached, 1 new (a decode),              block_table [4, 9, 1]

        token:            0     1     2   |  3
        positions:        5     6     7   |  9
        page, offset:   (7,1) (7,2) (7,3) | (1,1)     page = block_table[pos // 4], offset = pos % 4
        slot_mapping:    29    30    31   |  5        slot = page * 4 + offset
        query_start_loc: [0, 3, 4],  seq_lens: [8, 10],  logits_indices: [2, 3]

    Bucket choice: a step in which every sequence has exactly one new token (decode-only) takes the
    smallest decode bucket `d >= num_seqs` (num_tokens = num_seqs = d, `decode_only=True`); any
    other step, or a decode-only one with no decode bucket that large, takes the smallest bucket
    `b >= total tokens` (num_tokens = b, num_seqs = min(b, max_num_seqs)).

    Speculative verification: `num_logits[i]` logits rows for sequence i, its last num_logits[i]
    tokens, in order; logits_indices then has min(b, max_num_logits) entries (its own program per
    bucket), padding 0.

    `seq_lora_slots` (int32 [num_seqs], with adapters): each sequence's adapter slot, given to its tokens.
    `state_slots`: a hybrid model's step also carries each sequence's `state_slot` (padding rows 0).
    """
    seqs, num_new = scheduler_output.seqs, np.asarray(scheduler_output.num_new_tokens, np.int32)
    num_seqs, total = len(seqs), int(num_new.sum())
    if num_seqs == 0:
        raise ValueError("the step schedules no sequence; do not call the model for an empty step")
    if num_seqs > max_num_seqs:
        raise ValueError(f"{num_seqs} sequences exceed {max_num_seqs=}; the scheduler must cap them")
    if num_new.min() < 1:
        raise ValueError(f"every scheduled sequence needs >= 1 new token, got {num_new.tolist()}")
    decode_bucket = next((d for d in sorted(decode_buckets) if d >= num_seqs), None) if total == num_seqs else None
    if decode_bucket is not None:
        bucket = bucket_seqs = decode_bucket
    else:
        bucket = next((b for b in sorted(buckets) if b >= total), None)
        if bucket is None:
            raise ValueError(f"{total} tokens exceed the largest bucket {max(buckets)}; raise it or schedule fewer")
        bucket_seqs = min(bucket, max_num_seqs)

    start = np.fromiter(map(_num_computed_tokens, seqs), np.int32, num_seqs)
    seq_lens = start + num_new
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(num_new, out=query_start_loc[1:])

    # Block tables, each padded with page 0 to pages_per_seq: fill a row-major mask in one go.
    tables = list(map(_block_table, seqs))
    table_lens = np.fromiter(map(len, tables), np.int32, num_seqs)
    too_short = (table_lens * page_size < seq_lens) | (table_lens > pages_per_seq)
    if too_short.any():
        bad = int(np.argmax(too_short))
        raise ValueError(
            f"sequence {bad} needs {seq_lens[bad]} slots but its block table has {table_lens[bad]} pages "
            f"(at most {pages_per_seq}); the block manager must allocate pages before the step"
        )
    block_tables = np.zeros((bucket_seqs, pages_per_seq), np.int32)
    if block_table_rows is not None:  # the engine's persistent copy: only new entries are copied
        rows = block_table_rows.rows(seqs, page_size, bool(scheduler_output.copies), tables, table_lens)
        np.take(block_table_rows.table, rows, axis=0, out=block_tables[:num_seqs], mode="clip")  # rows are valid
    else:
        flat_pages = np.fromiter(
            itertools.chain.from_iterable(tables), np.int32, int(table_lens.sum())
        )
        block_tables[:num_seqs][np.arange(pages_per_seq) < table_lens[:, None]] = flat_pages

    # Per token: its sequence, its position, its slot.
    positions = np.zeros(bucket, np.int32)
    if total == num_seqs:  # one token per sequence (decodes): token i is sequence i's, at `start`
        seq_idx = np.arange(num_seqs, dtype=np.int32)
        positions[:total] = start
    else:
        seq_idx = np.repeat(np.arange(num_seqs, dtype=np.int32), num_new)  # [total]
        positions[:total] = start[seq_idx] + np.arange(total, dtype=np.int32) - query_start_loc[seq_idx]
    slot_mapping = np.full(bucket, num_pages * page_size, np.int32)
    pos = positions[:total]
    slot_mapping[:total] = block_tables[seq_idx, pos // page_size] * page_size + pos % page_size

    token_ids = np.zeros(bucket, np.int32)
    if total == num_seqs:  # all decodes: one token each, no slicing
        token_ids[:total] = list(map(operator.getitem, map(_token_ids, seqs), start.tolist()))
    else:
        token_ids[:total] = np.fromiter(
            itertools.chain.from_iterable(
                s.token_ids[c : c + n] for s, c, n in zip(seqs, start.tolist(), num_new.tolist())
            ),
            np.int32,
            total,
        )

    # Placeholders (tokens sampled by the previous step, not yet read back) are negative (planner/request.py).
    prev_token_rows = np.full(bucket, -1, np.int32)
    if token_ids[:total].min() < 0:
        placeholder = token_ids < 0
        prev_token_rows[placeholder] = placeholder_row(token_ids[placeholder])
        token_ids[placeholder] = 0

    padded_lens = np.zeros(bucket_seqs, np.int32)
    padded_lens[:num_seqs] = seq_lens
    padded_starts = np.full(bucket_seqs + 1, total, np.int32)
    padded_starts[: num_seqs + 1] = query_start_loc
    if num_logits is None:
        logits_indices = np.zeros(bucket_seqs, np.int32)
        logits_indices[:num_seqs] = query_start_loc[1:] - 1
    else:  # row r of sequence i's block of num_logits[i] rows: its token num_new[i] - num_logits[i] + r
        num_rows = int(num_logits.sum())
        logits_indices = np.zeros(min(bucket, max_num_logits), np.int32)
        ends = np.repeat(query_start_loc[1:], num_logits)
        rows_left = np.repeat(np.cumsum(num_logits), num_logits) - np.arange(num_rows)
        logits_indices[:num_rows] = ends - rows_left
    lora_slots = None
    if seq_lora_slots is not None:
        lora_slots = np.zeros(bucket, np.int32)
        lora_slots[:total] = np.asarray(seq_lora_slots, np.int32)[seq_idx]
    return StepInput(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=padded_lens,
        query_start_loc=padded_starts,
        logits_indices=logits_indices,
        prev_token_rows=prev_token_rows,
        lora_slots=lora_slots,
        state_slots=_state_slots(seqs, bucket_seqs) if state_slots else None,
        decode_only=decode_bucket is not None,
    )


def _state_slots(seqs, num_rows: int) -> np.ndarray:
    slots = np.zeros(num_rows, np.int32)
    slots[: len(seqs)] = [seq.state_slot for seq in seqs]
    if not slots[: len(seqs)].all():
        raise ValueError("a scheduled sequence of a hybrid model holds no state slot; the block manager must "
                         "give it one at admission (planner/state_pool.py)")
    return slots


def pack_step_input(step_input: StepInput) -> tuple[np.ndarray, tuple[tuple[str, tuple[int, ...]], ...]]:
    """All of a step's int32 arrays in one flat array (one host -> device transfer), and its layout.

    The layout, `((field name, shape), ...)` in field order, depends only on the bucket: as a static
    argument of the jitted step it adds no compilation. A field that is None is left out, and so is
    `decode_only` (static: the caller passes it to the jitted step beside the layout).
    """
    arrays = [(f.name, getattr(step_input, f.name)) for f in dataclasses.fields(step_input)]
    arrays = [(name, a) for name, a in arrays if isinstance(a, np.ndarray)]  # not None, not decode_only
    packed = np.concatenate([a.ravel() for _, a in arrays]).astype(np.int32, copy=False)
    return packed, tuple((name, a.shape) for name, a in arrays)
