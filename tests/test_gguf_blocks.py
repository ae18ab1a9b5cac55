"""quantization="gguf" (a .gguf model's default, as in vLLM): a GGUF's Q4_0 / Q4_1 / Q8_0 projections
kept as codes (models/gguf_blocks.py).

The oracle is the float path: gguf's own float32 dequantization (`gguf.quants.dequantize`) for the
codes, and the engine with quantization="dequantize" (weights dequantized at load) for what an engine serves. The codes
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
from jaxpaged.ops import gguf_panels

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


def assert_bits_equal(got: np.ndarray, expected: np.ndarray) -> None:
    """float32 bit patterns equal, except that a zero may differ in sign (gguf's d * 0 is -0.0 for a
    negative d, ours +0.0: models/gguf_blocks.py)."""
    differ = got.view(np.uint32) != expected.view(np.uint32)
    assert np.all(expected[differ] == 0) and np.all(got[differ] == 0), f"{differ.sum()} values differ"


@pytest.mark.parametrize("kind", list(TYPES))
def test_codes_dequantize_to_ggufs_own_floats_bit_for_bit(kind):
    weight = random_matrix(24, 96, seed=list(TYPES).index(kind))
    raw = quantize(weight, TYPES[kind])
    expected = dequantize(raw, TYPES[kind]).reshape(weight.shape)
    assert not np.array_equal(expected, weight)  # it really is quantized
    codes = gguf_blocks.unpack(raw, int(TYPES[kind]), weight.shape)
    assert codes.codes.dtype == np.uint8 and codes.scales.dtype == codes.mins.dtype == np.float32
    assert_bits_equal(codes.dequantize(), expected)
    # The step's math (jitted: XLA may fuse the multiply-add) on the parameter layout, [in, out]:
    leaves = {k.removeprefix("w"): v[0] for k, v in gguf_blocks.stacked_leaves("w", [codes]).items()}
    code_rows = 32 if kind == "Q8_0" else 16  # 4-bit codes packed two per byte
    assert leaves["_codes"].shape == (96 // 32, code_rows, 24) and leaves["_scales"].shape == (96 // 32, 24)
    params = {"params": {"w" + suffix: value for suffix, value in leaves.items()}}
    got = jax.jit(Weight((96, 24)).apply)(params)
    assert_bits_equal(np.asarray(got), np.ascontiguousarray(expected.T))


@pytest.mark.parametrize("kind", list(TYPES))
def test_codes_served_as_panels_dequantize_to_the_same_floats(kind):
    """XLA's path from the panels the CPU runner serves (`to_panels`; `linear_weight`'s panels branch)."""
    weight = random_matrix(32, 96, seed=7 + list(TYPES).index(kind))
    codes = gguf_blocks.unpack(quantize(weight, TYPES[kind]), int(TYPES[kind]), weight.shape)
    stacked = gguf_blocks.stacked_leaves("up_proj", [codes])
    served = gguf_blocks.to_panels({"params": {"layers": {"mlp": stacked}}})["params"]["layers"]["mlp"]
    assert sorted(served) == ["up_proj_panel_mins", "up_proj_panel_scales", "up_proj_panels"]
    params = {"params": {"w" + k.removeprefix("up_proj"): v[0] for k, v in served.items()}}
    got = jax.jit(Weight((96, 32)).apply)(params)
    assert_bits_equal(np.asarray(got), np.ascontiguousarray(codes.dequantize().T))


def test_packed_codes_round_trip_and_wider_codes_stay_bytes():
    codes = np.random.default_rng(3).integers(0, 16, (2, 3, 32, 40), dtype=np.uint8)
    packed = gguf_blocks.pack_nibbles(codes)
    assert packed.shape == (2, 3, 16, 40) and gguf_blocks.is_packed(packed)
    np.testing.assert_array_equal(packed[:, :, 5] & 15, codes[:, :, 5])  # byte j: row j low, row j + 16 high
    np.testing.assert_array_equal(packed[:, :, 5] >> 4, codes[:, :, 21])
    np.testing.assert_array_equal(np.asarray(gguf_blocks.unpacked(packed)), codes)
    with pytest.raises(ValueError, match="below 16"):
        gguf_blocks.pack_nibbles(codes + 1)  # a 16: Q8_0's codes are not packed


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
            assert gguf_blocks.is_packed(got[f"{name}_codes"]), name  # Q4_1: two codes per byte
            assert got[f"{name}_scales"].dtype == got[f"{name}_mins"].dtype == np.float32, name  # not bfloat16
            for layer in (0, 17, 29):
                c, s, m = (np.asarray(got[f"{name}{p}"][layer]) for p in gguf_blocks.SUFFIXES)
                c = np.concatenate([c & 15, c >> 4], axis=1)  # rows j, then j + 16, of each block
                weight = (s[:, None, :] * c.astype(np.float32) + m[:, None, :]).reshape(want[name].shape[1:])
                np.testing.assert_array_equal(weight, np.asarray(want[name][layer]), err_msg=f"{name} {layer}")
    # The tied Q8_0 embedding stays codes, in 16-column panels of its LM head: the same floats.
    assert "embedding" not in codes and codes["embedding_codes"].dtype == np.uint8
    assert codes["embedding_codes"].shape == (49152 // 16, 576, 16)
    assert codes["embedding_scales"].dtype == codes["embedding_mins"].dtype == np.float32
    panels = (codes["embedding" + p] for p in gguf_blocks.SUFFIXES)
    np.testing.assert_array_equal(np.asarray(gguf_panels.weight(*panels)).T, np.asarray(floats["embedding"]))
    # The rest is float, in the engine dtype.
    assert codes["final_norm"]["scale"].dtype == np.dtype("bfloat16")


ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def float_outputs():
    llm = LLM(quantization="dequantize", **ENGINE)
    assert not gguf_blocks.has_kept_weights(llm.params) and "gguf_panels" not in llm.engine.runner.matmul_kernels
    return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]


def _same_as_floats(outputs, float_outputs):
    assert [o.token_ids for o in outputs] == [o.token_ids for o in float_outputs]
    for got, want in zip(outputs, float_outputs):
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([a[t].logprob for t in a], [b[t].logprob for t in a], atol=2e-4)


@pytest.mark.parametrize("kernel", ["panels", "blocks", "xla-dequantize"])
@pytest.mark.parametrize("per_layer_weights", [False, True], ids=["scan", "per-layer"])
def test_engine_with_codes_serves_the_float_engines_tokens(float_outputs, per_layer_weights, kernel, monkeypatch):
    """The three ways of multiplying the codes: the CPU kernel on panels as the runner serves them
    (ops/cpu/gguf_panels.cc), the CPU kernel on GGUF's layout (ops/cpu/gguf_matmul.cc, SERVE_PANELS
    off), or XLA's dequantize-then-dot."""
    from jaxpaged.ops import cpu_kernels, gguf_panels

    if kernel != "xla-dequantize" and not gguf_panels.available():
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0" if kernel == "xla-dequantize" else "1")
    monkeypatch.setattr(gguf_blocks, "SERVE_PANELS", kernel == "panels")
    llm = LLM(quantization="gguf", per_layer_weights=per_layer_weights, **ENGINE)
    runner = llm.engine.runner
    assert gguf_blocks.has_kept_weights(llm.params) and ("gguf_panels" in runner.matmul_kernels) == (kernel != "xla-dequantize")
    layers = runner.served_params["params"]["layers"]
    served_attn = (layers[0] if per_layer_weights else layers)["attn"]
    assert ("q_proj_panels" in served_attn) == (kernel == "panels") != ("q_proj_codes" in served_attn)
    # The decode program: the kernel's calls read the codes where they lie, no uint8 slice is copied.
    hlo = runner.trace_step(runner.dummy_step_input(runner.decode_buckets[-1], decode_only=True)).lower().compile().as_text()
    calls_per_program = 7 * (len(layers) if per_layer_weights else 1)  # unrolled
    assert hlo.count('custom_call_target="jaxpaged_gguf_matmul"') == (calls_per_program if kernel == "blocks" else 0)
    head = kernel != "xla-dequantize"  # the tied LM head: panels whenever the kernel is built
    assert hlo.count('custom_call_target="jaxpaged_gguf_panels"') == (calls_per_program if kernel == "panels" else 0) + head
    sliced_codes = [line for line in hlo.splitlines() if "= u8[" in line and "dynamic-slice" in line]
    assert not sliced_codes if kernel != "xla-dequantize" else (sliced_codes or per_layer_weights)
    _same_as_floats([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)], float_outputs)


