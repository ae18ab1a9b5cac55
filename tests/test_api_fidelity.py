"""vLLM's spellings and the weights accessor in the Python API (issue 30 items 5 and 6)."""

import logging
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from compile_watch import backend_compiles
from jaxpaged.config import EngineConfig
from jaxpaged.entrypoints.cli import build_parser
from jaxpaged import SamplingParams
from test_llm_inputs import tiny_llm


# ------------------------------------------------------------------ item 5: vLLM's names and defaults

def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_vllm_fp8_names_are_aliases_of_float8_e4m3fn():
    for name in ("fp8", "fp8_e4m3"):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == "float8_e4m3fn"
        assert build_parser().parse_args(["--kv-cache-dtype", name]).kv_cache_dtype == name  # the CLI takes them
    llm = tiny_llm(kv_cache_dtype="fp8")
    assert llm.config.kv_cache_dtype == "float8_e4m3fn"
    # float8 pages: per (layer, K/V, KV head, token) 8 one-byte values and a float32 scale
    assert llm.engine.kv_bytes_per_page == 2 * 2 * 2 * 4 * (8 + 4)


def test_unsupported_vllm_kv_dtype_is_refused_with_the_names_that_work():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_e5m2'.*'int8', 'float8_e4m3fn'.*'fp8', 'fp8_e4m3'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_swap_without_swap_space_takes_vllms_4_gib_bounded_by_host_memory(caplog):
    with caplog.at_level(logging.INFO, logger="jaxpaged"):
        config = EngineConfig(preemption_mode="swap")
    want = min(4 << 30, int(0.4 * host_memory_bytes()))  # vLLM's 4 GiB, bounded by host memory
    assert config.swap_space_bytes == want > 0
    assert any(f"swap_space_bytes={want}" in r.getMessage() for r in caplog.records)  # logged
    assert EngineConfig(preemption_mode="swap", swap_space_bytes=1 << 20).swap_space_bytes == 1 << 20
    with pytest.raises(ValueError, match=r"more than 70% of this host's"):
        EngineConfig(preemption_mode="swap", swap_space_bytes=host_memory_bytes())


# ------------------------------------------------------------------ item 6: llm.params and its dtype

def test_params_of_another_dtype_are_cast_with_a_warning():
    llm = tiny_llm()
    params = llm.params  # the accessor the README documents
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the engine's own dtype: silent
        llm.update_params(params)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.warns(UserWarning, match=r"params are not in the engine's dtype float32 .*bfloat16.*dtype='bfloat16'"):
        llm.update_params(bf16)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(llm.params))  # cast, as the warning says
    with pytest.raises(ValueError, match="must be floating point"):
        llm.update_params(jax.tree.map(lambda x: x.astype(jnp.int32), params))


# ------------------------------------------------------------------ item 12: beam search after warm-up

def test_beam_search_compiles_nothing_after_warm_up():
    """At b8feddf the beam top-k compiled at the first beam step of each width (~seconds under load,
    inside a request). Warm-up now compiles it for every step's row count at one width."""
    from jaxpaged import BeamSearchParams
    from jaxpaged.device.sampler import beam_candidates

    llm = tiny_llm(warmup=True)
    compiled_steps, compiled_top_k = llm.stats()["num_compiles"], beam_candidates._cache_size()
    with backend_compiles() as compiled:  # every executable built, traced or not
        for width in (2, 3):
            beams = llm.beam_search("Hello there", BeamSearchParams(width, max_tokens=4))[0].beams
            assert len(beams) == width
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert beam_candidates._cache_size() == compiled_top_k, "the beam top-k compiled after warm-up"
    assert llm.stats()["num_compiles"] == compiled_steps


# ------------------------------------------------------------------ vLLM's LLM methods a port calls

def test_get_tokenizer_and_default_sampling_params_are_vllms():
    llm = tiny_llm()
    assert llm.get_tokenizer() is llm.tokenizer
    default = llm.get_default_sampling_params()
    # vLLM's defaults: temperature 1, top_p 1, top_k off, 16 tokens
    assert (default.temperature, default.top_p, default.max_tokens) == (1.0, 1.0, 16) and default.top_k in (0, -1)
    out = llm.generate([[1, 2, 3, 4, 5]])[0].outputs[0]  # no params: those defaults
    assert (out.finish_reason, len(out.token_ids)) == ("length", 16)


def test_reset_prefix_cache_forgets_pages_and_can_recompute_running_requests():
    llm = tiny_llm(enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = list(range(1, 18))  # 4 full pages of 4 tokens
    want = llm.generate([prompt], greedy)[0]
    assert llm.generate([prompt], greedy)[0].num_cached_tokens == 16  # served from the cache
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], greedy)[0].num_cached_tokens == 0  # forgotten
    # with reset_running_requests, a request in flight gives up its K/V and is recomputed: same tokens
    recomputed0 = llm.stats()["num_recomputed_tokens"]
    stream = llm.stream([prompt], greedy)
    got = [next(stream)]  # the first token is out; the request is running
    hits0 = llm.stats()["prefix_hit_tokens"]
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    got += list(stream)
    assert llm.stats()["num_recomputed_tokens"] > recomputed0
    assert llm.stats()["prefix_hit_tokens"] == hits0  # recomputed from its tokens, not found in the cache
    assert got[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert llm.stats()["num_used_pages"] == 0  # nothing leaked
    with pytest.raises(ValueError, match="reset_running_requests='yes'; pass True or False"):
        llm.reset_prefix_cache(reset_running_requests="yes")
    with pytest.raises(ValueError, match="reset_connector=1; pass True or False"):
        llm.reset_prefix_cache(reset_connector=1)


def test_chat_template_tokenize_gives_the_ids_hf_and_vllm_callers_expect():
    tokenizer = tiny_llm().get_tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False) and tokenizer.decode(ids, False) == text


def test_reset_running_requests_with_beams_on_any_replica_changes_no_replica():
    """The data-parallel engine resets every replica or none: a beam search on the second replica
    refuses the reset before the first replica's running requests lose their K/V."""
    from jaxpaged.engine import weights

    busy, searching = tiny_llm(enable_prefix_caching=True).engine, tiny_llm().engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    busy.add_request(list(range(1, 10)), greedy, request_id="r0")
    busy.step()  # the prompt is computed: the request is running with its K/V
    computed = [seq.num_computed_tokens for seq in busy.scheduler.running]
    searching.beams = ["a beam search"]  # any beam search makes the engine refuse
    with pytest.raises(ValueError, match="reset_running_requests=True with beam searches running"):
        weights.reset_prefix_cache([busy, searching], reset_running_requests=True)
    assert [seq.num_computed_tokens for seq in busy.scheduler.running] == computed and computed[0] > 0
    searching.beams = []
    assert weights.reset_prefix_cache([busy, searching], reset_running_requests=True) is True
    assert not busy.scheduler.running and busy.scheduler.waiting[0].num_computed_tokens == 0
