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

Sample first (step_mask; rows of greedy or plain-temperature requests, `samples_first`): such a row
draws without its mask, and StepMask.check(drawn) decides, after the draw, with llguidance's own
checks, which equal its mask (test_structured_sample_first.py walks grammars token by token):
    forced bytes with a token (compute_ff_tokens() non-empty: the mask allows that one token only)
                ──► allowed  <=>  t is that token; rejected: the token is put in (Fix.tokens)
    otherwise   ──► allowed  <=>  validate_tokens([t]) == 1 (eos: is_accepting()), or, where the
                    mask was filled ahead (temperature rows), its bit t; rejected: the row's first
                    allowed candidate (temperature rows: its draws without replacement,
                    sampling.sample_first_padded) is put in; with none, the device redraws it
                    under its mask: that mask (copied), else computed now (greedy rows, rows not
                    prefetched)
At commit, prefetch() consumes the step's tokens and computes these rows' forced tokens on the
worker (~8 us each against ~40 us for a mask) and, for temperature rows the grammar does not force
(masks_ahead), their masks into _ahead_mask after the masked rows': ~30% of them reject at T=1, and
their masks on the engine thread were most of its host time; greedy rows reject rarely, theirs stay
lazy. The engine joins the worker after the device's draw, so on a GPU host it overlaps the forward
pass (a step of only such rows does not wait before its draw). The thread rule holds: the worker
writes _ahead_mask, _forced and seconds["worker"] only between prefetch() and the next _join().
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import NamedTuple

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxpaged.planner.sequence import SequenceStatus


# Fewer running constrained sequences than this: their masks are computed at dispatch. The hand-off
# to the worker and back costs ~0.05 ms (bench_structured_host: 1 row, 0.02 ms at dispatch).
MIN_PREFETCH_ROWS = 4
GREEDY_TEMPERATURE = 1e-5  # sample/sampler.py's: below it a row draws its argmax


def samples_first(params) -> bool:
    """Whether a constrained row of these SamplingParams may draw before its mask: greedy, or a
    temperature with no top-k, top-p or min-p (those rank the allowed tokens, so the mask comes
    first). Exact: greedy draws the argmax over the allowed tokens either way, and drawing from p,
    then from p restricted to the allowed set A on rejection, gives p(t) / p(A) for every t in A."""
    return params.temperature < GREEDY_TEMPERATURE or (
        params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0)


