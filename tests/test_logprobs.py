"""Logprobs, prompt logprobs, logprobs_mode, penalties and logit bias against Hugging Face float32.

One tiny random Llama checkpoint (tests/tiny_checkpoint.py) is loaded both by `LLM` (as a user
would) and by transformers (the oracle); prompts go through its chat template. Prompts are longer
than max_num_batched_tokens=16, so every prompt is prefilled in chunks.
"""

import numpy as np
import pytest
from tiny_checkpoint import write_tiny_checkpoint

from jaxpaged import LLM, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ENGINE = dict(page_size=4, num_pages=96, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, warmup=False)
QUESTIONS = ["Name a color.", "What is two plus two?", "Say hi"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **ENGINE)


@pytest.fixture(scope="module")
def llm_processed(ckpt):
    return LLM(ckpt, logprobs_mode="processed_logprobs", **ENGINE)


def chat_ids(llm, question):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text)


def hf_logits(hf, token_ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([list(token_ids)])).logits[0].double().numpy()  # row i predicts token i + 1


def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def top_by_rank(entry, k):
    """(ids, logprobs) of an entry's top k, in rank order."""
    items = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
    return [t for _, t, _ in items], np.array([lp for _, _, lp in items])


def chosen(c):
    return np.array([entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)])


def test_top20_logprobs_equal_hf_log_softmax_greedy_and_seeded(llm, hf):
    prompts = [chat_ids(llm, q) for q in QUESTIONS[:2]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=20, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=20, ignore_eos=True)]
    outs = llm.generate([p for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        want = log_softmax(hf_logits(hf, prompt + c.token_ids))[len(prompt) - 1 : -1]
        assert len(c.logprobs) == len(c.token_ids) == 6
        for i, (entry, token) in enumerate(zip(c.logprobs, c.token_ids)):
            assert next(iter(entry)) == token, "the chosen token comes first"
            ids, values = top_by_rank(entry, 20)
            assert ids == np.argsort(-want[i], kind="stable")[:20].tolist(), f"token {i}: top-20 order"
            np.testing.assert_allclose(values, want[i][ids], atol=1e-5)
            assert entry[token].logprob == pytest.approx(want[i][token], abs=1e-5)
            assert entry[token].rank == 1 + int(np.sum(want[i] > want[i][token] + 1e-6))
            assert entry[token].decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)  # as vLLM
        assert c.cumulative_logprob == pytest.approx(float(chosen(c).sum()), abs=1e-6)
    assert outs[1].outputs[0].token_ids != outs[0].outputs[0].token_ids  # the seeded row really sampled


def processed_reference(logits, temperature, top_k, top_p):
    """log_softmax of HF logits / temperature, -inf outside top-k then top-p (the sampler's docstring)."""
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(x.shape, bool)
    keep[order[:top_k]] = True
    probs = np.exp(log_softmax(np.where(keep, x, -np.inf)))
    sorted_p = probs[order]
    mass_before = np.cumsum(sorted_p) - sorted_p
    keep_p = np.zeros(x.shape, bool)
    keep_p[order[(mass_before < top_p) | (np.arange(len(x)) == 0)]] = True
    return log_softmax(np.where(keep & keep_p, x, -np.inf))


def test_processed_logprobs_are_the_distribution_sampled_from(llm_processed, hf):
    prompt = chat_ids(llm_processed, QUESTIONS[2])
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.8, seed=3, max_tokens=5, logprobs=20, ignore_eos=True)
    c = llm_processed.generate(prompt, params)[0].outputs[0]
    logits = hf_logits(hf, prompt + c.token_ids)[len(prompt) - 1 : -1]
    for i, (entry, token) in enumerate(zip(c.logprobs, c.token_ids)):
        want = processed_reference(logits[i], 0.7, 8, 0.8)
        kept = np.flatnonzero(np.isfinite(want))
        assert 1 <= len(kept) <= 8
        ids, values = top_by_rank(entry, 20)
        assert ids[: len(kept)] == sorted(kept.tolist(), key=lambda t: -want[t])
        np.testing.assert_allclose(values[: len(kept)], want[ids[: len(kept)]], atol=1e-5)
        assert np.all(np.isneginf(values[len(kept) :]))
        assert token in kept and entry[token].logprob == pytest.approx(want[token], abs=1e-5)


def test_prompt_logprobs_equal_hf_teacher_forced_chunked_and_behind_a_cached_prefix(llm, hf):
    prompt = chat_ids(llm, "Tell me something long about the sea and its many waves.")
    assert len(prompt) > 3 * ENGINE["max_num_batched_tokens"]  # prefilled in several chunks
    want = log_softmax(hf_logits(hf, prompt))
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))  # caches its pages
    warm = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert warm.num_cached_tokens > 0 and warm.prompt_logprobs is None
    for k in (0, 5):
        out = llm.generate(prompt,
                           SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k))[0]
        assert out.num_cached_tokens == 0, "a request with prompt_logprobs recomputes its cached prefix"
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            entry, token = out.prompt_logprobs[position], prompt[position]
            row = want[position - 1]
            assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
            assert entry[token].rank == 1 + int(np.sum(row > row[token] + 1e-6))
            ids, values = top_by_rank(entry, k)
            assert ids == np.argsort(-row, kind="stable")[:k].tolist()
            np.testing.assert_allclose(values, row[ids], atol=1e-4)
            assert len(entry) in (k, k + 1)


