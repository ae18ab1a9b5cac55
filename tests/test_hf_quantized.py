"""Quantized Hugging Face checkpoints served packed (models/hf_quant.py), against Hugging Face float32 on
the weights each format's own dequantization gives (tests/quant_checkpoints.py).

- W8A16 / W4A16 (the CPU's default): greedy tokens equal Hugging Face's on the dequantized weights.
- W8A8 (fp8_activations="fp8"): the sampled tokens' logprobs within 1e-4 in the median (all within 0.25: an
  activation that float32 rounding moves across an FP8 rounding boundary) of Hugging Face's with the same
  FP8 activation quantization (a forward pre-hook per linear: per token, per token and 128-block, or the
  static input_scale). Float32 activations are further off (up to 2 nats on this random model's tokens).
"""

import json
import math
import os
import re

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from quant_checkpoints import (LINEARS, base_checkpoint, hf_greedy, hf_model, hf_token_logprobs, input_maxima,
                               write_awq, write_compressed_tensors, write_float, write_fp8, write_gptq)

PROMPTS = [[5, 17, 99, 3, 200, 41], [250, 12, 7, 7, 88, 160, 33, 2, 9]]
ENGINE = dict(max_model_len=64, num_pages=32, warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def run(llm) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def leaves(llm) -> dict:
    layers = llm.params["params"]["layers"]
    return {**layers["attn"], **layers["mlp"]}


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_checkpoint_stays_fp8_and_its_greedy_tokens_equal_hf_on_the_dequantized_weights(tmp_path, granularity):
    path, oracle = write_fp8(str(tmp_path / granularity), granularity)
    llm = LLM(path, **ENGINE)
    kept = leaves(llm)
    for name in LINEARS:  # every projection stays float8 with float32 scales: no float copy of the weight
        assert kept[name + "_fp8"].dtype == np.dtype("float8_e4m3fn") and name not in kept
        features = kept[name + "_fp8"].shape[1]  # in; blocks of 128 (in 320: groups of 64, math.gcd)
        assert kept[name + "_fp8_scale"].shape[1] == (features // math.gcd(128, features) if granularity == "block" else 1)
    hf = hf_model(oracle)
    for prompt, out in zip(PROMPTS, run(llm)):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 10)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """max |x| into every linear of the float model over PROMPTS (for static input scales)."""
    _, state = base_checkpoint(str(tmp_path_factory.mktemp("base")))
    return input_maxima(state, PROMPTS)


@pytest.mark.parametrize("granularity,scheme", [("block", "dynamic"), ("channel", "dynamic"), ("tensor", "static")])
def test_fp8_w8a8_logprobs_match_hf_with_the_same_activation_quantization(tmp_path, calibrated, granularity, scheme):
    path, oracle = write_fp8(str(tmp_path / granularity), granularity, scheme, calibrated)
    llm = LLM(path, fp8_activations="fp8", **ENGINE)
    if scheme == "static":
        assert leaves(llm)["q_proj_input_scale"].shape == (2,)
    prefixes = [f"model.layers.{i}.{part}.{name}" for i in range(2)
                for part, names in (("self_attn", LINEARS[:4]), ("mlp", LINEARS[4:])) for name in names]
    # dynamic: per token, or per token and block of 128 in-features (down_proj's 320: groups of 64)
    group = lambda p: (64 if p.endswith("down_proj") else 128) if granularity == "block" else None
    quant = {p: ("static", calibrated[p] / 448.0) if scheme == "static" else ("dynamic", group(p)) for p in prefixes}
    w8a8, float_acts = hf_model(oracle, quant), hf_model(oracle)
    gaps, float_gaps = [], []
    for prompt, out in zip(PROMPTS, run(llm)):
        tokens = list(out.token_ids)
        ours = np.array([entry[t].logprob for entry, t in zip(out.logprobs, tokens)])
        gaps += list(np.abs(ours - hf_token_logprobs(w8a8, prompt, tokens)))
        float_gaps += list(np.abs(ours - hf_token_logprobs(float_acts, prompt, tokens)))
    # Float32 rounding upstream can move an activation across an FP8 rounding boundary, which this random
    # model amplifies: the median token agrees to 1e-4 (measured ~1e-6), every one to 0.25 (measured <= 0.19).
    assert np.median(gaps) <= 1e-4 and max(gaps) <= 0.25, gaps
    # and the FP8 activations are what the engine ran: float activations give other logprobs (median ~0.2)
    assert np.median(float_gaps) > 1e-2, float_gaps


@pytest.mark.parametrize("activations,input_scale,groups", [("float", None, 1), ("fp8", None, 1), ("fp8", 0.02, 1),
                                                            ("fp8", None, 4), ("float", None, 4)])
def test_fp8_matmul_equals_its_plain_reference(activations, input_scale, groups):
    import jax.numpy as jnp

    from jaxpaged.ops.fp8_matmul import fp8_matmul, reference

    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 256)).astype(np.float32)
    w = jnp.asarray(rng.normal(size=(256, 48)) * 30, jnp.float32).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(0.001, 0.01, size=(groups, 48)).astype(np.float32)
    got = fp8_matmul(jnp.asarray(x), w, jnp.asarray(scale), input_scale, activations=activations)
    np.testing.assert_allclose(got, reference(x, w, scale, input_scale, activations=activations), rtol=1e-5, atol=1e-5)


