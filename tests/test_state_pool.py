"""The hybrid models' state pool (planner/state_pool.py), on the host alone: a slot per running sequence,
taken at admission (n for a request that forks), freed at finish and preemption, copied on fork."""

import pytest

from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence, SequenceStatus
from jaxpaged.planner.state_pool import HybridBlockManager, StatePool


def make_scheduler(num_pages=32, num_state_slots=3, max_num_seqs=3, budget=64):
    block_manager = HybridBlockManager(num_pages=num_pages, page_size=4, enable_prefix_caching=False,
                                       num_state_slots=num_state_slots)
    return Scheduler(block_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64)


def held_slots(scheduler):
    return sorted(seq.state_slot for seq in scheduler.running)


def test_pool_hands_out_lowest_free_slots_and_never_slot_zero():
    pool = StatePool(3)
    assert [pool.take(), pool.take()] == [1, 2]
    pool.release(1)
    assert pool.take() == 1 and pool.take() == 3 and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.take()
    with pytest.raises(ValueError):
        pool.release(0)


def test_admission_takes_a_slot_and_finish_gives_it_back():
    scheduler = make_scheduler()
    seqs = [Sequence(list(range(5 + i)), SamplingParams(max_tokens=2)) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert out.seqs == seqs[:3] and held_slots(scheduler) == [1, 2, 3]  # the 4th waits for a slot
    assert seqs[3].state_slot == 0 and scheduler.block_manager.state_pool.num_free == 0
    scheduler.update(out, [7, 7, 7])
    out = scheduler.schedule()
    scheduler.update(out, [7, 7, 7])  # max_tokens 2: all three finish
    assert all(seq.status is SequenceStatus.FINISHED and seq.state_slot == 0 for seq in seqs[:3])
    out = scheduler.schedule()
    assert out.seqs == [seqs[3]] and seqs[3].state_slot == 1


def test_a_request_with_n_samples_reserves_its_forks_slots_and_the_fork_plans_copies():
    scheduler = make_scheduler()
    parent = Sequence(list(range(6)), SamplingParams(n=3, max_tokens=4))
    other = Sequence(list(range(7)), SamplingParams(max_tokens=4))
    scheduler.add(parent)
    scheduler.add(other)
    out = scheduler.schedule()
    assert out.seqs == [parent]  # three slots for parent: none left for `other` yet
    scheduler.update(out, [[5, 6, 7]])  # forks two children
    children = [seq for seq in scheduler.running if seq is not parent]
    assert len(children) == 2
    out = scheduler.schedule()
    assert sorted(out.state_copies) == sorted((parent.state_slot, child.state_slot) for child in children)
    assert len({parent.state_slot, *(c.state_slot for c in children)}) == 3
    assert scheduler.schedule().state_copies == []  # planned once


def test_preemption_frees_the_slot_and_readmission_takes_one():
    # 4 usable pages of 4 tokens: two 5-token prompts fit, the second one is preempted as they pass 8 tokens.
    scheduler = make_scheduler(num_pages=5, max_num_seqs=2)
    first, second = (Sequence(list(range(5)), SamplingParams(max_tokens=6)) for _ in range(2))
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(6):
        out = scheduler.schedule()
        if out.preempted:
            break
        scheduler.update(out, [1] * len(out.seqs))
    assert out.preempted == [second] and second.state_slot == 0 and second.num_computed_tokens == 0
    assert scheduler.block_manager.state_pool.num_free == 2


def test_a_request_needing_more_slots_than_the_pool_is_refused_at_add():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="state slots"):
        scheduler.add(Sequence([1, 2, 3], SamplingParams(n=4)))


def test_prefix_caching_needs_snapshot_slots_and_swap_needs_host_state_slots():
    with pytest.raises(ValueError, match="prefix caching"):
        HybridBlockManager(num_pages=8, page_size=4, enable_prefix_caching=True, num_state_slots=2)
    block_manager = HybridBlockManager(num_pages=8, page_size=4, enable_prefix_caching=False, num_state_slots=2)
    assert not block_manager.can_swap_out(Sequence([1, 2]))