SCORE = SamplingParams(max_tokens=1, prompt_logprobs=1)


def scored_logprobs(llm, sequences) -> np.ndarray:
    """Teacher-forced: the logprob of every token after the first of each sequence, concatenated."""
    return np.array([lp[t].logprob for seq, out in zip(sequences, llm.generate(
        [{"prompt_token_ids": s} for s in sequences], SCORE)) for t, lp in zip(seq[1:], out.prompt_logprobs[1:])])


@pytest.fixture(scope="module")
def q8_1_scored(float_outputs):
    """The float engine's sequences (prompt and greedy tokens), scored by GGUF's arithmetic in XLA's
    plain form (JAXPAGED_CPU_KERNELS=0: Q8_1's values of x times the float weights) and by the float
    engine."""
    from jaxpaged.ops import cpu_kernels

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_kernels.DISABLE_ENV, "0")
        llm = LLM(quantization="gguf", gguf_activations="q8_1", **ENGINE)
        assert llm.engine.runner.matmul_kernels == {"q8_1"}
        sequences = [llm.tokenizer.encode(p) + list(o.token_ids) for p, o in zip(PROMPTS, float_outputs)]
        return sequences, scored_logprobs(llm, sequences), scored_logprobs(LLM(quantization="dequantize", **ENGINE), sequences)