CT_SCHEMES = {  # compressed-tensors QuantizationArgs, format: what each checkpoint holds
    "w4a16-asym-g32": (dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32), "pack-quantized", None),
    "w4a16-sym-g64": (dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64), "pack-quantized", None),
    "w8a16-sym-channel": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "pack-quantized", None),
    "fp8-dynamic": (dict(num_bits=8, type="float", symmetric=True, strategy="channel"), "float-quantized",
                    dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)),
}


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_checkpoint_stays_packed_and_its_greedy_tokens_equal_hf_on_its_own_decompression(
        tmp_path, scheme):
    from jaxpaged.models.hf_quant import quantized_state_dict
    from jaxpaged.models.loading import load_safetensors_dir

    weights, fmt, acts = CT_SCHEMES[scheme]
    path, oracle = write_compressed_tensors(str(tmp_path / scheme), weights, fmt, acts)
    # hf_quant's reading of each weight is compressed-tensors' decompression (scale * q + min: one rounding apart)
    config = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    state = quantized_state_dict(config, load_safetensors_dir(path))
    for name, expected in oracle.items():
        if name.endswith(tuple(f"{n}.weight" for n in LINEARS)):
            np.testing.assert_allclose(state[name].dequantize(), expected, rtol=1e-6, atol=1e-7, err_msg=name)
    llm = LLM(path, **ENGINE)
    kept = leaves(llm)
    for name in LINEARS:  # packed: 4-bit codes two per byte, 8-bit one, FP8 float8; no float copy
        assert name not in kept
        if weights["type"] == "float":
            assert kept[name + "_fp8"].dtype == np.dtype("float8_e4m3fn")
        else:
            assert kept[name + "_codes"].dtype == np.uint8 and kept[name + "_codes"].shape[2] == weights["num_bits"] * 4
    hf = hf_model(oracle)
    for prompt, out in zip(PROMPTS, run(llm)):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 10)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-asym", "gptq-desc-act"])
def test_awq_and_gptq_checkpoints_greedy_tokens_equal_hf_on_the_dequantized_weights(tmp_path, fmt):
    path, oracle = (write_awq(str(tmp_path / fmt)) if fmt == "awq" else
                    write_gptq(str(tmp_path / fmt), desc_act=fmt.endswith("desc-act"), symmetric=not fmt.endswith("asym")))
    llm = LLM(path, **ENGINE)
    kept = leaves(llm)
    for name in LINEARS:
        if fmt.endswith("desc-act"):  # act-order groups share no 32-row blocks: float32 weights, the same values
            assert kept[name].dtype == np.float32
        else:  # 4-bit codes, two per byte
            assert name not in kept and kept[name + "_codes"].dtype == np.uint8 and kept[name + "_codes"].shape[2] == 16
    hf = hf_model(oracle)
    for prompt, out in zip(PROMPTS, run(llm)):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 10)


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "gptq", "bits": 8}, "bits=8"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 32}}}},
     "num_bits=2"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}}, "input_activations"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     "nvfp4-pack-quantized"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
])
def test_schemes_not_implemented_are_refused_by_name(config, named):
    from jaxpaged.models import ModelConfig

    hf = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "quantization_config": config}
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig.from_hf(hf)


