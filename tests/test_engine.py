"""The engine on the real bundled SmolLM2-135M-Instruct: token-for-token equal to Hugging Face.

The oracle is transformers' own model (torch, float32, CPU) loaded from the same GGUF file, run
one prompt at a time with plain greedy decoding. jaxpaged runs all prompts in one batch, and then
again under configurations that change the schedule but must not change a single token: a KV pool
small enough to force preemptions, prefix caching on and off, a token budget that forces chunked
prefill, and max_num_seqs 1 versus many.
"""

import os

import numpy as np
import pytest

from compile_watch import backend_compiles
from jaxpaged import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish and German.",
    "List three prime numbers greater than 50.",
    "Why is the sky blue?",
    "Give me a name for a pet turtle.",
    "What does HTTP stand for?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "How many legs does a spider have?",
    "Écris une phrase sur Paris. 🙂",
]
NUM_NEW_TOKENS = 48
# A small engine so that each configuration compiles few buckets on 2 CPU cores.
SMALL = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)


def _chat_ids(llm, question):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def assert_no_leak(llm):
    stats = llm.stats()
    assert stats["num_used_pages"] == 0, f"pages leaked: {stats}"
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


@pytest.fixture(scope="module")
def prompts(llm):
    return [_chat_ids(llm, q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_model():
    """transformers' SmolLM2 from the bundled GGUF, float32."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.loading import default_model_path

    torch.set_num_threads(1)  # OpenMP spinning on shared cores makes small decode steps crawl
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_greedy(prompts, hf_model):
    """Hugging Face's greedy continuation of every prompt, one prompt at a time."""
    import torch

    model = hf_model
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            # Plain greedy decoding with HF's own KV cache, never stopping at eos (as ignore_eos).
            out = model(torch.tensor([ids]), use_cache=True)
            tokens = []
            for _ in range(NUM_NEW_TOKENS):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            outputs.append(tokens)
    return outputs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def _greedy_tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_greedy_batch_equals_hugging_face(llm, prompts, hf_greedy):
    with backend_compiles() as compiled:  # every executable built, traced or not
        got = _greedy_tokens(llm, prompts)
    assert compiled == [], f"compiled after warm-up: {compiled}"
    for i, (g, want) in enumerate(zip(got, hf_greedy)):
        assert g == want, f"prompt {i} ({QUESTIONS[i]!r}) diverges at token {next(j for j, (a, b) in enumerate(zip(g, want)) if a != b)}"
    assert llm.stats()["num_compiles"] == llm.engine.runner.num_step_programs, "a step compiled after warm-up"
    # jit also compiles again, without tracing, for an input placed differently from warm-up's (the
    # sampler's committed tokens fed back to the next step): its cache holds one program per bucket.
    assert llm.engine.runner._step._cache_size() == llm.engine.runner.num_step_programs, "a step compiled again"
    assert_no_leak(llm)


def test_chat_answer_mentions_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=20))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    assert_no_leak(llm)


