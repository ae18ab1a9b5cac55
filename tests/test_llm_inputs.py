"""What a JAX user passes to `LLM`: arrays of token ids, vLLM-style None, wrong types.

The engine is a tiny random model with the bundled SmolLM2 tokenizer (so text prompts and the
chat template are real); nothing here checks what the model says, only what the API accepts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.config import EngineConfig
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import init_params
from jaxpaged.models.loading import default_model_path
from jaxpaged.models.tokenizer import Tokenizer

VOCAB_SIZE = 49152  # SmolLM2's vocabulary


def tiny_llm(**engine_args) -> LLM:
    """An `LLM` over a tiny random model (no weight loading, no warm-up)."""
    tokenizer = Tokenizer.from_gguf(default_model_path())
    model_config = ModelConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
    )
    config = EngineConfig(
        **{**dict(page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                  warmup=False), **engine_args}
    ).resolved(on_gpu=False, model_max_len=model_config.max_position_embeddings)
    return LLM.from_engine(LLMEngine(
        model_config, init_params(model_config, jax.random.key(0)), tokenizer, config,
        num_pages=config.num_pages, attention_fn=reference_paged_attention,
    ))


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
IDS = [504, 3575, 282]
IDS2 = [504, 3575, 17]


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_numpy_and_jax_token_arrays_are_prompts(llm):
    want = _tokens(llm.generate([IDS, IDS2], GREEDY))
    assert len(want) == 2 and all(len(t) == 3 for t in want)
    for one in (np.array(IDS), np.array(IDS, dtype=np.int32), jnp.array(IDS)):
        outs = llm.generate(one, GREEDY)
        assert len(outs) == 1 and outs[0].prompt_token_ids == IDS and _tokens(outs) == want[:1]
    for batch in (np.array([IDS, IDS2]), jnp.array([IDS, IDS2]), [jnp.array(IDS), np.array(IDS2)],
                  [list(map(np.int64, IDS)), IDS2]):
        outs = llm.generate(batch, GREEDY)
        assert [o.prompt_token_ids for o in outs] == [IDS, IDS2] and _tokens(outs) == want
    assert all(type(t) is int for t in llm.generate(jnp.array(IDS), GREEDY)[0].prompt_token_ids)
    assert llm.stats()["num_used_pages"] == 0


def test_vllm_prompt_dicts_are_prompts(llm):
    """vLLM's TokensPrompt / TextPrompt dicts give what the plain ids / text give, one or a list."""
    want = _tokens(llm.generate([IDS, IDS2], GREEDY))
    outs = llm.generate([{"prompt_token_ids": IDS}, {"prompt_token_ids": np.array(IDS2)}], GREEDY)
    assert [o.prompt_token_ids for o in outs] == [IDS, IDS2] and _tokens(outs) == want
    single = llm.generate({"prompt_token_ids": IDS, "prompt": "kept as the text"}, GREEDY)
    assert len(single) == 1 and _tokens(single) == want[:1] and single[0].prompt == "kept as the text"
    text = llm.generate({"prompt": "Hello there"}, GREEDY)[0]
    assert text.prompt == "Hello there" and text.prompt_token_ids == llm.generate("Hello there", GREEDY)[0].prompt_token_ids
    assert llm.stats()["num_used_pages"] == 0


