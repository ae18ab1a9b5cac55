"""gpt-oss (`GptOssForCausalLM`) against Hugging Face float32: logits on every CPU attention path, the
clamped SwiGLU and YaRN against HF's own functions, n > 1 completions past the window (greedy tokens and
sampled tokens' log-probabilities), MXFP4 checkpoints, and the refusals of what is not implemented.
(Greedy past the window with prefix cache, chunked prefill and preemption: tests/test_sliding_window.py and
tests/test_family_preemption.py run "gptoss" too.)"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpaged.config import EngineConfig
from jaxpaged.device.backends import attention_fn as backend_attention_fn
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models import ModelConfig, params_from_hf
from jaxpaged.models.llama import CausalLM, rope_inv_freq
from jaxpaged.models.loading import load_safetensors_dir
from jaxpaged.models.moe import gated
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer, reference_paged_attention
from jaxpaged.planner.request import SamplingParams
from tp_fixtures import SilentTokenizer

NAME = "gptoss"


@functools.cache
def _forward(config, attention_fn):  # one compiled program per (config, backend) for the module
    return jax.jit(CausalLM(config, attention_fn).apply)


def _logits(config, params, attention_fn, token_ids, page_size=4):
    """One prefill of `token_ids` as one sequence through CausalLM with `attention_fn`: [T, V] float32."""
    n = len(token_ids)
    num_pages = n // page_size + 2
    kv = jnp.zeros((config.num_layers, 2, config.num_kv_heads, num_pages, page_size, config.head_dim), jnp.float32)
    arange = jnp.arange(n, dtype=jnp.int32)
    logits, _ = _forward(config, attention_fn)(
        params, kv, jnp.asarray(token_ids, jnp.int32), arange, arange + page_size,  # page 0 is padding
        jnp.arange(1, num_pages, dtype=jnp.int32)[None], jnp.asarray([n], jnp.int32), jnp.asarray([0, n], jnp.int32),
        arange)
    return np.asarray(logits)


@pytest.mark.parametrize("backend", ["reference", "chunked", "chunked-cpu-kernels"])
def test_logits_equal_hf_past_the_window(backend, tiny_hf_model, hf_logits):
    hf_config, _, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    assert config.layer_windows == (8, None) and config.attention_sinks and config.moe_bias
    fn = {"reference": reference_paged_attention, "chunked": chunked_paged_attention_from_buffer,
          "chunked-cpu-kernels": backend_attention_fn("chunked")}[backend]  # the engine's CPU default
    tokens = np.random.default_rng(0).integers(0, 256, 40).tolist()  # 5 windows; positions past YaRN's original 32
    params = params_from_hf(config, state_dict)
    np.testing.assert_allclose(_logits(config, params, fn, tokens), hf_logits(NAME, tokens), atol=2e-4, rtol=0)


def test_every_gpt_oss_part_changes_the_logits(tiny_hf_model, hf_logits):
    """The oracle test above can fail for each part: zeroing the sinks, the expert biases or the router bias,
    or dropping YaRN, moves the logits far beyond its tolerance."""
    hf_config, _, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    tokens = np.random.default_rng(0).integers(0, 256, 40).tolist()
    expected = hf_logits(NAME, tokens)
    for part in ("self_attn.sinks", "experts.gate_up_proj_bias", "experts.down_proj_bias", "mlp.router.bias"):
        changed = {k: (np.zeros_like(v) if k.endswith(part) else v) for k, v in state_dict.items()}
        got = _logits(config, params_from_hf(config, changed), reference_paged_attention, tokens)
        assert np.abs(got - expected).max() > 1e-2, part
    plain_rope = dataclasses.replace(config, rope_scaling=None)
    got = _logits(plain_rope, params_from_hf(config, state_dict), reference_paged_attention, tokens)
    assert np.abs(got - expected).max() > 1e-2


def test_clamped_swiglu_equals_hf_on_both_sides_of_the_clamps(tiny_hf_model):
    _, model, _ = tiny_hf_model(NAME)
    experts = model.model.layers[0].mlp.experts
    gate_up = torch.linspace(-20.0, 20.0, 2 * 401).reshape(401, 2)  # column 0 gate, 1 up (interleaved as HF's)
    gate_up = torch.cat([gate_up, gate_up.flip(0)], dim=1)  # pairs (g, u) and (u', g') over the whole range
    expected = experts._apply_gate(gate_up).numpy()
    got = np.asarray(gated("swigluoai", jnp.asarray(gate_up[:, 0::2].numpy()), jnp.asarray(gate_up[:, 1::2].numpy())))
    assert (np.abs(gate_up.numpy()) > 7).mean() > 0.5  # most inputs are clamped
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_equal_hf(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = GptOssConfig(head_dim=64, hidden_size=256, num_attention_heads=8, max_position_embeddings=131072,
                             rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                                  beta_slow=1.0, truncate=truncate,
                                                  original_max_position_embeddings=4096))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    assert config.rope_scaling.truncate == truncate
    assert config.rope_scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    got = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    np.testing.assert_allclose(got, inv_freq.numpy(), rtol=1e-6)


def _engine(config, params, attention_fn=chunked_paged_attention_from_buffer, **overrides):
    engine_config = EngineConfig(**{
        "page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "max_model_len": 96, "num_pages": 40,
        **overrides}).resolved(on_gpu=False, model_max_len=config.max_position_embeddings)
    return LLMEngine(config, params, SilentTokenizer(), engine_config, num_pages=engine_config.num_pages,
                     attention_fn=attention_fn)


def test_n_completions_past_the_window_equal_hf(tiny_hf_model):
    """n=2 greedy: both children are HF's greedy tokens; n=3 sampled: every sampled token's log-probability
    is HF's at that place of a forward over the prompt and the child's own tokens (each child's KV, forked
    from the parent's pages, is its own). 40 tokens past a window of 8, a 20-token prompt in two chunks."""
    hf_config, model, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, 9).tolist()]
    max_tokens = 40
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompts[0]]), attention_mask=torch.ones(1, 20, dtype=torch.long),
                                max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)[0, 20:].tolist()
    engine = _engine(config, params_from_hf(config, state_dict),
                     attention_fn=backend_attention_fn("chunked"))  # what LLM(...) runs on a CPU
    ids = [engine.add_request(prompts[0], SamplingParams(temperature=0.0, n=2, max_tokens=max_tokens, ignore_eos=True)),
           engine.add_request(prompts[1], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=max_tokens,
                                                         ignore_eos=True, logprobs=0))]
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert [list(c.token_ids) for c in done[ids[0]].outputs] == [greedy, greedy]
    sampled = done[ids[1]].outputs
    assert len(sampled) == 3 and len({tuple(c.token_ids) for c in sampled}) == 3
    for completion in sampled:
        tokens = list(completion.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompts[1] + tokens[:-1]])).logits[0, len(prompts[1]) - 1:]
        expected = torch.log_softmax(logits.double(), -1)[torch.arange(max_tokens), torch.tensor(tokens)].numpy()
        got = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
        np.testing.assert_allclose(got, expected, atol=2e-4)
    assert engine.block_manager.stats()["num_used_pages"] == 0


