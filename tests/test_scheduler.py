"""Scheduler stories on a tiny pool: page_size 4, 11 pages (pages 1..10 usable, free list [1..10]).

Free-list rules (see block_manager.py): fresh pages come from the front; a freed page that caches
nothing goes to the front, a freed registered (full, computed) page to the back; pages are freed
last page first.
"""

import pytest

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence, SequenceStatus

PAGE_SIZE = 4
NUM_PAGES = 11


def make(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, **bm_kwargs):
    bm = BlockManager(NUM_PAGES, PAGE_SIZE, **bm_kwargs)
    return bm, Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len)


def request(tokens, max_tokens=16):
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def plan(sched):
    out = sched.schedule()
    return out, [(s.seq_id, n) for s, n in zip(out.seqs, out.num_new_tokens)]


def test_chunked_prefill_continues_across_steps_beside_a_decode():
    bm, sched = make(max_num_batched_tokens=8)
    a = request([1, 2, 3, 4, 5], max_tokens=3)
    b = request(list(range(100, 120)), max_tokens=2)  # 20 tokens: longer than the budget
    sched.add(a)
    sched.add(b)

    # Step 1: a's 5-token prompt, then the first 3 tokens of b (8 - 5). Both get all their pages now.
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 5), (b.seq_id, 3)] and out.num_batched_tokens == 8
    assert a.block_table == [1, 2] and b.block_table == [3, 4, 5, 6, 7]
    result = sched.update(out, [50, 999])  # b did not reach its end: 999 is ignored
    assert result.appended == [(a, 50)] and b.output_token_ids == []
    assert b.status is SequenceStatus.RUNNING and b.num_computed_tokens == 3

    # Step 2: a decodes 1 token, b continues with 7: tokens [3, 10). Pages 3 and 4 become full.
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 1), (b.seq_id, 7)]
    sched.update(out, [51, 999])
    assert b.num_computed_tokens == 10 and sorted(bm.hash_to_page.values()) == [1, 3, 4]

    # Step 3: a's third token ends it ("length") and frees its pages; b computes [10, 17).
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 1), (b.seq_id, 7)]
    result = sched.update(out, [52, 999])
    assert result.finished == [a] and a.finish_reason == "length" and a.output_token_ids == [50, 51, 52]
    assert a.block_table == [] and sched.running == [b]

    # Step 4: b's last 3 prompt tokens; it samples.
    out, batch = plan(sched)
    assert batch == [(b.seq_id, 3)]
    sched.update(out, [60])
    assert b.output_token_ids == [60] and b.num_computed_tokens == 20


def test_preemption_takes_the_latest_arrival_and_the_prefix_cache_makes_recompute_cheap():
    bm, sched = make()
    a = request([1] * 12, max_tokens=2)
    b = request([2] * 12, max_tokens=10)
    c = request([3] * 12, max_tokens=10)
    for seq in (a, b, c):
        sched.add(seq)

    # Step 1: three 12-token prompts, 3 pages each; page 10 stays free. All 9 pages become full.
    out, _ = plan(sched)
    assert (a.block_table, b.block_table, c.block_table) == ([1, 2, 3], [4, 5, 6], [7, 8, 9])
    sched.update(out, [10, 20, 30])

    # Step 2: each writes token 12, which starts a 4th page. a takes page 10; b finds none, so c (the
    # latest arrival) is preempted: its registered pages go to the back, last first -> [9, 8, 7],
    # and b takes page 9 (evicting c's tail page from the cache).
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 1), (b.seq_id, 1)] and out.preempted == [c]
    assert a.block_table == [1, 2, 3, 10] and b.block_table == [4, 5, 6, 9]
    assert list(bm.free_page_ids) == [8, 7] and bm.num_evictions == 1
    assert c.status is SequenceStatus.PREEMPTED and c.block_table == [] and c.num_computed_tokens == 0
    assert c.output_token_ids == [30] and list(sched.waiting) == [c]
    assert (sched.num_preemptions, sched.num_recomputed_tokens) == (1, 12)
    result = sched.update(out, [11, 21])
    # a reaches max_tokens=2; its pages are freed: page 10 (partial) to the front, 3, 2, 1 to the back.
    assert result.finished == [a]
    assert list(bm.free_page_ids) == [10, 8, 7, 3, 2, 1]

    # Step 3: b decodes; c comes back: its first two pages (7, 8) are still cached, so it recomputes
    # only tokens [8, 13) in fresh pages 10 and 3.
    out, batch = plan(sched)
    assert batch == [(b.seq_id, 1), (c.seq_id, 5)]
    assert c.block_table == [7, 8, 10, 3] and c.num_cached_tokens == 8
    assert bm.num_evictions == 2  # page 3 held a's tail
    sched.update(out, [22, 31])
    assert c.output_token_ids == [30, 31] and c.status is SequenceStatus.RUNNING


