"""GGUF codes in panels against Q8_1 activations (jaxpaged/ops/cpu/gguf_panels_q8.cc, ops/gguf_panels.py:
gguf_activations="q8_1") against a numpy oracle of GGUF's arithmetic.

The oracle quantizes x as llama.cpp's Q8_1 defines it (per row and block of 32: d = max |x| / 127, as
a product by float32 1/127 here,
q = x * (1 / d) rounded to nearest even, s = d * sum(q)), sums code * q exactly in int64 per block, and
adds (scale * d) * sum + min * s over the blocks in float64. The kernel's integer sums are exact, so it
may differ only by float32 rounding of the per-block terms. The panels come from the runner's own
conversion (`to_panels`); other layers of a stack hold NaN scales, so reading the wrong layer poisons
the result. Rows cover one 16-row pass and several, with tails; codes one byte each (Q8_0) and packed
two per byte (Q4_0 / Q4_1).
"""

import itertools
import platform

import jax
import numpy as np
import pytest

from jaxpaged.ops import cpu_kernels
from jaxpaged.ops import gguf_panels as gp
from test_gguf_matmul import oracle as float_oracle  # GGUF's layout, one layer, float64 dequantized product
from test_gguf_matmul import poison_other_layers, stacked_weight  # codes [L, K/32, 32, N], scales, mins
from test_gguf_panels import served  # the same weight as the runner's panels

q8_kernel_only = pytest.mark.skipif(not cpu_kernels.register(gp.Q8_NAME), reason="no C++ compiler: no kernel here")


def q8_1(x: np.ndarray):
    """numpy Q8_1: q int64 [M, K], d and s float32 [M, K/32]."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    d = (np.abs(blocks).max(-1) * np.float32(1 / 127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint((blocks * inv[..., None]).astype(np.float32)).astype(np.int64)  # rint: to nearest even
    return q.reshape(m, k), d, (d * q.sum(-1).astype(np.float32)).astype(np.float32)


def oracle(x, codes, scales, mins, layer):
    """y [M, N] float64 of GGUF's arithmetic on layer `layer` of codes [L, K/32, 32, N] (one per byte)."""
    q, d, s = q8_1(x)
    m, k = x.shape
    c = codes[layer].astype(np.int64)  # [K/32, 32, N]
    dots = np.einsum("mbi,bin->mbn", q.reshape(m, k // 32, 32), c)  # exact integers
    sc, mn = scales[layer].astype(np.float64), mins[layer].astype(np.float64)  # [K/32, N]
    return (dots * sc[None] * d[..., None] + mn[None] * s[..., None].astype(np.float64)).sum(1)


def test_quantization_is_llama_cpps_q8_1():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 96)).astype(np.float32) * np.array([1e-3, 1, 30, 1, 1], np.float32)[:, None]
    x[1, 32:64] = 0  # a block of zeros: d = 0, q = 0
    x[2, :32] = np.linspace(-1, 1, 32) * 127 / 2  # x / d lands on halves: ties go to even
    q, d, s = (np.asarray(a) for a in gp.quantize_q8_1(x))
    wq, wd, ws = q8_1(x)
    np.testing.assert_array_equal(q, wq)
    np.testing.assert_array_equal(d, wd)
    np.testing.assert_array_equal(s, ws)
    assert q.dtype == np.int8 and np.abs(q).max() == 127 and d[1, 1] == 0 and not q[1, 32:64].any()
    # every x lies within half a step of its block's value
    assert np.all(np.abs(q.reshape(5, 3, 32) * d[..., None] - x.reshape(5, 3, 32)) <= d[..., None] / 2 * (1 + 1e-6))


@q8_kernel_only
@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "packed"])
@pytest.mark.parametrize("m", [1, 7, 16, 37])
@pytest.mark.parametrize("k,n", [(32, 16), (160, 144), (576, 192)])
def test_kernel_matches_the_integer_oracle(m, k, n, packed):
    num_layers, layer = 3, 1
    codes, scales, mins = stacked_weight(num_layers, k, n, seed=m * 100 + n, bits=4 if packed else 8)
    panels, _ = served(codes, poison_other_layers(scales, layer), mins, packed)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = np.asarray(jax.jit(gp.gguf_panels_q8)(x, *panels, jax.numpy.int32(layer)), np.float64)
    want = oracle(x, codes, scales, mins, layer)
    _, d, _ = q8_1(x)
    parts = scales[layer][:, None] * codes[layer] + np.abs(mins[layer])[:, None]  # |scale * code| + |min|
    terms = np.abs(x) @ parts.reshape(k, n).astype(np.float64)  # bounds each block's two float32 terms
    assert got.shape == (m, n) and np.all(np.abs(got - want) <= 8 * (k // 32) * np.finfo(np.float32).eps * terms
                                          + 1e-6)
    # Q8_1 is not float32: the product is the float one within half a quantization step per activation
    w_abs = np.abs(float_oracle(np.eye(k, dtype=np.float32), codes, scales, mins, layer))  # |W| [K, N]
    step = np.repeat(d, 32, axis=1) / 2  # [M, K]
    assert np.all(np.abs(want - float_oracle(x, codes, scales, mins, layer)) <= step @ w_abs * (1 + 1e-5) + 1e-6)
    # XLA's forms: the plain reference, and Q8_1's values times the float weight
    np.testing.assert_allclose(np.asarray(gp.reference_q8_1(x, *panels, layer)), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gp.reference(np.asarray(gp.dequantized_q8_1(x)), *panels, layer)), want,
                               rtol=1e-4, atol=1e-4)


@q8_kernel_only
def test_bad_shapes_are_refused_with_what_to_pass():
    codes, scales, mins = stacked_weight(1, 64, 32, seed=1, bits=8)
    panels, _ = served(codes, scales, mins, False)
    with pytest.raises(ValueError, match=r"needs codes \[L, N/16, 96, 16\]"):
        gp.gguf_panels_q8(np.ones((2, 96), np.float32), *panels)
    with pytest.raises(Exception, match="gguf_panels_q8: layer index out of range"):
        jax.block_until_ready(jax.jit(gp.gguf_panels_q8)(np.ones((2, 64), np.float32), *panels, jax.numpy.int32(1)))


@q8_kernel_only
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_the_build_without_vnni_computes_the_same():
    """-march=x86-64-v3 (AVX2, no VNNI): the kernel's plain C++ sums, and no AVX-512 quantization."""
    if not cpu_kernels.register(gp.Q8_NAME, "x86-64-v3"):
        pytest.skip("the compiler cannot build for -march=x86-64-v3")
    for m, (k, n), packed in itertools.product([3, 18], [(96, 48), (160, 272)], (False, True)):
        codes, scales, mins = stacked_weight(2, k, n, seed=m, bits=4 if packed else 8)
        panels, _ = served(codes, scales, mins, packed)
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(gp.gguf_panels_q8(x, *panels, 1, march="x86-64-v3")),
                                   oracle(x, codes, scales, mins, 1), rtol=1e-4, atol=1e-3,
                                   err_msg=f"{m=} {k=} {n=} {packed=}")