def greedy_reference(hf, prompt, steps, process):
    """HF greedy decoding with `process(input_ids, logits) -> logits` applied at every step."""
    tokens = []
    for _ in range(steps):
        logits = torch.tensor(hf_logits(hf, prompt + tokens)[-1:])
        logits = process(torch.tensor([prompt + tokens]), logits)
        tokens.append(int(torch.argmax(logits[0])))
    return tokens


def test_repetition_penalty_equals_hf_logits_processor(llm, hf):
    prompt = chat_ids(llm, QUESTIONS[0])
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                                      ignore_eos=True))[0].outputs[0].token_ids
    assert len(set(plain)) < len(plain) or set(plain) & set(prompt), "the test needs repeated tokens"
    for penalty in (1.8, 0.7):
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        want = greedy_reference(hf, prompt, 12, lambda ids, x: processor(ids, x.float()).double())
        got = llm.generate(prompt, SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=penalty))[0].outputs[0].token_ids
        assert got == want, f"repetition_penalty={penalty}"
    assert got != plain


def penalized(logits, prompt, tokens, presence, frequency, bias):
    counts = np.bincount(np.array(tokens, int), minlength=logits.shape[-1]) if tokens else np.zeros(logits.shape[-1])
    x = logits.copy()
    for t, b in bias.items():
        x[t] += b
    return x - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize("presence, frequency, bias", [(1.5, 0.0, {}), (0.0, 0.9, {}), (0.5, 0.5, {65: 4.0, 66: -50})])
def test_presence_frequency_and_logit_bias_equal_a_plain_reference(llm_processed, hf, presence, frequency, bias):
    prompt = chat_ids(llm_processed, QUESTIONS[1])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency, logit_bias=bias, logprobs=3)
    c = llm_processed.generate(prompt, params)[0].outputs[0]
    tokens = []
    for step in range(10):
        x = penalized(hf_logits(hf, prompt + tokens)[-1], prompt, tokens, presence, frequency, bias)
        tokens.append(int(np.argmax(x)))
        # processed logprobs: the penalized distribution (greedy rows: no temperature)
        assert c.logprobs[step][c.token_ids[step]].logprob == pytest.approx(log_softmax(x)[tokens[-1]], abs=1e-4)
    assert c.token_ids == tokens


def test_seeded_sampling_with_penalties_reports_the_penalized_distribution(llm_processed, hf):
    prompt = chat_ids(llm_processed, QUESTIONS[2])
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, frequency_penalty=1.0,
                            allowed_token_ids=list(range(60, 120)), logprobs=1, n=2)
    for c in llm_processed.generate(prompt, params)[0].outputs:
        assert all(60 <= t < 120 for t in c.token_ids)
        for step, token in enumerate(c.token_ids):
            x = penalized(hf_logits(hf, prompt + c.token_ids[:step])[-1], prompt, c.token_ids[:step], 0.0, 1.0, {})
            x = np.where((np.arange(len(x)) >= 60) & (np.arange(len(x)) < 120), x / 0.8, -np.inf)
            assert c.logprobs[step][token].logprob == pytest.approx(log_softmax(x)[token], abs=1e-4)


def test_bad_values_are_value_errors_and_the_engine_keeps_serving(llm):
    for kwargs in (dict(logprobs=21), dict(prompt_logprobs=-1), dict(repetition_penalty=0.0),
                   dict(presence_penalty=3.0), dict(logit_bias={"a": 1.0}), dict(allowed_token_ids=[])):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}))
    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(logprobs=False).logprobs is None
    assert llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=2))[0].finished


def test_no_compilation_after_warmup_with_every_feature_mixed_in_a_batch():
    """Logprobs, prompt logprobs, penalties, bias, allowed ids, n > 1 and plain rows in one batch,
    then steps without any of them: the warmed-up engine compiles nothing more."""
    from compile_watch import backend_compiles
    from test_async_engine import run
    from tp_fixtures import TINY, make_engine, prompts, tiny_params

    engine = make_engine(tiny_params(), warmup=True)
    with backend_compiles() as compiles:  # every executable built, traced or not
        p = prompts()
        mixed = [
            (p[4], SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)),
            (p[5], SamplingParams(temperature=0.9, seed=1, max_tokens=6, repetition_penalty=1.3, presence_penalty=0.4,
                                  n=2, logit_bias={3: 2.0}, ignore_eos=True)),
            (p[1], SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=6, frequency_penalty=0.5, logprobs=0,
                                  allowed_token_ids=list(range(100)), ignore_eos=True)),
            (p[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
        ]
        _, outs = run(engine, mixed)
        _, plain = run(engine, [(q, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)) for q in p[:4]])
    assert compiles == [], f"{len(compiles)} compilations after warm-up"
    assert len(outs[0].prompt_logprobs) == len(p[4]) and len(outs[0].outputs[0].logprobs) == 6
    assert all(t < 100 for t in outs[2].outputs[0].token_ids) and all(o.outputs[0].logprobs is None for o in plain)
    assert TINY.vocab_size == engine.step_runner.sampler.slots.vocab_size
