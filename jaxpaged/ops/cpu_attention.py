"""Attention as one XLA:CPU custom call over the pages in place: two C++ kernels.

    paged_attention   decode-only steps (`cpu/paged_attention.cc`)
        q             float32 [num_seqs, num_heads, head_dim]          one query token per sequence
    ragged_attention  any step: prompt chunks and decode tokens mixed (`cpu/ragged_attention.cc`)
        q             float32 [num_tokens, num_heads, head_dim]
        query_start_loc int32 [num_seqs + 1]          sequence s owns tokens query_start_loc[s] .. [s + 1] - 1

    kv_pages      float32 [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]
    block_tables  int32 [num_seqs, pages_per_seq]     seq_lens int32 [num_seqs]     layer_idx int32 []

`with_cpu_kernels(fn)` wraps a whole-buffer backend (the CPU default, "chunked"): steps over a float32
buffer without soft capping run a kernel on the CPU, the decode one in decode-only steps, the ragged
one in the others (gpt-oss's attention sinks included); the rest (quantized pools, soft caps, a kernel
switched off, other platforms at lowering) runs `fn`. Same semantics as `reference_paged_attention` (ops/attention.py, the oracle in
tests/test_cpu_attention.py), sliding windows included; float32 sums and exp in another order.

The ragged kernel computes each token in an order fixed by its own position: every page up to its
own, in block-table order, one online-softmax update per page, whatever else the step holds, how
its sequence's prompt was cut into chunks, or whether it is a decode token. The decode kernel orders
the sums otherwise (the same token differs by ~1 ulp), so `with_cpu_kernels(..., one_path=True)`
(EngineConfig.batch_invariant) runs the ragged kernel in every step. The ragged kernel is
differentiable (`jax.custom_vjp`: its backward is the reference's), so a trainer's forward can be
the engine's own arithmetic (jaxpaged/rl/).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpaged.ops import cpu_kernels
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.ops.kv_quant import QuantizedKV, layer_pools

NAME = "paged_attention"
RAGGED = "ragged_attention"
TARGET = f"jaxpaged_{NAME}"
MAX_PAGE_SIZE = 16  # the kernels score a page's keys as one 16-lane vector


def available() -> bool:
    return cpu_kernels.register(NAME)


def _check(name, kernel, q, kv_pages, block_tables, rows_ok, rows_need, march):
    """The FFI target of `kernel` for `march`, after checking the shapes (`rows_ok`: the per-sequence
    arrays agree, as `rows_need` says)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, page_size = kv_pages.shape[2], kv_pages.shape[4]
    if not rows_ok or num_heads % num_kv_heads or head_dim % 16 or page_size > MAX_PAGE_SIZE:
        raise ValueError(f"{name}: {q.shape=}, {kv_pages.shape=}, {block_tables.shape=}: needs {rows_need}, "
                         f"num_heads % num_kv_heads == 0, head_dim % 16 == 0, page_size <= {MAX_PAGE_SIZE}")
    if not cpu_kernels.register(kernel, march):
        raise RuntimeError(f"{cpu_kernels.target(kernel, march)} could not be built on this machine (see the warning "
                           "logged); use XLA's path")
    return cpu_kernels.target(kernel, march)


def _sinks_or_none(sinks, num_heads: int) -> jax.Array:
    """The kernels' sinks operand: float32 [N]; -inf for every head without sinks (their arithmetic is then
    exactly the plain softmax's)."""
    if sinks is None:
        return jnp.full((num_heads,), -jnp.inf, jnp.float32)
    return jnp.asarray(sinks, jnp.float32).reshape(num_heads)


def paged_decode_attention(q: ArrayLike, kv_pages: ArrayLike, block_tables: ArrayLike, seq_lens: ArrayLike, *,
                           layer_idx: ArrayLike, scale: float, sliding_window: int | None = None,
                           sinks: ArrayLike | None = None, march: str = "native") -> jax.Array:
    """Each sequence's one query token against its keys 0 .. seq_len - 1 (the last `sliding_window` of
    them if set) in layer `layer_idx` of the whole buffer; zeros for seq_len 0. `sinks` (gpt-oss): float32
    [num_heads], one more logit per head in the softmax, of value 0. CPU only. `march`: the build to run
    (another instruction set than the host's: tests; cpu_kernels.register)."""
    target = _check("paged_decode_attention", NAME, q, kv_pages, block_tables, block_tables.shape[0] == q.shape[0],
                    "one query token per block table row", march)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(jnp.asarray(q, jnp.float32), kv_pages, jnp.asarray(block_tables, jnp.int32),
                jnp.asarray(seq_lens, jnp.int32), jnp.asarray(layer_idx, jnp.int32), _sinks_or_none(sinks, q.shape[1]),
                scale=np.float32(scale), window=np.int64(sliding_window or 0))


