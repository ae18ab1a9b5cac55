"""Quantized KV cache (jaxpaged/ops/kv_quant.py): int8 / float8_e4m3fn pages with a scale per (token, head).

Kernel tests reuse the hostile cases of the float tests (pallas_kernels.testing.make_case: random
page ids, NaN in every page and slot a sequence does not own, lengths 0, 1, page_size +- 1, long).
The kernel gets the case's pages quantized (a NaN slot quantizes to a NaN scale, so the poison
survives quantization); the oracle is the float reference over the oracle layout quantized and then
dequantized *explicitly* here. Both see bit-identical dequantized values (quantization is per token,
so the layout does not change it), hence the float tolerances: 1e-5 for float32 queries and
dequantization math.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model_runner import _runner, tiny_params  # noqa: F401 (fixture)

from jaxpaged.ops.attention import chunked_paged_attention, chunked_paged_attention_from_buffer, reference_paged_attention
from jaxpaged.config import EngineConfig
from jaxpaged.ops.kv_quant import QuantizedKV, dequantize, hadamard, quantize, rotate
from jaxpaged.device.kv_cache import kv_cache_bytes_per_page, num_pages_for_budget
from jaxpaged.device.runner import apply_page_copies
from pallas_kernels import decode_attention, decode_attention_from_buffer, ragged_paged_attention
from pallas_kernels.jax_compat import cuda_target
from pallas_kernels.testing import make_case

QDTYPES = ["int8", "float8_e4m3fn"]
TOL = 1e-5
oracle = jax.jit(reference_paged_attention, static_argnames=("scale", "soft_cap"))


def quantized_pool(pages: np.ndarray, dtype: str) -> QuantizedKV:
    values, scales = quantize(jnp.asarray(pages), dtype)
    return QuantizedKV(values, scales)


def explicit_dequant(pages: np.ndarray, dtype: str) -> np.ndarray:
    values, scales = quantize(jnp.asarray(pages), dtype)
    return np.asarray(dequantize(values, scales))


# --- quantize / dequantize ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rel_bound", [("int8", 0.5 / 127), ("float8_e4m3fn", 2.0**-4)])
def test_round_trip_error_bound_and_zero_vectors(dtype, rel_bound):
    x = np.random.default_rng(0).standard_normal((5, 3, 64)).astype(np.float32) * 10
    x[0, 0] = 0.0  # amax = 0: scale 1, exact zeros, no NaN
    values, scales = quantize(jnp.asarray(x), dtype)
    assert values.dtype == (jnp.int8 if dtype == "int8" else jnp.uint8) and scales.shape == (5, 3)  # fp8 as bits
    back = np.asarray(dequantize(values, scales))
    np.testing.assert_array_equal(back[0, 0], 0.0)
    amax = np.abs(x).max(-1, keepdims=True)
    # int8: rounding error <= scale / 2 = amax / 254; fp8 (3 mantissa bits): <= 2^-4 relative.
    bound = rel_bound * (amax if dtype == "int8" else np.maximum(np.abs(x), amax / 448 * 2.0**-6))
    assert np.all(np.abs(back - x) <= bound * 1.0001 + 1e-7)
    assert np.abs(back).max() == pytest.approx(np.abs(x).max(), rel=1e-6)  # amax is exact


@pytest.mark.parametrize("dtype,qmax", [("int8", 127.0), ("float8_e4m3fn", 448.0)])
def test_scale_is_amax_over_the_format_maximum_and_the_amax_element_hits_it(dtype, qmax):
    """The scale is pinned, not just bounded: amax / 127 (int8) or amax / 448 (float8_e4m3fn's largest
    finite value), so the largest element of each vector is stored as +-qmax and the format's range
    is used whole (a smaller qmax would pass an error bound and waste fp8's top binades)."""
    x = np.array([[0.5, -3.0, 1.25, 2.0], [7.0, 0.0, -1.0, 6.5]], np.float32)
    values, scales = quantize(jnp.asarray(x), dtype)
    np.testing.assert_allclose(np.asarray(scales), np.abs(x).max(-1) / qmax, rtol=1e-7)
    stored = np.asarray(dequantize(values, jnp.ones_like(scales)))  # the stored values, unscaled
    np.testing.assert_array_equal(stored[0, 1], -qmax)
    np.testing.assert_array_equal(stored[1, 0], qmax)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_the_hadamard_basis_is_orthonormal_symmetric_and_its_own_inverse(head_dim):
    h = hadamard(head_dim)
    np.testing.assert_allclose(h @ h, np.eye(head_dim), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    block = head_dim & -head_dim  # 64, 32 (96 = 3 x 32), 128
    assert np.all(np.abs(h[:block, :block]) == np.float32(block**-0.5)) and np.count_nonzero(h) == head_dim * block
    x = np.random.default_rng(1).standard_normal((3, 2, head_dim)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(rotate(rotate(jnp.asarray(x)))), x, atol=1e-5)


def test_int8_in_the_hadamard_basis_keeps_the_scores_of_keys_with_outlier_channels():
    """SmolLM2's keys: a few channels ~10x the rest. Per-token int8 scales set by them leave the other
    channels a few steps; in the Hadamard basis (what the model stores for int8) the amax falls towards
    the rms and the score error q . (k - k~) drops several times. Scores are unchanged by the basis."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((512, 64)).astype(np.float32)
    q = rng.standard_normal((64,)).astype(np.float32)
    k[:, [5, 37]] *= 12.0  # two outlier channels (a RoPE pair), as in SmolLM2's keys
    q[[5, 37]] *= 3.0
    plain = np.asarray(dequantize(*quantize(jnp.asarray(k), "int8")))
    k_rot, q_rot = np.asarray(rotate(jnp.asarray(k))), np.asarray(rotate(jnp.asarray(q)))
    np.testing.assert_allclose(k_rot @ q_rot, k @ q, rtol=1e-4, atol=1e-3)
    rotated = np.asarray(dequantize(*quantize(jnp.asarray(k_rot), "int8")))
    err_plain = np.abs((plain - k) @ q).mean()
    err_rotated = np.abs((rotated - k_rot) @ q_rot).mean()
    assert err_rotated < err_plain / 2.5, (err_plain, err_rotated)  # measured 3.0x


def test_config_validates_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'.*use one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="mosaic.*kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="mosaic", dtype="bfloat16")
    assert EngineConfig(kv_cache_dtype="float8_e4m3fn").kv_cache_dtype == "float8_e4m3fn"


def test_pool_sizing_counts_the_scales(tiny_params):
    from test_model_runner import TINY

    float_page = kv_cache_bytes_per_page(TINY, 16)
    int8_page = kv_cache_bytes_per_page(TINY, 16, "int8")
    per_slot = TINY.num_layers * 2 * TINY.num_kv_heads * 16
    assert float_page == per_slot * TINY.head_dim * 4
    assert int8_page == per_slot * (TINY.head_dim + 4)  # values + a float32 scale per (token, head)
    assert kv_cache_bytes_per_page(TINY, 16, "float8_e4m3fn") == int8_page
    assert num_pages_for_budget(TINY, 16, 100 * int8_page, "int8") == 100
    runner = _runner(tiny_params, num_pages=10, page_size=16, kv_cache_dtype="int8")
    assert runner.kv_cache_bytes() == 10 * int8_page


# --- CPU attention (reference, chunked, whole-buffer) ---------------------------------------------


def _mixed_case(dtype_seed=0, page_size=8, head_dim=32):
    seq_lens = [1, page_size - 1, page_size, page_size + 1, 0, 5 * page_size + 3]
    q_lens = [1, 3, page_size, 2, 0, 7]
    return make_case(np.random.default_rng(dtype_seed), seq_lens=seq_lens, q_lens=q_lens, num_kv_heads=2,
                     group=3, head_dim=head_dim, page_size=page_size, dtype=np.float32, num_padding_tokens=3)


def _want(case, dtype, q=None, query_start_loc=None):
    q = case.q if q is None else q
    query_start_loc = case.query_start_loc if query_start_loc is None else query_start_loc
    return np.asarray(oracle(q, explicit_dequant(case.oracle_k_pages, dtype), explicit_dequant(case.oracle_v_pages, dtype),
                             case.oracle_block_tables, case.seq_lens, query_start_loc, scale=q.shape[-1] ** -0.5))


def _check(got, want, num_real):
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), "a NaN slot leaked: attention read past a length"
    np.testing.assert_array_equal(got[num_real:], 0.0)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    assert np.abs(want[:num_real]).max() > 0.1


@pytest.mark.parametrize("dtype", QDTYPES)
def test_cpu_attention_dequantizes_as_it_reads(dtype):
    case = _mixed_case()
    k, v = quantized_pool(case.k_pages, dtype), quantized_pool(case.v_pages, dtype)
    assert np.isnan(np.asarray(k.scales)).any()  # the poison survived quantization
    want, num_real = _want(case, dtype), int(case.query_start_loc[-1])
    q, args = jnp.asarray(case.q), tuple(map(jnp.asarray, (case.block_tables, case.seq_lens, case.query_start_loc)))
    scale = case.q.shape[-1] ** -0.5
    _check(reference_paged_attention(q, k, v, *args, scale=scale), want, num_real)
    _check(chunked_paged_attention(q, k, v, *args, scale=scale, pages_per_chunk=2), want, num_real)
    # Whole buffer: this layer (1) sits between two others full of NaN.
    buffer = jax.tree.map(lambda kk, vv: jnp.stack([jnp.full_like(jnp.stack([kk, vv]), jnp.nan), jnp.stack([kk, vv]),
                                                    jnp.full_like(jnp.stack([kk, vv]), jnp.nan)]), k, v)
    got = chunked_paged_attention_from_buffer(q, buffer, *args, layer_idx=jnp.int32(1), scale=scale,
                                              pages_per_chunk=2)
    _check(got, want, num_real)


def test_quantization_changes_the_result_measurably():
    """The quantized paths differ from float attention (so the tests above could not pass on float pages)."""
    case = _mixed_case()
    scale = case.q.shape[-1] ** -0.5
    args = (case.oracle_block_tables, case.seq_lens, case.query_start_loc)
    exact = np.asarray(oracle(case.q, case.oracle_k_pages, case.oracle_v_pages, *args, scale=scale))
    for dtype, bound in [("int8", 0.05), ("float8_e4m3fn", 0.2)]:
        err = np.abs(_want(case, dtype) - exact).max()
        assert 1e-4 < err < bound, (dtype, err)  # stated bound for unit-normal K/V, head_dim 32


# --- Pallas kernels, interpret mode ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", QDTYPES)
def test_pallas_ragged_on_quantized_pages(dtype):
    case = _mixed_case(page_size=16, head_dim=64)
    k, v = quantized_pool(case.k_pages, dtype), quantized_pool(case.v_pages, dtype)
    got = ragged_paged_attention(case.q, k, v, case.block_tables, case.seq_lens, case.query_start_loc,
                                 scale=64**-0.5, block_q=8, pages_per_compute_block=2, interpret=True)
    _check(got, _want(case, dtype), int(case.query_start_loc[-1]))


def _decode_case(page_size=16, head_dim=64, seed=0):
    seq_lens = [1, page_size - 1, page_size, page_size + 1, 0, 5 * page_size + 3]
    return make_case(np.random.default_rng(seed), seq_lens=seq_lens, q_lens=[1 if n else 0 for n in seq_lens],
                     num_kv_heads=2, group=3, head_dim=head_dim, page_size=page_size, dtype=np.float32)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_pallas_decode_on_quantized_pages(dtype):
    case = _decode_case()
    q = np.random.default_rng(1).standard_normal((6, 6, 64)).astype(np.float32)
    k, v = quantized_pool(case.k_pages, dtype), quantized_pool(case.v_pages, dtype)
    got = decode_attention(q, k, v, case.block_tables, case.seq_lens, scale=64**-0.5, num_splits=3,
                           pages_per_compute_block=2, interpret=True)
    want = _want(case, dtype, q=q, query_start_loc=np.arange(7, dtype=np.int32))
    got = np.asarray(got)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[4], 0.0)  # the length-0 row
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("page_size,head_dim,seed", [(8, 32, 1), (32, 128, 2), (16, 64, 3)])
def test_pallas_quantized_sweep(dtype, page_size, head_dim, seed):
    case = _decode_case(page_size, head_dim, seed)
    q = np.random.default_rng(seed).standard_normal((6, 6, head_dim)).astype(np.float32)
    kv = jax.tree.map(lambda kk, vv: jnp.stack([jnp.stack([kk, vv])] * 2),
                      quantized_pool(case.k_pages, dtype), quantized_pool(case.v_pages, dtype))
    got = decode_attention_from_buffer(q, kv, case.block_tables, case.seq_lens, layer_idx=1,
                                       scale=head_dim**-0.5, interpret=True)
    want = _want(case, dtype, q=q, query_start_loc=np.arange(7, dtype=np.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=TOL)
    case = _mixed_case(seed, page_size, head_dim)
    k, v = quantized_pool(case.k_pages, dtype), quantized_pool(case.v_pages, dtype)
    got = ragged_paged_attention(case.q, k, v, case.block_tables, case.seq_lens, case.query_start_loc,
                                 scale=head_dim**-0.5, interpret=True)
    _check(got, _want(case, dtype), int(case.query_start_loc[-1]))


# --- the runner's KV state ---------------------------------------------------------------------------


def test_page_copies_move_the_scales():
    shape = (2, 2, 2, 6, 4, 8)
    values, scales = quantize(jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32), "int8")
    kv = QuantizedKV(values, scales)
    after = apply_page_copies(kv, jnp.array([3, 1]), jnp.array([5, 6]))  # the second pair is dropped
    assert isinstance(after, QuantizedKV)
    for before_leaf, after_leaf in zip(kv, after):
        want = np.asarray(before_leaf).copy()
        want[:, :, :, 5] = want[:, :, :, 3]
        np.testing.assert_array_equal(np.asarray(after_leaf), want)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantized_state_is_donated_and_written_in_place(tiny_params, dtype):
    runner = _runner(tiny_params, num_pages=2048, page_size=16, buckets=(16,), max_num_batched_tokens=16,
                     kv_cache_dtype=dtype)
    assert isinstance(runner.kv_pages, QuantizedKV) and runner.kv_pages.pages.itemsize == 1
    step = runner.dummy_step_input(16)
    memory = runner.trace_step(step).lower().compile().memory_analysis()
    assert memory.alias_size_in_bytes == runner.kv_cache_bytes()  # both leaves alias their outputs
    assert memory.temp_size_in_bytes < runner.kv_cache_bytes() / 10
    old = runner.kv_pages
    runner.execute(step)
    assert all(leaf.is_deleted() for leaf in old) and not runner.kv_pages.pages.is_deleted()
    old = runner.kv_pages
    runner.copy_pages([(1, 2)])
    assert all(leaf.is_deleted() for leaf in old)


def test_mosaic_kernels_refuse_a_quantized_cache():
    from pallas_kernels.mosaic import ragged_paged_attention as mosaic_ragged

    kv = QuantizedKV(jnp.zeros((1, 2, 1, 4, 64, 64), jnp.int8), jnp.zeros((1, 2, 1, 4, 64), jnp.float32))
    ints = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="quantized.*kv_cache_dtype='auto'"):
        mosaic_ragged(jnp.zeros((4, 2, 64), jnp.bfloat16), kv, ints, jnp.ones(1, jnp.int32), jnp.array([0, 4]),
                      layer_idx=0, scale=0.125)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantized_kernels_lower_to_triton_for_cuda(dtype):
    """The whole-buffer kernels over a quantized buffer lower for CUDA (not run: no GPU here)."""
    from pallas_kernels import decode_attention_from_buffer, ragged_paged_attention_from_buffer

    kv = QuantizedKV(*quantize(jnp.ones((2, 2, 2, 8, 16, 64)), dtype))
    q, tables, lens = jnp.ones((4, 4, 64), jnp.bfloat16), jnp.ones((4, 4), jnp.int32), jnp.ones(4, jnp.int32)
    calls = [
        lambda q, kv: decode_attention_from_buffer(q, kv, tables, lens, layer_idx=1, scale=0.125, interpret=False),
        lambda q, kv: ragged_paged_attention_from_buffer(q, kv, tables, lens, jnp.arange(5, dtype=jnp.int32),
                                                         layer_idx=1, scale=0.125, interpret=False),
    ]
    for call in calls:
        with cuda_target():  # JAX >= 0.12's Triton lowering reads the GPU's kind; this host has none
            text = jax.jit(call).trace(q, kv).lower(lowering_platforms=("cuda",)).as_text()
        assert "stablehlo.custom_call @__gpu$xla.gpu.triton" in text, text[:500]
