"""The CPU kernel for GGUF codes (jaxpaged/ops/cpu/gguf_matmul.cc) against a float64 numpy oracle.

The oracle dequantizes the chosen layer itself (scales * codes + mins, as gguf_blocks documents) and
multiplies in float64; the kernel's float32 sums must land within float32 rounding of it. The other
layers of the stack hold NaN scales, so a read of the wrong layer (or past a strip, a chunk or a
block group) poisons the result. Shapes cover the kernel's paths and tails: up to 8 rows (codes
dequantized in registers) and more (a dequantized group in a buffer), rows not a multiple of its 8-row
passes nor of its 64-row tasks, columns ending in a 16-wide half strip and in a partial 128-column
task, and K spanning more and fewer block groups (2 blocks of 32) than one; each with one code per
byte (Q8_0's 0..255) and with 4-bit codes packed two per byte (Q4_0 / Q4_1, models/gguf_blocks.py).
"""

import itertools
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.gguf_blocks import pack_nibbles
from jaxpaged.ops import cpu_kernels
from jaxpaged.ops import gguf_matmul as gm

pytestmark = pytest.mark.skipif(not gm.available(), reason="no C++ compiler: the kernel cannot be built here")


def stacked_weight(num_layers: int, k: int, n: int, seed: int, bits: int = 8):
    """codes [L, K/32, 32, N] below 2**bits (one per byte: the oracle's), scales, mins."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2 ** bits, (num_layers, k // 32, 32, n), dtype=np.uint8)
    scales = (rng.random((num_layers, k // 32, n), dtype=np.float32) * 0.02).astype(np.float32)
    mins = (-rng.random((num_layers, k // 32, n), dtype=np.float32) * 2.0).astype(np.float32)
    return codes, scales, mins


def oracle(x: np.ndarray, codes, scales, mins, layer: int) -> np.ndarray:
    k, n = x.shape[1], scales.shape[-1]
    weight = scales[layer][:, None, :] * codes[layer].astype(np.float32) + mins[layer][:, None, :]  # float32, as gguf
    return x.astype(np.float64) @ weight.reshape(k, n).astype(np.float64)


def poison_other_layers(scales: np.ndarray, layer: int) -> np.ndarray:
    scales = scales.copy()
    scales[np.arange(len(scales)) != layer] = np.nan
    return scales


def kernel_codes(codes: np.ndarray, packed: bool) -> np.ndarray:
    """The codes as the kernel takes them: [L, K/32, 32, N], or packed [L, K/32, 16, N]."""
    return pack_nibbles(codes) if packed else codes


@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "packed"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 23, 64, 130, 520])
@pytest.mark.parametrize("k,n", [(32, 16), (96, 48), (160, 144), (576, 272), (256, 192)])
def test_kernel_matches_the_float64_oracle(m, k, n, packed):
    num_layers, layer = 3, 1
    codes, scales, mins = stacked_weight(num_layers, k, n, seed=m * 1000 + n, bits=4 if packed else 8)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    want = oracle(x, codes, scales, mins, layer)
    got = jax.jit(gm.gguf_matmul)(x, kernel_codes(codes, packed), poison_other_layers(scales, layer), mins,
                                  jnp.int32(layer))
    assert got.shape == (m, n) and got.dtype == jnp.float32
    # float32 sums of k terms: error bounded by ~k * eps * sum |x w|
    bound = k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(oracle(np.eye(k, dtype=np.float32), codes, scales,
                                                                           mins, layer)))
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-6)


@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "packed"])
def test_one_layer_of_leaves_and_the_reference_agree(packed):
    codes, scales, mins = stacked_weight(1, 64, 32, seed=5, bits=4 if packed else 8)
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32)
    given = kernel_codes(codes, packed)
    got = gm.gguf_matmul(x, given[0], scales[0], mins[0])  # [K/32, 32 or 16, N]: one layer, index 0
    np.testing.assert_allclose(np.asarray(got), oracle(x, codes, scales, mins, 0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gm.reference(x, given, scales, mins, 0)), np.asarray(got), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["bytes", "packed"])
def test_layer_index_traced_in_a_scan_reads_each_layer(packed):
    """As the model calls it: the whole stack a loop invariant, the layer the scan's index."""
    num_layers, k, n = 4, 128, 64
    codes, scales, mins = stacked_weight(num_layers, k, n, seed=7, bits=4 if packed else 8)
    x = np.random.default_rng(7).standard_normal((5, k)).astype(np.float32)
    given = kernel_codes(codes, packed)

    def body(_, layer):
        return None, gm.gguf_matmul(x, given, scales, mins, layer)

    _, ys = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(num_layers, dtype=jnp.int32)))()
    for layer in range(num_layers):
        np.testing.assert_allclose(np.asarray(ys[layer]), oracle(x, codes, scales, mins, layer), rtol=1e-5, atol=1e-3)


def test_bad_shapes_and_layers_are_refused_with_what_to_pass():
    codes, scales, mins = stacked_weight(2, 64, 48, seed=1)
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"needs codes \[L, 3, 32, N\] \(packed: \[L, 3, 16, N\]\)"):
        gm.gguf_matmul(np.ones((2, 96), np.float32), codes, scales, mins)
    with pytest.raises(ValueError, match=r"needs codes \[L, 2, 32, N\]"):  # 8 rows a block: neither layout
        gm.gguf_matmul(x, codes[:, :, :8], scales, mins)
    odd = stacked_weight(1, 64, 40, seed=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        gm.gguf_matmul(x, *odd)
    with pytest.raises(Exception, match="layer index out of range"):  # checked where the call runs
        jax.block_until_ready(jax.jit(gm.gguf_matmul)(x, codes, scales, mins, jnp.int32(2)))


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "broken.cc").write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="compiling broken.cc failed"):
        cpu_kernels.build("broken", cpu_kernels.compiler(), sources=tmp_path)
    assert not list((tmp_path / "cache").glob("kernels/*.so"))  # nothing half-written is left to be loaded later


def test_the_environment_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    assert not gm.enabled()
    monkeypatch.delenv(cpu_kernels.DISABLE_ENV)
    assert gm.enabled() and os.path.isdir(cpu_kernels.cache_dir())


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "generic"])
def test_the_avx2_and_generic_builds_compute_the_same(march):
    """The host here has AVX-512; CI or a user's machine may not: the kernel built for AVX2 (two
    256-bit halves per vector, the AVX2 code conversion) and for plain x86-64 (no intrinsics)."""
    if not cpu_kernels.register(gm.NAME, march):
        pytest.skip(f"the compiler cannot build for -march={march}")
    for (m, k, n), packed in itertools.product([(3, 96, 144), (16, 160, 48), (23, 64, 272)], (False, True)):
        codes, scales, mins = stacked_weight(2, k, n, seed=m, bits=4 if packed else 8)
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        got = gm.gguf_matmul(x, kernel_codes(codes, packed), poison_other_layers(scales, 1), mins, 1, march=march)
        np.testing.assert_allclose(np.asarray(got), oracle(x, codes, scales, mins, 1), rtol=1e-5, atol=1e-3,
                                   err_msg=f"{m=} {k=} {n=} {packed=}")
