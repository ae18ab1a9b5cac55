"""Swap preemption and the prefix cache's host tier through the engine (tiny random model, CPU)."""

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.config import EngineConfig
from test_llm_inputs import tiny_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts(num, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(300, 900, size=int(rng.integers(10, 20))).tolist() for _ in range(num)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_swap_preemption_recomputes_nothing_and_matches_an_unconstrained_run(async_scheduling):
    # 6 requests of up to 43 tokens (11 pages of 4) in 23 usable pages: they cannot all run at once.
    batch = prompts(6)
    reference = token_ids(tiny_llm(async_scheduling=async_scheduling).generate(batch, GREEDY))
    llm = tiny_llm(async_scheduling=async_scheduling, num_pages=24, preemption_mode="swap",
                   swap_space_bytes=1 << 20)
    got = token_ids(llm.generate(batch, GREEDY))
    stats = llm.stats()
    assert got == reference
    assert stats["num_swaps_out"] > 0 and stats["num_swaps_in"] == stats["num_swaps_out"]
    assert stats["num_preemptions"] == stats["num_swaps_out"]  # no fallback to recompute: pool is large
    assert stats["num_recomputed_tokens"] == 0
    # Every page swapped out comes back: copied from host, or shared again where the device still
    # caches it (planner/block_manager.py, swap_in_seq).
    assert stats["num_swapped_in_pages"] + stats["num_swap_in_shared_pages"] == stats["num_swapped_out_pages"] > 0
    assert stats["num_swapped_in_pages"] > 0
    assert stats["swap_bytes_out"] > 0 and stats["swap_bytes_in"] > 0
    assert stats["num_used_pages"] == 0 and stats["num_swap_pages_free"] == llm.engine.block_manager.swap_pool.num_pages


def test_a_full_swap_space_falls_back_to_recompute():
    batch = prompts(6)
    reference = token_ids(tiny_llm().generate(batch, GREEDY))
    # One page of host swap space: no victim fits (each holds more), every preemption recomputes.
    bytes_per_page = 2 * 2 * 2 * 4 * 8 * 4
    llm = tiny_llm(num_pages=24, preemption_mode="swap", swap_space_bytes=bytes_per_page)
    assert token_ids(llm.generate(batch, GREEDY)) == reference
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_swaps_out"] == 0 and stats["num_recomputed_tokens"] > 0


def test_host_tier_serves_prefixes_the_device_pool_evicted():
    # 4 shared prefixes of 24 tokens (6 pages each) against 15 usable pages: requests cycle through
    # the prefixes, so each prefix is evicted from the device before it comes back.
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(300, 900, size=24).tolist() for _ in range(4)]
    batch = [prefixes[i % 4] + rng.integers(300, 900, size=3).tolist() for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    args = dict(num_pages=16, max_num_seqs=2)
    off = tiny_llm(**args)
    reference = [token_ids(off.generate([p], params))[0] for p in batch]
    on = tiny_llm(**args, host_cache_bytes=1 << 20)
    got = [token_ids(on.generate([p], params))[0] for p in batch]
    assert got == reference
    stats_on, stats_off = on.stats(), off.stats()
    assert stats_off["prefix_hit_tokens_host"] == 0
    assert stats_on["prefix_hit_tokens_host"] > 0 and stats_on["num_host_cache_stores"] > 0
    assert stats_on["prefix_hit_tokens"] > stats_off["prefix_hit_tokens"]
    assert stats_on["prefix_hit_tokens"] == stats_on["prefix_hit_tokens_device"] + stats_on["prefix_hit_tokens_host"]
    assert stats_on["swap_bytes_in"] > 0


def test_swap_and_host_tier_settings_are_validated():
    assert EngineConfig(preemption_mode="swap").swap_space_bytes > 0  # vLLM's default (test_api_fidelity.py)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="spill")
    with pytest.raises(ValueError, match="only with preemption_mode='swap'"):
        EngineConfig(swap_space_bytes=1 << 20)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(host_cache_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no page"):
        tiny_llm(preemption_mode="swap", swap_space_bytes=10)


def test_cli_flags_reach_the_engine_config():
    from jaxpaged.entrypoints.cli import build_parser, engine_args

    args = build_parser().parse_args(
        ["--preemption-mode", "swap", "--swap-space", "0.0009765625", "--host-cache-bytes", "2097152"])  # GiB, as vLLM
    config = EngineConfig(**engine_args(args))
    assert (config.preemption_mode, config.swap_space_bytes, config.host_cache_bytes) == ("swap", 1 << 20, 2 << 20)
    assert EngineConfig(**engine_args(build_parser().parse_args([]))).preemption_mode == "recompute"


def test_reset_prefix_cache_empties_the_host_tier_too():
    from jaxpaged.planner.block_manager import BlockManager
    from jaxpaged.planner.sequence import Sequence

    bm = BlockManager(4, 2, num_host_cache_pages=3)
    first = Sequence([5, 6, 7, 8, 9])
    bm.allocate(first)
    first.num_computed_tokens = 4
    bm.cache_computed_pages(first, 0)
    bm.free(first)
    bm.allocate(Sequence([1, 2, 3, 4, 1, 2]))  # takes all 3 pages: the 2 cached ones go to host
    assert len(bm.host_cache.hash_to_page) == 2 and len(bm.take_transfers()[0]) == 2
    assert bm.reset_prefix_cache() == 2
    assert not bm.host_cache.hash_to_page and bm.host_cache.num_free_pages == 3
    assert bm._cached_prefix(Sequence([5, 6, 7, 8, 9])) == []


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "float8_e4m3fn"])
def test_swap_and_host_tier_move_quantized_pages_with_their_scales(kv_cache_dtype):
    """Swap and the host tier on a quantized cache (two leaves: values, per token-head scales) give
    the outputs of an unconstrained run on the same cache. This tiny model's greedy tokens survive
    stale scales (a page swapped in often lands where it was), so the next test checks that the
    transfers move every leaf bit for bit."""
    batch = prompts(6)
    reference = token_ids(tiny_llm(kv_cache_dtype=kv_cache_dtype).generate(batch, GREEDY))
    swapped = tiny_llm(kv_cache_dtype=kv_cache_dtype, num_pages=24, preemption_mode="swap", swap_space_bytes=1 << 20)
    assert token_ids(swapped.generate(batch, GREEDY)) == reference
    stats = swapped.stats()
    assert stats["num_swaps_out"] > 0 and stats["num_recomputed_tokens"] == 0
    assert stats["num_used_pages"] == 0

    rng = np.random.default_rng(1)
    prefixes = [rng.integers(300, 900, size=24).tolist() for _ in range(4)]
    cycle = [prefixes[i % 4] + rng.integers(300, 900, size=3).tolist() for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    off = tiny_llm(kv_cache_dtype=kv_cache_dtype, num_pages=16, max_num_seqs=2)
    on = tiny_llm(kv_cache_dtype=kv_cache_dtype, num_pages=16, max_num_seqs=2, host_cache_bytes=1 << 20)
    assert [token_ids(on.generate([p], params))[0] for p in cycle] == \
        [token_ids(off.generate([p], params))[0] for p in cycle]
    assert on.stats()["prefix_hit_tokens_host"] > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "float8_e4m3fn"])