@pytest.mark.parametrize(
    "prompts,match",
    [
        ({"prompt_token_ids": IDS, "multi_modal_data": {}}, "'multi_modal_data', which LLM.generate does not take"),
        ([{"prompt": "hi"}, {"cache_salt": "a", "prompt": "x"}], "prompt 1 has 'cache_salt'"),
        ({"prompt": IDS}, "'prompt' is a list; it must be text"),
        ({}, "without 'prompt' or 'prompt_token_ids'"),
        ({"prompt_token_ids": [1.5]}, "token ids must be ints"),
        (b"hello", "bytes; decode it"),
        ([b"hello"], "bytes; decode it"),
        (None, "prompts is None"),
        (np.array([1.0, 2.0]), "dtype float64"),
        (jnp.zeros((1, 2, 3), jnp.int32), "1-D .* or 2-D"),
        ([[1, 2.5]], "token ids must be ints"),
        ([[True, 3]], "token ids must be ints"),
        ("a \ud83d b", "lone surrogate"),
        (["fine", "bad \udc00"], "prompt 1 is not valid Unicode"),
    ],
    ids=["dict-multimodal", "dict-salt", "dict-ids-as-text", "dict-empty", "dict-float-id", "bytes", "list-of-bytes", "None", "float-array", "3-D", "float-id", "bool-id", "surrogate", "surrogate-2nd"],
)
def test_bad_prompts_are_clear_value_errors(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued


def test_chat_message_without_content_names_the_message(llm):
    with pytest.raises(ValueError, match=r"chat message 1 \(\{'role': 'user'\}\) needs a 'role' and a 'content'"):
        llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user"}], GREEDY)
    with pytest.raises(ValueError, match="needs a 'role'"):
        llm.chat([{"content": "hi"}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_none_means_the_default():
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == () and params.stop_token_ids == ()
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_max_tokens_none_runs_to_max_model_len(llm):
    # vLLM's meaning: no limit but the context. 3 prompt tokens + 61 outputs = max_model_len 64.
    out = llm.generate(IDS, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 64 - len(IDS) and out.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs",
    [dict(top_k=1.5), dict(top_k=True), dict(n=2.0), dict(n=True), dict(max_tokens=8.0), dict(min_tokens=1.0),
     dict(stop=5), dict(stop_token_ids=7)],
)
def test_sampling_params_reject_non_int_counts(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_the_parallel_compile_pass_leaves_warm_up_nothing_to_compile():
    """Engine.warmup first compiles every step and sampler program on threads (compile_in_parallel),
    then runs each warm-up call in order: those calls must find every program compiled (the same
    cache entries), or the parallel pass only added work."""
    from compile_watch import backend_compiles
    from jaxpaged.device.runner import compile_in_parallel

    engine = tiny_llm(enable_prefix_caching=True).engine
    jobs = engine.runner.compile_jobs() + engine.step_runner.sampler.warmup_jobs(engine.config.max_num_seqs)
    with backend_compiles() as parallel:
        compile_in_parallel(jobs, num_threads=4)
    assert parallel.count("jit(_step_fn)") == engine.runner.num_step_programs, parallel
    assert {"jit(sample_ext)", "jit(sample_padded)", "jit(init_slot)", "jit(_copy_fn)"} <= set(parallel), parallel
    with backend_compiles() as serial:
        engine.runner.warmup()
        engine.step_runner.sampler.warmup(engine.config.max_num_seqs)
    assert serial == [], f"warm-up compiled after the parallel pass: {serial}"


def test_compile_in_parallel_raises_a_jobs_error():
    from jaxpaged.device.runner import compile_in_parallel

    def bad():
        raise ValueError("job 2 failed")

    with pytest.raises(ValueError, match="job 2 failed"):
        compile_in_parallel([lambda: None, bad, lambda: None], num_threads=2)


def test_the_persistent_compilation_cache_keeps_every_program():
    """JAX keeps only programs that took >= 1 s to compile; most of a small model's took less, so a
    warm start compiled them again. Building an engine turns the threshold down to 0."""
    tiny_llm()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0


def test_n_fan_out_over_fewer_logits_rows_compiles_nothing_after_warm_up():
    """A cached prompt with n=2 or 3 samples 2-4 rows from one logits row: warm-up covers that shape
    (the logits are padded to the sample rows), so nothing compiles (it compiled `sample_padded`)."""
    from jaxpaged.baseline.measure import CompileCounter

    llm = tiny_llm(warmup=True, enable_prefix_caching=True)
    prompt = list(range(100, 117))
    llm.generate(prompt, GREEDY)
    for n in (2, 3, 4):
        with CompileCounter() as compiles:
            outs = llm.generate(prompt, SamplingParams(n=n, temperature=1.0, max_tokens=3, seed=1))
        assert len(outs[0].outputs) == n and compiles.count == 0, (n, compiles.count)
    assert llm.stats()["num_used_pages"] == 0