def test_swap_moves_the_state_to_a_host_slot_and_back_into_a_fresh_slot():
    block_manager = HybridBlockManager(num_pages=5, page_size=4, enable_prefix_caching=False, num_state_slots=2,
                                       num_swap_pages=8, num_host_state_slots=1)
    scheduler = Scheduler(block_manager, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                          preemption_mode="swap")
    first, second = (Sequence(list(range(5)), SamplingParams(max_tokens=6)) for _ in range(2))
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(6):
        out = scheduler.schedule()
        if out.preempted:
            break
        scheduler.update(out, [1] * len(out.seqs))
    assert out.preempted == [second] and second.status is SequenceStatus.SWAPPED
    assert out.state_swap_out == [(2, 1)] and second.state_slot == 0 and block_manager.host_state_pool.num_free == 0
    assert block_manager.state_pool.num_free == 1
    other = Sequence(list(range(5)), SamplingParams(max_tokens=6))  # recomputed, not swapped: no host slot left
    assert not block_manager.can_swap_out(other)
    scheduler.update(out, [1])
    while second.status is SequenceStatus.SWAPPED:
        out = scheduler.schedule()
        scheduler.update(out, [1] * len(out.seqs))
    # `first` finished (slot 1 back), then `second` came back into the lowest free slot with its host state
    assert out.state_swap_in == [(1, second.state_slot)] and second.state_slot == 1
    assert block_manager.host_state_pool.num_free == 1 and not block_manager.host_state_slot


def test_a_beam_group_holds_its_width_in_slots_and_forks_from_its_reserve():
    scheduler = make_scheduler()
    root = Sequence(list(range(6)), SamplingParams(max_tokens=4))
    other = Sequence(list(range(7)), SamplingParams(max_tokens=4))
    scheduler.block_manager.open_fork_group(root, 2)
    scheduler.add(root)
    scheduler.add(other)
    out = scheduler.schedule()
    assert out.seqs == [root, other] and scheduler.block_manager.state_pool.num_free == 0  # 2 for the search
    scheduler.update(out, [3, 3])
    child = scheduler.fork(root)
    assert scheduler.block_manager.take_state_copies() == [(root.state_slot, child.state_slot)]
    scheduler.finish(root, "stop")  # a dropped beam: its slot stays with the search
    assert scheduler.block_manager.state_pool.num_free == 0
    grandchild = scheduler.fork(child)
    assert {child.state_slot, grandchild.state_slot} == {1, 2}
    for seq in (child, grandchild):
        scheduler.finish(seq, "stop")
    scheduler.block_manager.close_fork_group(child)
    assert scheduler.block_manager.state_pool.num_free == 2


def test_a_swapped_beam_comes_back_into_its_searchs_reserve_not_the_pool():
    block_manager = HybridBlockManager(num_pages=16, page_size=4, enable_prefix_caching=False, num_state_slots=3,
                                       num_swap_pages=8, num_host_state_slots=1)
    beam = Sequence(list(range(6)), SamplingParams(max_tokens=4))
    block_manager.open_fork_group(beam, 2)
    block_manager.allocate(beam)
    slot = beam.state_slot
    beam.num_computed_tokens = 6
    block_manager.swap_out_seq(beam)
    assert block_manager.take_state_transfers() == ([(slot, 1)], []) and beam.state_slot == 0
    other = Sequence(list(range(5)), SamplingParams(max_tokens=4))
    block_manager.allocate(other)  # the pool's last slot: the search's two stay with it
    assert block_manager.state_pool.num_free == 0 and block_manager.can_swap_in(beam)
    block_manager.swap_in_seq(beam)
    assert block_manager.take_state_transfers() == ([], [(1, beam.state_slot)]) and beam.state_slot != other.state_slot
    block_manager.take_transfers()  # the swap-in was issued: its host slot is free again
    assert block_manager.host_state_pool.num_free == 1
    block_manager.free(beam)
    block_manager.close_fork_group(beam)
    assert block_manager.state_pool.num_free == 2
# ---------------------------------------------------------------- prefix caching: state snapshots


def caching_scheduler(num_pages=16, budget=7, num_snapshot_slots=2):
    """Running slots 1-2, snapshot slots 3.. ; pages of 4 tokens."""
    block_manager = HybridBlockManager(num_pages=num_pages, page_size=4, enable_prefix_caching=True,
                                       num_state_slots=2, num_snapshot_slots=num_snapshot_slots)
    return Scheduler(block_manager, max_num_seqs=2, max_num_batched_tokens=budget, max_model_len=64)


def step(scheduler, token=9):
    out = scheduler.schedule()
    scheduler.update(out, [token] * len(out.seqs))
    return out


def test_chunks_end_on_page_boundaries_and_each_end_saves_the_state_once():
    scheduler = caching_scheduler()
    block_manager = scheduler.block_manager
    seq = Sequence(list(range(10)), SamplingParams(max_tokens=1))
    scheduler.add(seq)
    outs = [step(scheduler) for _ in range(3)]
    # A 7-token budget over a 10-token prompt: [0, 7) cut to [0, 4), [4, 10) cut to [4, 8), then [8, 10).
    assert [out.num_new_tokens for out in outs] == [[4], [4], [2]]
    assert [out.samples for out in outs] == [[False], [False], [True]]
    # The state after each boundary step is saved by the next step's copies, before that step runs.
    assert [out.state_copies for out in outs] == [[], [(1, 3)], [(1, 4)]]
    assert seq.status is SequenceStatus.FINISHED
    assert dict(block_manager.snapshots) == {seq.page_hashes[0]: 3, seq.page_hashes[1]: 4}
    assert block_manager.leaks() == []


