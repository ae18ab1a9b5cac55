"""Small pieces both kernels share: backend choice, one online-softmax step, argument checks.

Backend: the kernels are written for Pallas's Triton backend (`pl.pallas_call` with BlockSpecs and
`jax.experimental.pallas.triton.CompilerParams`). Reasons:
  * it is the backend of JAX's own `ops/gpu/paged_attention.py`, so the gather-a-block-of-pages
    pattern (`k_pages_ref[page_ids]`) is known to lower; Mosaic GPU (the default from JAX 0.11,
    Hopper only) wants warpgroup-level `plgpu.kernel` code and explicit TMA/barriers, a larger
    rewrite that cannot be checked without a GPU;
  * naming `CompilerParams` of the Triton backend explicitly makes `pallas_call` pick Triton even
    where Mosaic GPU is the default;
  * on CPU both kernels run in interpret mode, which is backend independent.
On a JAX without the Triton backend (jax_compat.TRITON_COMPILER_PARAMS None) the package still
imports and interprets; there `compiler_params` is left to the default.

Only plain ref indexing is used inside the kernels (no `pl.load`/`pl.store`, which JAX removed), and
every array a kernel materialises has power-of-two dimensions (a Triton requirement): the query
heads of one KV head are padded up to a power of two by the wrappers.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.jax_compat import TRITON_COMPILER_PARAMS

# Finite "minus infinity" for masked logits and the running max: exp(MASK - m) underflows to 0
# without the inf - inf = NaN that a true -inf gives when a whole block is masked.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def by_target(call, interpret: bool | None):
    """`call(interpret)` with interpret mode chosen by the TARGET the program is lowered for.

    `interpret=None`: compiled (`call(False)`) when the surrounding program is lowered for a CUDA
    GPU, interpreted (`call(True)`) when lowered for anything else. The choice is made at lowering
    by `lax.platform_dependent`, which lowers only the target's branch, so the same jitted step runs
    interpreted on a CPU host and compiles to real kernels for an H100 from that same CPU host
    (deviceless ahead-of-time compilation). An explicit True / False is used as given.
    """
    if interpret is not None:
        return call(bool(interpret))
    return lax.platform_dependent(cuda=lambda: call(False), default=lambda: call(True))


def compiler_params(num_warps: int, num_stages: int):
    if TRITON_COMPILER_PARAMS is None:
        return None
    return TRITON_COMPILER_PARAMS(num_warps=num_warps, num_stages=num_stages)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def online_softmax_step(q, k, v, visible, carry, *, scale: float, soft_cap: float | None):
    """One block of flash attention: fold keys `k`/values `v` into the running (out, max, sum).

    q: [rows, head_dim]; k, v: [block_k, head_dim]; visible: bool [rows, block_k] (or broadcastable);
    carry: out f32 [rows, head_dim], m f32 [rows], l f32 [rows].
    Masked keys contribute exactly 0 even when their K/V hold NaN (pages a sequence does not own):
    their logits are replaced before the max, their probabilities are zeroed, and the caller zeroes
    their V rows (0 * NaN would still be NaN inside the matmul).
    """
    out_prev, m_prev, l_prev = carry
    # float32 pages get IEEE float32 dots (Triton's default for float32 is TF32, ~3 digits).
    precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    logits = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    logits = logits * scale  # [rows, block_k]
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    logits = jnp.where(visible, logits, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=-1))  # [rows]
    probs = jnp.where(visible, jnp.exp(logits - m_next[:, None]), 0.0)  # [rows, block_k]
    correction = jnp.exp(m_prev - m_next)  # [rows]
    l_next = correction * l_prev + probs.sum(axis=-1)
    pv = lax.dot_general(
        probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [rows, head_dim]
    out_next = correction[:, None] * out_prev + pv
    return out_next, m_next, l_next


def normalise(out, m, l, sink=None):
    """The output rows out / l of an online softmax's (out, max m, sum l); rows that saw no key (l = 0) are
    zeros. `sink` [rows] (attention sinks, gpt-oss): one more logit per row, of value 0, joins the sum
    first, at the common max (MASK_VALUE on padding rows: it adds nothing there that is ever stored)."""
    if sink is not None:
        m_new = jnp.maximum(m, sink)
        correction = jnp.exp(m - m_new)
        out, l = out * correction[:, None], l * correction + jnp.exp(sink - m_new)
    return jnp.where(l[:, None] > 0, out / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def grouped_sinks(sinks, num_kv_heads: int, group: int, group_rows: int):
    """float32 [num_heads] sinks -> [num_kv_heads, group_rows]: query head k * group + g at [k, g], the
    rows past `group` (padding heads) MASK_VALUE."""
    grouped = jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group)
    return jnp.pad(grouped, ((0, 0), (0, group_rows - group)), constant_values=MASK_VALUE)


def check_common(q, kv_shape, block_tables, seq_lens, scale, soft_cap) -> None:
    """Trace-time checks shared by the public functions; errors say what to change.

    `kv_shape` is one layer's pool shape `(num_kv_heads, num_pages, page_size, head_dim)`.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got shape {q.shape}")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, _, page_size, kv_head_dim = kv_shape
    if head_dim != kv_head_dim:
        raise ValueError(f"q's {head_dim=} differs from the pages' head_dim={kv_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if page_size & (page_size - 1) or head_dim & (head_dim - 1):
        raise ValueError(f"{page_size=} and {head_dim=} must be powers of two for the GPU lowering")
    if block_tables.ndim != 2 or not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(
            f"block_tables must be an int [num_seqs, pages_per_seq] array, got {block_tables.dtype}{block_tables.shape}"
        )
    if seq_lens.shape != block_tables.shape[:1] or not jnp.issubdtype(seq_lens.dtype, jnp.integer):
        raise ValueError(
            f"seq_lens must be int [{block_tables.shape[0]}] (one per block-table row), "
            f"got {seq_lens.dtype}{seq_lens.shape}"
        )
    if not scale > 0:
        raise ValueError(f"{scale=} must be positive (usually head_dim ** -0.5)")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{soft_cap=} must be positive or None")


def check_lengths_if_concrete(seq_lens, block_tables, page_size: int) -> None:
    """Host (numpy) lengths: no sequence may be longer than its block table can address.

    Lengths on the device are not read back (that would wait for the device on every call), and
    inside `jax.jit` (the engine's step) they are traced: there only the kernels' own guard holds,
    they never read a table entry past its width, so such a sequence is cut short, never read out
    of bounds.
    """
    if not isinstance(seq_lens, (np.ndarray, list, tuple)):
        return
    longest, addressable = int(np.max(np.asarray(seq_lens), initial=0)), block_tables.shape[1] * page_size
    if longest > addressable:
        raise ValueError(
            f"a sequence of length {longest} needs more than the block table's {block_tables.shape[1]} "
            f"pages x {page_size=} = {addressable} slots; widen block_tables or shorten seq_lens"
        )


def check_per_layer_pools(k_pages, v_pages) -> None:
    if is_quantized(k_pages) != is_quantized(v_pages):
        raise ValueError("k_pages and v_pages must both be quantized (pages + scales) or both plain arrays")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim], got shape {k_pages.shape}"
        )
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"k_pages {k_pages.dtype}{k_pages.shape} and v_pages {v_pages.dtype}{v_pages.shape} "
            "must have the same shape and dtype"
        )


