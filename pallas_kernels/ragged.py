"""Ragged paged attention: a flat batch of query chunks (prefill, chunked prefill, decode rows).

Each program handles one (KV head, query block): up to `block_q` consecutive tokens of ONE
sequence times all query heads of that KV head (GQA: one read of the KV pages serves them all),
online softmax over the sequence's pages up to the block's causal limit.

Query blocks never straddle two sequences. Sequence s gets the block ids starting at
`query_start_loc[s] // block_q + s`; its chunk of q_len tokens needs cdiv(q_len, block_q) blocks and
that range always has room for them (floor((a+q)/B) - floor(a/B) + 1 >= cdiv(q, B)), so a grid of
`num_tokens // block_q + num_seqs` blocks fits any batch of that size; some blocks are empty:

    block_q 4, query_start_loc [0, 8, 9, 11]          (chunks of 8, 1 and 2 tokens)
    token:        0 1 2 3 | 4 5 6 7 | 8 | 9 10
    block id:     0       | 1       | 3 | 4            first ids: 0//4+0=0, 8//4+1=3, 9//4+2=4
    row in block: 0 1 2 3 | 0 1 2 3 | 0 | 0 1
    grid: 11//4 + 3 = 5 blocks; block 2 (sequence 0's third id) is empty and writes zeros.

The wrapper computes this block -> (sequence, first token) map with two tiny jnp ops and passes it
to the kernel as small int arrays (the Triton backend has no scalar prefetch; reading them is a
scalar load per program). Each block writes only its own output block, so no program overwrites
another's rows and no masked store is needed; a final gather picks each token's row, and padding
tokens (t >= query_start_loc[-1]) are set to zero there.

Causality inside a block (token at position p sees keys 0..p):

    sequence with 5 cached tokens and a 3-token chunk (seq_len 8), page_size 4:
    key pos:   0 1 2 3 | 4 5 6 7
    row 0 (p=5) x x x x | x x . .
    row 1 (p=6) x x x x | x x x .
    row 2 (p=7) x x x x | x x x x       the block visits pages up to the last row's position

K/V are read as page rows (`_common.py`): the model's whole buffer, reshaped without a copy, plus
the row where this layer's K and V pools start, so no layer's pool is ever sliced out. GQA: query
head `h` reads KV head `h // (num_heads // num_kv_heads)`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

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
    grouped_sinks,
    online_softmax_step,
    page_rows_of_buffer,
    page_rows_of_pools,
    by_target,
)

# Legend: T=num_tokens S=num_seqs K=num_kv_heads Gp=query heads per KV head padded to a power of two
#         H=head_dim B=block_q P=pages_per_compute_block Q=num_q_blocks


def _ragged_kernel(
    block_seq_idx_ref,  # [Q] whole array: which sequence each query block belongs to
    block_token_start_ref,  # [Q] whole array: flat index of each block's first token
    query_start_loc_ref,  # [S + 1] whole array
    seq_lens_ref,  # [S] whole array
    bases_ref,  # [2] whole array: first page row of this layer's K pool and of its V pool
    block_tables_ref,  # [S, padded_pages_per_seq] whole array
    q_ref,  # [None, T + B, Gp, H]: this KV head's queries (padded by B tokens), sliced by hand
    k_rows_ref,  # [num_rows, page_size, H]: every page row (gathered from)
    v_rows_ref,  # [num_rows, page_size, H]
    *refs,  # quantized: k, v scale rows [num_rows, page_size]; sinks: [None, Gp] this KV head's; then out
    #         [None, None, B, Gp, H]
    quantized: bool,
    has_sinks: bool,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    num_pages: int,
    pages_per_seq: int,
    pages_per_compute_block: int,
):
    k_scale_ref, v_scale_ref, rest = split_kv_refs(refs, quantized)
    sinks_ref, out_ref = rest if has_sinks else (None, *rest)
    head_idx = pl.program_id(0)
    block_idx = pl.program_id(1)
    block_q, group_rows, head_dim = out_ref.shape
    page_size = k_rows_ref.shape[1]
    block_k = pages_per_compute_block * page_size
    num_rows = block_q * group_rows

    seq_idx = block_seq_idx_ref[block_idx]
    token_start = block_token_start_ref[block_idx]
    query_start = query_start_loc_ref[seq_idx]
    query_end = query_start_loc_ref[seq_idx + 1]
    seq_len = seq_lens_ref[seq_idx]
    # Position of this block's first token; row r of the block is token token_start + r // Gp.
    first_pos = seq_len - (query_end - query_start) + (token_start - query_start)
    num_valid_tokens = jnp.clip(query_end - token_start, 0, block_q)
    num_keys = jnp.where(num_valid_tokens > 0, first_pos + num_valid_tokens, 0)  # causal limit of the last row, + 1
    # Never past the block table's real width, whatever seq_len says: no table entry out of bounds.
    num_keys = jnp.minimum(num_keys, pages_per_seq * page_size)
    num_blocks = pl.cdiv(num_keys, block_k)
    k_head_base = bases_ref[0] + head_idx * num_pages  # page row of (this layer's K, this head, page 0)
    v_head_base = bases_ref[1] + head_idx * num_pages

    q = q_ref[pl.ds(token_start, block_q)].reshape(num_rows, head_dim)  # [B, Gp, H] -> [B*Gp, H]
    row_pos = first_pos + lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0) // group_rows  # [B*Gp, 1]

    def body(kv_block_idx, carry):
        page_idx = kv_block_idx * pages_per_compute_block
        page_ids = block_tables_ref[seq_idx, pl.ds(page_idx, pages_per_compute_block)]  # [P]
        # Entries past the length are masked but still gathered: keep them inside the pool (as XLA's
        # clamping gather does) so a stale table entry can never fault.
        page_ids = jnp.clip(page_ids, 0, num_pages - 1)
        # [P, page_size, H] -> [P*page_size, H]; a quantized cache is dequantized here, as it is read.
        k = read_page_rows(k_rows_ref, k_scale_ref, k_head_base + page_ids, q.dtype).reshape(block_k, head_dim)
        v = read_page_rows(v_rows_ref, v_scale_ref, v_head_base + page_ids, q.dtype).reshape(block_k, head_dim)
        key_pos = page_idx * page_size + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, block_k]
        in_sequence = key_pos < seq_len  # [1, block_k]
        visible = (key_pos <= row_pos) & in_sequence  # [B*Gp, block_k]
        if sliding_window is not None:  # row at position p sees keys p - window + 1 .. p
            visible &= key_pos > row_pos - sliding_window
            in_sequence &= key_pos > first_pos - sliding_window  # seen by no row: zero its values too
        v = jnp.where(in_sequence.reshape(block_k, 1), v, jnp.zeros_like(v))
        return online_softmax_step(q, k, v, visible, carry, scale=scale, soft_cap=soft_cap)

    carry = (
        jnp.zeros((num_rows, head_dim), jnp.float32),
        jnp.full((num_rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows,), jnp.float32),
    )
    first_block = 0
    if sliding_window is not None:  # blocks wholly before the first row's window are skipped
        first_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_k
    out, m, l = lax.fori_loop(first_block, jnp.maximum(num_blocks, first_block), body, carry)
    # Row r is query head r % Gp of this KV head: its sink.
    sink = None if sinks_ref is None else jnp.broadcast_to(sinks_ref[...][None], (block_q, group_rows)).reshape(num_rows)
    # Rows of tokens past the chunk (or of an empty block) have l = 0 (no sinks): write zeros, never 0/0.
    out = normalise(out, m, l, sink)
    out_ref[...] = out.reshape(block_q, group_rows, head_dim).astype(out_ref.dtype)


def _ragged_pallas_call(
    block_seq_idx: Int[ArrayLike, "num_q_blocks"],
    block_token_start: Int[ArrayLike, "num_q_blocks"],
    query_start_loc: Int[ArrayLike, "num_seqs_plus_1"],
    seq_lens: Int[ArrayLike, "num_seqs"],
    block_tables: Int[ArrayLike, "num_seqs padded_pages"],
    q: Float[ArrayLike, "num_kv_heads padded_tokens rows head_dim"],
    k_rows,  # [num_rows, page_size, head_dim] array, or QuantizedRows (values + scale rows)
    v_rows,
    bases: Int[ArrayLike, "2"],
    sinks: Float[ArrayLike, "num_kv_heads rows"] | None,
    *,
    block_q: int,
    scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    num_pages: int,
    pages_per_seq: int,
    pages_per_compute_block: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> Float[Array, "num_kv_heads num_q_blocks block_q rows head_dim"]:
    num_kv_heads, padded_tokens, group_rows, head_dim = q.shape
    num_q_blocks = block_seq_idx.shape[0]
    kv_args = kv_operands(k_rows, v_rows)
    kernel = functools.partial(
        _ragged_kernel, quantized=len(kv_args) == 4, has_sinks=sinks is not None, scale=scale, soft_cap=soft_cap,
        sliding_window=sliding_window,
        num_pages=num_pages, pages_per_seq=pages_per_seq,
        pages_per_compute_block=pages_per_compute_block,
    )

    def whole(x):
        return pl.BlockSpec(x.shape, lambda h, i: (0,) * x.ndim)

    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_q_blocks),
        in_specs=[
            whole(block_seq_idx),
            whole(block_token_start),
            whole(query_start_loc),
            whole(seq_lens),
            whole(bases),
            whole(block_tables),
            pl.BlockSpec((None, padded_tokens, group_rows, head_dim), lambda h, i: (h, 0, 0, 0)),
            *[whole(x) for x in kv_args],
            *([] if sinks is None else [pl.BlockSpec((None, group_rows), lambda h, i: (h, 0))]),
        ],
        out_specs=pl.BlockSpec((None, None, block_q, group_rows, head_dim), lambda h, i: (h, i, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_kv_heads, num_q_blocks, block_q, group_rows, head_dim), q.dtype),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(block_seq_idx, block_token_start, query_start_loc, seq_lens, bases, block_tables, q, *kv_args,
      *([] if sinks is None else [sinks]))


_TUNING = ("block_q", "pages_per_compute_block", "num_warps", "num_stages", "interpret")


def ragged_paged_attention(
    q: Float[ArrayLike, "num_tokens num_heads head_dim"],
    k_pages: Float[ArrayLike, "num_kv_heads num_pages page_size head_dim"] | tuple,
    v_pages: Float[ArrayLike, "num_kv_heads num_pages page_size head_dim"] | tuple,
    block_tables: Int[ArrayLike, "num_seqs pages_per_seq"],
    seq_lens: Int[ArrayLike, "num_seqs"],
    query_start_loc: Int[ArrayLike, "num_seqs_plus_1"],
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_q: int = 16,
    pages_per_compute_block: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    sinks: Float[ArrayLike, "num_heads"] | None = None,
) -> Float[Array, "num_tokens num_heads head_dim"]:
    """Causal paged attention for a flat batch of query chunks of any lengths (DESIGN.md contract).

    Args:
      q: [num_tokens, num_heads, head_dim], float32 or bfloat16: the chunks of all sequences, in
        batch order; tokens at or past `query_start_loc[-1]` are padding. Cast to the pages' dtype
        for the matmuls. Query head `h` reads KV head `h // (num_heads // num_kv_heads)`.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim], q's dtype: one layer's pool,
        already holding this step's K/V; or a quantized pool (`jaxpaged.ops.kv_quant.QuantizedKV`: int8 /
        float8_e4m3fn `pages`, float32 `scales` [num_kv_heads, num_pages, page_size]), dequantized to
        q's dtype as the kernel reads it.
      block_tables: int32 [num_seqs, pages_per_seq]: sequence s's logical page i is physical page
        `block_tables[s, i]`; entries past `cdiv(seq_lens[s], page_size)` are never used.
      seq_lens: int32 [num_seqs]: context length after this step (cached + new), at most
        `pages_per_seq * page_size` (a ValueError for numpy lengths; otherwise the kernel never reads past
        the table); 0 for padding rows.
      query_start_loc: int32 [num_seqs + 1]: sequence s owns tokens
        `query_start_loc[s]:query_start_loc[s+1]` (>= 1 token each, except padding rows, which
        repeat the total). Token t of s sits at position `seq_lens[s] - q_len + (t - query_start_loc[s])`.
      scale: softmax scale (usually head_dim ** -0.5).
      soft_cap: if set, logits become `soft_cap * tanh(logits / soft_cap)`.
      sliding_window: if set, the token at position p sees only keys p - sliding_window + 1 .. p.
      sinks: if set (gpt-oss), float32 [num_heads]: one more logit per head in every softmax, of value 0.
      block_q: query tokens per program (power of two).
      pages_per_compute_block: pages gathered per inner step (power of two).
      num_warps, num_stages: Triton launch parameters (ignored when interpreting).
      interpret: None = compiled when the program is lowered for a GPU, interpreted when lowered for
        anything else (the target decides, not the host: `_common.by_target`).

    Returns:
      [num_tokens, num_heads, head_dim] in q's dtype; zeros for padding tokens.

    The engine calls `ragged_paged_attention_from_buffer`, which reads the model's whole buffer.
    """
    check_per_layer_pools(k_pages, v_pages)
    check_lengths_if_concrete(seq_lens, block_tables, k_pages.shape[2])
    return _ragged_jit(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, None, sinks, whole_buffer=False, scale=scale,
        soft_cap=soft_cap, sliding_window=sliding_window, block_q=block_q,
        pages_per_compute_block=pages_per_compute_block,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )


def ragged_paged_attention_from_buffer(
    q: Float[ArrayLike, "num_tokens num_heads head_dim"],
    kv_pages: Float[ArrayLike, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | tuple,
    block_tables: Int[ArrayLike, "num_seqs pages_per_seq"],
    seq_lens: Int[ArrayLike, "num_seqs"],
    query_start_loc: Int[ArrayLike, "num_seqs_plus_1"],
    *,
    layer_idx: int | Int[ArrayLike, ""],
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    block_q: int = 16,
    pages_per_compute_block: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    sinks: Float[ArrayLike, "num_heads"] | None = None,
) -> Float[Array, "num_tokens num_heads head_dim"]:
    """`ragged_paged_attention` of layer `layer_idx` (an int32 scalar, may be traced), reading the whole buffer.

    kv_pages: [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim] (axis 1: K, V). The
    kernel gets the whole buffer (reshaped, not copied) and the layer's first page rows, so inside
    the model's layer loop no layer's pool is sliced out and copied. Other arguments as
    `ragged_paged_attention`.
    """
    check_lengths_if_concrete(seq_lens, block_tables, kv_pages.shape[4])
    return _ragged_jit(
        q, kv_pages, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx, sinks, whole_buffer=True,
        scale=scale, soft_cap=soft_cap, sliding_window=sliding_window, block_q=block_q,
        pages_per_compute_block=pages_per_compute_block,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("whole_buffer", "scale", "soft_cap", "sliding_window", *_TUNING))
def _ragged_jit(q, k, v, block_tables, seq_lens, query_start_loc, layer_idx, sinks, *, whole_buffer: bool, scale,
                soft_cap, sliding_window, block_q, pages_per_compute_block, num_warps, num_stages, interpret):
    if whole_buffer:  # k is v is the model's buffer
        k_rows, v_rows, bases = page_rows_of_buffer(k, layer_idx)
        kv_shape = k.shape[2:]
    else:
        check_per_layer_pools(k, v)
        k_rows, v_rows, bases = page_rows_of_pools(k, v)
        kv_shape = k.shape
    check_common(q, kv_shape, block_tables, seq_lens, scale, soft_cap)
    num_pages = kv_shape[1]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_shape[0]
    num_seqs, pages_per_seq = block_tables.shape
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must have shape ({num_seqs + 1},) (num_seqs + 1), got {query_start_loc.shape}"
        )
    for name, value in (("block_q", block_q), ("pages_per_compute_block", pages_per_compute_block)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two")

    query_start_loc = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    # Pad the table to whole compute blocks; padding entries (page 0) lie past every length.
    padded_pages = pl.cdiv(pages_per_seq, pages_per_compute_block) * pages_per_compute_block
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))

    # Query block -> (sequence, first token); see the module docstring.
    num_q_blocks = num_tokens // block_q + num_seqs
    first_block = query_start_loc[:-1] // block_q + jnp.arange(num_seqs, dtype=jnp.int32)  # [S], increasing
    block_ids = jnp.arange(num_q_blocks, dtype=jnp.int32)
    block_seq_idx = (jnp.searchsorted(first_block, block_ids, side="right") - 1).astype(jnp.int32)  # [Q]
    block_token_start = query_start_loc[block_seq_idx] + (block_ids - first_block[block_seq_idx]) * block_q
    # Empty blocks (past their sequence's chunk) start at the chunk's end, so every q slice is in bounds.
    block_token_start = jnp.minimum(block_token_start, query_start_loc[block_seq_idx + 1])

    # GQA rows: [T, N, H] -> [T, K, G, H] -> [K, T, G, H] (query head h = k * G + g reads KV head
    # k = h // G), padded to [K, T + B, Gp, H] so the slice
    # of block_q tokens starting at any token_start < T stays in bounds.
    group = num_heads // num_kv_heads
    group_rows = next_power_of_2(group)
    # The matmuls run in the pages' dtype (q is cast if it differs); the output keeps q's dtype.
    q_grouped = q.astype(compute_dtype(q, k_rows)).reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_grouped = jnp.pad(q_grouped, ((0, 0), (0, block_q), (0, group_rows - group), (0, 0)))

    out_blocks = by_target(
        lambda interpret_mode: _ragged_pallas_call(
            block_seq_idx,
            block_token_start,
            query_start_loc,
            seq_lens,
            block_tables,
            q_grouped,
            k_rows,
            v_rows,
            bases,
            None if sinks is None else grouped_sinks(sinks, num_kv_heads, group, group_rows),
            block_q=block_q,
            scale=scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            num_pages=num_pages,
            pages_per_seq=pages_per_seq,
            pages_per_compute_block=pages_per_compute_block,
            num_warps=num_warps,
            num_stages=num_stages,
            interpret=interpret_mode,
        ),
        interpret,
    )  # [K, Q, B, Gp, H]

    # Each token's row: block first_block[s] + local // B, row local % B, local = t - query_start_loc[s].
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq_idx = jnp.clip(jnp.searchsorted(query_start_loc, token_idx, side="right") - 1, 0, num_seqs - 1)
    local_idx = token_idx - query_start_loc[token_seq_idx]
    token_block = first_block[token_seq_idx] + local_idx // block_q
    token_row = local_idx % block_q
    out = out_blocks[:, jnp.clip(token_block, 0, num_q_blocks - 1), token_row, :group]  # [K, T, G, H]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)  # [T, K, G, H] -> [T, N, H]
    is_real = (token_idx < query_start_loc[-1])[:, None, None]
    return jnp.where(is_real, out, jnp.zeros_like(out)).astype(q.dtype)


# The oracle is `jaxpaged.ops.attention.reference_paged_attention` (plain jnp, per token); the tests in
# tests/test_pallas_ragged.py rebuild the oracle's inputs without this file's index logic.