def test_a_sequence_that_is_itself_the_latest_arrival_preempts_itself():
    bm, sched = make()
    a = request(list(range(10)), max_tokens=5)  # 3 pages; its decode stays inside page 3 for 2 steps
    b = request(list(range(100, 128)), max_tokens=5)  # 28 tokens: 7 pages, the pool is then full
    sched.add(a)
    sched.add(b)
    out, _ = plan(sched)
    assert a.block_table == [1, 2, 3] and b.block_table == [4, 5, 6, 7, 8, 9, 10]
    sched.update(out, [1, 2])

    # Step 2: a writes token 10 into its page 3; b needs an 8th page, none is free, and b is the
    # latest arrival: b is preempted, a runs alone. No new admission in a step that preempts.
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 1)] and out.preempted == [b]
    assert list(bm.free_page_ids) == [10, 9, 8, 7, 6, 5, 4]
    sched.update(out, [1])

    # Steps 3..5: a alone (token 12 takes page 10, evicting b's tail page); b cannot fit 8 pages yet.
    for _ in range(3):
        out, batch = plan(sched)
        assert batch == [(a.seq_id, 1)]
        sched.update(out, [1])
    assert a.finish_reason == "length" and a.block_table == []
    assert list(bm.free_page_ids) == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]

    # Step 6: b returns with 6 cached pages (24 tokens) and recomputes tokens [24, 29).
    out, batch = plan(sched)
    assert batch == [(b.seq_id, 5)]
    assert b.block_table == [4, 5, 6, 7, 8, 9, 10, 3] and b.num_cached_tokens == 24


def test_n_samples_fork_and_copy_the_shared_partial_page_on_their_next_write():
    bm, sched = make()
    parent = Sequence([1, 2, 3, 4, 5, 6], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    sched.add(parent)
    out, _ = plan(sched)
    assert parent.block_table == [1, 2]
    result = sched.update(out, [[70, 71, 72]])  # the sampler drew 3 tokens from the parent's logits
    child1, child2 = result.forked
    assert result.appended == [(parent, 70), (child1, 71), (child2, 72)]
    assert sched.running == [parent, child1, child2]
    assert child1.block_table == child2.block_table == [1, 2] and bm.ref_counts[1:3] == [3, 3]
    assert child1.token_ids == [1, 2, 3, 4, 5, 6, 71] and child1.num_computed_tokens == 6

    # Step 2: all three write token 6 into page 2 (shared, partial). The first two get private copies
    # (pages 3 and 4); the last one is then page 2's only owner and writes in place.
    out, batch = plan(sched)
    assert out.copies == [(2, 3), (2, 4)]
    assert (parent.block_table, child1.block_table, child2.block_table) == ([1, 3], [1, 4], [1, 2])
    assert bm.ref_counts[1:5] == [3, 1, 1, 1] and bm.stats()["num_cow_copies"] == 2
    sched.update(out, [80, 81, 82])
    assert child2.output_token_ids == [72, 82]

    # An explicit fork right after an update shares everything again.
    child3 = sched.fork(child2)
    assert child3.block_table == [1, 2] and bm.ref_counts[1:3] == [4, 2]
    assert sched.running == [parent, child1, child2, child3]
    for seq in list(sched.running):
        sched.abort(seq.seq_id)
    assert bm.ref_counts == [0] * NUM_PAGES and not sched.has_unfinished()


def test_requests_that_can_never_run_are_rejected_and_not_queued():
    _, sched = make(max_model_len=32)
    with pytest.raises(ValueError, match="prompt has 32 tokens but max_model_len=32"):
        sched.add(request(list(range(32))))
    _, sched = make(max_model_len=64)
    # 30 + 20 = 50 tokens = 13 pages > 10 usable pages.
    with pytest.raises(ValueError, match="13 pages of 4 tokens, but the pool holds only 10 pages"):
        sched.add(request(list(range(30)), max_tokens=20))
    assert not sched.has_unfinished() and not sched.waiting
    seq = request([1, 2, 3])
    sched.add(seq)
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence([1], seq_id=seq.seq_id))


