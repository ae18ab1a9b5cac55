"""Decode paged attention: one query token per sequence, flash-decoding over the context.

Each program handles one (sequence, tile of Hp KV heads, context split): the query heads of those
KV heads, packed into the rows of one tile (decode_plan.py), against one read of the split's pages,
gathered through the block table a compute block (`pages_per_compute_block` pages) of one KV head
at a time, with an online softmax. With one split (a batch that fills the GPU) the program writes
the normalised output; with more, every split writes its unnormalised output with its running max
and sum, and a small jnp step combines the splits.

    context of one sequence, page_size 4, pages_per_compute_block 2, 2 splits of 4 pages:

    logical page:  | 0  1 | 2  3 || 4  5 | 6  7 |      block_tables[s] = [9, 3, 7, 1, 0, 0, 0, 0]
    split:         |  split 0    ||   split 1   |      seq_len = 10 -> pages 0..2 hold tokens
    compute block: | b0   | b1   || (none: split starts past the last page, so it writes l=0)
    tokens 10, 11 of page 2 and all of page 3 are masked: their K/V may hold anything (NaN).

Sequences of length 0 (batch padding) visit no page and come out as zeros.

Compiled for an H100 (Qwen3-0.6B shapes, the defaults: 4 warps, 4-page blocks, 2 stages): 147-157
registers, no spills, 3 blocks per SM (18.75% occupancy, register-bound), ~165 KB of K/V in flight
per SM against the ~25 KB the HBM bandwidth needs (DESIGN.md, "Decode tiles, splits and registers").

The kernel reads K/V as page rows (`_common.py`): the model's whole buffer, reshaped without a copy,
plus the row where this layer's K and V pools start, so no layer's pool is ever sliced out. GQA:
query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Shaped

# Host (numpy) or device arrays: the public functions accept either, as jnp functions do.
ArrayLike = Array | np.ndarray

from pallas_kernels._common import (
    MASK_VALUE,
    check_common,
    check_lengths_if_concrete,
    check_per_layer_pools,
    compiler_params,
    compute_dtype,
    kv_operands,
    read_page_rows,
    split_kv_refs,
    next_power_of_2,
    normalise,
    online_softmax_step,
    page_rows_of_buffer,
    page_rows_of_pools,
    by_target,
    QuantizedRows,
)
from pallas_kernels.decode_plan import heads_per_tile, num_splits_for

# Legend: S=num_seqs K=num_kv_heads G=query heads per KV head Hp=KV heads per tile (decode_plan.py)
#         R=rows of a tile (Hp * G padded to a power of two >= 16) H=head_dim P=pages_per_compute_block
#         C=num_splits

MIN_ROWS = 16  # Triton's smallest tl.dot M


def _decode_kernel(
    seq_lens_ref,  # [S] whole array, read as scalars
    bases_ref,  # [2] whole array: first page row of this layer's K pool and of its V pool
    block_tables_ref,  # [None, padded_pages_per_seq]: this sequence's row
    q_ref,  # [None, None, R', H]: this sequence, the query heads of this tile's Hp KV heads
    k_rows_ref,  # [num_rows, page_size, H]: every page row (gathered from)
    v_rows_ref,  # [num_rows, page_size, H]
    *refs,  # quantized: k, v scale rows [num_rows, page_size]; then, with splits, out
    #         [None, None, None, R', H] f32 (unnormalised output of this split, its R' = real rows up to
    #         a power of two), m and l [None, None, None, R'] f32 (running max, sum); with one split,
    #         out [None, None, R', H] normalised
    #         (sinks, one split only: [None, R'] this tile's rows' sinks, before the outs)
    quantized: bool, scale: float, soft_cap: float | None, sliding_window: int | None, num_pages: int,
    pages_per_seq: int, pages_per_compute_block: int, pages_per_split: int, group: int, heads_per_tile: int,
    num_rows: int, has_sinks: bool,
):
    k_scale_ref, v_scale_ref, outs = split_kv_refs(refs, quantized)
    sinks_ref, outs = (outs[0], outs[1:]) if has_sinks else (None, outs)
    tile_idx = pl.program_id(0)
    seq_idx = pl.program_id(1)
    split_idx = pl.program_id(2)
    stored_rows, head_dim = q_ref.shape  # R': the tile's real rows up to a power of two (<= R)
    page_size = k_rows_ref.shape[1]
    block_k = pages_per_compute_block * page_size

    seq_len = seq_lens_ref[seq_idx]
    # Never past the block table's real width, whatever seq_len says: no table entry out of bounds.
    num_pages_used = jnp.minimum(pl.cdiv(seq_len, page_size), pages_per_seq)
    first_page_idx = split_idx * pages_per_split
    end_page_idx = jnp.minimum(first_page_idx + pages_per_split, num_pages_used)
    num_blocks = pl.cdiv(jnp.maximum(end_page_idx - first_page_idx, 0), pages_per_compute_block)
    # [R', H] -> [R, H] for the dot (R >= 16), in registers: row r holds q row r % R'; rows past
    # the real ones are padding and masked below, so nothing padded is ever stored in HBM.
    q = jnp.broadcast_to(q_ref[...][None], (num_rows // stored_rows, stored_rows, head_dim)).reshape(num_rows, head_dim)
    first_head = tile_idx * heads_per_tile
    # Row r holds query head r % G of local KV head r // G (decode_plan.py); rows past Hp * G are
    # padding, their head matches no step, so they stay empty (l = 0) and are dropped by the wrapper.
    row_head = lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0) // group  # [R, 1]

    def body(step_idx, carry):
        # Step = (key block, local KV head): one KV head's block of keys updates that head's rows.
        block_idx = lax.div(step_idx, jnp.int32(heads_per_tile))
        local_head = step_idx - block_idx * heads_per_tile
        page_idx = first_page_idx + block_idx * pages_per_compute_block
        page_ids = block_tables_ref[pl.ds(page_idx, pages_per_compute_block)]  # [P]
        # Entries past the length are masked but still gathered: keep them inside the pool (as XLA's
        # clamping gather does) so a stale table entry can never fault.
        page_ids = jnp.clip(page_ids, 0, num_pages - 1)
        head_row = (first_head + local_head) * num_pages  # page row of (this KV head, page 0)
        # [P, page_size, H] -> [P*page_size, H]; a quantized cache is dequantized here, as it is read.
        k = read_page_rows(k_rows_ref, k_scale_ref, bases_ref[0] + head_row + page_ids, q.dtype)
        v = read_page_rows(v_rows_ref, v_scale_ref, bases_ref[1] + head_row + page_ids, q.dtype)
        k, v = k.reshape(block_k, head_dim), v.reshape(block_k, head_dim)
        key_pos = page_idx * page_size + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, block_k]
        key_visible = key_pos < seq_len
        if sliding_window is not None:  # the query at seq_len - 1 sees keys seq_len - window ..
            key_visible &= key_pos >= seq_len - sliding_window
        v = jnp.where(key_visible.reshape(block_k, 1), v, jnp.zeros_like(v))
        visible = key_visible & (row_head == local_head)  # [R, block_k]
        return online_softmax_step(q, k, v, visible, carry, scale=scale, soft_cap=soft_cap)

    carry = (
        jnp.zeros((num_rows, head_dim), jnp.float32),
        jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )
    first_block = 0
    if sliding_window is not None:  # blocks wholly before the window are skipped
        oldest_page_idx = jnp.maximum(seq_len - sliding_window, 0) // page_size
        first_block = jnp.maximum(oldest_page_idx - first_page_idx, 0) // pages_per_compute_block
    last_block = jnp.maximum(num_blocks, first_block)
    out, m, l = lax.fori_loop(first_block * heads_per_tile, last_block * heads_per_tile, body, carry)
    if stored_rows < num_rows:  # store the real rows only: [R, H] -> [R', H]
        out, m, l = (jnp.split(x, num_rows // stored_rows, axis=0)[0] for x in (out, m, l))
    if len(outs) == 1:  # one split: the final output, normalised; empty rows (l = 0) are zeros
        (out_ref,) = outs
        out_ref[...] = normalise(out, m, l, None if sinks_ref is None else sinks_ref[...]).astype(out_ref.dtype)
        return
    out_ref, m_ref, l_ref = outs
    out_ref[...] = out
    m_ref[...] = m
    l_ref[...] = l


def _decode_pallas_call(
    q: Float[ArrayLike, "num_seqs num_tiles rows head_dim"],
    k_rows,  # [num_rows, page_size, head_dim] array, or QuantizedRows (values + scale rows)
    v_rows,
    bases: Int[ArrayLike, "2"],
    block_tables: Int[ArrayLike, "num_seqs padded_pages"],
    seq_lens: Int[ArrayLike, "num_seqs"],
    sinks: Float[ArrayLike, "num_tiles rows"] | None,  # one split only (more: _combine_splits folds them)
    *, scale: float, soft_cap: float | None, sliding_window: int | None, num_pages: int, pages_per_seq: int,
    pages_per_compute_block: int, num_splits: int, group: int, heads_per_tile: int, tile_rows: int, out_dtype,
    num_warps: int, num_stages: int, interpret: bool,
):
    num_seqs, num_tiles, num_rows, head_dim = q.shape  # num_rows: R' (stored), the kernel pads to R
    pages_per_split = block_tables.shape[1] // num_splits
    kv_args = kv_operands(k_rows, v_rows)
    kernel = functools.partial(
        _decode_kernel, quantized=len(kv_args) == 4, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
        num_pages=num_pages, pages_per_seq=pages_per_seq, pages_per_compute_block=pages_per_compute_block,
        pages_per_split=pages_per_split, group=group, heads_per_tile=heads_per_tile, num_rows=tile_rows,
        has_sinks=sinks is not None,
    )

    def whole(x):
        return pl.BlockSpec(x.shape, lambda t, s, c: (0,) * x.ndim)

    if num_splits == 1:  # the normalised output, in q's dtype: no partials, no combine
        out_specs = [pl.BlockSpec((None, None, num_rows, head_dim), lambda t, s, c: (s, t, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((num_seqs, num_tiles, num_rows, head_dim), out_dtype)]
    else:
        partial_shape = (num_seqs, num_tiles, num_splits, num_rows)
        out_specs = [
            pl.BlockSpec((None, None, None, num_rows, head_dim), lambda t, s, c: (s, t, c, 0, 0)),
            pl.BlockSpec((None, None, None, num_rows), lambda t, s, c: (s, t, c, 0)),
            pl.BlockSpec((None, None, None, num_rows), lambda t, s, c: (s, t, c, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
        ]
    return pl.pallas_call(
        kernel,
        grid=(num_tiles, num_seqs, num_splits),
        in_specs=[
            whole(seq_lens),
            whole(bases),
            pl.BlockSpec((None, block_tables.shape[1]), lambda t, s, c: (s, 0)),
            pl.BlockSpec((None, None, num_rows, head_dim), lambda t, s, c: (s, t, 0, 0)),
            *[whole(x) for x in kv_args],
            *([] if sinks is None else [pl.BlockSpec((None, num_rows), lambda t, s, c: (t, 0))]),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(seq_lens, bases, block_tables, q, *kv_args, *([] if sinks is None else [sinks]))


def _combine_splits(out, m, l, sinks=None):
    """Second flash-decoding step: rescale each split to the global max and normalise.

    out: [S, T, C, R', H], m/l: [S, T, C, R'] (T = KV-head tiles). Splits that saw no key have l = 0
    and m = MASK_VALUE, so their weight exp(m - m_max) is 0 (or they are all empty and the row comes
    out as zeros). `sinks` [T, R'] (gpt-oss) join as one more split per row: max the sink, sum 1, output 0.
    """
    if sinks is not None:
        m = jnp.concatenate([m, jnp.broadcast_to(sinks[None, :, None, :], (m.shape[0], sinks.shape[0], 1, m.shape[3]))],
                            axis=2)
        l = jnp.concatenate([l, jnp.ones_like(m[:, :, :1])], axis=2)
        out = jnp.concatenate([out, jnp.zeros_like(out[:, :, :1])], axis=2)
    m_max = m.max(axis=2, keepdims=True)  # [S, T, 1, R']
    weight = jnp.exp(m - m_max)  # [S, T, C, R']
    l_total = (weight * l).sum(axis=2)  # [S, T, R']
    out_total = (weight[..., None] * out).sum(axis=2)  # [S, T, R', H]
    safe_l = jnp.where(l_total > 0, l_total, 1.0)
    return jnp.where(l_total[..., None] > 0, out_total / safe_l[..., None], 0.0)


_TUNING = ("pages_per_compute_block", "num_splits", "num_warps", "num_stages", "interpret")


def decode_attention(
    q: Float[ArrayLike, "num_seqs num_heads head_dim"],
    k_pages: Float[ArrayLike, "num_kv_heads num_pages page_size head_dim"] | tuple,
    v_pages: Float[ArrayLike, "num_kv_heads num_pages page_size head_dim"] | tuple,
    block_tables: Int[ArrayLike, "num_seqs pages_per_seq"],
    seq_lens: Int[ArrayLike, "num_seqs"],
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_compute_block: int = 4,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    sinks: Float[ArrayLike, "num_heads"] | None = None,
) -> Float[Array, "num_seqs num_heads head_dim"]:
    """Paged attention of one new query token per sequence (a pure decode step), one layer's pools.

    Args:
      q: [num_seqs, num_heads, head_dim], float32 or bfloat16: the newest token of each sequence,
        sitting at position `seq_lens[s] - 1` (its own K/V already written to the pages); cast to
        the pages' dtype for the matmuls. Query head `h` reads KV head
        `h // (num_heads // num_kv_heads)`.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim], q's dtype: one layer's pool;
        or a quantized pool (`jaxpaged.ops.kv_quant.QuantizedKV`: int8 / float8_e4m3fn `pages` and float32
        `scales` [num_kv_heads, num_pages, page_size]), dequantized to q's dtype as the kernel reads it.
      block_tables: int32 [num_seqs, pages_per_seq]: sequence s's logical page i is physical page
        `block_tables[s, i]`; entries past `cdiv(seq_lens[s], page_size)` are never read.
      seq_lens: int32 [num_seqs]: context length including the new token, at most
        `pages_per_seq * page_size` (a ValueError for numpy lengths; otherwise the kernel never reads past
        the table); 0 for batch padding (those rows come out as zeros).
      scale: softmax scale (usually head_dim ** -0.5).
      soft_cap: if set, logits become `soft_cap * tanh(logits / soft_cap)`.
      sliding_window: if set, the query (at position seq_len - 1) sees only the last `sliding_window` keys.
      sinks: if set (gpt-oss), float32 [num_heads]: one more logit per head in every softmax, of value 0.
      pages_per_compute_block: pages gathered per inner step (block of P * page_size keys).
      num_splits: context splits per sequence (flash-decoding); capped so no split is empty of
        table entries. None: chosen from the batch, the KV heads and the table's width
        (`decode_plan.num_splits_for`): 1 (no float32 partials) when the batch fills an H100.
      num_warps, num_stages: Triton launch parameters (ignored when interpreting).
      interpret: None = compiled when the program is lowered for a GPU, interpreted when lowered for
        anything else (the target decides, not the host: `_common.by_target`).

    Returns:
      [num_seqs, num_heads, head_dim] in q's dtype.

    Equivalent to `jaxpaged.ops.attention.reference_paged_attention` with
    `query_start_loc = arange(num_seqs + 1)` (one token each), which is what the tests check.
    The engine calls `decode_attention_from_buffer`, which reads the model's whole buffer.
    """
    check_per_layer_pools(k_pages, v_pages)
    check_lengths_if_concrete(seq_lens, block_tables, k_pages.shape[2])
    return _decode_jit(
        q, k_pages, v_pages, block_tables, seq_lens, None, sinks, whole_buffer=False, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret,
    )


def decode_attention_from_buffer(
    q: Float[ArrayLike, "num_seqs num_heads head_dim"],
    kv_pages: Float[ArrayLike, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | tuple,
    block_tables: Int[ArrayLike, "num_seqs pages_per_seq"],
    seq_lens: Int[ArrayLike, "num_seqs"],
    query_start_loc: Int[ArrayLike, "num_seqs_plus_1"] | None = None,
    *,
    layer_idx: int | Int[ArrayLike, ""],
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_compute_block: int = 4,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    sinks: Float[ArrayLike, "num_heads"] | None = None,
) -> Float[Array, "num_seqs num_heads head_dim"]:
    """`decode_attention` of layer `layer_idx` (an int32 scalar, may be traced), reading the whole buffer.

    kv_pages: [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim] (axis 1: K, V). The
    kernel gets the whole buffer (reshaped, not copied) and the layer's first page rows, so inside
    the model's layer loop no layer's pool is sliced out and copied. `query_start_loc` is accepted
    for the whole-buffer signature's sake and ignored: a decode step has one token per sequence.
    Other arguments as `decode_attention`.
    """
    del query_start_loc
    check_lengths_if_concrete(seq_lens, block_tables, kv_pages.shape[4])
    return _decode_jit(
        q, kv_pages, kv_pages, block_tables, seq_lens, layer_idx, sinks, whole_buffer=True, scale=scale,
        soft_cap=soft_cap, sliding_window=sliding_window, pages_per_compute_block=pages_per_compute_block,
        num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("whole_buffer", "scale", "soft_cap", "sliding_window", *_TUNING))
def _decode_jit(q, k, v, block_tables, seq_lens, layer_idx, sinks, *, whole_buffer: bool, scale, soft_cap,
                sliding_window, pages_per_compute_block, num_splits, num_warps, num_stages, interpret):
    if whole_buffer:  # k is v is the model's buffer
        k_rows, v_rows, bases = page_rows_of_buffer(k, layer_idx)
        kv_shape = k.shape[2:]
    else:
        check_per_layer_pools(k, v)
        k_rows, v_rows, bases = page_rows_of_pools(k, v)
        kv_shape = k.shape
    return _decode(
        q, k_rows, v_rows, bases, block_tables, seq_lens, sinks, kv_shape=kv_shape, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window,
        pages_per_compute_block=pages_per_compute_block, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=interpret,
    )


def _decode(q, k_rows, v_rows, bases, block_tables, seq_lens, sinks, *, kv_shape, scale, soft_cap, sliding_window,
            pages_per_compute_block, num_splits, num_warps, num_stages, interpret):
    check_common(q, kv_shape, block_tables, seq_lens, scale, soft_cap)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size = kv_shape[:3]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but q has {num_seqs} sequences")
    if pages_per_compute_block < 1 or pages_per_compute_block & (pages_per_compute_block - 1):
        raise ValueError(f"{pages_per_compute_block=} must be a power of two")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{num_splits=} must be >= 1 (or None to choose)")

    # GQA: the query heads of Hp consecutive KV heads are the rows of one tile (decode_plan.py):
    # [S, N, H] -> [S, K / Hp, Hp * G, H] (free: query head n = k * G + g) -> [S, K / Hp, R', H],
    # R' = Hp * G up to a power of two; the kernel widens it to R >= 16 rows in registers.
    group = num_heads // num_kv_heads
    tile_heads = heads_per_tile(num_kv_heads, group, MIN_ROWS, num_seqs)
    num_tiles, real_rows = num_kv_heads // tile_heads, tile_heads * group
    num_rows = max(MIN_ROWS, next_power_of_2(real_rows))
    stored_rows = next_power_of_2(real_rows)  # R': q rows read, output / partial rows stored

    pages_per_seq = block_tables.shape[1]
    if num_splits is None:
        value_bytes = jnp.dtype(k_rows.values.dtype if isinstance(k_rows, QuantizedRows) else k_rows.dtype).itemsize
        scale_bytes = 4 if isinstance(k_rows, QuantizedRows) else 0
        num_splits = num_splits_for(
            num_tiles=num_seqs * num_tiles, pages_per_seq=pages_per_seq, pages_per_block=pages_per_compute_block,
            partial_bytes_per_split=2 * stored_rows * (head_dim + 2) * 4,  # out, max, sum: written, read back
            kv_bytes_per_page=tile_heads * page_size * 2 * (head_dim * value_bytes + scale_bytes),
        )
    # Pad the table so splits hold whole compute blocks: [S, pages_per_seq] -> [S, C * pages_per_split].
    # Padding entries point at page 0 and are always masked (they lie past every sequence's length).
    num_splits = min(num_splits, pl.cdiv(pages_per_seq, pages_per_compute_block))
    pages_per_split = pl.cdiv(pl.cdiv(pages_per_seq, num_splits), pages_per_compute_block) * pages_per_compute_block
    block_tables = jnp.pad(
        block_tables.astype(jnp.int32), ((0, 0), (0, num_splits * pages_per_split - pages_per_seq))
    )
    # The matmuls run in the pages' dtype (q is cast if it differs); the output keeps q's dtype.
    q_tiles = q.astype(compute_dtype(q, k_rows)).reshape(num_seqs, num_tiles, real_rows, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, stored_rows - real_rows), (0, 0)))  # [S, K/Hp, R', H]

    # Sinks by tile row: row r of tile t is query head t * R + r (R = real_rows), padding rows MASK_VALUE.
    sink_tiles = None if sinks is None else jnp.pad(
        jnp.asarray(sinks, jnp.float32).reshape(num_tiles, real_rows), ((0, 0), (0, stored_rows - real_rows)),
        constant_values=MASK_VALUE)
    outs = by_target(
        lambda interpret_mode: _decode_pallas_call(
            q_tiles, k_rows, v_rows, bases, block_tables, seq_lens.astype(jnp.int32),
            sink_tiles if num_splits == 1 else None, scale=scale,
            soft_cap=soft_cap, sliding_window=sliding_window, num_pages=num_pages, pages_per_seq=pages_per_seq,
            pages_per_compute_block=pages_per_compute_block, num_splits=num_splits, group=group,
            heads_per_tile=tile_heads, tile_rows=num_rows, out_dtype=q.dtype, num_warps=num_warps, num_stages=num_stages,
            interpret=interpret_mode,
        ),
        interpret,
    )
    out = outs[0] if num_splits == 1 else _combine_splits(*outs, sink_tiles)  # [S, K / Hp, R', H]
    return out[:, :, :real_rows].reshape(num_seqs, num_heads, head_dim).astype(q.dtype)


# The oracle is `jaxpaged.ops.attention.reference_paged_attention` (plain jnp, per token); the tests in
# tests/test_pallas_decode.py rebuild contiguous K/V for it without this file's index logic.
