"""quantization="gguf": a GGUF's Q4_0 / Q4_1 / Q8_0 projections kept as codes (models/gguf_blocks.py).

The oracle is the float path: gguf's own float32 dequantization (`gguf.quants.dequantize`) for the
codes, and the default engine (weights dequantized at load) for what an engine serves. The codes
must give the same float32 weights bit for bit, so the engine's tokens must be the same.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineConfig, engine_args_from_vllm
from jaxpaged.models import gguf_blocks
from jaxpaged.models.loading import load_model_files
from jaxpaged.models.weights import load_model

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1,
         "Q8_0": gguf.GGMLQuantizationType.Q8_0}
PROJECTIONS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def random_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of very different magnitudes, so scales span many exponents (and mins sit far from them)."""
    rng = np.random.default_rng(seed)
    scale = np.float32(10.0) ** rng.integers(-6, 3, size=(rows, 1))
    return (rng.standard_normal((rows, cols)) * scale + rng.standard_normal((rows, 1)) * scale * 4).astype(np.float32)


class Weight(nn.Module):
    """The model's own accessor (`linear_weight`), alone: codes in the tree -> the float weight."""

    shape: tuple

    @nn.compact
    def __call__(self):
        return gguf_blocks.linear_weight(self, "w", self.shape, jax.numpy.float32, nn.initializers.zeros)


@pytest.mark.parametrize("kind", list(TYPES))
def test_codes_dequantize_to_ggufs_own_floats_bit_for_bit(kind):
    weight = random_matrix(24, 96, seed=len(kind))
    raw = quantize(weight, TYPES[kind])
    expected = dequantize(raw, TYPES[kind]).reshape(weight.shape)
    assert not np.array_equal(expected, weight)  # it really is quantized
    codes = gguf_blocks.unpack(raw, int(TYPES[kind]), weight.shape)
    assert codes.codes.dtype == np.uint8 and codes.scales.dtype == codes.mins.dtype == np.float32
    np.testing.assert_array_equal(codes.dequantize(), expected)
    # The step's math (jitted: XLA may fuse the multiply-add) on the parameter layout, [in, out]:
    leaves = {k.removeprefix("w"): v[0] for k, v in gguf_blocks.stacked_leaves("w", [codes]).items()}
    assert leaves["_codes"].shape == (96 // 32, 32, 24) and leaves["_scales"].shape == (96 // 32, 24)
    params = {"params": {"w" + suffix: value for suffix, value in leaves.items()}}
    got = jax.jit(Weight((96, 24)).apply)(params)
    np.testing.assert_array_equal(np.asarray(got), expected.T)


def test_unpack_refuses_other_block_types():
    raw = quantize(random_matrix(2, 32, 0), gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="not one of"):
        gguf_blocks.unpack(raw, int(gguf.GGMLQuantizationType.Q5_0), (2, 32))


@pytest.fixture(scope="module")
def bundled_params():
    """The bundled SmolLM2 Q4_1 file both ways: float32 params, and codes (bfloat16 for the rest)."""
    _, floats, _ = load_model(None, "float32")
    _, codes, _ = load_model(None, "bfloat16", "gguf")
    return floats["params"], codes["params"]


def test_bundled_model_codes_are_the_float_weights(bundled_params):
    floats, codes = bundled_params
    for group, names in PROJECTIONS.items():
        got, want = codes["layers"][group], floats["layers"][group]
        for name in names:
            assert name not in got
            assert got[f"{name}_codes"].dtype == np.uint8, name
            assert got[f"{name}_scales"].dtype == got[f"{name}_mins"].dtype == np.float32, name  # not bfloat16
            for layer in (0, 17, 29):
                c, s, m = (np.asarray(got[f"{name}{p}"][layer]) for p in gguf_blocks.SUFFIXES)
                weight = (s[:, None, :] * c.astype(np.float32) + m[:, None, :]).reshape(want[name].shape[1:])
                np.testing.assert_array_equal(weight, np.asarray(want[name][layer]), err_msg=f"{name} {layer}")
    # The rest is float, in the engine dtype; the Q8_0 embedding is dequantized as before.
    assert codes["embedding"].dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(np.asarray(codes["embedding"], np.float32),
                                  np.asarray(floats["embedding"]).astype("bfloat16").astype(np.float32))


ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def float_outputs():
    llm = LLM(**ENGINE)
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]


def _same_as_floats(outputs, float_outputs):
    assert [o.token_ids for o in outputs] == [o.token_ids for o in float_outputs]
    for got, want in zip(outputs, float_outputs):
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([a[t].logprob for t in a], [b[t].logprob for t in a], atol=2e-4)


@pytest.mark.parametrize("per_layer_weights", [False, True], ids=["scan", "per-layer"])
def test_engine_with_codes_serves_the_float_engines_tokens(float_outputs, per_layer_weights):
    llm = LLM(quantization="gguf", per_layer_weights=per_layer_weights, **ENGINE)
    assert gguf_blocks.has_kept_weights(llm.params)
    _same_as_floats([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)], float_outputs)


def test_weight_updates_take_the_codes_tree_and_refuse_floats(float_outputs):
    llm = LLM(quantization="gguf", **ENGINE)
    floats = load_model(None, "float32")[1]
    with pytest.raises(ValueError, match="quantization='gguf'"):
        llm.update_params(floats)
    with pytest.raises(ValueError, match="quantization='gguf'"):  # a trainer's whole HF state dict
        llm.load_weights(load_model_files(None).state_dict)
    llm.update_params(llm.params)  # a trainer holding this engine's own layout: accepted
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    assert all(set(o.weight_versions) == {1} for o in outputs)  # sampled from the new weights
    _same_as_floats(outputs, float_outputs)
    assert llm.stats()["num_used_pages"] == 0


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="supports only 'gguf'"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)
    assert engine_args_from_vllm(None, {"quantization": "gguf"}) == {"quantization": "gguf"}  # vLLM's name
    from jaxpaged.entrypoints.cli import build_parser, engine_args

    assert EngineConfig(**engine_args(build_parser().parse_args(["-q", "gguf"]))).quantization == "gguf"  # CLI, server
    assert EngineConfig(**engine_args(build_parser().parse_args([]))).quantization is None
    from tiny_checkpoint import write_tiny_checkpoint

    with pytest.raises(ValueError, match="is not a .gguf file"):
        load_model(write_tiny_checkpoint(str(tmp_path)), "float32", "gguf")
