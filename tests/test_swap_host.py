"""Swap space and the host tier, host side only (no jax): stories on a tiny pool with exact counts.

Page size 4, device pages 1..10; host swap pages 0.. (HostPagePool ids), host-tier pages after them.
"""

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.host_pool import HostPagePool
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence, SequenceStatus

PAGE_SIZE = 4
NUM_PAGES = 11


def request(tokens, max_tokens=16):
    return Sequence(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched, tokens):
    out = sched.schedule()
    sched.update(out, tokens[: len(out.seqs)])
    return out


def test_a_swap_pool_of_exactly_one_sequences_pages_swaps_it_and_holds_pages_in_transit():
    # b's 28-token prompt fills 7 pages; the swap pool has exactly 7.
    bm = BlockManager(NUM_PAGES, PAGE_SIZE, num_swap_pages=7)
    sched = Scheduler(bm, 4, 64, 64, preemption_mode="swap")
    a = request(list(range(10)), max_tokens=5)  # 3 pages; its decode stays in page 3 for 2 steps
    b = request(list(range(100, 128)), max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched, [1, 2])
    assert a.block_table == [1, 2, 3] and b.block_table == [4, 5, 6, 7, 8, 9, 10]

    # Step 2: b needs an 8th page and is the latest arrival: preempted. Its 7 computed pages fit the
    # 7 free swap pages exactly (can_swap_out: 7 <= 7), so it swaps: nothing is recomputed.
    out = step(sched, [1])
    assert out.preempted == [b] and b.status is SequenceStatus.SWAPPED
    assert out.swap_out == list(zip([4, 5, 6, 7, 8, 9, 10], range(7)))
    assert (sched.num_swaps_out, sched.num_recomputed_tokens) == (1, 0)
    assert b.host_block_table == list(range(7)) and bm.swap_pool.num_free_pages == 0

    # Steps 3..5: a runs to its end (5 tokens) and frees its pages; b waits for 8 free pages.
    for _ in range(3):
        step(sched, [1])
    assert a.is_finished and b.status is SequenceStatus.SWAPPED

    # Step 6: b swaps in and computes its one new token. Its pages 0..5 still cache its tokens on
    # the device (pages 4..9, freed but not reused): shared again, not copied. Page 6's device copy
    # (page 10) was reused by a, so host page 6 is copied back into a fresh page; one more for token 28.
    out = step(sched, [1])
    assert out.seqs == [b] and out.num_new_tokens == [1] and sched.num_swaps_in == 1
    assert out.swap_in == [(6, 10)] and b.block_table == [4, 5, 6, 7, 8, 9, 10, 3]
    assert (bm.num_swap_in_shared_pages, bm.num_swapped_in_pages) == (6, 1)
    assert sched.num_recomputed_tokens == 0 and bm.swap_pool.num_free_pages == 7


def test_a_swapped_in_sequences_host_pages_stay_in_transit_until_its_transfers_are_taken():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE, num_swap_pages=3)
    a, b = request(list(range(12))), request(list(range(50, 62)))
    for seq in (a, b):
        bm.allocate(seq)
        seq.num_computed_tokens = 12  # its prompt ran
        seq.append_token(7)
    bm.swap_out_seq(a)  # a's 3 pages -> host pages 0, 1, 2
    assert bm.take_transfers() == ([(1, 0), (2, 1), (3, 2)], [])
    bm.swap_in_seq(a)
    # The swap-in's copies read host pages 0..2 when the step is issued: until the transfers are
    # taken, the pages are in transit, neither used nor free, and b cannot be swapped into them.
    assert bm.swap_pool.transit_page_ids == [0, 1, 2] and bm.swap_pool.num_free_pages == 0
    assert bm.swap_pool.ref_counts == [0, 0, 0] and not bm.can_swap_out(b)
    swap_out, swap_in = bm.take_transfers()
    assert swap_out == [] and [h for h, _ in swap_in] == [0, 1, 2]
    assert bm.swap_pool.transit_page_ids == [] and bm.swap_pool.num_free_pages == 3 and bm.can_swap_out(b)


