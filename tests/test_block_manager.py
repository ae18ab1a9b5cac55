"""Stories on a tiny pool: page_size 4, 11 pages (page 0 is padding, so pages 1..10 are usable).

The free list starts as [1, 2, ..., 10]; fresh pages come from its front. A freed page that caches
nothing goes back to the front; a freed page registered in the prefix cache goes to the back (least
recently freed is evicted first), and a sequence's pages are freed last page first.
"""

import os
import subprocess
import sys

import pytest

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.sequence import Sequence, num_live_slots

PAGE_SIZE = 4
NUM_PAGES = 11
PREFIX = [11, 12, 13, 14, 21, 22, 23, 24]  # two full pages


def free_list(bm):
    return list(bm.free_page_ids)


def compute(bm, seq, num_tokens=None):
    """Pretend the device computed the sequence's tokens up to `num_tokens` (default: all)."""
    before = seq.num_computed_tokens
    seq.num_computed_tokens = len(seq.token_ids) if num_tokens is None else num_tokens
    bm.cache_computed_pages(seq, before)


def admit(bm, tokens, **kwargs):
    seq = Sequence(tokens, **kwargs)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    return seq


def test_host_modules_do_not_import_jax():
    # Load the host modules without running jaxpaged/__init__.py (which may import the engine).
    package_dir = os.path.join(os.path.dirname(__file__), "..", "jaxpaged")
    code = (
        "import sys, types; pkg = types.ModuleType('jaxpaged'); pkg.__path__ = [sys.argv[1]]; "
        "sys.modules['jaxpaged'] = pkg; "
        "import jaxpaged.planner.request, jaxpaged.planner.sequence, jaxpaged.planner.block_manager, jaxpaged.planner.scheduler, jaxpaged.device.step_input; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch', 'flax')); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code, os.path.abspath(package_dir)], check=True)


def test_two_prompts_share_a_two_page_prefix():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, PREFIX + [100, 101])  # 10 tokens -> 3 pages, no hits
    assert a.block_table == [1, 2, 3] and a.num_computed_tokens == 0
    compute(bm, a)  # pages 1 and 2 are full and computed: registered; page 3 is partial: not
    assert bm.page_hash[1] is not None and bm.page_hash[2] is not None and bm.page_hash[3] is None

    b = admit(bm, PREFIX + [200])  # 9 tokens: both prefix pages hit, one fresh page for token 200
    assert b.block_table == [1, 2, 4]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert bm.ref_counts[1:5] == [2, 2, 1, 1]
    assert free_list(bm) == [5, 6, 7, 8, 9, 10]
    stats = bm.stats()
    assert (stats["prefix_query_tokens"], stats["prefix_hit_tokens"]) == (10 + 9, 8)
    assert stats["num_used_pages"] == 4 and stats["usage"] == pytest.approx(0.4)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, PREFIX + [100])
    compute(bm, a)
    # The same 8 tokens as a prompt: only page 1 may hit (pages wholly inside the first 7 tokens);
    # page 2 is recomputed in a fresh page, so the hit page is never written.
    b = admit(bm, list(PREFIX))
    assert b.block_table == [1, 4]
    assert b.num_computed_tokens == b.num_cached_tokens == 4 <= len(b.token_ids) - 1
    # When b finishes computing, its page 4 holds the same tokens as page 2: page 2 stays the cached one.
    compute(bm, b)
    assert bm.page_hash[4] is None and bm.hash_to_page[b.page_hashes[1]] == 2


