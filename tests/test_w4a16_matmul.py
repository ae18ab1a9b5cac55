"""The W4A16 Pallas kernel (ops/w4a16_matmul.py) against gguf_matmul.reference, in interpret mode on the CPU;
the GPU path choosing it; an engine on an AWQ checkpoint served through it.

Every case draws all 16 codes, a different scale and minimum per block of 32 in-features and column,
and M, N that leave the last row tile and several column tiles partly or wholly used, so a swapped
nibble, a block's scale read from its neighbour, or a tile offset by one changes the product.

Tolerances: float32 x: 1e-5 of the largest |y| (the same products, summed in another order); bfloat16 x:
1e-2 (the kernel rounds x and the dequantized weight tile to bfloat16 before the dot, as any bf16 GEMM does).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.device import runner as runner_module
from jaxpaged.models import ModelConfig, gguf_blocks, init_params
from jaxpaged.ops import w4a16_matmul
from jaxpaged.ops.gguf_matmul import reference
from pallas_kernels.jax_compat import cuda_target

TRITON_CALL = "__gpu$xla.gpu.triton"


def random_weight(k: int, n: int, seed: int):
    """Packed codes [k/32, 16, n] (from codes [k/32, 32, n] drawn in 0..15), scales and mins [k/32, n]."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (k // 32, 32, n), dtype=np.uint8)
    scales = (rng.uniform(0.5, 2.0, (k // 32, n)) * rng.choice([-1, 1], (k // 32, n))).astype(np.float32)
    mins = rng.standard_normal((k // 32, n)).astype(np.float32)
    return gguf_blocks.pack_nibbles(codes), scales, mins


def check(m: int, k: int, n: int, dtype, seed: int = 0, **tiles):
    codes, scales, mins = random_weight(k, n, seed)
    x = np.random.default_rng(seed + 1).standard_normal((m, k)).astype(np.float32)
    want = np.asarray(reference(x, codes, scales, mins))
    got = w4a16_matmul.w4a16_matmul(jnp.asarray(x, dtype), codes, scales, mins, interpret=True, **tiles)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got), want, atol=tolerance * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("m,k,n", [
    (1, 96, 80),    # 3 blocks of K (one a step), 5 column tiles of 16
    (7, 512, 96),   # 16 blocks in 2 steps of 8, 3 column tiles of 32, rows 7..15 of the tile masked
    (64, 256, 192),  # a whole row tile, 3 column tiles of 64
    (130, 320, 64),  # 3 row tiles (the last of 2 rows), 10 blocks in 5 steps of 2
])
def test_kernel_equals_the_reference_float32(m, k, n):
    check(m, k, n, jnp.float32)


def test_kernel_equals_the_reference_bfloat16_with_splits_of_k():
    # 2 rows against K = 2048 (64 blocks: 8 steps): split 4 ways, the partial sums added by XLA
    check(2, 2048, 128, jnp.bfloat16, block_n=32, splits=4)
    assert w4a16_matmul.tiles(2, 4096, 1024)[3] > 1  # a decode step's narrow projection is split by itself


def test_tiles_and_what_the_kernel_refuses():
    assert w4a16_matmul.tiles(1, 4096, 4096)[:3] == (16, 64, 8)  # Triton's dot takes 16 rows at least
    assert w4a16_matmul.tiles(64, 12288, 4096)[3] <= 2  # the partial sums stay small beside the weight
    assert not w4a16_matmul.supports((w4a16_matmul.MAX_ROWS + 1, 64), (2, 16, 64))  # a prefill: XLA's path
    assert not w4a16_matmul.supports((4, 64), (2, 32, 64))  # one byte a code (Q8_0): XLA's path
    assert not w4a16_matmul.supports((4, 64), (2, 16, 72))  # out-features not a multiple of 16
    codes, scales, mins = random_weight(64, 32, 0)
    with pytest.raises(ValueError, match="needs codes"):
        w4a16_matmul.w4a16_matmul(jnp.zeros((2, 96)), codes, scales, mins, interpret=True)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        w4a16_matmul.w4a16_matmul(jnp.zeros((2, 64), jnp.float16), codes, scales, mins, interpret=True)


def test_lowered_for_cuda_it_is_one_triton_kernel_reading_the_packed_codes():
    # From this CPU host, lowered for a CUDA GPU: the compiled kernel, not the interpreter; its operands
    # are the packed codes (K/2 x N bytes) as stored, and nothing in the program builds a float weight.
    k, n = 4096, 1024
    args = (jax.ShapeDtypeStruct((2, k), jnp.bfloat16), jax.ShapeDtypeStruct((k // 32, 16, n), jnp.uint8),
            jax.ShapeDtypeStruct((k // 32, n), jnp.float32), jax.ShapeDtypeStruct((k // 32, n), jnp.float32))
    with cuda_target():
        text = jax.jit(w4a16_matmul.w4a16_matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON_CALL) == 1
    assert f"tensor<{k // 32}x16x{n}xui8>" in text
    assert f"{k}x{n}xbf16" not in text and f"{k}x{n}xf32" not in text


TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)


def codes_params(seed: int = 0):
    """TINY's float32 params with every layer projection as packed 4-bit codes (random)."""
    params = jax.tree.map(np.asarray, init_params(TINY, jax.random.key(seed)))
    layers = {module: dict(leaves) for module, leaves in params["params"]["layers"].items()}
    for leaves in layers.values():
        for name in [n for n in gguf_blocks.PROJECTIONS if n in leaves]:
            shape = leaves.pop(name).shape  # [L, in..., out...] (o_proj: in = heads x head_dim)
            k = shape[1] * shape[2] if name == "o_proj" else shape[1]
            n = int(np.prod(shape[1:])) // k
            stack = [random_weight(k, n, seed + 10 * i + len(name)) for i in range(shape[0])]
            for suffix, part in zip(gguf_blocks.SUFFIXES, zip(*stack)):
                leaves[name + suffix] = np.stack([p * np.float32(0.05) if suffix != "_codes" else p for p in part])
    return {**params, "params": {**params["params"], "layers": layers}}


def test_the_gpu_path_chooses_the_kernel_for_packed_codes_only():
    params = codes_params()
    on = lambda platform, p=params: w4a16_matmul.NAME in gguf_blocks.cpu_matmul_kernels(p, platform, None, TINY)
    assert on("cuda") and not on("cpu")
    bytes_a_code = jax.tree_util.tree_map_with_path(
        lambda path, x: np.concatenate([x & 15, x >> 4], axis=-2) if gguf_blocks.leaf_name(path).endswith("_codes") else x,
        params)
    assert not on("cuda", bytes_a_code)  # one byte a code (Q8_0): XLA dequantizes
    assert not on("cuda", init_params(TINY, jax.random.key(0)))  # float weights


def test_steps_through_the_kernel_equal_the_cpu_paths(monkeypatch):
    """The runner as on a GPU (its kernels chosen for "cuda", per-layer weights), its layer projections
    multiplied by the kernel (interpreted here), against the CPU runner's own paths (XLA's dequantize-then-
    dot, or the C++ kernels): a prefill of 5 tokens, then 3 decode steps, logits within float32 rounding;
    and the decode step lowered for CUDA runs a Triton kernel per layer projection."""
    from conftest import make_scheduler_output, make_seq

    from jaxpaged.device.runner import ModelRunner

    params = codes_params()
    kwargs = dict(num_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32,
                  buckets=(16,), per_layer_weights=True)
    plain = ModelRunner(TINY, params, **kwargs)
    choose = runner_module.cpu_matmul_kernels
    monkeypatch.setattr(runner_module, "cpu_matmul_kernels", lambda p, platform, tp, c: choose(p, "cuda", tp, c))
    kernel = ModelRunner(TINY, params, **kwargs)
    assert w4a16_matmul.NAME in kernel.matmul_kernels and w4a16_matmul.NAME not in plain.matmul_kernels
    logits = {}
    for name, runner in (("plain", plain), ("kernel", kernel)):
        seq = make_seq([3, 14, 15, 9, 26], 0, [0, 1])
        rows = [np.asarray(runner.run(make_scheduler_output([seq], [5])))[0]]
        for _ in range(3):
            seq.num_computed_tokens = len(seq.token_ids)
            seq.token_ids.append(int(np.argmax(rows[-1])))
            rows.append(np.asarray(runner.run(make_scheduler_output([seq], [1])))[0])
        logits[name] = np.stack(rows)
    scale = np.abs(logits["plain"]).max()
    np.testing.assert_allclose(logits["kernel"], logits["plain"], atol=1e-5 * scale, rtol=0)
    with cuda_target():
        decode = kernel.dummy_step_input(kernel.decode_buckets[-1], decode_only=True)
        text = kernel.trace_step(decode).lower(lowering_platforms=("cuda",)).as_text()
    # (the reference attention here: every Triton kernel is the matmul's; one function per shape, called per projection)
    assert TRITON_CALL in text and len(re.findall(r"call @w4a16_matmul(?:_\d+)?\b", text)) == 7 * TINY.num_layers


def test_an_awq_checkpoint_served_through_the_kernel_gives_hf_greedy_tokens(tmp_path, monkeypatch):
    """An engine on an AutoAWQ checkpoint (tests/quant_checkpoints.py) whose runner picks its matmul kernels
    as on a GPU: every layer projection through the kernel (interpreted here; the prefill's 16 rows too),
    greedy tokens equal Hugging Face float32's on the format's own dequantized weights."""
    pytest.importorskip("torch")  # the checkpoint writers and HF oracle (the newest-JAX chroot has none)
    from quant_checkpoints import hf_greedy, hf_model, write_awq

    from jaxpaged import LLM, SamplingParams

    path, oracle = write_awq(str(tmp_path / "awq"))
    choose = runner_module.cpu_matmul_kernels
    monkeypatch.setattr(runner_module, "cpu_matmul_kernels", lambda p, platform, tp, c: choose(p, "cuda", tp, c))
    llm = LLM(path, max_model_len=64, num_pages=32, max_num_batched_tokens=16, warmup=False, per_layer_weights=True)
    assert w4a16_matmul.NAME in llm.engine.runner.matmul_kernels
    prompts = [[5, 17, 99, 3, 200, 41], [250, 12, 7, 7, 88, 160, 33, 2, 9]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    hf = hf_model(oracle)
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 8)


def test_the_static_profiles_w4a16_tree_is_the_tree_an_awq_checkpoint_loads_as(tmp_path):
    """benchmarks/bench_h100_static --quantized profiles abstract W4A16 leaves (static_profile.step_profile
    quantized_shapes "w4a16"): the names, shapes and dtypes an AWQ checkpoint really loads as."""
    pytest.importorskip("torch")  # the checkpoint writers and HF oracle (the newest-JAX chroot has none)
    from quant_checkpoints import write_awq

    from jaxpaged.models.llama import param_shapes
    from jaxpaged.models.weights import load_model
    from jaxpaged.static_profile.step_profile import quantized_shapes

    config, params, _ = load_model(write_awq(str(tmp_path / "awq"))[0], "float32")
    profiled = quantized_shapes(param_shapes(config), "w4a16")
    shape = lambda tree: jax.tree_util.tree_map_with_path(lambda p, x: (jax.tree_util.keystr(p), x.shape, x.dtype), tree)
    assert sorted(jax.tree.leaves(shape(profiled), is_leaf=lambda x: isinstance(x, tuple))) == sorted(
        jax.tree.leaves(shape(params), is_leaf=lambda x: isinstance(x, tuple)))
