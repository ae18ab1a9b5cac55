"""The CPU kernel for GGUF codes in 16-column panels (jaxpaged/ops/cpu/gguf_panels.cc) against a float64
numpy oracle, the panels' XLA forms (ops/gguf_panels.py), and the conversions between GGUF's layout
and panels (models/gguf_blocks.py), as the loader and the runner make them.

Two uses: a tied LM head (the embedding E [N, K] as panels, `panel_leaves`: one weight, one byte per
code) and the layer projections the runner serves (`to_panels`: a stack of L weights, 4-bit codes
packed two per byte). The oracle dequantizes in GGUF's layout itself (scales * codes + mins per
block of 32) and multiplies in float64; the kernel's float32 sums must land within float32 rounding
of it. The panels come from the conversions, so a mix-up of panel, k, nibble or column order shows as a
wrong product; the other layers of a stack hold NaN scales, so reading the wrong layer poisons the
result. Shapes cover the kernel's tails: one 8-row pass and several, rows not a multiple of 8, an odd
number of panels (a last lone panel), one panel only, K of one block and of many.
"""

import itertools
import platform

import jax
import numpy as np
import pytest

from jaxpaged.models import gguf_blocks
from jaxpaged.models.gguf_blocks import BlockCodes, pack_nibbles, panel_leaves
from jaxpaged.ops import cpu_kernels
from jaxpaged.ops import gguf_panels as gp
from test_gguf_matmul import oracle as stack_oracle  # GGUF's layout, one layer, float64
from test_gguf_matmul import stacked_weight  # codes [L, K/32, 32, N], scales, mins

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


def served(codes, scales, mins, packed: bool):
    """A stack in GGUF's layout as the runner serves it: panels (4-bit codes packed two per byte first)."""
    tree = {"params": {"layers": {"mlp": {"up_proj_codes": pack_nibbles(codes) if packed else codes,
                                          "up_proj_scales": scales, "up_proj_mins": mins}}}}
    leaves = gguf_blocks.to_panels(tree)["params"]["layers"]["mlp"]
    return tuple(leaves["up_proj" + s] for s in gguf_blocks.PANEL_SUFFIXES), tree


@kernel_only
@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "packed"])
@pytest.mark.parametrize("m", [1, 9, 23])
@pytest.mark.parametrize("k,n", [(32, 16), (160, 144), (576, 192)])
def test_stacked_layers_served_as_panels_match_the_oracle(m, k, n, packed):
    num_layers, layer = 3, 1
    codes, scales, mins = stacked_weight(num_layers, k, n, seed=m * 100 + n, bits=4 if packed else 8)
    poisoned = scales.copy()
    poisoned[np.arange(num_layers) != layer] = np.nan
    panels, _ = served(codes, poisoned, mins, packed)
    assert gp.is_packed(panels[0].shape, k) == packed and panels[0].shape[-2] == (k // 2 if packed else k)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    got = jax.jit(gp.gguf_panels)(x, *panels, jax.numpy.int32(layer))
    want = stack_oracle(x, codes, scales, mins, layer)
    bound = k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(stack_oracle(np.eye(k, dtype=np.float32), codes, scales,
                                                                               mins, layer)))
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-6)
    np.testing.assert_allclose(np.asarray(gp.reference(x, *panels, layer)), want, rtol=1e-5, atol=1e-4)  # XLA's form


@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "packed"])
def test_panels_convert_back_to_the_same_leaves(packed):
    codes, scales, mins = stacked_weight(2, 96, 48, seed=4, bits=4 if packed else 8)
    panels, tree = served(codes, scales, mins, packed)
    back = gguf_blocks.from_panels({"params": {"layers": {"mlp": dict(zip(
        ("up_proj" + s for s in gguf_blocks.PANEL_SUFFIXES), panels))}}})["params"]["layers"]["mlp"]
    for suffix in gguf_blocks.SUFFIXES:
        np.testing.assert_array_equal(back["up_proj" + suffix], tree["params"]["layers"]["mlp"]["up_proj" + suffix])
    on_device = gguf_blocks.to_panels(jax.tree.map(jax.numpy.asarray, tree))["params"]["layers"]["mlp"]  # jnp too
    for suffix, want in zip(gguf_blocks.PANEL_SUFFIXES, panels):
        np.testing.assert_array_equal(np.asarray(on_device["up_proj" + suffix]), want)


def test_a_weight_of_columns_not_in_whole_panels_stays_in_ggufs_layout():
    tree = {"params": {"layers": {"mlp": dict(zip(("up_proj" + s for s in gguf_blocks.SUFFIXES),
                                                  stacked_weight(2, 64, 24, seed=2))),
                                  "attn": dict(zip(("q_proj" + s for s in gguf_blocks.SUFFIXES),
                                                   stacked_weight(2, 64, 32, seed=3)))}}}
    served = gguf_blocks.to_panels(tree)["params"]["layers"]
    assert sorted(served["mlp"]) == ["up_proj_codes", "up_proj_mins", "up_proj_scales"]  # 24 columns
    assert sorted(served["attn"]) == ["q_proj_panel_mins", "q_proj_panel_scales", "q_proj_panels"]


def test_bad_shapes_are_refused_with_what_to_pass():
    _, (codes, scales, mins) = embedding(32, 64, seed=1)
    with pytest.raises(ValueError, match=r"needs codes \[L, N/16, 96, 16\] \(packed: \[L, N/16, 48, 16\]\) and "
                                         r"scales, mins \[L, N/16, 3, 16\]"):
        gp.gguf_panels(np.ones((2, 96), np.float32), codes, scales, mins)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and codes \[L, N/16, K or K/2, 16\]"):
        gp.gguf_panels(np.ones((2, 64), np.float32), codes[0], scales, mins)
    with pytest.raises(ValueError, match=r"scales, mins \[L, N/16, 2, 16\]"):
        gp.gguf_panels(np.ones((2, 64), np.float32), codes, scales[:, :1], mins)
    with pytest.raises(Exception, match="layer index out of range"):  # checked where the call runs
        jax.block_until_ready(jax.jit(gp.gguf_panels)(np.ones((2, 64), np.float32), codes, scales, mins,
                                                      jax.numpy.int32(1)))


@kernel_only
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "generic"])
def test_the_avx2_and_generic_builds_compute_the_same(march):
    if not cpu_kernels.register(gp.NAME, march):
        pytest.skip(f"the compiler cannot build for -march={march}")
    for m, (k, n), packed in itertools.product([3, 16], [(96, 48), (160, 272)], (False, True)):
        codes, scales, mins = stacked_weight(2, k, n, seed=m, bits=4 if packed else 8)
        panels, _ = served(codes, scales, mins, packed)
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(gp.gguf_panels(x, *panels, 1, march=march)),
                                   stack_oracle(x, codes, scales, mins, 1), rtol=1e-5, atol=1e-3,
                                   err_msg=f"{m=} {k=} {n=} {packed=}")