def test_freed_cached_pages_are_evicted_least_recently_freed_first():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    x = admit(bm, [1, 1, 1, 1, 2, 2, 2, 2, 3])  # pages [1, 2, 3]
    y = admit(bm, [5, 5, 5, 5, 6, 6, 6, 6, 7])  # pages [4, 5, 6]
    compute(bm, x)
    compute(bm, y)  # registered: 1, 2 (x) and 4, 5 (y); 3 and 6 are partial
    assert free_list(bm) == [7, 8, 9, 10]

    bm.free(x)  # last page first: 3 caches nothing -> front; 2 then 1 -> back
    assert free_list(bm) == [3, 7, 8, 9, 10, 2, 1]
    bm.free(y)  # 6 -> front; 5 then 4 -> back
    assert free_list(bm) == [6, 3, 7, 8, 9, 10, 2, 1, 5, 4]
    assert bm.stats()["num_cached_pages"] == 4

    # A newcomer of 25 tokens needs 7 fresh pages: the six uncached ones, then evicts page 2 (x's tail).
    z = admit(bm, list(range(100, 125)))
    assert z.block_table == [6, 3, 7, 8, 9, 10, 2]
    assert bm.num_evictions == 1 and free_list(bm) == [1, 5, 4]
    # x's head page is still findable, its tail is gone: x hits one page only.
    x_again = Sequence(x.token_ids)
    assert bm.can_allocate(x_again)
    bm.allocate(x_again)
    assert x_again.block_table == [1, 5, 4] and x_again.num_cached_tokens == 4
    assert bm.num_evictions == 3  # 5 and 4 were y's pages: evicted to give x_again fresh pages


def test_a_hit_on_a_free_page_takes_it_out_of_the_free_list():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, PREFIX + [9])
    compute(bm, a)
    bm.free(a)
    assert free_list(bm) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    b = admit(bm, PREFIX + [9, 9])
    assert b.block_table == [1, 2, 3]
    assert free_list(bm) == [4, 5, 6, 7, 8, 9, 10] and bm.num_evictions == 0


def test_a_hash_collision_is_never_a_hit():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    bm.hash_page = lambda parent_hash, cache_salt, token_ids: b"42"  # every page collides
    a = admit(bm, PREFIX + [9])
    compute(bm, a)
    assert bm.hash_to_page == {b"42": 1}  # page 2 has the same hash: not registered
    b = admit(bm, [7, 7, 7, 7, 7])  # different tokens, same hash: must miss
    assert b.num_cached_tokens == 0 and b.block_table == [4, 5]
    c = admit(bm, PREFIX + [8])  # page 1 matches for real; page 2's key differs from page 1's: stop
    assert c.block_table == [1, 6, 7] and c.num_cached_tokens == 4


def test_cache_salt_isolates_tenants():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, PREFIX + [9], cache_salt="tenant-a")
    compute(bm, a)
    assert admit(bm, PREFIX + [9], cache_salt="tenant-b").num_cached_tokens == 0
    assert admit(bm, PREFIX + [9]).num_cached_tokens == 0
    assert admit(bm, PREFIX + [9], cache_salt="tenant-a").num_cached_tokens == 8


def test_prefix_caching_can_be_switched_off_and_reset():
    off = BlockManager(NUM_PAGES, PAGE_SIZE, enable_prefix_caching=False)
    a = admit(off, PREFIX + [9])
    compute(off, a)
    assert off.hash_to_page == {} and admit(off, PREFIX + [9]).num_cached_tokens == 0

    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, PREFIX + [9])
    compute(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.hash_to_page == {} and bm.page_hash == [None] * NUM_PAGES
    assert admit(bm, PREFIX + [9]).num_cached_tokens == 0


def test_pages_filled_during_decode_are_registered():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, [1, 2, 3])  # 3 tokens, page [1]
    compute(bm, a)
    assert bm.hash_to_page == {}
    a.append_token(4)
    assert bm.append_slot(a) is None and a.block_table == [1]
    compute(bm, a)  # token 4 fills page 1
    assert list(bm.hash_to_page.values()) == [1]
    a.append_token(5)
    assert bm.append_slot(a) is None and a.block_table == [1, 2]  # token 5 starts page 2
    b = admit(bm, [1, 2, 3, 4, 9])
    assert b.block_table == [1, 3] and b.num_cached_tokens == 4


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    parent = admit(bm, [1, 2, 3, 4, 5, 6])  # pages [1, 2]; page 2 holds 2 of 4 tokens
    compute(bm, parent)
    parent.append_token(70)  # sampled its first token: 7 tokens, 6 computed
    child = bm.fork(parent)
    assert child.block_table == [1, 2] and bm.ref_counts[1:3] == [2, 2]
    assert child.token_ids == parent.token_ids and child.token_ids is not parent.token_ids

    # The parent writes token 6 into page 2, which the child shares: it gets a private copy (page 3).
    assert bm.can_append(parent)
    assert bm.append_slot(parent) == (2, 3)
    assert parent.block_table == [1, 3] and bm.ref_counts[1:4] == [2, 1, 1]
    # The child is now page 2's only owner: it writes in place.
    assert bm.append_slot(child) is None and child.block_table == [1, 2]
    assert bm.stats()["num_cow_copies"] == 1

    bm.free(parent)
    bm.free(child)
    assert bm.ref_counts == [0] * NUM_PAGES and sorted(free_list(bm)) == list(range(1, NUM_PAGES))


