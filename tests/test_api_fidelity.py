"""vLLM's spellings and the weights accessor in the Python API (issue 30 items 5 and 6)."""

import logging
import math
import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from compile_watch import backend_compiles
from jaxpaged.config import EngineConfig
from jaxpaged.entrypoints.cli import build_parser
from jaxpaged import SamplingParams
from test_llm_inputs import IDS, tiny_llm


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
    from jaxpaged.sample.sampler import beam_candidates

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


# ------------------------------------------------------------------ code written for vLLM, run unchanged

def test_vllm_engine_arguments_are_renamed_accepted_or_refused_by_name(caplog):
    from jaxpaged.config import engine_args_from_vllm

    with caplog.at_level(logging.INFO, logger="jaxpaged"):
        args = engine_args_from_vllm("m", dict(block_size=8, gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 20,
                                               enforce_eager=True, trust_remote_code=True, enable_sleep_mode=True,
                                               dtype="auto", seed=None, tokenizer="m", max_logprobs=5, swap_space=4))
    assert args["page_size"] == 8 and args["kv_memory_fraction"] == 0.5 and args["kv_memory_bytes"] == 1 << 20
    assert args["dtype"] is None and isinstance(args["seed"], int) and args["max_logprobs"] == 5
    assert not {"enforce_eager", "trust_remote_code", "enable_sleep_mode", "tokenizer", "swap_space"} & set(args)
    logged = caplog.text
    assert "enforce_eager=True has no effect" in logged and "swap_space=4 has no effect" in logged
    EngineConfig(**args)  # all of it is a valid config
    assert engine_args_from_vllm(None, dict(swap_space=1, preemption_mode="swap"))["swap_space_bytes"] == 1 << 30
    with pytest.raises(ValueError, match="quantization='bitsandbytes': jaxpaged supports"):
        EngineConfig(**engine_args_from_vllm("m", dict(quantization="bitsandbytes")))
    EngineConfig(**engine_args_from_vllm("m", dict(quantization="awq")))  # vLLM's method names pass (tests/test_hf_quantized.py)
    for bad, match in ((dict(tokenizer="other/tok"), "tokenizer='other/tok'"),
                       (dict(block_size=8, page_size=8), "same setting"),
                       (dict(max_logprobs=50), "max_logprobs=50")):
        with pytest.raises(ValueError, match=match):
            engine_args_from_vllm("m", bad)


def test_max_logprobs_caps_requests():
    llm = tiny_llm(max_logprobs=2)
    assert len(llm.generate([IDS], SamplingParams(max_tokens=1, logprobs=2))[0].outputs[0].logprobs[0]) >= 2
    with pytest.raises(ValueError, match="max_logprobs=2"):
        llm.generate([IDS], SamplingParams(max_tokens=1, logprobs=3))
    with pytest.raises(ValueError, match="max_logprobs=2"):
        llm.generate([IDS], SamplingParams(max_tokens=1, prompt_logprobs=5))
    assert llm.stats()["num_used_pages"] == 0


def test_sampling_params_are_mutable_and_cloned_as_vllms_and_each_request_keeps_its_own():
    params = SamplingParams(temperature=0.0, max_tokens=2, seed=-1, logprobs=True)
    assert params.seed is None and params.logprobs == 1  # vLLM: -1 = no seed; True = 1
    clone = params.clone()
    clone.max_tokens = 4
    assert params.max_tokens == 2 and clone.max_tokens == 4
    llm = tiny_llm()
    assert len(llm.generate([IDS], clone)[0].outputs[0].token_ids) == 4
    clone.max_tokens = 0  # a change since construction is validated when the request is added
    with pytest.raises(ValueError, match="max_tokens=0"):
        llm.generate([IDS], clone)
    assert llm.stats()["num_used_pages"] == 0


def test_stop_reason_and_stop_token_text_end_to_end():
    llm = tiny_llm()
    free = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[2]
    first = free.token_ids.index(stop_id)
    out = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids == free.token_ids[: first + 1]
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(free.token_ids[:first])  # the stop token's text is left out, as vLLM
    kept = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop_id],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == tokenizer.decode(free.token_ids[: first + 1])
    assert free.stop_reason is None and free.finish_reason == "length"


def test_generation_config_eos_ids_stop_requests_as_vllm():
    llm = tiny_llm()
    free = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    end = free.token_ids[1]
    llm.engine.generation_eos_ids = (end,)  # what build_engine reads from generation_config.json
    out = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(end) + 1] and out.stop_reason == end
    ignored = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == free.token_ids


def test_generation_eos_ids_are_read_from_the_file():
    from jaxpaged.models.loading import generation_eos_ids

    assert generation_eos_ids({"eos_token_id": [2, 7, 7, 9]}, 2) == (7, 9)
    assert generation_eos_ids({"eos_token_id": 2}, 2) == () and generation_eos_ids({}, 2) == ()
    with pytest.raises(ValueError, match="eos_token_id"):
        generation_eos_ids({"eos_token_id": "x"}, 2)


