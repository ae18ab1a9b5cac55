"""Decode attention as one XLA:CPU custom call over the pages in place (`cpu/paged_attention.cc`).

    q             float32 [num_seqs, num_heads, head_dim]          one query token per sequence
    kv_pages      float32 [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]
    block_tables  int32 [num_seqs, pages_per_seq]     seq_lens int32 [num_seqs]     layer_idx int32 []

`with_cpu_decode(fn)` wraps a whole-buffer backend (the CPU default, "chunked"): decode-only steps over a
float32 buffer without soft capping run the kernel on the CPU, everything else (prefill and mixed
steps, quantized pools, soft caps, other platforms at lowering) runs `fn`. Same semantics as
`reference_paged_attention` (ops/attention.py, the oracle in tests/test_cpu_attention.py), sliding
windows included; float32 sums and exp in another order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxpaged.ops import cpu_kernels
from jaxpaged.ops.kv_quant import QuantizedKV

NAME = "paged_attention"
TARGET = f"jaxpaged_{NAME}"
MAX_PAGE_SIZE = 16  # the kernel scores a page's keys as one 16-lane vector


def available() -> bool:
    return cpu_kernels.register(NAME)


def enabled() -> bool:
    return cpu_kernels.enabled(NAME)


def paged_decode_attention(q: ArrayLike, kv_pages: ArrayLike, block_tables: ArrayLike, seq_lens: ArrayLike, *,
                           layer_idx: ArrayLike, scale: float, sliding_window: int | None = None,
                           march: str = "native") -> jax.Array:
    """Each sequence's one query token against its keys 0 .. seq_len - 1 (the last `sliding_window` of
    them if set) in layer `layer_idx` of the whole buffer; zeros for seq_len 0. CPU only. `march`: the
    build to run (another instruction set than the host's: tests; cpu_kernels.register)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_pages.shape[2], kv_pages.shape[4]
    if block_tables.shape[0] != num_seqs or num_heads % num_kv_heads or head_dim % 16 or page_size > MAX_PAGE_SIZE:
        raise ValueError(f"paged_decode_attention: {q.shape=} (one token per sequence), {kv_pages.shape=}, "
                         f"{block_tables.shape=}: needs num_heads % num_kv_heads == 0, head_dim % 16 == 0, "
                         f"page_size <= {MAX_PAGE_SIZE}")
    if not cpu_kernels.register(NAME, march):
        raise RuntimeError(f"{cpu_kernels.target(NAME, march)} could not be built on this machine (see the warning logged); use XLA's path")
    call = jax.ffi.ffi_call(cpu_kernels.target(NAME, march), jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(jnp.asarray(q, jnp.float32), kv_pages, jnp.asarray(block_tables, jnp.int32),
                jnp.asarray(seq_lens, jnp.int32), jnp.asarray(layer_idx, jnp.int32),
                scale=np.float32(scale), window=np.int64(sliding_window or 0))


def _kernel_applies(q, kv_pages, block_tables, soft_cap, decode_only) -> bool:
    return (decode_only and soft_cap is None and not isinstance(kv_pages, QuantizedKV)
            and kv_pages.dtype == jnp.float32 and q.dtype == jnp.float32 and q.shape[0] == block_tables.shape[0]
            and q.shape[2] % 16 == 0 and kv_pages.shape[4] <= MAX_PAGE_SIZE)


def with_cpu_decode(fn):
    """`fn` (a whole-buffer backend) with decode-only steps on the CPU kernel where it applies."""

    @functools.wraps(fn)
    def attention(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale, soft_cap=None,
                  sliding_window=None, decode_only=False, **kwargs):
        fallback = functools.partial(fn, layer_idx=layer_idx, scale=scale, soft_cap=soft_cap,
                                     sliding_window=sliding_window, decode_only=decode_only, **kwargs)
        if not _kernel_applies(q, kv_pages, block_tables, soft_cap, decode_only):
            return fallback(q, kv_pages, block_tables, seq_lens, query_start_loc)
        kernel = lambda: paged_decode_attention(q, kv_pages, block_tables, seq_lens, layer_idx=layer_idx, scale=scale,
                                                sliding_window=sliding_window).astype(q.dtype)
        # Chosen when the step is lowered: a program lowered for a GPU from this CPU host keeps `fn`.
        return jax.lax.platform_dependent(cpu=kernel, default=lambda: fallback(
            q, kv_pages, block_tables, seq_lens, query_start_loc))

    attention.reads_whole_kv_buffer = True
    attention.has_decode_kernel = True
    return attention