def test_release_page_gives_back_a_page_with_no_known_token():
    # A speculative step grew the table for draft tokens; all were rejected, so the last page holds
    # nothing known and the speculator gives it back (spec_decode/speculator.py).
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    seq = admit(bm, PREFIX + [100])  # 9 tokens -> pages [1, 2, 3]; free [4 .. 10]
    compute(bm, seq, 8)  # pages 1 and 2 registered; page 3 caches nothing
    bm.release_page(seq.block_table[-1])
    seq.block_table = seq.block_table[:2]
    assert bm.ref_counts[1:4] == [1, 1, 0]
    assert free_list(bm) == [3, 4, 5, 6, 7, 8, 9, 10]  # caches nothing: back at the front
    bm.free(seq)  # last page first, registered: to the back
    assert free_list(bm) == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]


def test_fork_on_a_page_boundary_needs_no_copy():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    parent = admit(bm, PREFIX)  # exactly 2 pages
    compute(bm, parent)
    parent.append_token(70)
    child = bm.fork(parent)
    assert bm.append_slot(parent) is None and parent.block_table == [1, 2, 3]
    assert bm.append_slot(child) is None and child.block_table == [1, 2, 4]
    assert bm.num_cow_copies == 0


def test_fork_in_the_middle_of_a_prompt_is_refused():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    seq = admit(bm, list(range(10)))
    compute(bm, seq, 4)
    with pytest.raises(ValueError, match="fork only once its prompt is computed"):
        bm.fork(seq)


def test_append_without_a_free_page_is_refused():
    bm = BlockManager(3, PAGE_SIZE)  # pages 1 and 2
    seq = admit(bm, list(range(8)))
    compute(bm, seq)
    seq.append_token(1)
    assert not bm.can_append(seq)
    with pytest.raises(RuntimeError, match="can_append"):
        bm.append_slot(seq)
    assert seq.block_table == [1, 2]


def test_allocate_refuses_when_the_pool_is_short_and_changes_nothing():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    admit(bm, list(range(36)))  # 9 pages
    big = Sequence(list(range(100, 108)))  # 2 pages, 1 free
    assert not bm.can_allocate(big)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(big)
    assert big.block_table == [] and free_list(bm) == [10]


def test_sampling_params_errors_say_what_to_do():
    with pytest.raises(ValueError, match="temperature=-0.5 is negative; use 0 for greedy"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="min_tokens=5 must be in"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="top_k=-2"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    params = SamplingParams(stop="###", stop_token_ids=[2, 3], temperature=0)
    assert params.stop == ("###",) and params.stop_token_ids == (2, 3) and params.greedy
    assert params == SamplingParams(stop=["###"], stop_token_ids=(2, 3), temperature=0)  # lists normalised


def test_reset_prefix_cache_while_pages_are_in_use():
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, PREFIX + [9])  # pages [1, 2, 3]; 1 and 2 registered once computed
    compute(bm, a)
    assert bm.reset_prefix_cache() == 2  # e.g. new weights: the old K/V must not be found again
    assert admit(bm, PREFIX + [9]).block_table == [4, 5, 6]  # no hit
    # a still holds its pages; they cache nothing now, so freeing sends them all to the front.
    bm.free(a)
    assert free_list(bm) == [1, 2, 3, 7, 8, 9, 10] and bm.num_evictions == 0


