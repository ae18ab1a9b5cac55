"""Static per-channel centring of a quantized KV cache (jaxpaged/device/kv_centres.py).

Centring is exact in float: a float32 cache that stores k - mu_k and v - mu_v (centres as large as
the K/V themselves) gives the logits of the plain cache. The calibration is the mean of the model's
own K/V over the calibration tokens, position 0 skipped, checked for layer 0 against K/V computed
here by hand from the weights. How much it buys on a quantized cache is the benchmark's
(benchmarks/kv_quant_accuracy.py); tests/test_kv_quant_engine.py and tests/test_engine_variants.py
run quantized engines with centring on.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from test_model_runner import TINY, _Pages, _run, _runner, make_seq, tiny_params  # noqa: F401 (fixture)

from jaxpaged.device.kv_centres import (
    CALIBRATION_NUM_TOKENS,
    calibrate_kv_centres,
    calibration_kv,
    calibration_token_ids,
)
from jaxpaged.models.llama import apply_rope, rope_inv_freq


def _steps(runner):
    """A chunked prefill (A: 6 then 3 tokens, so the second chunk reads cached and in-flight K/V),
    B's prefill beside it, then two decode steps of both: every step's logits."""
    pages = _Pages()
    seq_a, seq_b = make_seq(list(range(3, 12)), block_table=[]), make_seq(list(range(20, 27)), block_table=[])
    logits = [_run(runner, pages, [(seq_a, 6), (seq_b, 7)])]
    logits.append(_run(runner, pages, [(seq_a, 3), (seq_b, 1)]))
    for _ in range(2):
        logits.append(_run(runner, pages, [(seq_a, 1), (seq_b, 1)]))
    return logits, seq_a.token_ids + seq_b.token_ids


def test_centring_is_exact_in_float32(tiny_params):
    plain = _runner(tiny_params)
    centred = _runner(tiny_params)
    assert plain.kv_centres is None and centred.kv_centres is None  # "auto": no centring
    c = TINY
    centres = 3.0 * jax.random.normal(jax.random.key(1), (c.num_layers, 2, c.num_kv_heads, c.head_dim))
    centred.kv_centres = centres  # as large as the K/V themselves (~1 here)
    want, want_tokens = _steps(plain)
    got, got_tokens = _steps(centred)
    assert got_tokens == want_tokens
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)
    # The pages really hold k - mu_k, v - mu_v: page 1 (A's first page) differs by exactly the centres.
    diff = np.asarray(plain.kv_pages)[:, :, :, 1] - np.asarray(centred.kv_pages)[:, :, :, 1]  # [L, 2, K, ps, H]
    np.testing.assert_allclose(diff, np.broadcast_to(np.asarray(centres)[:, :, :, None], diff.shape), atol=1e-5)


def test_calibration_is_the_mean_of_the_models_own_kv(tiny_params):
    assert calibrate_kv_centres(TINY, tiny_params, "auto") is None
    assert calibrate_kv_centres(TINY, tiny_params, "float8_e4m3fn") is None  # fp8 is not centred (module doc)
    centres = np.asarray(calibrate_kv_centres(TINY, tiny_params, "int8"))
    assert centres.shape == (TINY.num_layers, 2, TINY.num_kv_heads, TINY.head_dim)
    # Layer 0 by hand: RMSNorm(embedding) -> k/v projections -> RoPE on k; mean over positions 1..
    p = jax.tree.map(np.asarray, tiny_params["params"])
    ids = calibration_token_ids(TINY.vocab_size)
    x = p["embedding"][ids]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + TINY.rms_norm_eps) * p["layers"]["input_norm"]["scale"][0]
    k = np.einsum("td,dkh->tkh", x, p["layers"]["attn"]["k_proj"][0])
    v = np.einsum("td,dkh->tkh", x, p["layers"]["attn"]["v_proj"][0])
    angles = np.arange(CALIBRATION_NUM_TOKENS)[:, None] * rope_inv_freq(TINY.head_dim, TINY.rope_theta, None)[None]
    k = np.asarray(apply_rope(jnp.asarray(k), jnp.cos(angles), jnp.sin(angles)))
    np.testing.assert_allclose(centres[0, 0], k[1:].mean(0), atol=1e-5)
    np.testing.assert_allclose(centres[0, 1], v[1:].mean(0), atol=1e-5)
    # calibration_kv (the studies' K/V) is the same K/V token by token, head-major, position 0 left out.
    kv = np.asarray(calibration_kv(TINY, tiny_params))
    assert kv.shape == (TINY.num_layers, 2, TINY.num_kv_heads, CALIBRATION_NUM_TOKENS - 1, TINY.head_dim)
    np.testing.assert_allclose(kv[0, 0], k[1:].transpose(1, 0, 2), atol=1e-5)
    np.testing.assert_allclose(kv[0, 1], v[1:].transpose(1, 0, 2), atol=1e-5)
    assert np.abs(centres[1]).max() > 0  # every layer calibrated
    # Soft-capped scores are not shift-invariant: there K is not centred, V still is.
    capped = calibrate_kv_centres(dataclasses.replace(TINY, attn_soft_cap=50.0), tiny_params, "int8")
    assert not np.asarray(capped[:, 0]).any() and np.asarray(capped[:, 1]).any()


def test_an_int8_runner_calibrates_its_centres(tiny_params):
    runner = _runner(tiny_params, kv_cache_dtype="int8")
    want = np.asarray(calibrate_kv_centres(TINY, tiny_params, "int8"))
    np.testing.assert_allclose(np.asarray(runner.kv_centres), want, atol=1e-6)
    assert _runner(tiny_params, kv_cache_dtype="float8_e4m3fn").kv_centres is None
