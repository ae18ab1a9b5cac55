"""The CPU kernel for float32 layer projections (jaxpaged/ops/cpu/dense_matmul.cc) against a float64
numpy oracle, and a float engine built with it against one built without it.

The other layers of the stack hold NaN, so a read of the wrong layer poisons the result. Shapes cover
the kernel's paths and tails (cpu/matmul.h): rows not a multiple of its 8-row passes and above its
512-row pass, columns ending in a 16-wide half strip and in a partial 128-column chunk, K not a
multiple of its 64-row groups nor of 32, K shorter than one group per thread.
"""

import math
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.ops import cpu_kernels
from jaxpaged.ops import dense_matmul as dm

pytestmark = pytest.mark.skipif(not dm.available(), reason="no C++ compiler: the kernel cannot be built here")


def stacked_weight(num_layers: int, k: int, n: int, seed: int, poison_all_but: int | None = None) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((num_layers, k, n)).astype(np.float32)
    if poison_all_but is not None:
        w[np.arange(num_layers) != poison_all_but] = np.nan
    return w


def oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64)


def within_float32_rounding(got, x, w) -> bool:
    """|got - x @ w| within k * eps * (|x| @ |w|): float32 sums of k terms, in any order."""
    bound = x.shape[1] * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    return bool(np.all(np.abs(np.asarray(got, np.float64) - oracle(x, w)) <= bound + 1e-6))


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 23, 64, 130, 520])
@pytest.mark.parametrize("k,n", [(16, 16), (40, 48), (160, 144), (576, 272), (100, 192)])
def test_kernel_matches_the_float64_oracle(m, k, n):
    num_layers, layer = 3, 1
    w = stacked_weight(num_layers, k, n, seed=m * 1000 + n + k, poison_all_but=layer)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = jax.jit(dm.dense_matmul)(x, w, jnp.int32(layer))
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert within_float32_rounding(got, x, w[layer])


def test_layer_index_traced_in_a_scan_reads_each_layer():
    """As the model calls it: the whole stack a loop invariant, the layer the scan's index."""
    num_layers, k, n = 4, 128, 64
    w = stacked_weight(num_layers, k, n, seed=7)
    x = np.random.default_rng(7).standard_normal((5, k)).astype(np.float32)
    _, ys = jax.jit(lambda: jax.lax.scan(lambda _, layer: (None, dm.dense_matmul(x, w, layer)), None,
                                         jnp.arange(num_layers, dtype=jnp.int32)))()
    for layer in range(num_layers):
        assert within_float32_rounding(ys[layer], x, w[layer])
    assert within_float32_rounding(dm.dense_matmul(x, w[2]), x, w[2])  # one layer [K, N]


def test_bad_shapes_and_layers_are_refused_with_what_to_pass():
    w = stacked_weight(2, 64, 48, seed=1)
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"needs a float32 w \[L, K, N\]"):
        dm.dense_matmul(np.ones((2, 96), np.float32), w)
    with pytest.raises(ValueError, match=r"needs a float32 w \[L, K, N\]"):
        dm.dense_matmul(x, w.astype(np.float16))
    with pytest.raises(ValueError, match="multiple of 16"):
        dm.dense_matmul(x, stacked_weight(1, 64, 40, seed=1))
    with pytest.raises(Exception, match="layer index out of range"):  # checked where the call runs
        jax.block_until_ready(jax.jit(dm.dense_matmul)(x, w, jnp.int32(2)))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "generic"])
def test_the_avx2_and_generic_builds_compute_the_same(march):
    if not cpu_kernels.register(dm.NAME, march):
        pytest.skip(f"the compiler cannot build for -march={march}")
    for m, k, n in [(3, 96, 144), (16, 160, 48), (23, 64, 272)]:
        w = stacked_weight(2, k, n, seed=m, poison_all_but=1)
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        assert within_float32_rounding(dm.dense_matmul(x, w, 1, march=march), x, w[1])


ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,", "Once upon a time"]
OTHER_KERNELS = "gguf_matmul,paged_attention,ragged_attention"  # every CPU kernel but this one


def weight_sized_slices(hlo: str) -> list[str]:
    """The program's dynamic-slices as large as a layer projection (a norm's is 576 floats)."""
    sizes = [(line, re.search(r"= f32\[([\d,]*)\]", line)) for line in hlo.splitlines() if "dynamic-slice(" in line]
    return [line for line, m in sizes if m and math.prod(int(d) for d in m.group(1).split(",") if d) >= 100_000]


@pytest.mark.parametrize("per_layer_weights", [False, True], ids=["scan", "per-layer"])
def test_float_engine_with_the_kernel_serves_xlas_tokens(per_layer_weights, monkeypatch):
    """The float32 engine on the CPU (a .gguf dequantized at load) multiplies its projections with the kernel, reading each
    layer's weight in the stack (no weight-sized slice copied); its greedy tokens and logprobs are
    those of the same engine with XLA's dots."""
    from jaxpaged import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, OTHER_KERNELS)
    xla = LLM(per_layer_weights=per_layer_weights, quantization="dequantize", **ENGINE)
    assert xla.engine.runner.matmul_kernels == frozenset()
    want = [o.outputs[0] for o in xla.generate(PROMPTS, greedy)]
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    llm = LLM(per_layer_weights=per_layer_weights, quantization="dequantize", **ENGINE)
    runner = llm.engine.runner
    assert runner.matmul_kernels == frozenset({dm.NAME})
    hlo = runner.trace_step(runner.dummy_step_input(runner.decode_buckets[-1], decode_only=True)).lower().compile().as_text()
    layers = len(runner.served_params["params"]["layers"]) if per_layer_weights else 1  # unrolled, or one scan body
    assert hlo.count('custom_call_target="jaxpaged_dense_matmul"') == 7 * layers
    assert not weight_sized_slices(hlo)
    xla_hlo = xla.engine.runner.trace_step(xla.engine.runner.dummy_step_input(
        xla.engine.runner.decode_buckets[-1], decode_only=True)).lower().compile().as_text()
    assert weight_sized_slices(xla_hlo) or per_layer_weights  # the check sees the scan's copies where they are
    got = [o.outputs[0] for o in llm.generate(PROMPTS, greedy)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a_out, b_out in zip(got, want):
        for a, b in zip(a_out.logprobs, b_out.logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([a[t].logprob for t in a], [b[t].logprob for t in a], atol=2e-4)
