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

    # Step 6: b swaps in (8 pages: 7 copied back, 1 fresh) and computes its one new token.
    out = step(sched, [1])
    assert out.seqs == [b] and out.num_new_tokens == [1] and sched.num_swaps_in == 1
    assert [h for h, _ in out.swap_in] == list(range(7)) and len(b.block_table) == 8
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
