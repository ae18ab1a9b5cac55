"""engine/prefix_routing.py: which data-parallel replica each request goes to. Host only: stories on
4 replicas with pages of 4 tokens, exact replica indices. (The routing's effect on prefix hits over
real replicas is measured by benchmarks/bench_prefix_routing.py.)"""

import pytest

from jaxpaged.config import EngineConfig
from jaxpaged.engine.prefix_routing import ReplicaRouter

GROUP = list(range(100, 112))  # 3 full pages
OTHER = list(range(200, 212))
IDLE = [0, 0, 0, 0]


def test_prefix_sends_a_group_and_its_next_turn_to_one_replica():
    router = ReplicaRouter("prefix", 4, 4, max_imbalance=4)
    assert router.choose(GROUP + [1], None, IDLE) == 0  # nothing known: the least loaded
    # The group's other samples, sent while the first runs: the same replica, though others are idle.
    assert [router.choose(GROUP + [k], None, [k, 0, 0, 0]) for k in (2, 3, 4)] == [0, 0, 0]
    assert router.choose(OTHER, None, [4, 0, 0, 0]) == 1  # another prompt: the least loaded
    # The conversation's next turn (its first turn + answer + a question) follows its pages.
    assert router.choose(OTHER + [7, 8, 9, 10, 11], None, [4, 1, 0, 0]) == 1
    # A prompt sharing only the first page of GROUP still goes where that page went.
    assert router.choose(GROUP[:4] + OTHER, None, [4, 2, 0, 0]) == 0


def test_prefix_balances_past_the_imbalance_and_salts_apart():
    router = ReplicaRouter("prefix", 4, 4, max_imbalance=2)
    assert router.choose(GROUP, None, IDLE) == 0
    assert router.choose(GROUP, None, [3, 0, 0, 0]) == 1  # 3 > 0 + 2: balanced instead
    assert router.choose(GROUP, None, [2, 2, 0, 0]) == 1  # ... and the prefix now lives on replica 1
    assert router.choose(GROUP, "tenant-b", [0, 1, 0, 0]) == 0  # another cache_salt shares no page
    assert router.choose(GROUP[:3], None, [0, 5, 1, 1]) == 0  # no full page: the least loaded


def test_least_loaded_and_round_robin():
    least = ReplicaRouter("least_loaded", 4, 4, max_imbalance=4)
    assert [least.choose(GROUP, None, loads) for loads in ([1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0])] == [1, 2, 0]
    turns = ReplicaRouter("round_robin", 4, 4, max_imbalance=4)
    assert [turns.choose(GROUP, None, [9, 0, 0, 0]) for _ in range(6)] == [0, 1, 2, 3, 0, 1]


def test_lru_capacity_and_bad_routing():
    router = ReplicaRouter("prefix", 2, 4, max_imbalance=4, capacity=3)
    router.choose(GROUP, None, [0, 0])  # 3 pages -> replica 0
    router.choose(OTHER, None, [1, 0])  # 3 pages -> replica 1: GROUP's pages fall out of the LRU
    assert router.choose(GROUP, None, [1, 0]) == 1  # remembered, it would have gone to replica 0
    with pytest.raises(ValueError, match="data_parallel_routing"):
        ReplicaRouter("random", 2, 4, max_imbalance=4)
    with pytest.raises(ValueError, match="data_parallel_routing"):
        EngineConfig(data_parallel_routing="random")