def test_metrics_counters_allocations_ref_counts_and_live_slots():
    # The numbers /metrics reports: fresh-page allocations, the ref-count histogram of used pages,
    # and the slots that hold a token (the rest of the used pages' slots are fragmentation).
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    a = admit(bm, PREFIX + [100, 101])  # 10 tokens: pages [1, 2, 3], page 3 holds 2 of 4 slots
    compute(bm, a)
    assert bm.stats()["num_page_allocations"] == 3
    assert bm.ref_count_histogram() == {1: 3}
    assert num_live_slots([a], bm.page_size) == 10  # 12 slots allocated, 2 empty

    b = admit(bm, PREFIX + [200])  # hits pages 1 and 2, one fresh page (4) for token 200
    assert b.block_table == [1, 2, 4]
    assert bm.stats()["num_page_allocations"] == 4  # a hit is not an allocation
    assert bm.ref_count_histogram() == {2: 2, 1: 2}
    # Shared pages count once: 8 prefix slots + 2 on page 3 + 1 on page 4 = 11 of 16 allocated.
    assert num_live_slots([a, b], bm.page_size) == 11

    compute(bm, b)
    b.append_token(201)
    child = bm.fork(b)  # shares pages [1, 2, 4]: ref counts 3, 3, 1, 2
    assert bm.ref_count_histogram() == {3: 2, 1: 1, 2: 1}
    assert bm.append_slot(child) == (4, 5)  # copy-on-write of the partial page is an allocation too
    assert bm.stats()["num_page_allocations"] == 5

    for seq in (a, b, child):
        bm.free(seq)
    assert bm.ref_count_histogram() == {} and num_live_slots([], bm.page_size) == 0


def test_a_collision_of_the_fast_hash_never_returns_a_wrong_page():
    """Python's hash has no secret: hash(2**61 - 1) == hash(0), so pages X and Y below collide
    under it. Keyed by the parent's *fast* hash, page Z computed after X was found again after Y
    (a wrong K/V page; the class of vLLM's CVE-2025-25183). Keyed by a cryptographic digest of
    the parent's digest, the salt and the tokens, Z-after-Y is a miss."""
    x, y, z = [0, 0, 0, 0], [2**61 - 1, 0, 0, 0], [5, 6, 7, 8]
    assert hash((None, None, tuple(x))) == hash((None, None, tuple(y)))  # a real collision
    bm = BlockManager(NUM_PAGES, PAGE_SIZE)
    b = admit(bm, y + [9])  # Y registered first: pages [1, 2]
    compute(bm, b)
    a = admit(bm, x + z + [9])  # X misses (Y's page is not X), Z registered as computed after X
    assert a.num_cached_tokens == 0 and a.block_table == [3, 4, 5]
    compute(bm, a)
    assert bm.page_hash[4] is not None
    again = admit(bm, y + z + [9])  # Y hits page 1; Z after Y was never computed: must miss
    assert again.block_table[0] == 1
    assert again.num_cached_tokens == PAGE_SIZE
    assert again.block_table[1] != 4, "page Z computed after X was returned after Y"
    # Digests are bytes, and the same tokens after the same parent still hit.
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a.page_hashes)
    repeat = admit(bm, x + z + [9])
    assert repeat.block_table[:2] == [3, 4] and repeat.num_cached_tokens == 2 * PAGE_SIZE


def test_page_digests_separate_salt_and_tokens():
    """The digest's input is unambiguous: a salt cannot pose as token ids, nor None as a salt."""
    digest = BlockManager.hash_page
    assert digest(None, None, (1, 2)) != digest(None, "", (1, 2))
    assert digest(None, "a", (1, 2)) != digest(None, "a\x00", (1, 2))
    # The salt's length is hashed: without it, salt "a" + token 0 (8 zero bytes) reads as salt "a\0...\0".
    assert digest(None, "a", (0, 1)) != digest(None, "a" + "\x00" * 8, (1,))
    assert digest(None, None, (1, 2)) != digest(digest(None, None, (1,)), None, (2,))
    assert digest(None, None, (1, 2)) == digest(None, None, (1, 2))