def test_budgets_limit_sequences_and_tokens():
    _, sched = make(max_num_seqs=2, max_num_batched_tokens=6)
    seqs = [request([i] * 4, max_tokens=3) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out, batch = plan(sched)
    assert batch == [(seqs[0].seq_id, 4), (seqs[1].seq_id, 2)]  # 6 tokens, 2 sequences: third waits
    assert list(sched.waiting) == [seqs[2]]


def test_stop_rules():
    _, sched = make(max_model_len=8)
    eos = Sequence([1, 2], SamplingParams(max_tokens=10, min_tokens=2), eos_token_id=0)
    stop_id = Sequence([3, 4], SamplingParams(max_tokens=10, stop_token_ids=[7]), eos_token_id=0)
    ignore = Sequence([5, 6], SamplingParams(max_tokens=10, ignore_eos=True), eos_token_id=0)
    long = Sequence([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=10, ignore_eos=True))
    for seq in (eos, stop_id, ignore, long):
        sched.add(seq)

    out = sched.schedule()
    result = sched.update(out, [0, 5, 0, 9])  # eos before min_tokens: kept; long has 7 tokens
    assert result.finished == []
    out = sched.schedule()
    result = sched.update(out, [0, 7, 0, 9])  # eos now counts; 7 is a stop id; long reaches max_model_len
    assert result.finished == [eos, stop_id, long]
    assert [s.finish_reason for s in result.finished] == ["stop", "stop", "length"]
    assert eos.output_token_ids == [0, 0] and ignore.status is SequenceStatus.RUNNING
    assert sched.running == [ignore]


def test_a_stop_token_that_is_also_the_last_allowed_token_is_a_stop():
    # vLLM's check_stop looks at eos and stop_token_ids before max_tokens / max_model_len.
    _, sched = make(max_model_len=8)
    by_max_tokens = Sequence([1, 2], SamplingParams(max_tokens=2), eos_token_id=0)
    by_model_len = Sequence([1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=[5]), eos_token_id=0)
    for seq in (by_max_tokens, by_model_len):
        sched.add(seq)
    result = sched.update(sched.schedule(), [9, 5])
    assert result.finished == [by_model_len] and by_model_len.finish_reason == "stop"
    result = sched.update(sched.schedule(), [0])
    assert result.finished == [by_max_tokens] and by_max_tokens.finish_reason == "stop"


def test_finish_and_abort_free_pages_at_once_and_update_skips_them():
    bm, sched = make()
    a, b, c = request([1] * 5), request([2] * 5), request([3] * 5)
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    sched.abort(b.seq_id)  # between schedule and update
    assert b.status is SequenceStatus.FINISHED and b.finish_reason == "abort" and b.block_table == []
    result = sched.update(out, [10, 20, 30])
    assert result.appended == [(a, 10), (c, 30)] and b.output_token_ids == []
    sched.finish(a, "stop")  # e.g. a stop string
    assert a.finish_reason == "stop" and sched.running == [c]
    assert sched.abort(b.seq_id) is None  # already finished
    waiting = request([4] * 5)
    sched.add(waiting)
    assert sched.abort(waiting.seq_id) is waiting and not sched.waiting
    sched.abort(c.seq_id)
    assert not sched.has_unfinished() and bm.stats()["num_used_pages"] == 0


def test_the_last_budget_token_admits_a_one_token_chunk_of_a_waiting_prompt():
    """Budget 6: a's 5-token prompt leaves exactly one token, which admits b with a 1-token chunk
    (its first page now, no sample yet); b's other 3 tokens run next step."""
    bm, sched = make(max_num_batched_tokens=6)
    a = request([1, 2, 3, 4, 5], max_tokens=3)
    b = request([7, 8, 9, 10], max_tokens=3)
    sched.add(a)
    sched.add(b)
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 5), (b.seq_id, 1)] and out.num_batched_tokens == 6
    assert out.samples == [True, False]
    assert b.status is SequenceStatus.RUNNING and b.block_table == [3]


