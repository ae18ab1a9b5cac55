"""Pallas paged-attention kernels, importable without the jaxpaged engine.

- `paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *, scale,
  soft_cap=None, interpret=None)`: the DESIGN.md attention backend contract, correct for any mix
  of decode rows and prefill chunks (the ragged kernel). This is what `attention_backend="pallas"`
  calls.
- `decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale, soft_cap=None,
  interpret=None)`: one query token per sequence (flash-decoding with context splits). A caller may
  use it instead of `paged_attention` only when it knows statically that every sequence has exactly
  one query token and `num_tokens == num_seqs` (a decode-only bucket): then
  `decode_attention(q, ..., seq_lens)` equals `paged_attention(q, ..., seq_lens, arange(num_seqs + 1))`
  for real rows and gives zeros for padding rows (seq_len 0).

`interpret=None` runs compiled on a GPU and in Pallas interpret mode elsewhere (slow, but exact).
The oracle for both is `jaxpaged.attention.reference_paged_attention`.
"""

from pallas_kernels.decode import decode_attention
from pallas_kernels.ragged import ragged_paged_attention

paged_attention = ragged_paged_attention

__all__ = ["paged_attention", "ragged_paged_attention", "decode_attention"]
