"""The CPU kernel for a tied LM head kept as GGUF codes in 16-column panels (jaxpaged/ops/cpu/gguf_panels.cc)
against a float64 numpy oracle, and the panels' XLA forms (ops/gguf_panels.py) against plain numpy.

The oracle dequantizes the embedding E [N, K] from its row-major codes (scales * codes + mins per block
of 32, as gguf_blocks documents), multiplies x @ E^T in float64, and the kernel's float32 sums must land
within float32 rounding of it. The panels are built by gguf_blocks.panel_leaves, as the loader does, so
a mix-up of panel, k or column order shows as a wrong product. Shapes cover the kernel's tails: one
8-row pass and several, rows not a multiple of 8, an odd number of panels (a last lone panel), one
panel only, K of one block and of many.
"""

import itertools
import platform

import jax
import numpy as np
import pytest

from jaxpaged.models.gguf_blocks import BlockCodes, panel_leaves
from jaxpaged.ops import cpu_kernels
from jaxpaged.ops import gguf_panels as gp

kernel_only = pytest.mark.skipif(not gp.available(), reason="no C++ compiler: the kernel cannot be built here")


def embedding(n: int, k: int, seed: int):
    """A Q8_0-like embedding [N, K] as codes (0..255), scales and mins per block of 32; its panels."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    scales = (rng.random((n, k // 32), dtype=np.float32) * 0.02).astype(np.float32)
    mins = (scales * np.float32(-128)).astype(np.float32)
    blocks = BlockCodes(codes, scales, mins)
    leaves = panel_leaves(blocks)
    return blocks, tuple(leaves["embedding" + s] for s in ("_codes", "_scales", "_mins"))


def oracle(x: np.ndarray, blocks: BlockCodes) -> np.ndarray:
    return x.astype(np.float64) @ blocks.dequantize().astype(np.float64).T


@kernel_only
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 23, 64])
@pytest.mark.parametrize("k,n", [(32, 16), (96, 48), (576, 272), (256, 96)])
def test_kernel_matches_the_float64_oracle(m, k, n):
    blocks, panels = embedding(n, k, seed=m * 1000 + n)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = jax.jit(gp.gguf_panels)(x, *panels)
    assert got.shape == (m, n) and got.dtype == np.float32
    bound = k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(blocks.dequantize()).T)  # float32 sums of k terms
    assert np.all(np.abs(np.asarray(got, np.float64) - oracle(x, blocks)) <= bound + 1e-6)


def test_xla_forms_dequantize_to_the_embedding():
    blocks, panels = embedding(48, 96, seed=3)
    floats = blocks.dequantize()
    np.testing.assert_array_equal(np.asarray(gp.weight(*panels)), floats.T)  # the same floats, bit for bit
    ids = np.array([0, 47, 16, 15, 31, 3], np.int32)
    np.testing.assert_array_equal(np.asarray(gp.rows(*panels, ids)), floats[ids])
    x = np.random.default_rng(3).standard_normal((5, 96)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(gp.reference(x, *panels)), oracle(x, blocks), rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused_with_what_to_pass():
    _, (codes, scales, mins) = embedding(32, 64, seed=1)
    with pytest.raises(ValueError, match=r"needs codes \[N/16, 96, 16\] and scales, mins \[N/16, 3, 16\]"):
        gp.gguf_panels(np.ones((2, 96), np.float32), codes, scales, mins)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and codes \[N/16, K, 16\]"):
        gp.gguf_panels(np.ones((2, 64), np.float32), codes[0], scales, mins)
    with pytest.raises(ValueError, match=r"scales, mins \[N/16, 2, 16\]"):
        gp.gguf_panels(np.ones((2, 64), np.float32), codes, scales[:, :1], mins)


@kernel_only
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "generic"])
def test_the_avx2_and_generic_builds_compute_the_same(march):
    if not cpu_kernels.register(gp.NAME, march):
        pytest.skip(f"the compiler cannot build for -march={march}")
    for m, (k, n) in itertools.product([3, 16], [(96, 48), (160, 272)]):
        blocks, panels = embedding(n, k, seed=m)
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(gp.gguf_panels(x, *panels, march=march)), oracle(x, blocks),
                                   rtol=1e-5, atol=1e-3, err_msg=f"{m=} {k=} {n=}")