def paged_ragged_attention(q: ArrayLike, kv_pages: ArrayLike, block_tables: ArrayLike, seq_lens: ArrayLike,
                           query_start_loc: ArrayLike, *, layer_idx: ArrayLike, scale: float,
                           sliding_window: int | None = None, sinks: ArrayLike | None = None,
                           march: str = "native") -> jax.Array:
    """Each token of sequence s (tokens query_start_loc[s] .. [s + 1] - 1, the last of them at position
    seq_lens[s] - 1) against its keys up to its own position (the last `sliding_window` of them if set)
    in layer `layer_idx` of the whole buffer; zeros for tokens no sequence owns. `sinks` as
    `paged_decode_attention`'s. CPU only."""
    starts, lens = np.shape(query_start_loc), np.shape(seq_lens)
    target = _check("paged_ragged_attention", RAGGED, q, kv_pages, block_tables,
                    starts == (block_tables.shape[0] + 1,) and lens == (block_tables.shape[0],),
                    f"seq_lens [num_seqs] and query_start_loc [num_seqs + 1] (got {lens} and {starts})", march)
    ints = tuple(jnp.asarray(a, jnp.int32) for a in (block_tables, seq_lens, query_start_loc, layer_idx))
    return _ragged(target, float(scale), sliding_window, sinks is not None, jnp.asarray(q, jnp.float32), kv_pages,
                   _sinks_or_none(sinks, q.shape[1]), *ints)


def _ragged_kernel(target, scale, window, q, kv_pages, sinks, block_tables, seq_lens, query_start_loc, layer_idx):
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx, sinks, scale=np.float32(scale),
                window=np.int64(window or 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ragged(target, scale, window, has_sinks, q, kv_pages, sinks, block_tables, seq_lens, query_start_loc, layer_idx):
    return _ragged_kernel(target, scale, window, q, kv_pages, sinks, block_tables, seq_lens, query_start_loc,
                          layer_idx)


def _ragged_forward(target, scale, window, has_sinks, q, kv_pages, sinks, *ints):
    return _ragged_kernel(target, scale, window, q, kv_pages, sinks, *ints), (q, kv_pages, sinks, ints)


def _ragged_backward(target, scale, window, has_sinks, saved, d_out):
    """The reference's gradient at the same inputs (its forward equals the kernel's up to float32 rounding)."""
    q, kv_pages, sinks, (block_tables, seq_lens, query_start_loc, layer_idx) = saved

    def reference(q, kv_pages, sinks):
        k_pool, v_pool = layer_pools(kv_pages, layer_idx)
        return reference_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, scale=scale,
                                         sliding_window=window, sinks=sinks if has_sinks else None)

    d_q, d_kv, d_sinks = jax.vjp(reference, q, kv_pages, sinks)[1](d_out)
    return (d_q, d_kv, d_sinks) + (None,) * 4  # the integer inputs have no cotangent


_ragged.defvjp(_ragged_forward, _ragged_backward)


def _kernel_for(q, kv_pages, block_tables, soft_cap, decode_only, kernels, one_path=False) -> str | None:
    """Which of `kernels` runs this call: NAME, RAGGED, or None (the wrapped backend)."""
    if not (soft_cap is None and not isinstance(kv_pages, QuantizedKV) and kv_pages.dtype == jnp.float32
            and q.dtype == jnp.float32 and q.shape[2] % 16 == 0 and kv_pages.shape[4] <= MAX_PAGE_SIZE):
        return None
    if decode_only and q.shape[0] == block_tables.shape[0] and not one_path:
        return NAME if NAME in kernels else None
    return RAGGED if RAGGED in kernels else None


def enabled_kernels() -> frozenset[str]:
    """The attention kernels engines built now run (JAXPAGED_CPU_KERNELS, and whether they build)."""
    return frozenset(name for name in (NAME, RAGGED) if cpu_kernels.enabled(name))


def with_cpu_kernels(fn, kernels=frozenset({NAME, RAGGED}), *, one_path: bool = False):
    """`fn` (a whole-buffer backend) with `kernels` (NAME: decode-only steps, RAGGED: the others) where
    they apply. `one_path`: RAGGED in every step, decode-only ones included (a token's arithmetic then
    never depends on the step it is in: EngineConfig.batch_invariant); it needs RAGGED in `kernels`."""
    if one_path and RAGGED not in kernels:
        raise ValueError(f"one_path runs {RAGGED} in every step; kernels={sorted(kernels)} lacks it")

    @functools.wraps(fn)
    def attention(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale, soft_cap=None,
                  sliding_window=None, decode_only=False, **kwargs):
        fallback = functools.partial(fn, layer_idx=layer_idx, scale=scale, soft_cap=soft_cap,
                                     sliding_window=sliding_window, decode_only=decode_only, **kwargs)
        sinks = kwargs.get("sinks")  # gpt-oss: both kernels take them
        which = _kernel_for(q, kv_pages, block_tables, soft_cap, decode_only, kernels, one_path)
        if which is None:
            return fallback(q, kv_pages, block_tables, seq_lens, query_start_loc)
        if which == NAME:
            kernel = lambda: paged_decode_attention(q, kv_pages, block_tables, seq_lens, layer_idx=layer_idx,
                                                    scale=scale, sliding_window=sliding_window,
                                                    sinks=sinks).astype(q.dtype)
        else:
            kernel = lambda: paged_ragged_attention(q, kv_pages, block_tables, seq_lens, query_start_loc,
                                                    layer_idx=layer_idx, scale=scale, sliding_window=sliding_window,
                                                    sinks=sinks).astype(q.dtype)
        # Chosen when the step is lowered: a program lowered for a GPU from this CPU host keeps `fn`.
        return jax.lax.platform_dependent(cpu=kernel, default=lambda: fallback(
            q, kv_pages, block_tables, seq_lens, query_start_loc))

    attention.reads_whole_kv_buffer = True
    attention.has_decode_kernel = True
    attention.one_path = one_path  # the runner checks it under EngineConfig.batch_invariant
    return attention
