"""The CPU decode-attention kernel (jaxpaged/ops/cpu/paged_attention.cc) and the backend wrapper.

Oracle: test_attention's float64 loop over each sequence's contiguous K/V (`_naive`), and for sliding
windows the plain `reference_paged_attention`. The pool is filled with NaN except the slots the
sequences own, the pages are a random permutation, the other layers of the buffer are NaN too: a read
of anything a sequence does not own poisons its row. Lengths sit on and around page boundaries.
"""

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import _naive

from jaxpaged.ops import cpu_attention, cpu_kernels
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer, reference_paged_attention
from jaxpaged.ops.kv_quant import zeros_kv_cache

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ compiler: the kernel cannot be built")


def paged_problem(page_size, num_heads, num_kv_heads, head_dim, seq_lens, seed=0, num_pages=40):
    """A 3-layer buffer (layer 1 real, 0 and 2 NaN) holding `seq_lens` keys per sequence on random pages,
    one query per sequence, and a padding row (seq_len 0) at the end."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(-(-n // page_size) for n in seq_lens) + 1
    kv = np.full((3, 2, num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    block_tables = np.zeros((len(seq_lens) + 1, pages_per_seq), np.int32)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        k, v = (rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32) for _ in range(2))
        ks.append(k.astype(np.float64))
        vs.append(v.astype(np.float64))
        for p in range(-(-n // page_size)):
            page_id = block_tables[i, p] = free.pop()
            rows = slice(p * page_size, min(n, (p + 1) * page_size))
            kv[1, 0, :, page_id, :rows.stop - rows.start] = k[rows].transpose(1, 0, 2)
            kv[1, 1, :, page_id, :rows.stop - rows.start] = v[rows].transpose(1, 0, 2)
    q = rng.standard_normal((len(seq_lens) + 1, num_heads, head_dim)).astype(np.float32)
    return q, kv, block_tables, np.array([*seq_lens, 0], np.int32), ks, vs


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_kernel_matches_the_float64_loop(page_size, num_heads, num_kv_heads, head_dim):
    seq_lens = [1, page_size - 1, page_size, page_size + 1, 3 * page_size + 2]
    q, kv, tables, lens, ks, vs = paged_problem(page_size, num_heads, num_kv_heads, head_dim, seq_lens)
    scale = head_dim**-0.5
    out = np.asarray(jax.jit(cpu_attention.paged_decode_attention, static_argnames=("scale", "sliding_window"))(
        q, kv, tables, lens, layer_idx=jnp.int32(1), scale=scale))
    want = _naive(q, ks, vs, [1] * len(seq_lens), seq_lens, scale, None)
    np.testing.assert_allclose(out[:-1], want, atol=2e-5, rtol=1e-5)
    assert np.all(out[-1] == 0), "a padding row (seq_len 0) gives zeros"


@pytest.mark.parametrize("window", [1, 3, 5, 40])
def test_sliding_window_reads_only_the_window(window):
    """Keys before the window are NaN as well: the kernel must not even read them."""
    page_size, seq_lens = 4, [1, 3, 4, 5, 9, 14]
    q, kv, tables, lens, _, _ = paged_problem(page_size, 4, 2, 16, seq_lens, seed=3)
    want = reference_paged_attention(*map(jnp.asarray, (q, kv[1, 0], kv[1, 1], tables, lens)),
                                     jnp.arange(len(lens) + 1, dtype=jnp.int32), scale=0.25, sliding_window=window)
    for i, n in enumerate(seq_lens):  # poison what the window leaves out
        for pos in range(max(0, n - window)):
            kv[1, :, :, tables[i, pos // page_size], pos % page_size] = np.nan
    got = cpu_attention.paged_decode_attention(q, kv, tables, lens, layer_idx=1, scale=0.25, sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_bad_inputs_are_refused_with_what_to_pass():
    q, kv, tables, lens, _, _ = paged_problem(4, 4, 2, 16, [5, 9])
    with pytest.raises(ValueError, match="head_dim % 16 == 0"):
        cpu_attention.paged_decode_attention(q[..., :8], kv[..., :8], tables, lens, layer_idx=1, scale=1.0)
    bad = tables.copy()
    bad[1, 1] = kv.shape[3]  # a page id past the pool
    with pytest.raises(Exception, match="page id out of range"):
        jax.block_until_ready(cpu_attention.paged_decode_attention(q, kv, bad, lens, layer_idx=1, scale=1.0))
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(cpu_attention.paged_decode_attention(q, kv, tables, lens, layer_idx=3, scale=1.0))


def _wrapped(kv, soft_cap=None, decode_only=True, kernels=(cpu_attention.NAME, cpu_attention.RAGGED)):
    """The wrapped backend, its arguments (sequences of 5 and 9 keys, one padding row) and keywords."""
    q, _, tables, lens, _, _ = paged_problem(4, 4, 2, 16, [5, 9])
    args = (jnp.asarray(q), kv, jnp.asarray(tables), jnp.asarray(lens), jnp.arange(len(lens) + 1, dtype=jnp.int32))
    kwargs = dict(layer_idx=jnp.int32(1), scale=0.25, soft_cap=soft_cap, decode_only=decode_only)
    return cpu_attention.with_cpu_kernels(chunked_paged_attention_from_buffer, frozenset(kernels)), args, kwargs


def test_the_backend_runs_each_kernel_only_where_it_applies():
    kv = jnp.asarray(paged_problem(4, 4, 2, 16, [5, 9])[1])
    decode, ragged_target = cpu_attention.TARGET, cpu_kernels.target(cpu_attention.RAGGED)
    cases = {"decode step": ({}, decode), "not decode-only": (dict(decode_only=False), ragged_target),
             "soft cap": (dict(soft_cap=5.0), None), "soft cap, not decode-only": (dict(soft_cap=5.0, decode_only=False), None),
             "int8 pool": (dict(kv=zeros_kv_cache(kv.shape, jnp.float32, "int8")), None),
             "decode kernel off": (dict(kernels=[cpu_attention.RAGGED]), None),
             "ragged kernel off": (dict(decode_only=False, kernels=[cpu_attention.NAME]), None)}
    for name, (change, target) in cases.items():
        fn, args, kwargs = _wrapped(change.pop("kv", kv), **change)
        text = str(jax.make_jaxpr(lambda *a, fn=fn, kwargs=kwargs: fn(*a, **kwargs))(*args))
        assert [t for t in (decode, ragged_target) if t in text] == ([target] if target else []), name
    for decode_only in (True, False):
        fn, args, kwargs = _wrapped(kv, decode_only=decode_only)
        want = chunked_paged_attention_from_buffer(*args, **kwargs)
        np.testing.assert_allclose(np.asarray(fn(*args, **kwargs)), np.asarray(want), atol=2e-6)
        # Lowered for another platform, the step keeps XLA's path (platform_dependent): no CPU custom call.
        lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(lowering_platforms=("tpu",))
        assert "jaxpaged_" not in lowered.as_text()


def test_the_default_cpu_backend_runs_the_kernels(monkeypatch):
    """The "chunked" backend (the CPU default) wraps itself with the kernels unless switched off."""
    from jaxpaged.device.backends import attention_fn

    assert attention_fn("chunked") is not chunked_paged_attention_from_buffer
    assert attention_fn("chunked").reads_whole_kv_buffer and attention_fn("chunked").has_decode_kernel
    assert cpu_attention.enabled_kernels() == {cpu_attention.NAME, cpu_attention.RAGGED}
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "gguf_matmul,ragged_attention")
    assert cpu_attention.enabled_kernels() == {cpu_attention.RAGGED}
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "gguf_matmul")
    assert attention_fn("chunked") is chunked_paged_attention_from_buffer


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "generic"])
def test_the_avx2_and_generic_builds_compute_the_same(march):
    if not cpu_kernels.register(cpu_attention.NAME, march):
        pytest.skip(f"the compiler cannot build for -march={march}")
    seq_lens = [1, 15, 16, 17, 50]
    q, kv, tables, lens, ks, vs = paged_problem(16, 8, 2, 64, seq_lens, seed=4)
    out = np.asarray(cpu_attention.paged_decode_attention(q, kv, tables, lens, layer_idx=1, scale=0.125, march=march))
    np.testing.assert_allclose(out[:-1], _naive(q, ks, vs, [1] * len(seq_lens), seq_lens, 0.125, None), atol=2e-5, rtol=1e-5)
    assert np.all(out[-1] == 0)


# The ragged kernel (cpu/ragged_attention.cc): prompt chunks and decode tokens in one step.

def ragged_problem(page_size, num_heads, num_kv_heads, head_dim, seq_lens, q_lens, seed=0, pad_tokens=3):
    """`paged_problem`'s pool, with q_lens[i] query tokens for sequence i (its last ones), then
    `pad_tokens` tokens no sequence owns; the padding sequence (seq_len 0) owns none."""
    _, kv, tables, lens, ks, vs = paged_problem(page_size, num_heads, num_kv_heads, head_dim, seq_lens, seed=seed,
                                                num_pages=4 + sum(-(-n // page_size) for n in seq_lens))
    rng = np.random.default_rng(seed + 100)
    q = rng.standard_normal((sum(q_lens) + pad_tokens, num_heads, head_dim)).astype(np.float32)
    starts = np.array([0, *np.cumsum(q_lens), sum(q_lens)], np.int32)
    return q, kv, tables, lens, starts, ks, vs


def ragged(q, kv, tables, lens, starts, march="native", **kwargs):
    fn = jax.jit(cpu_attention.paged_ragged_attention, static_argnames=("scale", "sliding_window", "march"))
    return np.asarray(fn(q, kv, tables, lens, starts, layer_idx=jnp.int32(1), march=march, **kwargs))


# (seq_len, q_len): whole prompts, chunks after cached keys, decode tokens, blocks of 32 and past them.
RAGGED_CASES = [(1, 1), (7, 7), (40, 3), (33, 1), (70, 70), (100, 37), (16, 16), (17, 2)]


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_ragged_kernel_matches_the_float64_loop(page_size, num_heads, num_kv_heads, head_dim):
    seq_lens, q_lens = zip(*RAGGED_CASES)
    q, kv, tables, lens, starts, ks, vs = ragged_problem(page_size, num_heads, num_kv_heads, head_dim, seq_lens, q_lens)
    scale = head_dim**-0.5
    out = ragged(q, kv, tables, lens, starts, scale=scale)
    want = _naive(q, ks, vs, q_lens, seq_lens, scale, None)
    np.testing.assert_allclose(out[:sum(q_lens)], want, atol=2e-5, rtol=1e-5)
    assert np.all(out[sum(q_lens):] == 0), "tokens no sequence owns give zeros"


@pytest.mark.parametrize("window", [1, 3, 5, 40])
def test_ragged_sliding_window_reads_only_the_window(window):
    """Keys before every token's window are NaN: the kernel must not even read them."""
    page_size, cases = 4, [(1, 1), (9, 9), (14, 5), (45, 38), (12, 1)]
    seq_lens, q_lens = zip(*cases)
    q, kv, tables, lens, starts, _, _ = ragged_problem(page_size, 4, 2, 16, seq_lens, q_lens, seed=3)
    want = reference_paged_attention(*map(jnp.asarray, (q, kv[1, 0], kv[1, 1], tables, lens, starts)), scale=0.25,
                                     sliding_window=window)
    for i, (n, q_len) in enumerate(cases):  # poison what the first token's window leaves out
        for pos in range(max(0, n - q_len + 1 - window)):
            kv[1, :, :, tables[i, pos // page_size], pos % page_size] = np.nan
    got = ragged(q, kv, tables, lens, starts, scale=0.25, sliding_window=window)
    np.testing.assert_allclose(got, np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_both_kernels_fold_attention_sinks_as_the_reference(window):
    """gpt-oss's sinks (one logit per query head, spread so that some outweigh the keys): the decode and the
    ragged kernel against the reference, a window on top; pages the window leaves out are NaN. The ragged
    kernel's gradient with respect to the sinks is the reference's (its backward)."""
    page_size, cases = 4, [(1, 1), (9, 9), (14, 5), (45, 38), (12, 1)]
    seq_lens, q_lens = zip(*cases)
    q, kv, tables, lens, starts, _, _ = ragged_problem(page_size, 8, 2, 16, seq_lens, q_lens, seed=5)
    sinks = jnp.asarray(np.random.default_rng(6).normal(0.0, 3.0, 8), jnp.float32)
    pools = tuple(map(jnp.asarray, (kv[1, 0], kv[1, 1], tables, lens)))
    want = reference_paged_attention(jnp.asarray(q), *pools, jnp.asarray(starts), scale=0.25, sliding_window=window,
                                     sinks=sinks)
    plain = reference_paged_attention(jnp.asarray(q), *pools, jnp.asarray(starts), scale=0.25, sliding_window=window)
    assert np.abs(np.asarray(want) - np.asarray(plain)).max() > 0.1  # the sinks matter here
    q_decode = q[np.append(starts[1:-1] - 1, 0)]  # each sequence's last token (the padding row's: any)
    want_decode = reference_paged_attention(jnp.asarray(q_decode), *pools, jnp.arange(len(lens) + 1, dtype=jnp.int32),
                                            scale=0.25, sliding_window=window, sinks=sinks)
    if window is not None:
        for i, (n, q_len) in enumerate(cases):  # poison what the first token's window leaves out
            for pos in range(max(0, n - q_len + 1 - window)):
                kv[1, :, :, tables[i, pos // page_size], pos % page_size] = np.nan
    got = ragged(q, kv, tables, lens, starts, scale=0.25, sliding_window=window, sinks=sinks)
    np.testing.assert_allclose(got, np.asarray(want), atol=2e-6, rtol=1e-5)
    got_decode = cpu_attention.paged_decode_attention(q_decode, kv, tables, lens, layer_idx=1, scale=0.25,
                                                      sliding_window=window, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got_decode), np.asarray(want_decode), atol=2e-6, rtol=1e-5)
    if window is None:
        loss = lambda fn: jax.grad(lambda s: jnp.sum(fn(s) * jnp.asarray(q)))(sinks)
        kernel = lambda s: cpu_attention.paged_ragged_attention(jnp.asarray(q), jnp.asarray(kv), *map(
            jnp.asarray, (tables, lens, starts)), layer_idx=1, scale=0.25, sinks=s)
        reference = lambda s: reference_paged_attention(jnp.asarray(q), *pools, jnp.asarray(starts), scale=0.25, sinks=s)
        np.testing.assert_allclose(np.asarray(loss(kernel)), np.asarray(loss(reference)), rtol=1e-5, atol=1e-6)


def test_ragged_bad_inputs_are_refused_with_what_to_pass():
    q, kv, tables, lens, starts, _, _ = ragged_problem(4, 4, 2, 16, [5, 9], [5, 2])
    with pytest.raises(ValueError, match="query_start_loc"):
        cpu_attention.paged_ragged_attention(q, kv, tables, lens, starts[:-1], layer_idx=1, scale=1.0)
    bad = tables.copy()
    bad[1, 1] = kv.shape[3]  # a page id past the pool
    with pytest.raises(Exception, match="page id out of range"):
        jax.block_until_ready(cpu_attention.paged_ragged_attention(q, kv, bad, lens, starts, layer_idx=1, scale=1.0))
    backwards = starts.copy()
    backwards[2] = 3  # sequence 1 would own tokens 5 .. 2
    with pytest.raises(Exception, match="query_start_loc decreases"):
        jax.block_until_ready(cpu_attention.paged_ragged_attention(q, kv, tables, lens, backwards, layer_idx=1, scale=1.0))
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(cpu_attention.paged_ragged_attention(q, kv, tables, lens, starts, layer_idx=3, scale=1.0))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"], ids=["avx2", "generic"])
def test_the_ragged_avx2_and_generic_builds_compute_the_same(march):
    if not cpu_kernels.register(cpu_attention.RAGGED, march):
        pytest.skip(f"the compiler cannot build for -march={march}")
    seq_lens, q_lens = zip(*RAGGED_CASES)
    q, kv, tables, lens, starts, ks, vs = ragged_problem(16, 9, 3, 64, seq_lens, q_lens, seed=4)
    out = ragged(q, kv, tables, lens, starts, march=march, scale=0.125)
    np.testing.assert_allclose(out[:sum(q_lens)], _naive(q, ks, vs, q_lens, seq_lens, 0.125, None), atol=2e-5, rtol=1e-5)
    assert np.all(out[sum(q_lens):] == 0)
