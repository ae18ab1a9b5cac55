"""Per-sequence grammar matchers and the step's token bitmask (host side).

    admission ──► templates[request_id] = template (the request's compiled matcher, grammar.py)
    commit k  ──► release(live request ids)   matchers of finished sequences are dropped
              └─► prefetch()                  each running matcher consumes step k's token and its
                                              next mask is computed on a worker thread (llguidance
                                              releases the GIL): it overlaps the host's output
                                              processing, scheduling and the device's forward pass
    dispatch  ──► bitmask(rows, num_rows)     int32 [num_rows, ceil(vocab / 32)]: bit t of row r
                                              = token t allowed; rows without a grammar all ones (-1).
                                              Masks computed ahead are copied in; a row without one
                                              (a first token, a resumed sequence) is computed now.

A step with a constrained row is committed in the engine step that dispatched it (engine.py), so at
dispatch every output token of a constrained sequence has landed. A sample of an n > 1 request
starts from its own copy of the template (forked children included); preemption keeps the matcher,
since a preempted sequence keeps its output tokens. Thread rule: only one thread touches the
matchers at a time; every method here first waits for the worker (`_join`). Pure host code, no jax.
"""

from __future__ import annotations

import concurrent.futures
import time

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxpaged.planner.sequence import SequenceStatus


# Fewer running constrained sequences than this: their masks are computed at dispatch. The hand-off
# to the worker and back costs ~0.05 ms (bench_structured_host: 1 row, 0.02 ms at dispatch).
MIN_PREFETCH_ROWS = 4


class StructuredState:
    def __init__(self, vocab_size: int, eos_token_id: int | None, num_threads: int | None = None):
        self.num_words = (vocab_size + 31) // 32
        self.eos_token_id = eos_token_id
        self.templates: dict[str, llguidance.LLMatcher] = {}  # request_id -> its compiled template
        self._matchers: dict[int, list] = {}  # seq_id -> [seq, matcher, output tokens consumed]
        self._executor = llguidance.LLExecutor(num_threads)  # llguidance's own threads, one mask each
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpaged-mask")
        self._ahead: concurrent.futures.Future | None = None  # prefetch() in flight
        self._ahead_rows: dict[int, tuple[int, int]] = {}  # seq_id -> (row of _ahead_mask, outputs consumed)
        self._ahead_mask = np.empty((0, self.num_words), np.int32)  # grows to the most rows prefetched
        # Engine-thread seconds: in bitmask() (of which waiting for the worker) and in prefetch()
        self.seconds = {"bitmask": 0.0, "wait": 0.0, "prefetch": 0.0}
        self.num_rows_ahead = self.num_rows_now = 0  # rows whose mask came from prefetch / was computed at dispatch

    def __len__(self) -> int:
        """Matchers and templates held (0 once every constrained request finished: no leak)."""
        return len(self._matchers) + len(self.templates)

    def _join(self) -> None:
        if self._ahead is not None:
            t0 = time.perf_counter()
            self._ahead.result()
            self.seconds["wait"] += time.perf_counter() - t0
            self._ahead = None

    def _matcher(self, seq, request_id: str):
        entry = self._matchers.get(seq.seq_id)
        if entry is None:  # each sample (forked ones included) starts from its own copy
            entry = self._matchers[seq.seq_id] = [seq, self.templates[request_id].deep_copy(), 0]
        return _catch_up(entry)

    def prefetch(self) -> None:
        """Starts computing the next mask of every running constrained sequence whose tokens have all
        landed, on the worker thread; bitmask() picks them up at the next dispatch."""
        t0 = time.perf_counter()
        self._start_prefetch()
        self.seconds["prefetch"] += time.perf_counter() - t0

    def _start_prefetch(self) -> None:
        self._join()
        self._ahead_rows = {}
        pairs = []
        for seq_id, entry in self._matchers.items():
            seq = entry[0]
            if seq.status is not SequenceStatus.RUNNING or seq.num_placeholders:
                continue  # not in the next step, or its last token is still on the device
            self._ahead_rows[seq_id] = (len(pairs), len(seq.output_token_ids))
            pairs.append((_catch_up(entry), len(pairs)))
        if len(pairs) < MIN_PREFETCH_ROWS:  # a thread hand-off costs more than these few masks
            self._ahead_rows = {}
            return
        if self._ahead_mask.shape[0] < len(pairs):
            self._ahead_mask = np.empty((max(len(pairs), 2 * self._ahead_mask.shape[0]), self.num_words), np.int32)
        self._ahead = self._worker.submit(llnp.fill_next_token_bitmask_par, self._executor, pairs, self._ahead_mask)

    def bitmask(self, rows: list[tuple[int, object, str]], num_rows: int) -> np.ndarray:
        """The step's mask: each (sampler row, sequence, request id) of `rows` gets its sequence's
        allowed tokens; a row whose matcher allows nothing (it ended under ignore_eos) gets eos."""
        t0 = time.perf_counter()
        mask = self._bitmask(rows, num_rows)
        self.seconds["bitmask"] += time.perf_counter() - t0
        return mask

    def _bitmask(self, rows: list[tuple[int, object, str]], num_rows: int) -> np.ndarray:
        self._join()
        mask = np.full((num_rows, self.num_words), -1, np.int32)
        first_row: dict[int, int] = {}  # seq_id -> its first row (n > 1 first tokens share a state)
        pairs, copies, ahead_dst, ahead_src = [], [], [], []
        for row, seq, request_id in rows:
            if seq.seq_id in first_row:
                copies.append((row, first_row[seq.seq_id]))
                continue
            first_row[seq.seq_id] = row
            ahead = self._ahead_rows.get(seq.seq_id)
            if ahead is not None and ahead[1] == len(seq.output_token_ids):  # computed for this state
                ahead_dst.append(row)
                ahead_src.append(ahead[0])
            else:
                pairs.append((self._matcher(seq, request_id), row))
        self._ahead_rows = {}  # good for one step only: the buffer is refilled at the next commit
        if ahead_dst:
            mask[ahead_dst] = self._ahead_mask[ahead_src]
        if pairs:
            llnp.fill_next_token_bitmask_par(self._executor, pairs, mask)
        for row, source in copies:
            mask[row] = mask[source]
        self.num_rows_ahead += len(ahead_dst)
        self.num_rows_now += len(pairs)
        if self.eos_token_id is not None:
            constrained = [row for row, _, _ in rows]
            for row in np.asarray(constrained)[~mask[constrained].any(axis=1)]:
                mask[row, self.eos_token_id // 32] = np.uint32(1 << (self.eos_token_id % 32)).view(np.int32)
        return mask

    def release(self, live_request_ids) -> None:
        """Drops the matchers of finished sequences and the templates of requests not in live_request_ids."""
        self._join()
        for seq_id in [s for s, (seq, _, _) in self._matchers.items() if seq.is_finished]:
            del self._matchers[seq_id]
            self._ahead_rows.pop(seq_id, None)
        for request_id in [r for r in self.templates if r not in live_request_ids]:
            del self.templates[request_id]


def _catch_up(entry: list):
    """The entry's matcher, after consuming its sequence's outputs it has not seen."""
    seq, matcher, consumed = entry
    if len(seq.output_token_ids) > consumed:
        matcher.consume_tokens(seq.output_token_ids[consumed:])
        entry[2] = len(seq.output_token_ids)
    return matcher