def test_storing_a_hash_again_refreshes_it_so_the_next_eviction_takes_another_page():
    pool = HostPagePool(2, first_id=5)
    assert pool.store(b"a", ("a",)) == 5 and pool.store(b"b", ("b",)) == 6  # free list: [a, b], a oldest
    assert pool.store(b"a", ("a",)) is None  # already here: refreshed, now [b, a]
    assert list(pool.free_page_ids) == [6, 5]
    assert pool.store(b"c", ("c",)) == 6  # one eviction: the least recently stored, b
    assert pool.num_evictions == 1
    assert pool.lookup(b"a", ("a",)) == 5 and pool.lookup(b"b", ("b",)) is None
    assert pool.lookup(b"c", ("c",)) == 6


def test_a_page_filled_by_the_step_in_flight_at_swap_out_is_cached_once_swapped_in():
    """Async stepping: step 2 is dispatched (advance) and step 3 is planned before step 2's tokens land
    (commit). Step 2 fills b's 7th page; step 3 swaps b out; step 2's commit cannot register that
    page (b's device pages are gone). At swap-in every full, computed page of b is registered."""
    bm = BlockManager(NUM_PAGES, PAGE_SIZE, num_swap_pages=8)
    sched = Scheduler(bm, 4, 64, 64, preemption_mode="swap")
    a = request(list(range(10)), max_tokens=6)  # 3 pages
    b = request(list(range(100, 127)), max_tokens=8)  # 27 tokens: 7 pages, the pool is full
    sched.add(a)
    sched.add(b)
    step(sched, [1, 2])
    out2 = sched.schedule()  # a: token 10; b: token 27, the last slot of its page 6
    sched.advance(out2, [0, 1])
    out3 = sched.schedule()  # b needs page 7 and none is free: swapped out behind step 2
    assert out3.preempted == [b] and b.status is SequenceStatus.SWAPPED and len(b.host_block_table) == 7
    sched.advance(out3, [0])
    sched.commit(out2, [3, 4])
    sched.commit(out3, [5])
    while not a.is_finished:
        step(sched, [6])
    while b.status is not SequenceStatus.RUNNING:
        step(sched, [7])
    # b's pages 0..6 hold tokens 0..27 (computed before the swap); all 7 are registered, page 6 too.
    assert b.num_computed_tokens >= 28 and len(b.page_hashes) >= 7
    assert bm.hash_to_page[b.page_hashes[6]] == b.block_table[6]
    assert bm.page_hash[b.block_table[6]] == b.page_hashes[6]


def test_pages_shared_with_another_sequence_come_back_shared_after_swap_in():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE, num_swap_pages=4)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]  # two full pages
    c = request(prefix + [9, 9, 9])
    bm.allocate(c)  # pages 1, 2, 3
    c.num_computed_tokens = 11
    bm.cache_computed_pages(c, 0)  # its pages 1 and 2 are full: registered
    b = request(prefix + [5, 5])
    bm.allocate(b)  # hits c's pages 1 and 2, a fresh page 4 for tokens 8..9
    assert b.block_table == [1, 2, 4] and b.num_computed_tokens == 8
    b.num_computed_tokens = 10
    b.append_token(7)
    used_before = bm.stats()["num_used_pages"]
    assert used_before == 4

    bm.swap_out_seq(b)  # 3 host pages; c still holds pages 1 and 2
    bm.take_transfers()
    assert bm.ref_counts[1:5] == [1, 1, 1, 0]
    bm.swap_in_seq(b)
    # Pages 1 and 2 still hold the prefix (registered, used by c): b shares them again. Only its
    # third page is copied back from host (into fresh page 4): b takes no second copy of the prefix.
    assert b.block_table == [1, 2, 4] and bm.ref_counts[1:5] == [2, 2, 1, 1]
    assert bm.swap_in == [(2, 4)] and (bm.num_swap_in_shared_pages, bm.num_swapped_in_pages) == (2, 1)
    assert bm.stats()["num_used_pages"] == used_before
    assert bm.swap_pool.num_free_pages == 3 and bm.swap_pool.transit_page_ids == [2]  # 0, 1: nothing reads them
    bm.free(b)
    bm.free(c)
    bm.take_transfers()
    assert bm.num_free_pages == NUM_PAGES - 1 and bm.swap_pool.num_free_pages == 4