@pytest.mark.parametrize("per_layer_weights", [False, True], ids=["scan", "per-layer"])
def test_q8_1_activations_kernel_scores_as_the_plain_form(q8_1_scored, per_layer_weights):
    """gguf_activations="q8_1": every projection and the tied head on ops/cpu/gguf_panels_q8.cc (integer
    sums of Q8_1 x and the codes; exact against an oracle in test_gguf_panels_q8.py) scores the same
    sequences as the plain form within what rounding x to 1/127 of its block's largest value does to
    float32 noise (a float difference that moves x * (1 / d) across a half moves that value by d), and
    is not float32's arithmetic."""
    from jaxpaged.ops import gguf_panels

    if not gguf_panels.available():
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    llm = LLM(quantization="gguf", gguf_activations="q8_1", per_layer_weights=per_layer_weights, **ENGINE)
    runner = llm.engine.runner
    assert {"gguf_panels_q8", "q8_1"} <= runner.matmul_kernels
    layers = runner.served_params["params"]["layers"]
    hlo = runner.trace_step(runner.dummy_step_input(runner.decode_buckets[-1], decode_only=True)).lower().compile().as_text()
    assert hlo.count('custom_call_target="jaxpaged_gguf_panels_q8"') == 7 * (len(layers) if per_layer_weights else 1) + 1
    assert 'custom_call_target="jaxpaged_gguf_panels"' not in hlo
    sequences, plain, floats = q8_1_scored
    got = scored_logprobs(llm, sequences)
    gap, off_float = np.abs(got - plain), np.abs(got - floats)
    print(f"q8_1 kernel vs plain: mean {gap.mean():.4f} max {gap.max():.4f}; vs float32: mean "
          f"{off_float.mean():.4f} max {off_float.max():.4f}")
    assert gap.mean() < 0.08 and gap.max() < 0.5  # measured here: 0.032 and 0.15 (float32 vs plain: 0.043, 0.37)
    assert off_float.mean() > 0.005 and np.abs(plain - floats).mean() > 0.005