def test_a_hit_restores_the_deepest_snapshot_and_never_uses_a_page_past_it():
    scheduler = caching_scheduler(budget=16)
    block_manager = scheduler.block_manager
    first = Sequence(list(range(8)), SamplingParams(max_tokens=5))
    scheduler.add(first)
    for _ in range(5):
        step(scheduler, token=50)
    # Its prompt's end (8) has a snapshot; page 2 (tokens 8-11) filled while decoding: cached, no snapshot.
    assert first.status is SequenceStatus.FINISHED and len(block_manager.hash_to_page) == 3
    assert list(block_manager.snapshots) == [first.page_hashes[1]]
    second = Sequence(list(range(8)) + [50] * 4 + [7], SamplingParams(max_tokens=1))
    scheduler.add(second)
    out = scheduler.schedule()
    assert second.num_cached_tokens == second.num_computed_tokens == 8
    assert out.num_new_tokens == [4]  # [8, 13) cut to the prompt page boundary 12: recomputed, then saved
    assert out.state_copies == [(block_manager.snapshots[first.page_hashes[1]], second.state_slot)]
    assert block_manager.stats()["num_snapshot_restores"] == 1


def test_eviction_reset_and_a_full_pool_free_snapshots():
    scheduler = caching_scheduler(num_pages=6, num_snapshot_slots=1)
    block_manager = scheduler.block_manager
    first = Sequence(list(range(10)), SamplingParams(max_tokens=1))
    scheduler.add(first)
    for _ in range(3):
        step(scheduler)
    # Saves at 4 and 8 into a one-slot pool: the second drops the first (its page stays cached, unusable).
    assert dict(block_manager.snapshots) == {first.page_hashes[1]: 3}
    assert block_manager.stats()["num_snapshot_drops"] == 1 and block_manager.leaks() == []
    # 5 usable pages: a 19-token prompt takes them all, evicting the first prompt's cached pages.
    other = Sequence(list(range(100, 119)), SamplingParams(max_tokens=1))
    scheduler.add(other)
    scheduler.schedule()
    assert block_manager.num_evictions >= 2 and first.page_hashes[1] not in block_manager.hash_to_page
    assert first.page_hashes[1] not in block_manager.snapshots and block_manager.num_snapshot_evictions == 1
    scheduler.abort(other.seq_id)
    assert block_manager.leaks() == []
    for _ in range(3):  # again, to the snapshot at 8; then the cache is reset
        scheduler.add(Sequence(list(range(10)), SamplingParams(max_tokens=1)))
        while scheduler.has_unfinished():
            step(scheduler)
        block_manager.reset_prefix_cache()
        assert not block_manager.snapshots and block_manager.snapshot_pool.num_free == 1
        assert block_manager.leaks() == []


def test_leaks_names_what_is_held():
    scheduler = caching_scheduler()
    seq = Sequence(list(range(10)), SamplingParams(max_tokens=4))
    scheduler.add(seq)
    step(scheduler)
    assert scheduler.block_manager.leaks() == ["3 pages held", "1 state slots held"]
    scheduler.abort(seq.seq_id)  # mid-prompt, a save planned: the slot goes back, the snapshot stays cached
    assert scheduler.block_manager.leaks() == [] and len(scheduler.block_manager.snapshots) == 1


def test_a_preempted_sequence_is_readmitted_from_its_own_snapshot():
    # 6 usable pages: two 8-token prompts growing to 16 tokens need 8; the second is preempted at 12, and
    # readmitted once the first finishes, from the snapshot at its prompt's end (its pages still cached).
    scheduler = caching_scheduler(num_pages=7, budget=16)
    block_manager = scheduler.block_manager
    first, second = (Sequence(list(range(i, i + 8)), SamplingParams(max_tokens=8)) for i in (0, 50))
    scheduler.add(first)
    scheduler.add(second)
    preempted = False
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        preempted |= second in out.preempted
        if second.num_cached_tokens:
            assert out.state_copies == [(block_manager.snapshots[second.page_hashes[1]], second.state_slot)]
            break
        scheduler.update(out, [1] * len(out.seqs))
    assert preempted and second.num_cached_tokens == 8 and block_manager.num_snapshot_restores == 1