def test_a_quantization_argument_that_is_not_the_checkpoints_method_is_refused(tmp_path):
    path, _ = write_gptq(str(tmp_path / "gptq"))
    with pytest.raises(ValueError, match="quantization='awq', but .* is a 'gptq' checkpoint"):
        LLM(path, quantization="awq", **ENGINE)


@pytest.mark.parametrize("fmt,kv_cache_dtype", [("awq", "int8"), ("fp8-block", "float8_e4m3fn")])
def test_quantized_weights_combine_with_a_quantized_kv_cache(tmp_path, fmt, kv_cache_dtype):
    """The packed weights under a quantized KV cache: the same tokens as the dequantized twin (float weights,
    the same values up to one float32 rounding: s * q - s * z against s * (q - z)) under the same cache,
    logprobs within 0.05 (a K/V value that rounding moves across an int8 / FP8 step; measured <= 0.016)."""
    from jaxpaged.ops.kv_quant import QuantizedKV

    path, oracle = write_awq(str(tmp_path / fmt)) if fmt == "awq" else write_fp8(str(tmp_path / fmt), "block")
    packed = LLM(path, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    assert isinstance(packed.engine.runner.kv_pages, QuantizedKV)
    assert any(k.endswith(("_codes", "_fp8")) for k in leaves(packed))
    twin = LLM(write_float(str(tmp_path / "twin"), oracle), kv_cache_dtype=kv_cache_dtype, **ENGINE)
    for ours, theirs in zip(run(packed), run(twin)):
        assert list(ours.token_ids) == list(theirs.token_ids)
        np.testing.assert_allclose([e[t].logprob for e, t in zip(ours.logprobs, ours.token_ids)],
                                   [e[t].logprob for e, t in zip(theirs.logprobs, theirs.token_ids)], atol=0.05)


def test_quantized_weights_with_tensor_parallelism_are_refused_by_name(tmp_path, monkeypatch):
    import jaxpaged.engine.build as build
    from jaxpaged.models.hf_quant import quantized_leaves

    path, _ = write_fp8(str(tmp_path / "fp8"), "tensor")
    monkeypatch.setattr(build, "replica_meshes", lambda dp, tp: [None])  # no second device needed to be refused
    with pytest.raises(ValueError, match=r"keeps quantized weights \(k_proj_fp8, ...\).*tensor_parallel_size=1"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    assert quantized_leaves({"params": {"layers": {"attn": {"q_proj": np.zeros(1)}}}}) == []


def test_the_static_profiles_fp8_tree_is_the_tree_a_checkpoint_loads_as(tmp_path):
    """benchmarks/bench_h100_static --quantized profiles abstract FP8 leaves (static_profile.step_profile
    quantized_shapes): the names, shapes and dtypes a per-channel fp8 checkpoint really loads as."""
    import jax

    from jaxpaged.models.llama import param_shapes
    from jaxpaged.models.weights import load_model
    from jaxpaged.static_profile.step_profile import quantized_shapes

    config, params, _ = load_model(write_fp8(str(tmp_path / "fp8"), "channel")[0], "float32")
    profiled = quantized_shapes(param_shapes(config), "fp8-channel")
    shape = lambda tree: jax.tree_util.tree_map_with_path(lambda p, x: (jax.tree_util.keystr(p), x.shape, x.dtype), tree)
    assert sorted(jax.tree.leaves(shape(profiled), is_leaf=lambda x: isinstance(x, tuple))) == sorted(
        jax.tree.leaves(shape(params), is_leaf=lambda x: isinstance(x, tuple)))


def test_fp8_weights_through_the_gpus_serving_structure_and_in_bfloat16(tmp_path):
    """A GPU serves one weight buffer per layer (per_layer_weights) in bfloat16: the FP8 leaves go through the
    per-layer split (tokens equal Hugging Face's on the dequantized weights) and dequantize to bfloat16 (the
    tokens of the dequantized float twin in bfloat16, which holds the same bfloat16 weights)."""
    path, oracle = write_fp8(str(tmp_path / "block"), "block")
    hf = hf_model(oracle)
    per_layer = LLM(path, per_layer_weights=True, **ENGINE)
    for prompt, out in zip(PROMPTS, run(per_layer)):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 10)
    twin = [list(o.token_ids) for o in run(LLM(write_float(str(tmp_path / "twin"), oracle), dtype="bfloat16", **ENGINE))]
    assert [list(o.token_ids) for o in run(LLM(path, dtype="bfloat16", **ENGINE))] == twin
