"""Mosaic GPU paged attention, whole-buffer form (DESIGN.md): tile planning around `kernel.py`.

`ragged_paged_attention` serves any mix of decode rows and prefill chunks; `decode_attention` serves
decode-only buckets (one token per sequence) and splits long contexts across CUDA blocks.

Ragged tiles. A tile is C * 64 rows = B tokens of ONE sequence x Gp query heads (B = C * 64 // Gp),
C consumer warpgroups of 64 rows each (C = 2 compiled, 1 interpreted: see RAGGED_CONSUMERS), so one read of a KV head's pages serves every query head of its
group and 128 query rows. Tiles never straddle sequences:
sequence s gets the tile ids starting at `query_start_loc[s] // B + s` (the Triton kernel's scheme,
pallas_kernels/ragged.py), so `num_tokens // B + num_seqs` tiles fit any batch; some are empty.

    B = 4 (Gp = 32), query_start_loc [0, 8, 9, 11]
    token:    0 1 2 3 | 4 5 6 7 | 8 | 9 10
    tile id:  0       | 1       | 3 | 4          tile 2 is empty (num_keys 0) and writes zeros

Decode tiles. One tile per (sequence, Hp KV heads): row r = query head r % G of local KV head
r // G (pallas_kernels/decode_plan.py; Qwen3's G = 2 with 8 KV heads fills 16 of the 64 rows; rows
past Hp * G are padding that the wgmma computes and the wrapper drops: decode is bound by reading
K/V, not by the tensor cores). The block loops over (key step, local KV head) units, each one KV
head's 64 keys for that head's rows. `num_splits` blocks per tile (1 when the batch fills the GPU),
each over a contiguous share of the sequence's key steps; the wrapper merges splits with their
log-sum-exp.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels._common import next_power_of_2
from pallas_kernels.decode_plan import heads_per_tile, num_splits_for
from pallas_kernels.mosaic.kernel import STEP_KEYS, TILE_ROWS, KernelShape, attention_tiles

# Consumer warpgroups per ragged tile when compiled: 128 query rows share each K/V step. GPU interpret
# mode runs each warpgroup as a host thread blocked in XLA callbacks, and XLA's CPU runtime gives at
# most one such thread per core: a producer plus two consumers hang on a 2-core machine, so the
# interpreted default is one consumer (64-row tiles).
RAGGED_CONSUMERS = 2

# Legend: T=num_tokens S=num_seqs K=num_kv_heads G=query heads per KV head Gp=G padded to a power of
#         two B=tokens per tile Q=tiles H=head_dim L=num_layers R=TILE_ROWS (64) X=splits


def _check(q, kv_pages, block_tables, seq_lens, scale, soft_cap) -> None:
    if hasattr(kv_pages, "scales"):  # jaxpaged.ops.kv_quant.QuantizedKV
        raise ValueError(
            "the Mosaic kernels read bfloat16/float16 pages only, not a quantized (int8/fp8) KV cache; "
            "use the Triton kernels (pallas_kernels.paged_attention_from_buffer) or kv_cache_dtype='auto'")
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {q.shape}")
    if kv_pages.ndim != 6 or kv_pages.shape[1] != 2:
        raise ValueError(
            "kv_pages must be the whole buffer [num_layers, 2, num_kv_heads, num_pages, page_size, "
            f"head_dim], got shape {kv_pages.shape}"
        )
    num_heads, head_dim = q.shape[1:]
    _, _, num_kv_heads, _, page_size, kv_head_dim = kv_pages.shape
    if head_dim != kv_head_dim:
        raise ValueError(f"q's {head_dim=} differs from the pages' head_dim={kv_head_dim}")
    if head_dim not in (64, 128, 256):
        raise ValueError(f"{head_dim=} must be 64, 128 or 256 for the wgmma tiles")
    if page_size not in (8, 16, 32, 64):
        raise ValueError(f"{page_size=} must be 8, 16, 32 or 64 (a divisor of the {STEP_KEYS}-key step)")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if next_power_of_2(num_heads // num_kv_heads) > TILE_ROWS:  # decode packs one group per 64-row tile
        raise ValueError(f"at most {TILE_ROWS} query heads per KV head, got {num_heads // num_kv_heads}")
    if jnp.dtype(kv_pages.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"kv_pages must be bfloat16 or float16 for wgmma, got {kv_pages.dtype}")
    if block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(
            f"block_tables must be [num_seqs, pages_per_seq] and seq_lens [num_seqs], got "
            f"{block_tables.shape} and {seq_lens.shape}"
        )
    if not scale > 0:
        raise ValueError(f"{scale=} must be positive (usually head_dim ** -0.5)")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{soft_cap=} must be positive or None")


def _run(q_tiles, kv_pages, block_tables, layer_idx, tile_seq_idx, tile_first_pos, tile_num_keys, *,
         group_rows, num_consumers, num_splits, num_slots, scale, soft_cap, out_dtype, interpret,
         heads_per_tile=1, group=1, real_rows=TILE_ROWS, decode=False, with_lse=False):
    num_layers, _, num_kv_heads, num_pages, page_size, head_dim = kv_pages.shape
    pages_per_step = STEP_KEYS // page_size
    num_seqs, pages_per_seq = block_tables.shape
    # Pad the table to whole key steps; padding entries lie past every length (masked, never read).
    padded_pages = -(-pages_per_seq // pages_per_step) * pages_per_step
    block_tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)))
    shape = KernelShape(
        group_rows=group_rows,
        page_size=page_size,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        num_pages=num_pages,
        num_q_tiles=tile_num_keys.shape[0],
        num_splits=num_splits,
        num_slots=num_slots,
        num_consumers=num_consumers,
        heads_per_tile=heads_per_tile,
        group=group,
        real_rows=real_rows,
        scale=scale,
        soft_cap=soft_cap,
        interpret=interpret,
        decode=decode,
        with_lse=with_lse,
    )
    # One row per page of one (layer, K/V, KV head): a free reshape of the contiguous buffer.
    kv_flat = kv_pages.reshape(num_layers * 2 * num_kv_heads * num_pages, page_size, head_dim)
    layer_idx = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    return attention_tiles(
        layer_idx, tile_seq_idx, tile_first_pos, tile_num_keys, block_tables,
        q_tiles.astype(kv_pages.dtype), kv_flat, shape=shape, out_dtype=out_dtype,
    )


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "num_slots", "num_consumers", "interpret"))
def ragged_paged_attention(
    q: Float[Array, "num_tokens num_heads head_dim"],
    kv_pages: Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | tuple,  # tuple: refused
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    seq_lens: Int[Array, "num_seqs"],
    query_start_loc: Int[Array, "num_seqs_plus_1"],
    *,
    layer_idx,
    scale: float,
    soft_cap: float | None = None,
    num_slots: int = 2,
    num_consumers: int | None = None,
    interpret: bool | None = None,
    sinks: Float[Array, "num_heads"] | None = None,
) -> Float[Array, "num_tokens num_heads head_dim"]:
    """Causal paged attention for a flat batch of query chunks, reading the model's whole KV buffer.

    Args:
      q: [num_tokens, num_heads, head_dim]: the chunks of all sequences in batch order; tokens at or
        past `query_start_loc[-1]` are padding (zeros out). Cast to the pages' dtype for wgmma.
      kv_pages: bfloat16/float16 [num_layers, 2, num_kv_heads, num_pages, page_size, head_dim],
        already holding this step's K/V; page_size 8..64, head_dim 64/128/256.
      block_tables: int32 [num_seqs, pages_per_seq]; entries past a length are never used.
      seq_lens: int32 [num_seqs], context length after this step; 0 for padding rows.
      query_start_loc: int32 [num_seqs + 1], cumulative query lengths; padding rows repeat the total.
      layer_idx: int32 scalar, may be traced (the model's layer scan).
      scale, soft_cap: softmax scale; optional `soft_cap * tanh(logits / soft_cap)`.
      num_slots: pipeline depth in 64-key steps (>= 2).
      num_consumers: consumer warpgroups per tile (64 query rows each); None: 2 compiled, 1 when
        interpreting (see RAGGED_CONSUMERS).
      interpret: None = compiled on a GPU host, GPU interpret mode elsewhere; to compile for a GPU
        from another host pass False (jaxpaged.device.backends.attention_fn(..., platform="cuda")).
      sinks: gpt-oss's, float32 [num_heads]: one more logit per head in every softmax, of value 0. The
        kernel writes each row's log-sum-exp too, and a row's output is scaled by sigmoid(lse - sink).

    Returns:
      [num_tokens, num_heads, head_dim] in q's dtype.
    """
    _check(q, kv_pages, block_tables, seq_lens, scale, soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_pages.shape[2]
    num_seqs = block_tables.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have shape ({num_seqs + 1},), got {query_start_loc.shape}")
    interpret = _resolve_interpret(interpret)
    if num_consumers is None:
        num_consumers = 1 if interpret else RAGGED_CONSUMERS
    if num_consumers not in (1, 2):
        raise ValueError(f"{num_consumers=} must be 1 or 2 (consumer warpgroups of 64 rows)")
    group = num_heads // num_kv_heads
    group_rows = next_power_of_2(group)
    tile_rows = num_consumers * TILE_ROWS
    tokens_per_tile = tile_rows // group_rows  # B
    query_start_loc = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)

    # Tile -> (sequence, first token); see the module docstring.
    num_tiles = num_tokens // tokens_per_tile + num_seqs
    first_tile = query_start_loc[:-1] // tokens_per_tile + jnp.arange(num_seqs, dtype=jnp.int32)  # [S]
    tile_ids = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq_idx = (jnp.searchsorted(first_tile, tile_ids, side="right") - 1).astype(jnp.int32)  # [Q]
    query_start, query_end = query_start_loc[tile_seq_idx], query_start_loc[tile_seq_idx + 1]
    token_start = jnp.minimum(query_start + (tile_ids - first_tile[tile_seq_idx]) * tokens_per_tile, query_end)
    first_pos = seq_lens[tile_seq_idx] - (query_end - query_start) + (token_start - query_start)  # [Q]
    num_valid = jnp.clip(query_end - token_start, 0, tokens_per_tile)
    num_keys = jnp.where(num_valid > 0, first_pos + num_valid, 0)  # the last real row's causal limit + 1

    # Query tiles: row r of tile i is token token_start[i] + r // Gp, head r % Gp of the group.
    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, N, H] -> [T, K, G, H]
    q_grouped = jnp.pad(q_grouped, ((0, tokens_per_tile), (0, 0), (0, group_rows - group), (0, 0)))
    row_tokens = token_start[:, None] + jnp.arange(tokens_per_tile, dtype=jnp.int32)  # [Q, B]
    q_tiles = q_grouped[row_tokens]  # [Q, B, K, Gp, H]; rows past a chunk hold finite neighbours/zeros
    # [Q, B, K, Gp, H] -> [K, Q, B, Gp, H] -> [K * Q * C, 64, H]: consumer c of tile i takes rows c * 64...
    q_tiles = q_tiles.transpose(2, 0, 1, 3, 4).reshape(num_kv_heads * num_tiles * num_consumers, TILE_ROWS, head_dim)

    out_tiles, lse = _run(
        q_tiles, kv_pages, block_tables, layer_idx, tile_seq_idx, first_pos, num_keys,
        group_rows=group_rows, num_consumers=num_consumers, num_splits=1, num_slots=num_slots, scale=scale,
        soft_cap=soft_cap, out_dtype=kv_pages.dtype, interpret=interpret, with_lse=sinks is not None,
    )  # [K * Q * C, R, H] (lse [K * Q * C, R])
    out_tiles = out_tiles.reshape(num_kv_heads, num_tiles, tokens_per_tile, group_rows, head_dim)

    # Each token's row: tile first_tile[s] + local // B, token local % B, local = t - query_start_loc[s].
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq_idx = jnp.clip(jnp.searchsorted(query_start_loc, token_idx, side="right") - 1, 0, num_seqs - 1)
    local_idx = token_idx - query_start_loc[token_seq_idx]
    token_tile = jnp.clip(first_tile[token_seq_idx] + local_idx // tokens_per_tile, 0, num_tiles - 1)
    out = out_tiles[:, token_tile, local_idx % tokens_per_tile, :group]  # [K, T, G, H]
    if sinks is not None:  # e^lse / (e^lse + e^sink) of each row's normalised output; an empty row's lse is MASK_VALUE
        lse = lse.reshape(num_kv_heads, num_tiles, tokens_per_tile, group_rows)[:, token_tile, local_idx % tokens_per_tile,
                                                                               :group]  # [K, T, G]
        sink = jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, 1, group)
        out = out.astype(jnp.float32) * jax.nn.sigmoid(lse - sink)[..., None]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)  # [T, K, G, H] -> [T, N, H]
    is_real = (token_idx < query_start_loc[-1])[:, None, None]
    return jnp.where(is_real, out, jnp.zeros_like(out)).astype(q.dtype)


ragged_paged_attention.reads_whole_kv_buffer = True


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "num_splits", "num_slots", "interpret"))
def decode_attention(
    q: Float[Array, "num_seqs num_heads head_dim"],
    kv_pages: Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | tuple,  # tuple: refused
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    seq_lens: Int[Array, "num_seqs"],
    *,
    layer_idx,
    scale: float,
    soft_cap: float | None = None,
    num_splits: int | None = None,
    num_slots: int = 2,
    interpret: bool | None = None,
    sinks: Float[Array, "num_heads"] | None = None,
) -> Float[Array, "num_seqs num_heads head_dim"]:
    """One query token per sequence (its last position), contexts split `num_splits` ways.

    Equals `ragged_paged_attention(q, ..., seq_lens, arange(num_seqs + 1))` for real rows and gives
    zeros for padding rows (seq_len 0). Arguments as in `ragged_paged_attention`; q has one row per
    block-table row. The query heads of Hp KV heads share each 64-row tile (decode_plan.py).
    num_splits: None = chosen from the batch against the GPU's SMs (`decode_plan.num_splits_for`):
    1 when the batch fills it (the kernel then writes bf16 rows, no float32 partials, no combine).
    sinks (gpt-oss): join the combine of the splits as one more split per row, of log-sum-exp the sink and
    output 0 (with one split the kernel writes the log-sum-exp for it).
    """
    _check(q, kv_pages, block_tables, seq_lens, scale, soft_cap)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_pages.shape[2]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"decode needs one query per sequence: q has {num_seqs} rows, block_tables {block_tables.shape[0]}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{num_splits=} must be >= 1 (or None to choose)")
    interpret = _resolve_interpret(interpret)
    group = num_heads // num_kv_heads
    seq_lens = seq_lens.astype(jnp.int32)
    # The groups of Hp KV heads share one 64-row tile (pallas_kernels/decode_plan.py):
    # [S, N, H] -> [S, K / Hp, Hp * G, H] (free: query head n = k * G + g) -> [S * K / Hp, R8, H], sequence
    # major (kernel._tile_index), R8 = Hp * G up to 8-row tiles: the kernel loads and stores only these rows.
    tile_heads = heads_per_tile(num_kv_heads, group, TILE_ROWS, num_seqs)
    num_tiles, real_rows = num_kv_heads // tile_heads, tile_heads * group
    store_rows = -(-real_rows // 8) * 8  # q rows read and output rows stored (KernelShape.store_rows)
    if num_splits is None:
        pages_per_step = STEP_KEYS // kv_pages.shape[4]
        num_splits = num_splits_for(
            num_tiles=num_seqs * num_tiles, pages_per_seq=block_tables.shape[1], pages_per_block=pages_per_step,
            # float32 partials (and one lse) per stored row, written and read back
            partial_bytes_per_split=2 * store_rows * (head_dim + 1) * 4,
            kv_bytes_per_page=tile_heads * kv_pages.shape[4] * 2 * head_dim * kv_pages.dtype.itemsize,
        )
    q_tiles = q.reshape(num_seqs, num_tiles, real_rows, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, store_rows - real_rows), (0, 0)))
    q_tiles = q_tiles.reshape(num_seqs * num_tiles, store_rows, head_dim)
    # Decode tiles: tile t is sequence t, every row at its last position (KernelShape.decode).
    out, lse = _run(
        q_tiles, kv_pages, block_tables, layer_idx, None, None, seq_lens, group_rows=TILE_ROWS, num_consumers=1,
        num_splits=num_splits, num_slots=num_slots, scale=scale, soft_cap=soft_cap,
        out_dtype=jnp.float32 if num_splits > 1 else kv_pages.dtype, interpret=interpret, heads_per_tile=tile_heads,
        group=group, real_rows=real_rows, decode=True, with_lse=sinks is not None,
    )  # out [S * K/Hp * X, R8, H], lse [S * K/Hp * X, R8]
    out = out.reshape(num_seqs, num_tiles, num_splits, store_rows, head_dim)[:, :, :, :real_rows]
    if num_splits > 1 or sinks is not None:
        # Merge the splits: weights exp(lse_x - max lse); an empty split has lse = MASK_VALUE, weight 0.
        lse = lse.reshape(num_seqs, num_tiles, num_splits, store_rows)[:, :, :, :real_rows]
        if sinks is not None:  # one more split per row: lse the sink, output 0
            sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(1, num_tiles, 1, real_rows),
                                    (num_seqs, num_tiles, 1, real_rows))
            lse = jnp.concatenate([lse, sink], axis=2)
            out = jnp.concatenate([out.astype(jnp.float32), jnp.zeros_like(out[:, :, :1], jnp.float32)], axis=2)
        weights = jnp.exp(lse - lse.max(axis=2, keepdims=True))  # [S, K/Hp, X, Hp*G]
        out = (out * weights[..., None]).sum(axis=2) / weights.sum(axis=2)[..., None]  # [S, K/Hp, Hp*G, H]
    else:
        out = out[:, :, 0]
    out = out.reshape(num_seqs, num_heads, head_dim)  # [S, K/Hp, Hp*G, H] -> [S, N, H]: free
    # Padding rows (seq_len 0) are zeros already: a row that sees no key is written as 0 (the kernel's
    # has_keys), and all-empty splits merge to 0. No select here: it was one more launch per layer.
    return out.astype(q.dtype)


decode_attention.reads_whole_kv_buffer = True


def _resolve_interpret(interpret: bool | None) -> bool:
    """None: compiled on a GPU host, GPU interpret mode elsewhere.

    Not `_common.by_target` (which lets the lowering platform choose, as the Triton kernels do): GPU
    interpret mode runs through ordered io callbacks, and `lax.platform_dependent`'s `cond` cannot
    drop an effectful branch when lowering for CUDA. Callers that target another platform than the
    host's say so with an explicit `interpret` (jaxpaged.device.backends.attention_fn(platform=...)).
    """
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)