def test_min_tokens_masks_eos_like_hugging_face(llm, prompts, hf_model):
    """The issue's prompt: greedy SmolLM2 emits eos after a few tokens; with min_tokens=20 eos is
    masked until 20 tokens exist (HF's min_new_tokens), after which eos may stop the request."""
    import torch

    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20)
    got = llm.generate([prompts[0]], params)[0].outputs[0]
    with torch.no_grad():
        want = hf_model.generate(
            torch.tensor([prompts[0]]), do_sample=False, min_new_tokens=20, max_new_tokens=40,
            eos_token_id=eos, pad_token_id=eos, temperature=None, top_p=None, top_k=None,
        )[0, len(prompts[0]):].tolist()
    free = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert len(free.token_ids) < 20, "without min_tokens this prompt must stop at eos early"
    assert eos not in got.token_ids[:20]
    assert got.token_ids == want
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "name,engine_args",
    [
        ("preemption", dict(num_pages=14)),  # 13 usable pages of 16 tokens; 6 sequences need ~4-5 each
        ("no-prefix-caching", dict(enable_prefix_caching=False)),
        ("chunked-prefill", dict(max_num_batched_tokens=32, max_num_seqs=16)),
        ("one-seq-at-a-time", dict(max_num_seqs=1, max_num_batched_tokens=64)),
    ],
)
def test_schedule_does_not_change_greedy_tokens(name, engine_args, prompts, hf_greedy):
    llm = LLM(**{**SMALL, **engine_args})
    # Half the prompts, 24 tokens: enough to exercise each schedule on 2 cores.
    some = prompts[:6]
    got = _greedy_tokens(llm, some, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert got == [h[:24] for h in hf_greedy[:6]]
    stats = llm.stats()
    if name == "preemption":
        assert stats["num_preemptions"] > 0
    if name == "chunked-prefill":
        assert all(len(p) > 32 for p in some), "prompts must be longer than the token budget"
    assert_no_leak(llm)


def test_prefix_caching_hits_and_keeps_tokens(llm, prompts, hf_greedy):
    """Prompts sharing a long prefix: hits happen, and outputs equal a run with caching off."""
    long_prefix = llm.tokenizer.encode("You are a careful assistant. " * 12, add_special_tokens=False)
    shared = [long_prefix + p for p in prompts[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = llm.stats()["prefix_hit_tokens"]
    with_cache = _greedy_tokens(llm, shared, params)
    again = _greedy_tokens(llm, shared, params)  # every full page of every prompt is cached now
    hits = llm.stats()["prefix_hit_tokens"] - before
    assert hits >= len(long_prefix) // 16 * 16 * 3, f"too few prefix hits: {hits}"
    no_cache = LLM(**SMALL, enable_prefix_caching=False)
    assert with_cache == again == _greedy_tokens(no_cache, shared, params)
    assert no_cache.stats()["prefix_hit_tokens"] == 0
    assert_no_leak(llm)


def test_seeded_request_is_batch_independent(llm, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, seed=i) for i in range(8)]
    batch = llm.generate(prompts[1:9] + [prompts[0]], others + [params])
    assert batch[-1].outputs[0].token_ids == alone
    assert_no_leak(llm)


def test_n_samples_share_prompt_pages_and_differ(llm, prompts):
    params = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    cow_before = llm.stats()["num_cow_copies"]  # (under async stepping the first copies precede `first`)
    stream = llm.stream([prompts[1]], params)
    first = next(stream)
    assert len(first.outputs) == 4
    request = next(iter(engine.processor.requests.values()))
    tables = [list(seq.block_table) for seq in request.seqs]
    num_full_prompt_pages = len(prompts[1]) // llm.config.page_size
    assert num_full_prompt_pages >= 2
    shared = tables[0][:num_full_prompt_pages]
    assert all(t[:num_full_prompt_pages] == shared for t in tables), "samples must share the prompt's pages"
    assert all(engine.block_manager.ref_counts[p] == 4 for p in shared)
    final = None
    for final in stream:
        pass
    samples = [c.token_ids for c in final.outputs] if final.finished else None
    assert samples is not None and all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) > 1, "4 samples at temperature 1 should not all be equal"
    if len(prompts[1]) % llm.config.page_size:  # the prompt's last page is partial and shared
        assert llm.stats()["num_cow_copies"] > cow_before
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "make_call,match",
    [
        (lambda llm: llm.generate([""]), "empty"),
        (lambda llm: llm.generate([[]]), "empty"),
        (lambda llm: llm.generate([[1] * 600]), "max_model_len"),
        (lambda llm: llm.generate([[1, 2, 10**7]]), "vocabulary"),
        (lambda llm: llm.generate(["hi"], SamplingParams(temperature=-1.0)), "temperature"),
        (lambda llm: llm.generate(["hi"], SamplingParams(top_p=0.0)), "top_p"),
        (lambda llm: llm.generate(["hi"], SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate(["hi"], SamplingParams(n=0)), "n="),
        (lambda llm: llm.generate(["fine", ""], SamplingParams(max_tokens=2)), "empty"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(llm, make_call, match):
    with pytest.raises(ValueError, match=match):
        make_call(llm)
    assert_no_leak(llm)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert_no_leak(llm)


def test_unknown_model_path_is_a_clear_error():
    with pytest.raises((ValueError, FileNotFoundError), match="does-not-exist"):
        LLM("/nonexistent/does-not-exist")


def test_stop_string_and_logprobs(llm, prompts):
    free = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0]
    assert len(free.text) > 4
    stop = free.text[2:5]
    cut = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=20, stop=stop, logprobs=True))
    out = cut[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    assert len(out.logprobs) == len(out.token_ids)
    assert all(d[t].logprob <= 0.0 for d, t in zip(out.logprobs, out.token_ids))
    assert_no_leak(llm)


def test_update_params_changes_outputs_without_recompiling(llm, prompts):
    import jax

    params = llm.params
    compiles = llm.stats()["num_compiles"]
    base = _greedy_tokens(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    # The default model's engine keeps its GGUF codes (quantization None on a .gguf): halving every float
    # matrix (the codes' scales and mins among them, so each weight they code) halves the weights.
    scaled = jax.tree.map(lambda x: x * 0.5 if x.ndim >= 2 and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
                          else x, params)
    llm.update_params(scaled)
    try:
        with backend_compiles() as compiled:
            changed = _greedy_tokens(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert changed != base and compiled == [], compiled
        assert llm.stats()["num_compiles"] == compiles
    finally:
        llm.update_params(params)
    assert _greedy_tokens(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) == base
    assert_no_leak(llm)


@pytest.mark.slow
def test_synchronous_stepping_gives_the_same_outputs(llm, prompts, hf_greedy):
    """`async_scheduling=False` (the debugging and benchmark mode): HF's greedy tokens, and for
    seeded sampling with n > 1, stop strings and logprobs exactly the asynchronous engine's outputs."""
    sync_llm = LLM(**SMALL, async_scheduling=False)
    assert llm.config.async_scheduling and not sync_llm.config.async_scheduling
    assert _greedy_tokens(sync_llm, prompts) == hf_greedy
    free = sync_llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0].text
    params = [
        SamplingParams(temperature=0.9, top_k=40, seed=3, n=3, max_tokens=12, logprobs=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop=free[3:7]),
    ]
    want = sync_llm.generate([prompts[1], prompts[0]], params)
    got = llm.generate([prompts[1], prompts[0]], params)
    for w, g in zip(want, got):
        assert [(c.token_ids, c.text, c.finish_reason) for c in g.outputs] == [
            (c.token_ids, c.text, c.finish_reason) for c in w.outputs]
        for wc, gc in zip(w.outputs, g.outputs):
            if wc.logprobs is not None:
                np.testing.assert_allclose([d[t].logprob for d, t in zip(gc.logprobs, gc.token_ids)], [d[t].logprob for d, t in zip(wc.logprobs, wc.token_ids)], atol=1e-4)  # batches differ: float sums too
    assert got[1].outputs[0].finish_reason == "stop"
    assert_no_leak(sync_llm)
    assert_no_leak(llm)