def test_prompt_pages_are_findable_from_the_step_that_computes_them():
    # vLLM registers a request's full prompt blocks when it schedules them, so a request admitted after
    # it, in the same step, reuses them (each layer writes all the step's K/V before attention reads).
    bm, sched = make(max_num_batched_tokens=20)
    shared = list(range(100, 108))  # 2 full pages
    a = request(shared + [1, 2, 3, 4, 5])  # 13 tokens: pages 0-2 full
    b = request(shared + [7, 8, 9])  # shares a's first 2 pages
    c = request(shared + [1, 2, 3, 4, 6, 6])  # shares 3 pages, but a's page 2 is only ready next step
    for seq in (a, b, c):
        sched.add(seq)

    # Step 1 (budget 20): a's whole prompt; b hits pages 0-1 (computing only its 3 own tokens); c gets
    # the last 4 tokens of the budget: it too hits a's 3 full pages, and computes tokens [12, 16).
    out, batch = plan(sched)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 8 and c.num_cached_tokens == 12
    assert batch == [(a.seq_id, 13), (b.seq_id, 3), (c.seq_id, 2)]
    assert b.block_table[:2] == a.block_table[:2] and c.block_table[:3] == a.block_table[:3]
    assert [bm.ref_counts[p] for p in a.block_table] == [3, 3, 2, 1]
    assert bm.num_prefix_hit_tokens == 20
    sched.update(out, [50, 60, 70])
    assert [s.output_token_ids for s in (a, b, c)] == [[50], [60], [70]]


def test_only_known_prompt_tokens_are_registered_at_schedule_time():
    # A chunk registers the pages it fills, not the prompt's later pages; a decode's token is a
    # placeholder until it lands, so its page is registered at commit, as before.
    bm, sched = make(max_num_batched_tokens=6)
    a = request(list(range(200, 210)), max_tokens=8)  # 10 tokens: pages 0, 1 full
    sched.add(a)
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 6)]
    assert sorted(bm.hash_to_page.values()) == [a.block_table[0]]  # page 1 (tokens 4-7) is half done
    sched.update(out, [999])
    out, batch = plan(sched)
    assert batch == [(a.seq_id, 4)]
    assert sorted(bm.hash_to_page.values()) == a.block_table[:2]
    sched.update(out, [51])  # token 10
    out, _ = plan(sched)  # computes token 10 (a sampled token): page 2 is not full yet
    sched.update(out, [52])
    assert len(bm.hash_to_page) == 2
    out, _ = plan(sched)  # computes token 11 and so fills page 2, but decodes register at commit only
    assert len(bm.hash_to_page) == 2
    sched.update(out, [53])
    assert a.token_ids[8:12] == [208, 209, 51, 52]
    assert len(bm.hash_to_page) == 3 and bm.hash_to_page[a.page_hashes[2]] == a.block_table[2]


def test_a_request_waiting_for_its_grammar_is_held_aside_until_grammar_ready():
    bm, sched = make()
    held = request([1, 2, 3], max_tokens=2)
    held.status = SequenceStatus.WAITING_FOR_GRAMMAR
    sched.add(held)  # its grammar compiles elsewhere: planned for nothing, but unfinished
    later = request([7, 8], max_tokens=1)
    sched.add(later)
    assert sched.num_unfinished == 2 and sched.num_schedulable == 1
    assert sched.stats()["num_waiting"] == 2 and sched.stats()["num_waiting_for_grammar"] == 1

    # Step 1: only `later` runs (the held request does not block the queue behind it) and finishes.
    out, batch = plan(sched)
    assert batch == [(later.seq_id, 2)] and held.block_table == []
    sched.update(out, [70])
    assert later.is_finished and sched.num_unfinished == 1 and sched.num_schedulable == 0

    # Its grammar compiled: it arrives now, behind everything already queued, and runs.
    sched.grammar_ready(held)
    assert held.status is SequenceStatus.WAITING and sched.stats()["num_waiting_for_grammar"] == 0
    out, batch = plan(sched)
    assert batch == [(held.seq_id, 3)] and held.block_table == [1]
    with pytest.raises(ValueError, match="not waiting for its grammar"):
        sched.grammar_ready(held)


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind():
    bm, sched = make()
    held = request([1, 2, 3])
    held.status = SequenceStatus.WAITING_FOR_GRAMMAR
    sched.add(held)
    assert sched.abort(held.seq_id) is held
    assert held.finish_reason == "abort" and sched.num_unfinished == 0 and not sched.waiting_for_grammar
    out, batch = plan(sched)
    assert batch == [] and bm.num_free_pages == NUM_PAGES - 1
