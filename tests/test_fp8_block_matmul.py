"""The block-scaled FP8 GEMM (jaxpaged/ops/fp8_block_matmul.py; Pallas, interpret mode here) against
fp8_matmul.reference (numpy loops, one token and block at a time), and its selection on a GPU runner.

Scales are random per (block of K, column), not repeated over 128 columns as a checkpoint's are, so a
kernel that reads the scale of a wrong block or column fails; weights span FP8's range."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.ops import fp8_block_matmul, fp8_matmul


def operands(m, k, n, groups, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[:, : k // groups] *= 8.0  # the first block of K larger: per-block activation scales differ
    w = jnp.asarray(np.clip(rng.normal(size=(k, n)) * 120, -448, 448), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(0.001, 0.01, size=(groups, n)).astype(np.float32)
    return x, w, scale


# (M, K, N, block_n): one token with N 384 = one 256-column tile + a 128-column tail (XLA's form); five
# tokens over K = 3 blocks; a decode batch of 64 over two 64-column tiles; K in blocks of 64 (hf_quant's
# groups where in-features are not whole 128-blocks).
SHAPES = [(1, 256, 384, 256, 2), (5, 384, 256, None, 3), (64, 256, 128, 64, 2), (3, 320, 128, None, 5)]


@pytest.mark.parametrize("activations", ["float", "fp8"])
@pytest.mark.parametrize("m,k,n,block_n,groups", SHAPES)
def test_the_kernel_equals_the_plain_reference(m, k, n, block_n, groups, activations):
    x, w, scale = operands(m, k, n, groups)
    got = fp8_block_matmul.block_matmul(jnp.asarray(x), w, jnp.asarray(scale), activations=activations,
                                        block_n=block_n, interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    want = fp8_matmul.reference(x, w, scale, activations=activations)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("activations", ["float", "fp8"])
def test_bfloat16_activations_round_once(activations):
    """bf16 x (a GPU's): the sum in float32 and one rounding to bf16, so within a bf16 ulp of the reference
    on the same bf16 x; fp8_matmul's XLA form rounds the dequantized weight to bf16 first (W8A16)."""
    x, w, scale = operands(5, 256, 128, 2, seed=1)
    xb = jnp.asarray(x, jnp.bfloat16)
    got = fp8_block_matmul.block_matmul(xb, w, jnp.asarray(scale), activations=activations, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = fp8_matmul.reference(np.asarray(xb.astype(jnp.float32)), w, scale, activations=activations)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2 ** -8, atol=1e-3 * np.abs(want).max())


def test_the_calls_it_does_not_serve_are_refused_by_name():
    x, w, scale = operands(2, 256, 128, 2)
    assert fp8_block_matmul.use_kernel(x, scale)
    assert not fp8_block_matmul.use_kernel(x, scale[:1])  # per channel: XLA's dot reads it once already
    assert not fp8_block_matmul.use_kernel(x, scale, np.float32(0.1))  # a static activation scale
    assert not fp8_block_matmul.use_kernel(np.zeros((fp8_block_matmul.MAX_ROWS + 1, 256)), scale)  # prefill
    with pytest.raises(ValueError, match="use fp8_matmul.fp8_matmul"):
        fp8_block_matmul.block_matmul(jnp.zeros((2, 256)), w, jnp.asarray(scale[:1]))


def _block_and_channel_params():
    layer = lambda g: {"q_proj_fp8": jnp.zeros((1, 256, 128), jnp.float8_e4m3fn),
                       "q_proj_fp8_scale": jnp.ones((1, g, 128), jnp.float32)}
    return ({"params": {"layers": {"attn": layer(2)}}}, {"params": {"layers": {"attn": layer(1)}}})


def test_a_gpu_runner_selects_it_for_block_scales_only():
    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.gguf_blocks import cpu_matmul_kernels

    config = ModelConfig(vocab_size=320, hidden_size=256, intermediate_size=320, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=64, dtype="bfloat16", fp8_activations="fp8")
    block, channel = _block_and_channel_params()
    assert fp8_block_matmul.NAME in cpu_matmul_kernels(block, "gpu", None, config)  # a CUDA device's, an H100's
    assert fp8_block_matmul.NAME in cpu_matmul_kernels(block, "cuda", None, config)  # the name lowering uses
    assert fp8_block_matmul.NAME not in cpu_matmul_kernels(channel, "gpu", None, config)
    assert fp8_block_matmul.NAME not in cpu_matmul_kernels(block, "cpu", None, config)


def test_the_model_path_multiplies_through_the_kernel_where_selected():
    """gguf_blocks.linear (every projection of the model) with the kernel's name in its kernels: a Pallas
    call for decode-sized rows, XLA's form past MAX_ROWS, both equal to the reference."""
    import flax.linen as nn

    from jaxpaged.models.gguf_blocks import linear

    x, w, scale = operands(4, 256, 128, 2)
    weights = {"q_proj_fp8": w, "q_proj_fp8_scale": jnp.asarray(scale)}

    class Proj(nn.Module):
        @nn.compact
        def __call__(self, h):
            return linear(self, "q_proj", h, (256, 128), "SD,DN->SN", jnp.float32, None,
                          kernels=frozenset({fp8_block_matmul.NAME, fp8_matmul.W8A8}))

    apply = lambda h: Proj().apply({"params": weights}, h)
    for rows in (4, fp8_block_matmul.MAX_ROWS + 1):
        h = np.resize(x, (rows, 256))
        traced = str(jax.make_jaxpr(apply)(jnp.asarray(h)))
        assert ("pallas_call" in traced) == (rows <= fp8_block_matmul.MAX_ROWS), rows
        want = fp8_matmul.reference(h, w, scale, activations="fp8")
        np.testing.assert_allclose(np.asarray(apply(jnp.asarray(h))), want, rtol=2e-5, atol=1e-4)


def test_a_block_fp8_checkpoint_through_the_kernel_gives_hf_greedy_tokens(tmp_path, monkeypatch):
    """The engine on a block-FP8 checkpoint with the runner's kernels chosen as on a GPU (the platform
    passed to cpu_matmul_kernels; the kernel interpreted here): greedy tokens equal Hugging Face's on the
    dequantized weights (W8A16, float32), as the XLA path's do (tests/test_hf_quantized.py)."""
    pytest.importorskip("torch")  # the checkpoint writers and HF oracle (the newest-JAX chroot has none)
    from quant_checkpoints import hf_greedy, hf_model, write_fp8

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.device import runner as runner_module
    from jaxpaged.models import gguf_blocks

    as_gpu = lambda params, platform, tp, config: gguf_blocks.cpu_matmul_kernels(params, "gpu", tp, config)
    monkeypatch.setattr(runner_module, "cpu_matmul_kernels", as_gpu)
    path, oracle = write_fp8(str(tmp_path / "block"), "block")
    llm = LLM(path, max_model_len=64, num_pages=32, warmup=False)
    assert fp8_block_matmul.NAME in llm.engine.runner.matmul_kernels
    hf = hf_model(oracle)
    prompts = [[5, 17, 99, 3, 200, 41], [250, 12, 7, 7, 88, 160, 33, 2, 9]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 6)


H100_STEP = """
import json
from jaxpaged.static_profile.step_profile import StepCase, profile
case = StepCase(model="qwen3-0.6b", backend="pallas", kv_cache_dtype="auto", num_seqs=2, context=256,
                weights="fp8-block", num_layers=1)
row = profile(case, kernels=False)
print(json.dumps({"pallas": [p["detail"] for p in row["pallas"]], "bytes_to_ideal": row["bytes_to_ideal"]}))
"""


def test_the_h100_decode_step_multiplies_every_projection_in_the_kernel():
    """The runner's own selection on a GPU target: a one-layer block-FP8 decode step compiled for an H100
    (abstract weights; static_profile) runs each of the layer's 7 projections as one Pallas `_block_kernel`
    and reads its weights about once (estimated from the compiled program)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    toolchain = os.environ.get("JAXPAGED_H100_TOOLCHAIN") or os.path.join(root, ".h100-toolchain")
    if not os.path.isdir(os.path.join(toolchain, "jax_plugins")):
        message = "no H100 toolchain: run scripts/install_h100_toolchain.sh (.ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.static_profile.target", "-c", H100_STEP], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sum(detail.startswith("_block_kernel ") for detail in row["pallas"]) == 7, row["pallas"]
    assert row["bytes_to_ideal"] <= 1.15, row["bytes_to_ideal"]
