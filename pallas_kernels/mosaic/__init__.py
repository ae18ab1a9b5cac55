"""Mosaic GPU (Hopper: wgmma, TMA, warp-specialised) paged-attention kernels, whole-buffer form.

- `ragged_paged_attention(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale,
  soft_cap=None)`: any mix of decode rows and prefill chunks; `attention_backend="mosaic"`.
- `decode_attention(q, kv_pages, block_tables, seq_lens, *, layer_idx, scale, soft_cap=None,
  num_splits=4)`: one query token per sequence, long contexts split across CUDA blocks.

Both carry `reads_whole_kv_buffer = True` (DESIGN.md). Off a GPU they run in Mosaic GPU interpret
mode (simulated warpgroups, barriers, TMA and wgmma on the CPU: slow, for tests). The oracle is
`jaxpaged.ops.attention.reference_paged_attention` on `kv_pages[layer_idx, 0]`, `kv_pages[layer_idx, 1]`.
"""

from pallas_kernels.mosaic.attention import decode_attention, ragged_paged_attention

paged_attention = ragged_paged_attention


def paged_attention_from_buffer(
    q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale, soft_cap=None,
    decode_only: bool = False, sliding_window: int | None = None, interpret: bool | None = None, sinks=None,
):
    """`attention_backend="mosaic"`: the split-context decode kernel in decode-only steps (static
    `decode_only`: one query token per sequence, `num_tokens == num_seqs`), else the ragged kernel.
    `sinks` (gpt-oss): float32 [num_heads], one more logit per head in every softmax."""
    if sliding_window is not None:
        raise ValueError(
            f"{sliding_window=}: the mosaic kernels have no sliding window; use attention_backend='pallas' or 'chunked'"
        )
    if decode_only:
        if q.shape[0] != block_tables.shape[0]:
            raise ValueError(
                f"decode_only needs one token per sequence, got {q.shape[0]} tokens for "
                f"{block_tables.shape[0]} sequences; plan the step in a decode bucket"
            )
        return decode_attention(q, kv_pages, block_tables, seq_lens, layer_idx=layer_idx, scale=scale,
                                soft_cap=soft_cap, interpret=interpret, sinks=sinks)
    return ragged_paged_attention(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx=layer_idx,
                                  scale=scale, soft_cap=soft_cap, interpret=interpret, sinks=sinks)


paged_attention_from_buffer.reads_whole_kv_buffer = True  # the model passes kv_pages and layer_idx
paged_attention_from_buffer.has_decode_kernel = True  # and decode_only in decode-bucket steps
paged_attention_from_buffer.effects_when_interpreted = True  # GPU interpret mode: ordered io callbacks

__all__ = ["paged_attention", "paged_attention_from_buffer", "ragged_paged_attention", "decode_attention"]
