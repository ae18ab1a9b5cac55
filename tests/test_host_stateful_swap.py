"""The stateful host test with swap preemption and the prefix cache's host tier on.

Same random operations as tests/test_host_stateful.py (whose `FakeKVPool` also plays the host
pages: it applies each step's swap-outs, then swap-ins, then copies, then writes, and every
context read back must equal the sequence's tokens, so a swapped-in page or a host-tier hit with
the wrong contents fails there). Host pools are small, so swaps fall back to recompute and the
host tier evicts too. After every operation both host pools are checked: free, used and in-transit
pages partition each pool, swap pages' ref counts equal the swapped sequences' references, the
host tier's hash index is one to one and only names free pages; when all requests end, nothing
leaks.
"""

import collections

from hypothesis import event, settings
from hypothesis.stateful import invariant

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.sequence import SequenceStatus
from test_host_stateful import NUM_PAGES, PAGE_SIZE, HostMachine

NUM_SWAP_PAGES = 6
NUM_HOST_CACHE_PAGES = 5


def check_host_pools(bm, seqs):
    references = collections.Counter(h for seq in seqs for h in seq.host_block_table)
    for pool in (bm.swap_pool, bm.host_cache):
        free, transit = set(pool.free_page_ids), set(pool.transit_page_ids)
        used = {h for h in pool.page_ids() if pool.ref_counts[h - pool.first_id] > 0}
        assert len(free) == len(pool.free_page_ids) and len(transit) == len(pool.transit_page_ids)
        assert free | used | transit == set(pool.page_ids())
        assert not free & used and not free & transit and not used & transit
        assert all(pool.ref_counts[h - pool.first_id] == references[h] for h in pool.page_ids())
        assert {h: k for k, h in pool.hash_to_page.items()} == pool.page_hash
        assert pool.page_key.keys() == pool.page_hash.keys() and set(pool.page_hash) <= free
    # A hash may be in both tiers (its tokens recomputed on the device after the page went to host):
    # lookups try the device first, and the device page's next eviction only refreshes the host copy.
    for page_hash, host_page_id in bm.host_cache.hash_to_page.items():
        assert bm.host_cache.page_key[host_page_id] == bm.page_key[bm.hash_to_page[page_hash]] \
            if page_hash in bm.hash_to_page else True
    for seq in seqs:
        assert not (seq.block_table and seq.host_block_table)
        assert bool(seq.host_block_table) == (seq.status is SequenceStatus.SWAPPED)


class SwapHostMachine(HostMachine):
    preemption_mode = "swap"

    @staticmethod
    def make_block_manager():
        return BlockManager(NUM_PAGES, PAGE_SIZE, num_swap_pages=NUM_SWAP_PAGES,
                            num_host_cache_pages=NUM_HOST_CACHE_PAGES)

    @invariant()
    def host_pools_are_consistent(self):
        check_host_pools(self.bm, self.unfinished())

    def teardown(self):
        stats = {**self.bm.stats(), **self.sched.stats()}
        event(f"swaps out: {min(stats['num_swaps_out'], 1)}, swaps in: {min(stats['num_swaps_in'], 1)}, "
              f"host-tier stores: {min(stats['num_host_cache_stores'], 1)}, "
              f"host-tier hits: {min(stats['prefix_hit_tokens_host'], 1)}, "
              f"swapped-in pages shared again: {min(stats['num_swap_in_shared_pages'], 1)}")
        super().teardown()
        self.bm.take_transfers()  # the last planned swap-ins are issued: their pages are free again
        check_host_pools(self.bm, [])
        assert self.bm.swap_pool.num_free_pages == NUM_SWAP_PAGES
        assert self.bm.host_cache.num_free_pages == NUM_HOST_CACHE_PAGES


SwapHostMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
test_swap_host_state_machine = SwapHostMachine.TestCase