# ---------------------------------------------------------------------------------------------
# Page rows: how the kernels address K/V, whichever buffer they were given.
#
# Both kernels see the pages as one array of "page rows" `[num_rows, page_size, head_dim]`, where a
# row is one page of one KV head of K or of V, and get two base rows: where this layer's K pool
# and V pool start. The row of (KV head h, page p) is then `base + h * num_pages + p`.
#
#   whole model buffer [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim]
#     -> reshape (free: merges leading axes of a contiguous array, no copy) to
#        [num_layers * 2 * num_kv_heads * num_pages, page_size, head_dim]
#     K base of layer l = (2 l) * num_kv_heads * num_pages;   V base = (2 l + 1) * num_kv_heads * num_pages
#   one layer's k_pages, v_pages [num_kv_heads, num_pages, page_size, head_dim]
#     -> two arrays of [num_kv_heads * num_pages, page_size, head_dim], both bases 0
#
# Row indices are int32 (checked below to fit); element offsets `row * page_size * head_dim` can
# pass 2^31 on a large card, and the Triton lowering computes them in 64 bits whenever the array
# spans more than 2^32 bytes, which covers every int32-overflowing offset of a 2- or 4-byte dtype.

MAX_PAGE_ROWS = 2**31 - 1


# Quantized caches (int8 / float8_e4m3fn values plus one float32 scale per token and KV head, the
# `jaxpaged.ops.kv_quant.QuantizedKV` layout): a pool or buffer is any object with `.pages` and `.scales`
# (duck-typed, so this package still imports without jaxpaged). Scales become "scale rows"
# `[num_rows, page_size]` with the same row index as the page rows; the kernels gather a block's
# scales with its pages and dequantize as they read: `k = values * scale[:, None]`.
class QuantizedRows(NamedTuple):
    values: jax.Array  # [num_rows, page_size, head_dim] int8, or uint8 holding float8_e4m3fn bits
    scales: jax.Array  # [num_rows, page_size] float32