def test_weight_updates_take_the_codes_tree_and_refuse_floats(float_outputs):
    llm = LLM(quantization="gguf", **ENGINE)
    floats = load_model(None, "float32")[1]
    with pytest.raises(ValueError, match="quantization='gguf'"):
        llm.update_params(floats)
    with pytest.raises(ValueError, match="quantization='gguf'"):  # a trainer's whole HF state dict
        llm.load_weights(load_model_files(None).state_dict)
    codes = jax.device_get(llm.params)  # a trainer holding this engine's own layout, on the host
    one_byte = jax.tree_util.tree_map_with_path(  # 4-bit codes one per byte: refused, saying to pack them
        lambda path, leaf: np.asarray(gguf_blocks.unpacked(leaf)) if gguf_blocks.leaf_name(path).endswith("_codes")
        else leaf, codes)
    with pytest.raises(ValueError, match=r"_codes.*expected \(30, 18, 16, \d+\); this engine keeps 4-bit GGUF codes packed.*"
                                         r"pack_nibbles"):
        llm.update_params(one_byte)
    llm.sleep(level=2)  # the weights are gone: the refusal must not depend on them
    with pytest.raises(ValueError, match="quantization='gguf'"):
        llm.update_params(floats)
    llm.update_params(codes)  # accepted
    llm.wake_up()
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    assert all(set(o.weight_versions) == {1} for o in outputs)  # sampled from the new weights
    _same_as_floats(outputs, float_outputs)
    assert llm.stats()["num_used_pages"] == 0


def test_bfloat16_engine_with_codes_serves_the_bfloat16_float_engines_tokens():
    """The codes dequantize in float32 and are cast to the engine dtype in the step; the float engine
    casts the float32 weights at load: the same bfloat16 weights."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(dtype="bfloat16", quantization="dequantize", **ENGINE).generate(
        PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in LLM(dtype="bfloat16", quantization="gguf", **ENGINE).generate(
        PROMPTS, params)] == want


def test_a_gguf_model_serves_its_codes_by_default_as_vllm_does(float_outputs):
    """quantization None on a .gguf resolves to "gguf" (vLLM's rule): the tree holds the codes, the step
    program multiplies them (the CPU kernel on panels, or XLA slicing the uint8 codes), no float32
    matrix is multiplied, and the greedy tokens are the float path's."""
    llm = LLM(**ENGINE)
    runner = llm.engine.runner
    assert llm.engine.config.quantization == "gguf"
    assert gguf_blocks.kept_projections(llm.params) == list(gguf_blocks.PROJECTIONS)
    served_attn = runner.served_params["params"]["layers"]["attn"]
    assert "q_proj" not in served_attn and ("q_proj_panels" in served_attn or "q_proj_codes" in served_attn)
    hlo = runner.trace_step(runner.dummy_step_input(runner.decode_buckets[-1], decode_only=True)).lower().compile().as_text()
    assert 'custom_call_target="jaxpaged_dense_matmul"' not in hlo
    if gguf_panels.available():
        assert "gguf_panels" in runner.matmul_kernels
        assert hlo.count('custom_call_target="jaxpaged_gguf_panels"') == 7 + 1  # 7 projections (scanned) + the tied head
    else:
        assert any("= u8[" in line and "dynamic-slice" in line for line in hlo.splitlines())
    _same_as_floats([o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)], float_outputs)


def test_lora_adapters_run_over_the_codes_as_over_the_floats():
    """An adapter adds x A^T B^T to the projection's output whatever multiplies the base weight: the
    default (codes) engine serves the float engine's tokens under it, and the adapter changes them."""
    from jaxpaged import LoRARequest

    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(30):  # SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64
        for module, (fan_in, fan_out) in {"q_proj": (576, 576), "v_proj": (576, 192)}.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[prefix + ".lora_A.weight"] = (rng.standard_normal((4, fan_in)) * 0.05).astype(np.float32)
            tensors[prefix + ".lora_B.weight"] = (rng.standard_normal((fan_out, 4)) * 0.05).astype(np.float32)
    adapter = LoRARequest("noise", 1, lora_tensors=tensors,
                          lora_config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    lora_engine = dict(ENGINE, max_num_seqs=2, enable_lora=True, max_lora_rank=4)
    codes, floats = LLM(**lora_engine), LLM(quantization="dequantize", **lora_engine)
    assert gguf_blocks.has_kept_weights(codes.params) and not gguf_blocks.has_kept_weights(floats.params)
    tokens = {name: [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, lora_request=adapter)]
              for name, llm in (("codes", codes), ("floats", floats))}
    assert tokens["codes"] == tokens["floats"]
    assert tokens["codes"] != [o.outputs[0].token_ids for o in codes.generate(PROMPTS[:2], params)]


