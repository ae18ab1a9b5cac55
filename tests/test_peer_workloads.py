"""The pure-Python parts of the vLLM peer benchmarks (no vLLM, no model): the workloads both engines
are fed, the pool sizing, the greedy cross-checks and the hit-rate arithmetic."""

import pytest

from jaxpaged.baseline.peer_workloads import (
    compare_greedy,
    compare_texts,
    prefix_hit_rate,
    same_pool,
    w1_workloads,
    w2_workload,
    w3_workload,
)


def test_w2_prefix_is_shared_within_a_call_and_redrawn_between_calls():
    w2 = w2_workload("w2", num_seqs=4, prefix_len=32, suffix_min=2, suffix_max=5)
    first, again, second = w2.prompts_for(1), w2.prompts_for(1), w2.prompts_for(2)
    assert first == again  # every system gets the same prompts for the same call
    assert all(p[:32] == first[0][:32] for p in first)  # one prefix per call
    assert first[0][:32] != second[0][:32]  # a repeat cannot hit the previous repeat's pages
    assert [p[32:] for p in first] == [p[32:] for p in second]  # distinct suffixes, kept
    assert len({tuple(p[32:]) for p in first}) == 4
    assert [len(p) for p in first] == [len(p) for p in w2.prompts]  # token counts as reported


def test_workloads_without_fresh_prefix_are_the_same_every_call():
    w1, _ = w1_workloads(num_seqs=3)
    assert w1.prompts_for(0) is w1.prompts and w1.prompts_for(5) is w1.prompts
    w3 = w3_workload(num_seqs=16)
    peak = sum(len(p) + s["max_tokens"] for p, s in zip(w3.prompts, w3.params))
    assert peak > 2 * 768  # W3's batch needs far more KV than its 768-token pool: preemption must happen


def test_same_pool_holds_the_same_tokens_in_both_engines():
    jax_pages, vllm_blocks = same_pool(768, 16, 32)
    assert (jax_pages - 1) * 16 == vllm_blocks * 32 == 768  # jaxpaged's page 0 holds no tokens
    with pytest.raises(ValueError, match="multiple of 512"):
        same_pool(784, 16, 32)


def test_compare_greedy_counts_tokens_before_the_first_divergence():
    check = compare_greedy([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9, 5], [6, 7]])
    assert check["prompts_identical"] == 1
    assert check["first_divergence"] == [None, 1, 1]
    assert (check["matching_tokens"], check["total_tokens"]) == (3 + 1 + 1, 3 + 3 + 2)


def test_compare_texts_and_failed_requests():
    check = compare_texts(["Paris.", "abc", None, "x"], ["Paris.", "abd", "y", None])
    assert check["identical"] == 1 and check["num_requests"] == 4
    assert check["first_divergence_char"] == [None, 2, 0, 0]


def test_prefix_hit_rate():
    assert prefix_hit_rate([[0] * 48, [0] * 16], [32, 0]) == 0.5
    with pytest.raises(ValueError):
        prefix_hit_rate([[0]], [])
