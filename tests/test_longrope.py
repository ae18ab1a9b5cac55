"""Phi-3 LongRoPE (models/config.py `LongRope`): logits equal HF float32 with the short factors
(a forward inside the original context, an engine whose max_model_len is inside it) and with the long
ones (a forward past it, an engine configured past it), and greedy tokens equal HF in an engine."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxpaged.config import EngineConfig
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models import ModelConfig, params_from_hf
from jaxpaged.models.rope_scaling import LongRope
from jaxpaged.models.llama import CausalLM
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from jaxpaged.planner.request import SamplingParams
from tp_fixtures import SilentTokenizer

NAME = "phi3-longrope"


def _prefill_logits(config, params, tokens):
    n = len(tokens)
    kv = jnp.zeros((config.num_layers, 2, config.num_kv_heads, 8, 4, config.head_dim))
    ints = lambda x: np.asarray(x, np.int32)
    logits, _ = jax.jit(CausalLM(config).apply)(
        params, kv, ints(tokens), ints(range(n)), ints(range(4, n + 4)), ints([range(1, 8)]), ints([n]), ints([0, n]),
        ints(range(n)))
    return np.asarray(logits)


def test_longrope_logits_equal_hf_short_and_long(tiny_hf_model, hf_logits):
    hf_config, _, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    assert isinstance(config.rope_scaling, LongRope)
    np.testing.assert_allclose(config.rope_scaling.attention_factor, np.sqrt(1 + np.log(4) / np.log(16)), rtol=1e-6)
    params = params_from_hf(config, state_dict)
    rng = np.random.default_rng(2)
    for num_tokens, max_model_len in ((12, 16), (28, 64)):  # inside the original 16 (short), past it (long)
        tokens = rng.integers(0, 256, num_tokens).tolist()
        local = config.for_max_model_len(max_model_len)
        assert local.rope_scaling.use_long == (max_model_len > 16)
        np.testing.assert_allclose(_prefill_logits(local, params, tokens), hf_logits(NAME, tokens), atol=1e-4, rtol=1e-4)
    # The long factors on the last (long) prompt are far from HF's short-factor logits of the same tokens:
    # the two sets differ enough here for the checks above to tell them apart.
    short_hf = hf_logits(NAME, tokens[:16])
    assert np.abs(_prefill_logits(local, params, tokens[:16]) - short_hf).max() > 1e-2


def test_longrope_engine_greedy_equals_hf(tiny_hf_model):
    hf_config, model, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    prompt = np.random.default_rng(4).integers(0, 256, 5).tolist()
    with torch.no_grad():  # 5 + 10 tokens stay inside the original 16: HF uses the short factors throughout
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                                  max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    engine_config = EngineConfig(page_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16, num_pages=8,
                                 warmup=False).resolved(on_gpu=False, model_max_len=64)
    engine = LLMEngine(config, params_from_hf(config, state_dict), SilentTokenizer(), engine_config, num_pages=8,
                       attention_fn=chunked_paged_attention_from_buffer)
    assert not engine.runner.config.rope_scaling.use_long
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.outputs[0].delta_token_ids]
    assert tokens == expected
