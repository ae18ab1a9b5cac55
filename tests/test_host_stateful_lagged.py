"""The scheduler under asynchronous stepping: tokens land one step late (or at once), at random.

A random interleaving of add / step (schedule, dispatch, advance, commit the previous step) /
drain / finish / abort. The step input built from the engine's persistent block tables must equal
one rebuilt from the lists (through preemption, forks, copy-on-write, recycled rows). The fake device resolves each placeholder from the previous step's drawn
tokens, as the real step gathers it on device. After every operation: the page pool's invariants,
the device's K/V equal to every sequence's known tokens, and no sequence gains or loses a token:
its outputs are exactly the tokens the device drew for it and the host committed, in order.
"""

import dataclasses

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_host_stateful import ADD_ARGS, EOS, NUM_PAGES, PAGE_SIZE, FakeKVPool, check_pool, registered

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.request import placeholder_row
from jaxpaged.planner.sequence import Sequence, SequenceStatus
from jaxpaged.device.step_input import BlockTableRows, prepare_step_input

MAX_MODEL_LEN = 28
PREPARE_ARGS = dict(page_size=PAGE_SIZE, num_pages=NUM_PAGES, pages_per_seq=MAX_MODEL_LEN // PAGE_SIZE,
                    max_num_seqs=4, buckets=(16,))


class LaggedKVPool(FakeKVPool):
    def run(self, out, prev_tokens, registered_before):
        """Writes each scheduled token; a placeholder reads the previous step's sampled row."""
        ps = self.page_size
        for src_page_id, dst_page_id in out.copies:
            self.pages[dst_page_id] = list(self.pages[src_page_id])
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                page_id = self.check_write(seq, pos, registered_before)
                token_id = seq.token_ids[pos]
                if token_id < 0:
                    assert prev_tokens is not None, "a placeholder whose step was already committed"
                    token_id = prev_tokens[placeholder_row(token_id)]
                self.pages[page_id][pos % ps] = token_id


class LaggedHostMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_PAGES, PAGE_SIZE)
        self.sched = Scheduler(self.bm, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=MAX_MODEL_LEN)
        self.pool = LaggedKVPool(NUM_PAGES, PAGE_SIZE, self.bm)
        self.in_flight = None  # (SchedulerOutput, drawn tokens by row) dispatched, not committed
        self.all_seqs = []
        self.drawn = {}  # seq_id -> every token the device drew for it, in order
        self.committed = {}  # seq_id -> the tokens the host committed to it, in order
        self.fanned_out = set()  # seq_ids of parents that already forked
        self.block_table_rows = BlockTableRows(6, PREPARE_ARGS["pages_per_seq"])  # few rows: rows get recycled

    def unfinished(self):
        return list(self.sched.running) + list(self.sched.waiting)

    @rule(**ADD_ARGS)
    def add(self, prefix, cut, suffix, max_tokens, min_tokens, n, ignore_eos, salt):
        tokens = prefix[:cut] + suffix or [1]
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), n=n, ignore_eos=ignore_eos
        )
        seq = Sequence(tokens, params, cache_salt=salt, eos_token_id=EOS)
        self.sched.add(seq)
        self.all_seqs.append(seq)

    @initialize(data=st.data())
    def start_with_three_requests(self, data):
        for _ in range(3):
            self.add(*(data.draw(strategy) for strategy in ADD_ARGS.values()))

    def commit(self, dispatched=None):
        if dispatched is None:
            dispatched, self.in_flight = self.in_flight, None
        out, tokens = dispatched
        result = self.sched.commit(out, tokens)
        for (seq, token_id), row in zip(result.appended, result.rows):
            assert token_id == tokens[row]
            self.committed.setdefault(seq.seq_id, []).append(token_id)
        for seq in result.finished:
            assert seq.status is SequenceStatus.FINISHED and seq.block_table == [] and seq.num_placeholders == 0

    @rule(data=st.data())
    def step(self, data):
        # What the engine does per step: schedule, dispatch (the fake device runs it now), advance,
        # then commit the step before it; or commit this one at once (synchronous, or a fan-out
        # too wide for the next step to read).
        for _ in range(data.draw(st.integers(1, 4))):
            registered_before = registered(self.bm)
            out = self.sched.schedule()
            if not out.seqs:
                if self.in_flight is not None:
                    self.commit()
                continue
            self.pool.run(out, self.in_flight[1] if self.in_flight else None, registered_before)
            # The engine's persistent block tables give the step input a rebuild from the lists gives.
            rebuilt = prepare_step_input(out, **PREPARE_ARGS)
            incremental = prepare_step_input(out, **PREPARE_ARGS, block_table_rows=self.block_table_rows)
            for field in dataclasses.fields(rebuilt):
                np.testing.assert_array_equal(getattr(incremental, field.name), getattr(rebuilt, field.name))
            rows, num_rows = [], 0
            for seq, samples in zip(out.seqs, out.samples):
                if not samples:
                    rows.append(None)
                    continue
                assert seq.num_placeholders <= 1
                n = seq.sampling_params.n
                if n > 1 and seq.seq_id not in self.fanned_out and seq.num_output_tokens + seq.num_placeholders == 0:
                    self.fanned_out.add(seq.seq_id)
                    rows.append(list(range(num_rows, num_rows + n)))
                    num_rows += n
                else:
                    rows.append(num_rows)
                    num_rows += 1
            tokens = data.draw(st.lists(st.integers(1, 3), min_size=num_rows, max_size=num_rows))
            children = self.sched.advance(out, rows)
            self.all_seqs += children
            for seq, row in out.sampled:
                self.drawn.setdefault(seq.seq_id, []).append(tokens[row])
            previous, self.in_flight = self.in_flight, (out, tokens)
            if previous is not None:
                self.commit(previous)
            if data.draw(st.booleans()):
                self.commit()
            self.check_everything()

    @precondition(lambda self: self.in_flight is not None)
    @rule()
    def drain(self):
        self.commit()

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data(), reason=st.sampled_from(["stop", "abort"]))
    def finish_or_abort(self, data, reason):
        # The engine does this at any time: a stop string found, a client gone, tokens in flight.
        seq = data.draw(st.sampled_from(self.unfinished()))
        if reason == "abort":
            assert self.sched.abort(seq.seq_id) is seq
        else:
            self.sched.finish(seq, reason)
        assert seq.status is SequenceStatus.FINISHED and seq.block_table == [] and seq.num_placeholders == 0

    @invariant()
    def check_everything(self):
        unfinished = self.unfinished()
        check_pool(self.bm, unfinished)
        for seq in self.all_seqs:
            # No token gained or lost: outputs are what was committed, which is a prefix of what the
            # device drew (a finished sequence drops at most its tokens still in flight).
            committed = self.committed.get(seq.seq_id, [])
            assert seq.output_token_ids == committed
            assert self.drawn.get(seq.seq_id, [])[: len(committed)] == committed
            num_known = len(seq.token_ids) - seq.num_placeholders
            assert seq.token_ids[:num_known] == seq.prompt_token_ids + committed
            assert all(t < 0 for t in seq.token_ids[num_known:]) and seq.num_placeholders <= 2
            if seq.status is SequenceStatus.FINISHED:
                assert seq.block_table == [] and seq.num_placeholders == 0
                assert seq.num_output_tokens <= seq.sampling_params.max_tokens
                assert len(seq.token_ids) <= MAX_MODEL_LEN
            else:
                assert len(self.drawn.get(seq.seq_id, [])) - len(committed) == seq.num_placeholders
        for seq in self.sched.running:
            # The device holds each known computed token's K/V where the block table says.
            context = self.pool.context(seq, seq.num_computed_tokens)
            known = seq.token_ids[: seq.num_computed_tokens]
            assert [c for c, t in zip(context, known) if t >= 0] == [t for t in known if t >= 0]
        for seq in self.sched.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0

    def teardown(self):
        if self.in_flight is not None:
            self.commit()
        for seq in self.unfinished():
            self.sched.abort(seq.seq_id)
        assert not self.sched.has_unfinished()
        assert self.bm.ref_counts == [0] * NUM_PAGES
        assert sorted(self.bm.free_page_ids) == list(range(1, NUM_PAGES))


LaggedHostMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
test_lagged_host_state_machine = LaggedHostMachine.TestCase