def is_quantized(pool) -> bool:
    return hasattr(pool, "pages") and hasattr(pool, "scales")


def kv_operands(k_rows, v_rows) -> list:
    """The kernel's K/V operands: [k, v] rows, or [k, v, k scales, v scales] for a quantized cache."""
    if isinstance(k_rows, QuantizedRows):
        return [k_rows.values, v_rows.values, k_rows.scales, v_rows.scales]
    return [k_rows, v_rows]


def split_kv_refs(refs, quantized: bool):
    """`(k_scale_ref, v_scale_ref, rest)` of the refs that follow the K/V row refs."""
    return (refs[0], refs[1], refs[2:]) if quantized else (None, None, refs)


def read_page_rows(rows_ref, scale_ref, row_ids, dtype):
    """Rows `row_ids` [P] -> [P, page_size, H] in `dtype`, dequantized when `scale_ref` is given.

    Slots holding NaN scales (or NaN values) stay NaN: the callers mask them as they mask float pages.
    """
    values = rows_ref[row_ids]
    if scale_ref is None:
        return values
    if values.dtype == jnp.uint8:  # float8_e4m3fn values stored as their bits
        values = lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return (values.astype(jnp.float32) * scale_ref[row_ids][..., None]).astype(dtype)


def compute_dtype(q, k_rows):
    """Matmul dtype: the pages' dtype for float pages, q's dtype for quantized ones."""
    return q.dtype if isinstance(k_rows, QuantizedRows) else k_rows.dtype


def page_rows_of_buffer(kv_pages, layer_idx):
    """`(k_rows, v_rows, bases)` of layer `layer_idx` of the whole buffer (k_rows is v_rows).

    A quantized buffer gives `QuantizedRows` (values and scales reshaped alike, no copy)."""
    if is_quantized(kv_pages):
        rows, _, bases = page_rows_of_buffer(kv_pages.pages, layer_idx)
        scale_rows = kv_pages.scales.reshape(rows.shape[:2])
        quantized = QuantizedRows(rows, scale_rows)
        return quantized, quantized, bases
    if kv_pages.ndim != 6 or kv_pages.shape[1] != 2:
        raise ValueError(
            "kv_pages must be the model's whole buffer [num_layers, 2, num_kv_heads, num_pages, page_size, "
            f"head_dim], got shape {kv_pages.shape}"
        )
    num_layers, _, num_kv_heads, num_pages, page_size, head_dim = kv_pages.shape
    num_rows = num_layers * 2 * num_kv_heads * num_pages
    if num_rows > MAX_PAGE_ROWS:
        raise ValueError(f"{num_rows} page rows overflow int32 row indices; use fewer or larger pages")
    rows = kv_pages.reshape(num_rows, page_size, head_dim)  # [L*2*K*P, page_size, H]
    pool_rows = num_kv_heads * num_pages
    layer_idx = jnp.asarray(layer_idx, jnp.int32)
    bases = jnp.stack([2 * layer_idx * pool_rows, (2 * layer_idx + 1) * pool_rows]).astype(jnp.int32)  # [2]
    return rows, rows, bases


def page_rows_of_pools(k_pages, v_pages):
    """`(k_rows, v_rows, bases)` of one layer's K and V pools (bases 0); QuantizedRows if quantized."""
    if is_quantized(k_pages):
        k_rows, v_rows, bases = page_rows_of_pools(k_pages.pages, v_pages.pages)
        return (QuantizedRows(k_rows, k_pages.scales.reshape(k_rows.shape[:2])),
                QuantizedRows(v_rows, v_pages.scales.reshape(v_rows.shape[:2])), bases)
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    if num_kv_heads * num_pages > MAX_PAGE_ROWS:
        raise ValueError(f"{num_kv_heads * num_pages} page rows overflow int32 row indices")
    k_rows = k_pages.reshape(num_kv_heads * num_pages, page_size, head_dim)
    v_rows = v_pages.reshape(num_kv_heads * num_pages, page_size, head_dim)
    return k_rows, v_rows, jnp.zeros((2,), jnp.int32)
