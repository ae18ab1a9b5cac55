"""Mosaic GPU (Hopper: wgmma, TMA, warp-specialised) paged-attention kernels, whole-buffer form.

- `ragged_paged_attention(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale,
  soft_cap=None)`: any mix of decode rows and prefill chunks; `attention_backend="mosaic"`.
- `decode_attention(q, kv_pages, block_tables, seq_lens, *, layer_idx, scale, soft_cap=None,
  num_splits=4)`: one query token per sequence, long contexts split across CUDA blocks.

Both carry `reads_whole_kv_buffer = True` (DESIGN.md). Off a GPU they run in Mosaic GPU interpret
mode (simulated warpgroups, barriers, TMA and wgmma on the CPU: slow, for tests). The oracle is
`jaxpaged.attention.reference_paged_attention` on `kv_pages[layer_idx, 0]`, `kv_pages[layer_idx, 1]`.
"""

from pallas_kernels.mosaic.attention import decode_attention, ragged_paged_attention

paged_attention = ragged_paged_attention

__all__ = ["paged_attention", "ragged_paged_attention", "decode_attention"]