@dataclasses.dataclass
class StepMask:
    """A step's grammar rows, from StructuredState.step_mask."""

    mask: np.ndarray | None  # the draw's int32 mask; None: no row needs one (the unmasked sampler)
    deferred: list  # (sampler row, sequence, request id): rows drawn without a mask, checked after
    num_rows: int
    state: "StructuredState"

    def check(self, drawn: np.ndarray, candidates: np.ndarray | None = None) -> "Fix | None":
        """The tokens drawn by the deferred rows, checked: None if every one is allowed, else the
        Fix of the rejected rows. `candidates` (int32 [rows, C], -1: none; sampling.sample_first_padded):
        a rejected row the grammar does not force takes its first allowed candidate after column 0
        (the drawn token), and only rows with none are redrawn. The worker's forced tokens and masks
        are joined here, after the device's draw, not before the draw."""
        t0 = time.perf_counter()
        state, eos = self.state, self.state.eos_token_id
        state._join()
        ahead_of: dict[int, tuple[int, int]] = {}  # seq_id -> (forced token or -1, row of _ahead_mask or -1)
        free: dict[int, list] = {}  # seq_id -> [matcher or mask row ahead, its rejected rows] (n > 1 rows share one)
        put_in = []  # (row, token): rejected rows fixed on the host, a forced token or an allowed candidate
        num_forced = num_rejected_forced = 0
        for row, seq, request_id in self.deferred:
            ahead = ahead_of.get(seq.seq_id)
            if ahead is None:
                ahead = ahead_of[seq.seq_id] = state._forced_now(seq, request_id)
            forced, mask_row = ahead
            token = int(drawn[row])
            if forced >= 0:
                num_forced += 1
                if token != forced:
                    put_in.append((row, forced))
                    num_rejected_forced += 1
            elif mask_row >= 0:  # its mask came from the worker: the check is a bit of it
                if not _bit(state._ahead_mask[mask_row], token):
                    free.setdefault(seq.seq_id, [mask_row]).append(row)
            else:
                matcher = state._matchers[seq.seq_id][1]
                if not drawn_allowed(matcher, token, eos):
                    free.setdefault(seq.seq_id, [matcher]).append(row)
        num_free = sum(len(seq_rows) for _, *seq_rows in free.values())
        if candidates is not None and free:
            free = self._take_candidates(free, candidates, put_in)
        state.num_rows_checked += len(self.deferred) - num_forced
        state.num_rows_forced += num_forced
        state.num_rows_rejected += num_free + num_rejected_forced
        state.num_rows_rejected_forced += num_rejected_forced
        fix = None
        if free or put_in:
            tokens = np.array(drawn, np.int32)  # a fresh array: the device may alias it (DESIGN.md)
            for row, token in put_in:
                tokens[row] = token
            fix = Fix(None, None, tokens)
        if free:  # a device redraw under the masks of the rows still rejected
            state.num_redraws += 1
            mask = np.full((self.num_rows, state.num_words), -1, np.int32)
            t1 = time.perf_counter()
            lazy = [(source, first) for source, first, *_ in free.values() if not isinstance(source, int)]
            if lazy:
                llnp.fill_next_token_bitmask_par(state._executor, lazy, mask)
                state.allow_eos_where_empty(mask, [first for _, first in lazy])
            state.num_rows_rejected_lazy += len(lazy)
            state.seconds["reject_masks"] += time.perf_counter() - t1
            for source, first, *others in free.values():
                if isinstance(source, int):
                    mask[first] = state._ahead_mask[source]
                mask[others] = mask[first]
            flags = np.zeros(self.num_rows, np.bool_)
            flags[[row for _, *seq_rows in free.values() for row in seq_rows]] = True
            fix = Fix(mask, flags, tokens)
        elif put_in:
            state.num_puts += 1
        state.seconds["check"] += time.perf_counter() - t0
        return fix

    def _take_candidates(self, free: dict, candidates: np.ndarray, put_in: list) -> dict:
        """Each rejected row of `free` takes its first allowed candidate (into put_in); returns the
        rows with none, as `free` holds them."""
        state, eos = self.state, self.state.eos_token_id
        left: dict[int, list] = {}
        for seq_id, (source, *rows) in free.items():
            if isinstance(source, int):
                allows = lambda token, words=state._ahead_mask[source]: _bit(words, token)
            else:
                allows = lambda token, matcher=source: drawn_allowed(matcher, token, eos)
            for row in rows:
                token = next((t for t in candidates[row, 1:].tolist() if t >= 0 and allows(t)), -1)
                if token >= 0:
                    put_in.append((row, token))
                    state.num_rows_candidate += 1
                else:
                    left.setdefault(seq_id, [source]).append(row)
        return left


class Fix(NamedTuple):
    """StepMask.check's verdict on a step with rejected rows. `tokens`: the drawn tokens (int32, the
    drawn array's length) with those the host could fix put in (a forced row's token, a rejected
    row's first allowed candidate): the step's tokens as they are when `mask` is None. Else the
    rows still rejected are redrawn on the device: `mask` holds their masks (other rows all ones),
    `rejected` (bool [num_rows]) flags them, and the other rows keep `tokens`."""

    mask: np.ndarray | None
    rejected: np.ndarray | None
    tokens: np.ndarray