# MXFP4: the released checkpoints' expert format, written here from random codes.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _oracle_dequantize(blocks, scales):
    """Independent of models/mxfp4.py: one value at a time, straight from the format's definition."""
    *prefix, out_dim, groups, _ = blocks.shape
    values = np.zeros((*prefix, out_dim, groups * 32), np.float32)
    for index in np.ndindex(*prefix, out_dim, groups):
        for j in range(32):
            byte = int(blocks[index][j // 2])
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            values[index[:-1] + (index[-1] * 32 + j,)] = E2M1[code] * 2.0 ** (int(scales[index]) - 127)
    return np.swapaxes(values, -1, -2)  # [E, out, in] -> [E, in, out], HF's GptOssExperts layout


def _mxfp4_checkpoint(state_dict, num_layers, rng):
    """`state_dict` with each layer's expert projections replaced by random MXFP4 blocks and scales (scales
    near 2^-3, so the weights' magnitudes are like the fixture's), and the float weights they stand for."""
    packed, floats = dict(state_dict), {}
    for i in range(num_layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            num_experts, in_dim, out_dim = state_dict[name].shape
            blocks = rng.integers(0, 256, (num_experts, out_dim, in_dim // 32, 16), dtype=np.uint8)
            scales = rng.integers(122, 127, (num_experts, out_dim, in_dim // 32), dtype=np.uint8)
            del packed[name]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            floats[name] = _oracle_dequantize(blocks, scales)
    return packed, floats


def test_mxfp4_checkpoint_loads_dequantized_and_greedy_equals_hf(tiny_hf_model, tmp_path):
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_config, model, state_dict = tiny_hf_model(NAME)
    packed, floats = _mxfp4_checkpoint(state_dict, hf_config.num_hidden_layers, np.random.default_rng(2))
    name = "model.layers.0.mlp.experts.down_proj"
    hf_dequantized = convert_moe_packed_tensors(torch.from_numpy(packed[name + "_blocks"]),
                                                torch.from_numpy(packed[name + "_scales"]), dtype=torch.float32)
    np.testing.assert_array_equal(floats[name], hf_dequantized.numpy())  # the oracle agrees with transformers'
    # A Hugging Face directory as the released checkpoints have it: config.json with the quantization_config.
    config_dict = {**hf_config.to_dict(), "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config_dict, f)
    save_file(packed, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = ModelConfig.from_hf(json.load(f), dtype="float32")
    assert config == ModelConfig.from_hf(hf_config, dtype="float32")
    loaded = params_from_hf(config, load_safetensors_dir(str(tmp_path)))
    expected = params_from_hf(config, {**state_dict, **floats})
    jax.tree.map(np.testing.assert_array_equal, loaded, expected)

    # HF's model with the dequantized experts is the oracle for the engine on the MXFP4 directory.
    import copy

    hf_model = copy.deepcopy(model)
    with torch.no_grad():
        for key, value in floats.items():
            hf_model.get_parameter(key).copy_(torch.from_numpy(value))
    prompt = np.random.default_rng(4).integers(0, 256, 13).tolist()
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 13, dtype=torch.long),
                                 max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 13:].tolist()
    engine = _engine(config, loaded)
    ids = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert list(done[ids].outputs[0].token_ids) == want


def test_mxfp4_blocks_without_scales_are_refused(tiny_hf_model):
    hf_config, _, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    packed, _ = _mxfp4_checkpoint(state_dict, 1, np.random.default_rng(0))
    del packed["model.layers.0.mlp.experts.down_proj_scales"]
    with pytest.raises(ValueError, match="down_proj_blocks.*without its pair"):
        params_from_hf(config, packed)


def test_what_is_not_implemented_is_refused_by_name(tiny_hf_model):
    from jaxpaged.device.sharding import TensorParallel, make_mesh

    hf_config, _, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    base = hf_config.to_dict()
    for field, value in (("swiglu_limit", 10.0), ("swiglu_alpha", 1.0), ("attention_bias", False)):
        with pytest.raises(ValueError, match=field):
            ModelConfig.from_hf({**base, field: value})
    with pytest.raises(ValueError, match="mscale"):
        ModelConfig.from_hf({**base, "rope_parameters": {**base["rope_parameters"], "mscale": 1.0}})
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        ModelConfig.from_hf({**base, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        TensorParallel.create(make_mesh(1), config)


def test_model_on_the_pallas_backend_equals_hf(tiny_hf_model, hf_logits):
    """The Pallas kernels (interpreted here) with sinks through the model: the ragged kernel on a prompt past the
    window (sliding and full layers by lax.cond), then the decode kernel in a decode-only step."""
    import pallas_kernels
    from conftest import make_scheduler_output, make_seq

    from jaxpaged.device.runner import ModelRunner

    hf_config, _, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    runner = ModelRunner(config, params_from_hf(config, state_dict), num_pages=12, page_size=4, max_num_seqs=1,
                         max_num_batched_tokens=16, max_model_len=32, buckets=(16,), decode_buckets=(1,),
                         attention_fn=pallas_kernels.paged_attention_from_buffer)
    token_ids = np.random.default_rng(4).integers(0, 256, size=15)
    expected = hf_logits(NAME, token_ids)
    seq = make_seq(token_ids, block_table=[3, 1, 7, 2])
    prefill = np.asarray(runner.run(make_scheduler_output([seq], [14])))[0]
    seq.num_computed_tokens = 14
    decode = np.asarray(runner.run(make_scheduler_output([seq], [1])))[0]  # decode-only: the decode kernel
    np.testing.assert_allclose(prefill, expected[13], atol=1e-4, rtol=0)
    np.testing.assert_allclose(decode, expected[14], atol=1e-4, rtol=0)


def test_bfloat16_model_stays_close_to_float32_hf(tiny_hf_model, hf_logits):
    """The accelerator default: bf16 weights (sinks and biases included), activations and KV pages, float32
    logits, prefill then decode through the engine's CPU backend. A wrong cast or a dropped part is far
    outside the tolerance, 2% of the logits' range: bf16 rounding of 8 mantissa bits costs ~0.6% here."""
    from conftest import make_scheduler_output, make_seq

    from jaxpaged.device.runner import ModelRunner

    hf_config, _, state_dict = tiny_hf_model(NAME)
    config = ModelConfig.from_hf(hf_config, dtype="bfloat16")
    runner = ModelRunner(config, params_from_hf(config, state_dict), num_pages=12, page_size=4, max_num_seqs=2,
                         max_num_batched_tokens=16, max_model_len=32, buckets=(16,),
                         attention_fn=backend_attention_fn("chunked"))
    assert runner.kv_pages.dtype == jnp.bfloat16
    token_ids = np.random.default_rng(2).integers(0, 256, size=15)
    expected = hf_logits(NAME, token_ids)
    seq = make_seq(token_ids, block_table=[3, 1, 7, 2])
    prefill = np.asarray(runner.run(make_scheduler_output([seq], [14])))[0]
    seq.num_computed_tokens = 14
    decode = np.asarray(runner.run(make_scheduler_output([seq], [1])))[0]
    tolerance = 0.02 * np.ptp(expected[13:15])
    np.testing.assert_allclose(prefill, expected[13], atol=tolerance, rtol=0)
    np.testing.assert_allclose(decode, expected[14], atol=tolerance, rtol=0)


def test_the_released_20b_config_reads_as_the_static_profiles_model():
    """openai/gpt-oss-20b's config.json (MXFP4 quantization_config, `rope_scaling` in the older key, extra keys
    of the original release) reads to the shapes the H100 static profile compiles (static_profile MODELS)."""
    from jaxpaged.static_profile.step_profile import StepCase, model_config

    released = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
    config = ModelConfig.from_hf(released, dtype="bfloat16")
    profiled = model_config(StepCase("gpt-oss-20b", "pallas", "auto", 1, 128))
    assert config == dataclasses.replace(profiled, max_position_embeddings=131072)
    assert config.layer_windows[:2] == (128, None) and config.rope_scaling.truncate is False