def test_features_needing_float_weights_dequantize_a_gguf_and_say_why(tmp_path, caplog, monkeypatch):
    """Left None, quantization on a .gguf falls back to float weights where a feature asked for needs
    them (tensor parallelism, batch invariance), with a warning naming it; asked for, it is kept or refused."""
    import logging

    from tiny_checkpoint import write_tiny_checkpoint

    from jaxpaged.engine.build import gguf_default

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    with caplog.at_level(logging.WARNING, logger="jaxpaged"):
        assert gguf_default(None, EngineConfig()).quantization == "gguf"
        assert not caplog.records
        assert gguf_default(None, EngineConfig(tensor_parallel_size=2)).quantization == "dequantize"
        assert "but tensor_parallel_size > 1 needs float weights" in caplog.text
        caplog.clear()
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # vLLM's switch, as batch_invariant=True
        assert gguf_default(None, EngineConfig()).quantization == "dequantize"
        assert "but batch_invariant needs float weights" in caplog.text
        monkeypatch.delenv("VLLM_BATCH_INVARIANT")
        caplog.clear()
        assert gguf_default(None, EngineConfig(quantization="dequantize")).quantization == "dequantize"
        assert not caplog.records  # asked for: nothing to say
    with pytest.raises(ValueError, match="tensor_parallel_size=1.*quantization='dequantize'"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)  # asked for codes: refused, not changed
    with pytest.raises(ValueError, match="quantization cannot be batch-invariant"):
        EngineConfig(quantization="gguf", batch_invariant=True)
    assert EngineConfig(quantization="dequantize", batch_invariant=True).batch_invariant  # what the fallback builds
    checkpoint = write_tiny_checkpoint(str(tmp_path))
    assert gguf_default(checkpoint, EngineConfig()).quantization is None  # not a .gguf: untouched
    with pytest.raises(ValueError, match="quantization='dequantize' dequantizes a .gguf model's blocks"):
        gguf_default(checkpoint, EngineConfig(quantization="dequantize"))


def test_a_gguf_runs_the_codes_it_has_by_default(tmp_path, caplog):
    """None on a .gguf whose projections are all float32 runs dequantized (an info line says so; "gguf"
    asked for by name is refused); with Q8_0 FFN projections it keeps those as codes, with the float
    path's tokens."""
    import logging

    from test_gguf import tiny_hf_state_dict, write_tiny_gguf

    tiny = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, warmup=False)
    prompt, greedy = [{"prompt_token_ids": [1, 5, 9, 3]}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    floats, q8 = tmp_path / "f32.gguf", tmp_path / "q8_ffn.gguf"
    write_tiny_gguf(floats, tiny_hf_state_dict(tie=True), tie=True, quantize_ffn=False, merges=True)
    write_tiny_gguf(q8, tiny_hf_state_dict(tie=True), tie=True, quantize_ffn=True, merges=True)
    with caplog.at_level(logging.INFO, logger="jaxpaged"):
        llm = LLM(str(floats), **tiny)
    assert llm.engine.config.quantization == "dequantize" and not gguf_blocks.has_kept_weights(llm.params)
    assert "keeps no Q4_0 / Q4_1 / Q8_0 projections" in caplog.text
    with pytest.raises(ValueError, match="has none"):
        LLM(str(floats), quantization="gguf", **tiny)
    llm = LLM(str(q8), **tiny)
    assert llm.engine.config.quantization == "gguf"
    assert gguf_blocks.kept_projections(llm.params) == ["gate_proj", "up_proj", "down_proj"]
    want = LLM(str(q8), quantization="dequantize", **tiny).generate(prompt, greedy)[0].outputs[0].token_ids
    assert llm.generate(prompt, greedy)[0].outputs[0].token_ids == want


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="quantization='bitsandbytes': jaxpaged supports"):
        EngineConfig(quantization="bitsandbytes")
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)
    assert engine_args_from_vllm(None, {"quantization": "gguf"}) == {"quantization": "gguf"}  # vLLM's name
    from jaxpaged.entrypoints.cli import build_parser, engine_args

    assert EngineConfig(**engine_args(build_parser().parse_args(["-q", "gguf"]))).quantization == "gguf"  # CLI, server
    assert EngineConfig(**engine_args(build_parser().parse_args([]))).quantization is None
    assert EngineConfig(**engine_args(build_parser().parse_args(["-q", "gguf", "--gguf-activations", "q8_1"]))
                        ).gguf_activations == "q8_1"
    assert EngineConfig(gguf_activations="q8_1").quantization is None  # a .gguf's codes by default
    with pytest.raises(ValueError, match="needs a .gguf model run as its codes"):
        EngineConfig(quantization="dequantize", gguf_activations="q8_1")
    assert EngineConfig(**engine_args(build_parser().parse_args(["-q", "dequantize"]))).quantization == "dequantize"
    with pytest.raises(ValueError, match=r"must be one of \('float32', 'q8_1'\)"):
        EngineConfig(quantization="gguf", gguf_activations="int8")
    from tiny_checkpoint import write_tiny_checkpoint

    with pytest.raises(ValueError, match="is not a .gguf file"):
        load_model(write_tiny_checkpoint(str(tmp_path)), "float32", "gguf")