def test_chat_takes_vllms_arguments_and_never_adds_a_second_bos():
    from tokenizers import processors

    llm = tiny_llm()
    tokenizer = llm.get_tokenizer()
    # A Llama-3-like tokenizer: encode() adds a BOS, and the template writes one too.
    tokenizer.backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    template = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}{% if tools %}T{{ tools | length }}{% endif %}" \
               "{% if enable_thinking %}<think>{% endif %}"
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    out = llm.chat(messages, greedy, chat_template=template, tools=[{"type": "function"}],
                   chat_template_kwargs={"enable_thinking": True})[0]
    text = "<|im_start|><user>Hi\nthere<assistant>T1<think>"
    assert out.prompt == text
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False) != tokenizer.encode(text)
    # continue_final_message: the last assistant message stays open (no generation prompt after it)
    open_turn = messages + [{"role": "assistant", "content": "The answer"}]
    out = llm.chat(open_turn, greedy, chat_template=template + "</end>", add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt == "<|im_start|><user>Hi\nthere<assistant>The answer"
    for kwargs, match in ((dict(continue_final_message=True), "add_generation_prompt=False"),
                          (dict(lora_request=object()), "lora_request"),
                          (dict(chat_template_content_format="openai"), "chat_template_content_format")):
        with pytest.raises(ValueError, match=match):
            llm.chat(open_turn, greedy, **kwargs)
    with pytest.raises(ValueError, match="content part of type 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], greedy)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([IDS], greedy, priority=[3])
    assert len(llm.generate([IDS], greedy, priority=[0], lora_request=None)) == 1
    assert llm.stats()["num_used_pages"] == 0


def test_logit_bias_takes_any_float_and_minus_inf_bans_empty_generate_and_a_tqdm_factory():
    llm = tiny_llm()
    free = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    banned = {t: -math.inf for t in free.token_ids}
    out = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias=banned))
    assert not set(out[0].outputs[0].token_ids) & set(free.token_ids)
    forced = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logit_bias={7: 1e9})
    assert llm.generate([IDS], forced)[0].outputs[0].token_ids == [7, 7]
    for bad in (math.inf, math.nan, True):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias={3: bad})
    assert llm.generate([]) == []
    made = []

    def factory(*args, **kwargs):  # vLLM's use_tqdm callable: called with tqdm's arguments
        from tqdm import tqdm
        made.append(kwargs)
        return tqdm(*args, **{**kwargs, "disable": True})

    llm.generate([IDS], forced, use_tqdm=factory)
    assert len(made) == 1


def test_beam_search_answers_vllms_sequences_view_and_refuses_what_it_does_not_do():
    from jaxpaged import BeamSearchParams

    llm = tiny_llm()
    (out,) = llm.beam_search([IDS], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    tokenizer = llm.get_tokenizer()
    assert len(out.sequences) == len(out.beams) == 2
    for seq, beam in zip(out.sequences, out.beams):
        assert seq.tokens == IDS + beam.token_ids and seq.text == tokenizer.decode(seq.tokens)
        assert seq.cum_logprob == beam.cumulative_logprob and seq.finish_reason == beam.finish_reason
    for kwargs, match in ((dict(temperature=0.7), "temperature"), (dict(include_stop_str_in_output=True),
                                                                   "include_stop_str_in_output")):
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(beam_width=2, **kwargs)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([IDS], BeamSearchParams(beam_width=2), concurrency_limit=1)


def test_data_parallel_stats_sum_token_counters_and_recompute_ratios():
    import tp_fixtures
    from jaxpaged import LLM
    from jaxpaged.engine.data_parallel import DataParallelEngine

    params = tp_fixtures.tiny_params()
    engine = DataParallelEngine([tp_fixtures.make_engine(params, warmup=False) for _ in range(2)])
    LLM.from_engine(engine).generate(tp_fixtures.prompts()[:4], SamplingParams(max_tokens=2, ignore_eos=True))
    stats = engine.stats()
    replicas = stats["replicas"]
    assert all(r["prefix_query_tokens"] > 0 for r in replicas)
    for key in ("prefix_query_tokens", "prefix_hit_tokens", "swap_bytes_out", "num_generated_tokens"):
        assert stats[key] == sum(r[key] for r in replicas), key
    assert stats["prefix_hit_rate"] == stats["prefix_hit_tokens"] / stats["prefix_query_tokens"]


def test_chat_template_kwargs_may_not_set_reserved_names_and_a_trimmed_final_message_continues():
    llm = tiny_llm()
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    for reserved in ("tokenize", "chat_template", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"may not set.*{reserved}"):
            llm.chat([{"role": "user", "content": "Hi"}], greedy, chat_template_kwargs={reserved: True})
    trims = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
    out = llm.chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}], greedy,
                   chat_template=trims, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == "<user>Hi</s><assistant>Sure,"  # HF's fallback: the stripped content


def test_eos_in_stop_token_ids_has_no_stop_reason_as_vllm():
    llm = tiny_llm()
    free = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    llm.engine.tokenizer.eos_token_id, eos = free.token_ids[1], llm.engine.tokenizer.eos_token_id
    try:
        out = llm.generate([IDS], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[free.token_ids[1]]))
    finally:
        llm.engine.tokenizer.eos_token_id = eos
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None and len(c.token_ids) == free.token_ids.index(
        free.token_ids[1]) + 1
