"""Which sampler row serves which sequence: n > 1 seeds and logprobs in mixed batches, checked
through LLMEngine on a tiny random Hugging Face Llama (the torch model is the logits oracle)."""

import numpy as np
import pytest
from test_async_engine import PieceTokenizer, run

from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.planner.request import seed_for
from jaxpaged.config import EngineConfig
from jaxpaged.models import ModelConfig, params_from_hf
from jaxpaged.planner.request import SamplingParams

MODEL = "llama-tied"
PROMPTS = [[5, 17, 3, 99, 42], [200, 1, 77], list(range(30, 47)), [8, 250, 13, 13, 6, 91]]


@pytest.fixture(scope="module")
def engine_factory():
    cache = {}

    def build(tiny_hf_model):
        if "engine" not in cache:
            hf_config, _, state_dict = tiny_hf_model(MODEL)
            config = ModelConfig.from_hf(hf_config, dtype="float32")
            engine_config = EngineConfig(
                page_size=4, num_pages=64, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                warmup=False,
            ).resolved(on_gpu=False, model_max_len=64)
            cache["engine"] = LLMEngine(
                config, params_from_hf(config, state_dict), PieceTokenizer(lambda t: f"<{t}>"), engine_config,
                num_pages=64, attention_fn=reference_paged_attention,
            )
        return cache["engine"]

    return build


@pytest.fixture
def engine(engine_factory, tiny_hf_model):
    return engine_factory(tiny_hf_model)


def test_sample_j_of_a_seeded_request_equals_a_single_request_with_its_seed(engine):
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6)
    fan_out = run(engine, [(PROMPTS[0], params)])[1][0].outputs
    assert len({c.token_ids[0] for c in fan_out}) > 1, "the samples' first tokens must not share one seed"
    for j, sample in enumerate(fan_out):
        alone = SamplingParams(temperature=1.0, seed=seed_for(11, j), max_tokens=6)
        assert sample.token_ids == run(engine, [(PROMPTS[0], alone)])[1][0].outputs[0].token_ids, f"sample {j}"


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_logprobs_in_a_mixed_batch_equal_alone_and_the_models_log_softmax(engine, hf_logits):
    requests = [
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, logprobs=True)),
        (PROMPTS[1], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5, logprobs=True)),
        (PROMPTS[2], SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=5)),  # no logprobs
        (PROMPTS[3], SamplingParams(temperature=1.2, seed=9, max_tokens=5, logprobs=True)),
    ]
    batch = run(engine, requests)[1]
    for (prompt, params), out in zip(requests, batch):
        alone = run(engine, [(prompt, params)])[1][0]
        for sample, sample_alone in zip(out.outputs, alone.outputs, strict=True):
            assert sample.token_ids == sample_alone.token_ids
            if params.logprobs is None:
                assert sample.logprobs is None
                continue
            np.testing.assert_allclose([d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)], [d[t].logprob for d, t in zip(sample_alone.logprobs, sample_alone.token_ids)], atol=1e-5)
            tokens = sample.token_ids
            logits = hf_logits(MODEL, prompt + tokens)  # row i predicts token i + 1
            want = log_softmax(logits)[np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens)), tokens]
            np.testing.assert_allclose([d[t].logprob for d, t in zip(sample.logprobs, sample.token_ids)], want, atol=1e-4)
    assert len({tuple(c.token_ids) for c in batch[1].outputs}) == 2