# ---- a tiny GGUF with every kept kind, Q/K rows permuted as llama.cpp writes them ------------------

# Per projection, the block type of layer 0 and layer 1 (None: float32). down_proj mixes a kept kind
# with float, so it must stay float for every layer.
TINY_TYPES = {"q_proj": ("Q4_0", "Q4_0"), "k_proj": ("Q4_1", "Q4_1"), "v_proj": ("Q8_0", "Q8_0"),
              "o_proj": ("Q4_1", "Q4_1"), "gate_proj": ("Q8_0", "Q8_0"), "up_proj": ("Q4_0", "Q4_0"),
              "down_proj": ("Q8_0", None)}


def write_mixed_gguf(path, state_dict, embedding_kind: str | None = None):
    from test_gguf import TINY, _HF_TO_GGUF, llamacpp_permute

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", TINY["num_hidden_layers"]), ("context_length", 256),
                       ("embedding_length", TINY["hidden_size"]), ("feed_forward_length", TINY["intermediate_size"]),
                       ("attention.head_count", TINY["num_attention_heads"]),
                       ("attention.head_count_kv", TINY["num_key_value_heads"]),
                       ("rope.dimension_count", TINY["head_dim"])]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(TINY["vocab_size"])])
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    for name, value in state_dict.items():
        if name in globals_:
            if name == "model.embed_tokens.weight" and embedding_kind:
                writer.add_tensor(globals_[name], quantize(value, TYPES[embedding_kind]), raw_dtype=TYPES[embedding_kind])
            else:
                writer.add_tensor(globals_[name], value)
            continue
        parts = name.split(".")  # model.layers.0.self_attn.q_proj.weight
        layer, module = int(parts[2]), parts[-2]
        if module in ("q_proj", "k_proj"):
            value = llamacpp_permute(value, TINY["num_attention_heads" if module == "q_proj" else "num_key_value_heads"])
        kind = TINY_TYPES.get(module, (None, None))[layer]
        gguf_name = f"blk.{layer}.{_HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        if kind is None:
            writer.add_tensor(gguf_name, value)
        else:
            writer.add_tensor(gguf_name, quantize(value, TYPES[kind]), raw_dtype=TYPES[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# The embedding: float and untied (its own LM head), or a kept kind tied to the LM head (panels).
EMBEDDINGS = {"float-untied": (None, False), "q8_0-tied": ("Q8_0", True), "q4_0-tied": ("Q4_0", True),
              "q8_0-untied": ("Q8_0", False)}


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_tiny_gguf_of_every_kind_loads_as_codes_with_the_float_logits(tmp_path, caplog, embedding):
    from test_gguf import tiny_hf_state_dict

    from jaxpaged.models import ModelConfig, params_from_hf
    from jaxpaged.models import gguf as jgguf
    from jaxpaged.models.llama import CausalLM
    from jaxpaged.models.weights import check_kept

    embedding_kind, tie = EMBEDDINGS[embedding]
    path = tmp_path / "mixed.gguf"
    state_dict = {k: v for k, v in tiny_hf_state_dict(tie=tie).items() if not (tie and k == "lm_head.weight")}
    write_mixed_gguf(path, state_dict, embedding_kind)  # tied: no output.weight in the file
    hf_config, floats, _ = jgguf.load_gguf(path)
    _, blocks, _ = jgguf.load_gguf(path, keep_blocks=True)
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    want, got = params_from_hf(config, floats), params_from_hf(config, blocks)
    assert gguf_blocks.kept_projections(got) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
    with caplog.at_level("WARNING", logger="jaxpaged"):
        check_kept(got, "mixed.gguf")
    assert "['down_proj'] of mixed.gguf stay float" in caplog.text
    for group, names in PROJECTIONS.items():
        for name in names:
            layers = got["params"]["layers"][group]
            if name == "down_proj":
                np.testing.assert_array_equal(layers[name], want["params"]["layers"][group][name])
                continue
            c, s, m = (layers[name + suffix] for suffix in gguf_blocks.SUFFIXES)
            assert gguf_blocks.is_packed(c) == (TINY_TYPES[name][0] != "Q8_0"), name  # 4-bit: two per byte
            c = np.asarray(gguf_blocks.unpacked(c))
            weight = (s[:, :, None, :] * c.astype(np.float32) + m[:, :, None, :]).reshape(
                want["params"]["layers"][group][name].shape)
            assert_bits_equal(weight, want["params"]["layers"][group][name])  # rows un-permuted alike
    kept_embedding = embedding_kind is not None and tie  # an untied embedding only looks tokens up: float
    assert ("embedding" in got["params"]) != kept_embedding and ("embedding_codes" in got["params"]) == kept_embedding
    if kept_embedding:
        panels = [got["params"]["embedding" + suffix] for suffix in gguf_blocks.SUFFIXES]
        assert_bits_equal(np.asarray(gguf_panels.weight(*panels)).T, want["params"]["embedding"])
    # The model on both trees: one prefill of 12 tokens, logits equal up to float32 summation order.
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 12).astype(np.int32)
    kv = jax.numpy.zeros((config.num_layers, 2, config.num_kv_heads, 4, 4, config.head_dim))
    n = len(tokens)
    args = (kv, tokens, np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32), np.array([[0, 1, 2, 3]], np.int32),
            np.array([n], np.int32), np.array([0, n], np.int32), np.arange(n, dtype=np.int32))
    model = jax.jit(CausalLM(config).apply)
    np.testing.assert_allclose(np.asarray(model(got, *args)[0]), np.asarray(model(want, *args)[0]), atol=1e-5, rtol=1e-5)
    from jaxpaged.ops import gguf_matmul

    if gguf_matmul.available():  # the CPU kernel on packed (Q4) and one-byte (Q8_0) codes side by side
        kernels = frozenset({gguf_matmul.NAME, gguf_panels.NAME} if gguf_panels.available() else {gguf_matmul.NAME})
        kernel = jax.jit(CausalLM(config, matmul_kernels=kernels).apply)
        hlo = kernel.lower(got, *args).as_text()
        assert hlo.count(gguf_matmul.TARGET) == 6  # every kept projection of the scanned layer
        assert hlo.count("jaxpaged_gguf_panels") == (kept_embedding and gguf_panels.NAME in kernels)  # the head
        logits = np.asarray(model(want, *args)[0])  # up to ~34: float32 sums in the kernel's order
        np.testing.assert_allclose(np.asarray(kernel(got, *args)[0]), logits, atol=1e-5 * np.abs(logits).max(), rtol=0)
    with pytest.raises(ValueError, match="has none"):  # a file none of whose projections is kept
        check_kept(want, "floats.gguf")