def test_gather_and_scatter_move_every_leaf_of_a_page_bit_for_bit(kv_cache_dtype):
    """The runner's transfers, device -> host -> other device pages: values and (quantized) scales."""
    import jax

    runner = tiny_llm(kv_cache_dtype=kv_cache_dtype).engine.runner
    rng = np.random.default_rng(0)
    leaves, treedef = jax.tree.flatten(runner.kv_pages)
    assert len(leaves) == (1 if kv_cache_dtype == "auto" else 2)
    filled = [rng.integers(0, 100, leaf.shape).astype(leaf.dtype) for leaf in leaves]
    runner.kv_pages = jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in filled])
    host = jax.tree.map(np.asarray, runner.gather_pages([3, 5]))
    runner.scatter_pages(host, [7, 9])
    for before, after in zip(filled, jax.tree.leaves(runner.kv_pages)):
        after = np.asarray(after)
        np.testing.assert_array_equal(after[:, :, :, [7, 9]], before[:, :, :, [3, 5]])
        untouched = [p for p in range(before.shape[3]) if p not in (7, 9)]
        np.testing.assert_array_equal(after[:, :, :, untouched], before[:, :, :, untouched])


def test_warmup_compiles_the_host_transfers_only_when_there_are_host_pages():
    """With swap space, serving under pressure compiles no transfer after warm-up; without host
    pages warm-up compiles none (and touches no page: a multi-process mesh cannot gather them)."""
    batch = prompts(6)
    warm = tiny_llm(warmup=True, num_pages=24, preemption_mode="swap", swap_space_bytes=1 << 20)
    runner = warm.engine.runner
    assert runner.num_transfer_compiles == 2  # the gather and the scatter
    warm.generate(batch, GREEDY)
    assert warm.stats()["num_swaps_out"] > 0 and runner.num_transfer_compiles == 2
    assert tiny_llm(warmup=True).engine.runner.num_transfer_compiles == 0


def test_a_step_swaps_out_before_it_swaps_in_to_the_same_device_page():
    """One step's transfers (SchedulerOutput: "swap-outs first"): device page 5 is copied out to host
    page 0 and, freed, receives host page 1. Swapping in first would overwrite page 5 before its
    K/V left: host page 0 must hold page 5's old contents, page 5 host page 1's."""
    import jax

    from jaxpaged.planner.scheduler_output import SchedulerOutput

    engine = tiny_llm(preemption_mode="swap", swap_space_bytes=1 << 20).engine
    runner, host_kv = engine.runner, engine.host_kv
    assert host_kv.num_host_pages >= 2
    rng = np.random.default_rng(1)
    leaves, treedef = jax.tree.flatten(runner.kv_pages)
    filled = [rng.integers(0, 100, leaf.shape).astype(leaf.dtype) for leaf in leaves]
    runner.kv_pages = jax.tree.unflatten(treedef, [jax.numpy.asarray(x) for x in filled])
    for host in jax.tree.leaves(host_kv.pages):
        host[:, :, :, 1] = rng.integers(100, 200, host[:, :, :, 1].shape).astype(host.dtype)
    incoming = [np.array(host[:, :, :, 1]) for host in jax.tree.leaves(host_kv.pages)]
    out = SchedulerOutput(seqs=[], num_new_tokens=[], copies=[], preempted=[], num_batched_tokens=0,
                          swap_out=[(5, 0)], swap_in=[(1, 5)])
    assert engine.step_runner.run(out, {}, None) is None  # nothing scheduled: only the transfers
    host_kv.swap_out([])  # lands the swap-out's copy in the host pages
    for before, host, device, want_in in zip(filled, jax.tree.leaves(host_kv.pages),
                                             jax.tree.leaves(runner.kv_pages), incoming):
        np.testing.assert_array_equal(host[:, :, :, 0], before[:, :, :, 5])
        np.testing.assert_array_equal(np.asarray(device)[:, :, :, 5], want_in)