def _bit(words: np.ndarray, token: int) -> bool:
    """Whether an int32 mask row allows `token` (bit token % 32 of word token // 32)."""
    return bool((words[token >> 5] >> (token & 31)) & 1)


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
        # seq_id -> (outputs consumed, (forced token or -1, its mask's row in _ahead_mask or -1))
        self._forced: dict[int, tuple[int, tuple[int, int]]] = {}
        self.sample_first = True  # False: every constrained row draws under its full mask (the old way)
        # True: prefetch() also fills the masks of sampled (temperature > 0) sample-first rows the
        # grammar does not force, so check() only copies a rejected row's mask; False: they are
        # computed in check(), when rejected (greedy rows always are: they seldom reject)
        self.masks_ahead = True
        # True: a sample-first step draws candidates too (sampling.sample_first_padded), and a rejected
        # row takes its first allowed one; False: every rejected row not forced is redrawn on the device
        self.candidates = True
        # Engine-thread seconds: in step_mask() (of which waiting for the worker), in prefetch(), in
        # check() of the tokens drawn unmasked, in the redraw (check and the resample's dispatch,
        # sample/step_sampler.py) and waiting there for the device's first draw; of check, the masks
        # of rejected rows computed there; the worker's wall seconds in prefetch's work (its thread)
        self.seconds = {"bitmask": 0.0, "wait": 0.0, "prefetch": 0.0, "check": 0.0, "redraw": 0.0, "device": 0.0,
                        "reject_masks": 0.0, "worker": 0.0}
        self.num_rows_ahead = self.num_rows_now = 0  # rows whose mask came from prefetch / was computed at dispatch
        self.num_rows_checked = self.num_rows_rejected = self.num_rows_forced = 0  # sample-first rows
        self.num_rows_rejected_forced = 0  # rejected rows whose grammar forces a token (no mask needed)
        self.num_rows_rejected_lazy = 0  # rejected rows whose mask check() computed (none ahead)
        self.num_rows_candidate = 0  # rejected rows that took a candidate (no mask, no redraw)
        self.num_redraws = 0  # steps with a device redraw (a rejected row with no allowed candidate)
        self.num_puts = 0  # steps whose rejected rows were all fixed on the host: tokens put in, no redraw

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
        self._ahead_rows, self._forced = {}, {}
        masked, forced = [], []  # (seq_id, entry, its new tokens)
        for seq_id, entry in self._matchers.items():
            seq = entry[0]
            if seq.status is not SequenceStatus.RUNNING or seq.num_placeholders:
                continue  # not in the next step, or its last token is still on the device
            first = self.sample_first and samples_first(seq.sampling_params)
            (forced if first else masked).append((seq_id, entry, seq.output_token_ids[entry[2]:]))
        if len(masked) + len(forced) < MIN_PREFETCH_ROWS:  # a thread hand-off costs more than these few
            return
        for i, (seq_id, entry, new) in enumerate(masked):
            entry[2] += len(new)  # consumed on the worker, before anything else touches the matcher
            self._ahead_rows[seq_id] = (i, entry[2])
        for seq_id, entry, new in forced:
            entry[2] += len(new)
        # Rows from len(masked) on: the masks of sample-first rows filled ahead (masks_ahead).
        if self._ahead_mask.shape[0] < len(masked) + len(forced):
            self._ahead_mask = np.empty(
                (max(len(masked) + len(forced), 2 * self._ahead_mask.shape[0]), self.num_words), np.int32)
        self._ahead = self._worker.submit(self._work_ahead, masked, forced, self._forced, self.masks_ahead)

    def _work_ahead(self, masked: list, forced: list, forced_out: dict, masks_ahead: bool) -> None:
        """The worker's part of prefetch(): the step's tokens consumed, then the masked rows' masks,
        the sample-first rows' forced tokens and, for the sampled ones with none, their masks."""
        t0 = time.perf_counter()
        for _, entry, new in masked + forced:
            if new:
                entry[1].consume_tokens(new)
        if masked:
            llnp.fill_next_token_bitmask_par(
                self._executor, [(entry[1], i) for i, (_, entry, _) in enumerate(masked)], self._ahead_mask)
        pairs = []  # (matcher, its row in _ahead_mask)
        for seq_id, entry, _ in forced:
            token, mask_row = forced_token(entry[1]), -1
            if token < 0 and masks_ahead and entry[0].sampling_params.temperature >= GREEDY_TEMPERATURE:
                mask_row = len(masked) + len(pairs)
                pairs.append((entry[1], mask_row))
            forced_out[seq_id] = (entry[2], (token, mask_row))
        if pairs:
            llnp.fill_next_token_bitmask_par(self._executor, pairs, self._ahead_mask)
            self.allow_eos_where_empty(self._ahead_mask, [row for _, row in pairs])
        self.seconds["worker"] += time.perf_counter() - t0  # a key only the worker writes

    def bitmask(self, rows: list[tuple[int, object, str]], num_rows: int) -> np.ndarray:
        """The step's full mask (no row drawn first): each (sampler row, sequence, request id) of
        `rows` gets its sequence's allowed tokens; a row whose matcher allows nothing (it ended
        under ignore_eos) gets eos."""
        return self.step_mask([(row, seq, request_id, False) for row, seq, request_id in rows], num_rows).mask

    def step_mask(self, rows: list[tuple[int, object, str, bool]], num_rows: int) -> StepMask:
        """The step's StepMask: (sampler row, sequence, request id, sample first) for each row of
        `rows`. Rows sampled first are deferred to StepMask.check, after the draw: a step of only
        those touches no matcher here and does not wait for the worker."""
        t0 = time.perf_counter()
        deferred = [(row, seq, request_id) for row, seq, request_id, first in rows if first]
        mask = None  # no row needs one: the step draws with the unmasked sampler
        if len(deferred) < len(rows):
            self._join()
            mask = self._full_masks([r for r in rows if not r[3]], num_rows)
        self.seconds["bitmask"] += time.perf_counter() - t0
        return StepMask(mask, deferred, num_rows, self)

    def _full_masks(self, rows: list, num_rows: int) -> np.ndarray:
        mask = np.full((num_rows, self.num_words), -1, np.int32)
        first_row: dict[int, int] = {}  # seq_id -> its first row (n > 1 first tokens share a state)
        pairs, copies, ahead_dst, ahead_src = [], [], [], []
        for row, seq, request_id, _ in rows:
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
        self.allow_eos_where_empty(mask, list(first_row.values()))
        for row, source in copies:
            mask[row] = mask[source]
        self.num_rows_ahead += len(ahead_dst)
        self.num_rows_now += len(pairs)
        return mask

    def _forced_now(self, seq, request_id: str) -> tuple[int, int]:
        """A sample-first row's (forced token or -1, row of its mask in _ahead_mask or -1), from
        prefetch() if it is for this state."""
        ahead = self._forced.get(seq.seq_id)
        if ahead is not None and ahead[0] == len(seq.output_token_ids):
            return ahead[1]
        return forced_token(self._matcher(seq, request_id)), -1

    def allow_eos_where_empty(self, mask: np.ndarray, rows: list[int]) -> None:
        """Rows of `rows` whose matcher allows nothing (it ended under ignore_eos) get eos."""
        if self.eos_token_id is not None and rows:
            for row in np.asarray(rows)[~mask[rows].any(axis=1)]:
                mask[row, self.eos_token_id // 32] = np.uint32(1 << (self.eos_token_id % 32)).view(np.int32)

    def release(self, live_request_ids) -> None:
        """Drops the matchers of finished sequences and the templates of requests not in live_request_ids."""
        self._join()
        for seq_id in [s for s, (seq, _, _) in self._matchers.items() if seq.is_finished]:
            del self._matchers[seq_id]
            self._ahead_rows.pop(seq_id, None)
        for request_id in [r for r in self.templates if r not in live_request_ids]:
            del self.templates[request_id]


def drawn_allowed(matcher, token: int, eos_token_id: int | None) -> bool:
    """Whether the matcher's mask allows `token`, where it forces no token (see the module's doc)."""
    return matcher.is_accepting() if token == eos_token_id else matcher.validate_tokens([token]) == 1


def forced_token(matcher) -> int:
    """The one token the matcher's mask allows where the grammar forces bytes, else -1."""
    tokens = matcher.compute_ff_tokens()
    return tokens[0] if tokens else -1


def _catch_up(entry: list):
    """The entry's matcher, after consuming its sequence's outputs it has not seen."""
    seq, matcher, consumed = entry
    if len(seq.output_token_ids) > consumed:
        matcher.consume_tokens(seq.output_token_ids[consumed:])
        entry[2] = len(seq.output_token_ids)
    return matcher
