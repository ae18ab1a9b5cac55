"""Random interleavings of add / schedule / update / fork / finish / abort / preempt, with the page
pool's invariants checked after every operation.

`FakeKVPool` plays the device: it applies the copy-on-write copies, writes each scheduled token id
into its slot, and reads every sequence's context back through its block table. If paging were wrong
anywhere (a shared page written, a bad cache hit, a missing copy), the read-back would differ from
the sequence's own tokens.
"""

import collections

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence, SequenceStatus

PAGE_SIZE = 4
NUM_PAGES = 11
EOS = 3
PREFIXES = ([1, 2, 1, 2, 1, 1, 2, 2, 1, 2], [2, 2, 2, 2, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])


class FakeKVPool:
    """The device's view: slot contents are the token ids whose K/V would be stored there."""

    def __init__(self, num_pages, page_size, block_manager):
        self.page_size = page_size
        self.block_manager = block_manager
        self.pages = [[None] * page_size for _ in range(num_pages)]
        self.host_pages = {}  # host page id -> slot contents (swap space and the prefix cache's host tier)

    def run(self, out, registered_before):
        """`registered_before`: the (page id, hash) pairs registered before schedule() planned `out`."""
        ps = self.page_size
        for page_id, host_page_id in out.swap_out:  # before anything this step writes
            self.host_pages[host_page_id] = list(self.pages[page_id])
        for host_page_id, page_id in out.swap_in:
            self.pages[page_id] = list(self.host_pages[host_page_id])
        for src_page_id, dst_page_id in out.copies:
            self.pages[dst_page_id] = list(self.pages[src_page_id])
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                page_id = self.check_write(seq, pos, registered_before)
                self.pages[page_id][pos % ps] = seq.token_ids[pos]

    def check_write(self, seq, pos, registered_before):
        """The page `seq` writes position `pos` into: one no other sequence reads, or one registered
        by this very schedule() (a page held and cached before it is never written), whose sharers are
        this step's hits: then what it is written with is what its key promises them."""
        bm, ps = self.block_manager, self.page_size
        page_id = seq.block_table[pos // ps]
        assert page_id != 0, (seq, pos)
        if bm.page_hash[page_id] is None:
            assert bm.ref_counts[page_id] == 1, (seq, pos)
        else:
            assert (page_id, bm.page_hash[page_id]) not in registered_before, (seq, pos)
            assert pos < seq.num_prompt_tokens, (seq, pos)
            assert bm.page_key[page_id][2][pos % ps] == seq.token_ids[pos], (seq, pos)
        return page_id

    def context(self, seq, num_tokens):
        """What attention reads for positions [0, num_tokens) of `seq`."""
        ps = self.page_size
        return [self.pages[seq.block_table[pos // ps]][pos % ps] for pos in range(num_tokens)]


def registered(bm):
    """The (page id, hash) pairs the prefix cache holds now in pages some sequence holds. (A free
    cached page may be evicted and taken fresh by the next schedule(), which may register the same
    tokens in it again: that write is legitimate, and the key check in `check_write` covers it.)"""
    return {(page_id, h) for page_id, h in enumerate(bm.page_hash) if h is not None and bm.ref_counts[page_id] > 0}


def check_pool(bm, seqs, scheduled=None):
    """free ∪ used = pages 1..num_pages-1, free ∩ used = ∅, ref counts = block-table references.

    `scheduled`: seq_id -> tokens a planned step computes (registered from schedule() on)."""
    scheduled = scheduled or {}
    free = set(bm.free_page_ids)
    assert len(free) == len(bm.free_page_ids)
    references = collections.Counter(page_id for seq in seqs for page_id in seq.block_table)
    used = {page_id for page_id in range(NUM_PAGES) if bm.ref_counts[page_id] > 0}
    assert free | used == set(range(1, NUM_PAGES)) and not free & used
    assert 0 not in free and 0 not in references and bm.ref_counts[0] == 0
    assert all(bm.ref_counts[page_id] == references[page_id] for page_id in range(NUM_PAGES))
    # The prefix cache maps hash <-> page one to one, and a cached page's stored tokens are the tokens
    # of every sequence that holds it at that logical index.
    assert {page_id: h for h, page_id in bm.hash_to_page.items()} == {
        page_id: h for page_id, h in enumerate(bm.page_hash) if h is not None
    }
    for seq in seqs:
        for page_idx, page_id in enumerate(seq.block_table):
            if bm.page_hash[page_id] is not None:
                assert page_idx < (seq.num_computed_tokens + scheduled.get(seq.seq_id, 0)) // PAGE_SIZE
                stored = bm.page_key[page_id][2]
                assert stored == tuple(seq.token_ids[page_idx * PAGE_SIZE : (page_idx + 1) * PAGE_SIZE])


ADD_ARGS = dict(
    prefix=st.sampled_from(PREFIXES),
    cut=st.integers(0, 12),
    suffix=st.lists(st.integers(1, 3), max_size=6),
    max_tokens=st.integers(1, 16),
    min_tokens=st.integers(0, 2),
    n=st.integers(1, 3),
    ignore_eos=st.booleans(),
    salt=st.sampled_from([None, "tenant"]),
)


class HostMachine(RuleBasedStateMachine):
    preemption_mode = "recompute"

    @staticmethod
    def make_block_manager():
        return BlockManager(NUM_PAGES, PAGE_SIZE)

    def __init__(self):
        super().__init__()
        self.bm = self.make_block_manager()
        self.sched = Scheduler(self.bm, max_num_seqs=4, max_num_batched_tokens=10, max_model_len=28,
                               preemption_mode=self.preemption_mode)
        self.pool = FakeKVPool(NUM_PAGES, PAGE_SIZE, self.bm)
        self.pending = None  # a SchedulerOutput between schedule() and update()
        self.all_seqs = []

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

    @precondition(lambda self: self.pending is None)
    @rule(data=st.data())
    def step(self, data):
        # schedule() and update() back to back, a few times: the common case, and it makes long runs likely.
        for _ in range(data.draw(st.integers(1, 4))):
            self.schedule()
            self.update(data)
            self.pool_is_consistent()

    @precondition(lambda self: self.pending is None)
    @rule()
    def schedule(self):
        had_work = self.sched.has_unfinished()
        registered_before = registered(self.bm)
        out = self.sched.schedule()
        assert 1 <= out.num_batched_tokens <= 10 if had_work else out.num_batched_tokens == 0
        assert len(out.seqs) <= 4 and all(n >= 1 for n in out.num_new_tokens)
        assert out.num_batched_tokens == sum(out.num_new_tokens)
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_computed_tokens + num_new <= len(seq.token_ids)
            assert len(seq.block_table) * PAGE_SIZE >= len(seq.token_ids)
        assert all(seq.status in (SequenceStatus.PREEMPTED, SequenceStatus.SWAPPED) and not seq.block_table
                   for seq in out.preempted)
        self.pool.run(out, registered_before)
        self.pending = out

    @precondition(lambda self: self.pending is not None)
    @rule(data=st.data())
    def update(self, data):
        out, self.pending = self.pending, None
        sampled = []
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            if seq.status is SequenceStatus.RUNNING:
                num_context = seq.num_computed_tokens + num_new
                assert self.pool.context(seq, num_context) == seq.token_ids[:num_context]
            samples = data.draw(st.lists(st.integers(1, 3), min_size=seq.sampling_params.n,
                                         max_size=seq.sampling_params.n))
            first_sample = seq.num_output_tokens == 0 and seq.sampling_params.n > 1
            sampled.append(samples if first_sample else samples[0])
        result = self.sched.update(out, sampled)
        self.all_seqs += result.forked
        for seq, token_id in result.appended:
            assert seq.token_ids[-1] == token_id

    @precondition(lambda self: self.pending is None and self.sched.running)
    @rule(data=st.data())
    def fork(self, data):
        candidates = [s for s in self.sched.running if s.num_computed_tokens >= len(s.token_ids) - 1]
        if candidates:
            parent = data.draw(st.sampled_from(candidates))
            child = self.sched.fork(parent)
            assert child.block_table == parent.block_table and child.token_ids == parent.token_ids
            self.all_seqs.append(child)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data(), reason=st.sampled_from(["stop", "abort"]))
    def finish_or_abort(self, data, reason):
        seq = data.draw(st.sampled_from(self.unfinished()))
        if reason == "abort":
            assert self.sched.abort(seq.seq_id) is seq
        else:
            self.sched.finish(seq, reason)
        assert seq.status is SequenceStatus.FINISHED and seq.block_table == []

    @precondition(lambda self: self.pending is None and self.sched.running)
    @rule()
    def preempt_latest(self):
        # What schedule() does under memory pressure, forced at a random moment.
        victim = self.sched.running.pop()
        self.sched._preempt(victim)  # swap mode: the copies run at the next schedule(), before any write
        assert self.sched.waiting[0] is victim

    @invariant()
    def pool_is_consistent(self):
        unfinished = self.unfinished()
        scheduled = {} if self.pending is None else {
            seq.seq_id: num_new for seq, num_new in zip(self.pending.seqs, self.pending.num_new_tokens)}
        check_pool(self.bm, unfinished, scheduled)
        arrival = [seq.arrival_idx for seq in unfinished]
        assert arrival == sorted(arrival)
        for seq in self.sched.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED, SequenceStatus.SWAPPED)
            assert seq.block_table == []
            if seq.status is SequenceStatus.SWAPPED:  # keeps its progress, its K/V in host pages
                assert len(seq.host_block_table) == -(-seq.num_computed_tokens // PAGE_SIZE) > 0
            else:
                assert seq.num_computed_tokens == 0 and seq.host_block_table == []
        for seq in self.sched.running:
            assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens <= len(seq.token_ids)
            assert len(seq.block_table) * PAGE_SIZE >= seq.num_computed_tokens
        for seq in self.all_seqs:
            if seq.status is SequenceStatus.FINISHED:
                assert seq.block_table == [] and seq.finish_reason in ("stop", "length", "abort")
                assert seq.num_output_tokens <= seq.sampling_params.max_tokens
                assert len(seq.token_ids) <= 28

    def teardown(self):
        stats = self.bm.stats()
        event(f"preemptions: {min(self.sched.num_preemptions, 1)}, cow copies: {min(stats['num_cow_copies'], 1)}, "
              f"prefix hits: {min(stats['prefix_hit_tokens'], 1)}, evictions: {min(stats['num_evictions'], 1)}")
        # Every request ends: every page is free, only the prefix cache may still name some of them.
        for seq in self.unfinished():
            self.sched.abort(seq.seq_id)
        assert not self.sched.has_unfinished()
        assert self.bm.ref_counts == [0] * NUM_PAGES
        assert sorted(self.bm.free_page_ids) == list(range(1, NUM_PAGES))


HostMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
test_host_state_machine = HostMachine.TestCase
