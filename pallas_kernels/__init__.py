"""Pallas paged-attention kernels, importable without the jaxpaged engine.

Two kernels, each with two signatures (same arithmetic, same kernel):

- the ragged kernel, correct for any mix of decode rows and prefill chunks (the DESIGN.md
  attention contract):
  `ragged_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *, scale, ...)`
  over one layer's pools, and
  `ragged_paged_attention_from_buffer(q, kv_pages, block_tables, seq_lens, query_start_loc, *,
  layer_idx, scale, ...)` over the model's whole buffer `[num_layers, 2, num_kv_heads, num_pages,
  page_size, head_dim]`;
- the decode kernel, one query token per sequence (flash-decoding with context splits):
  `decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale, ...)` and
  `decode_attention_from_buffer(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx,
  scale, ...)`. A caller may use it instead of the ragged kernel only when it knows statically that
  every sequence has exactly one query token and `num_tokens == num_seqs` (a decode-only bucket):
  then it equals the ragged kernel with `query_start_loc = arange(num_seqs + 1)` for real rows and
  gives zeros for padding rows (seq_len 0).

Query head `h` reads KV head `h // (num_heads // num_kv_heads)` everywhere.

`paged_attention_from_buffer` is what `attention_backend="pallas"` runs: the whole-buffer ragged
kernel, or, when the model passes `decode_only=True` (a static flag of decode-only steps), the
whole-buffer decode kernel. The whole-buffer signatures exist because inside the model's layer
loop `kv_pages[layer_idx, 0]` is a dynamic slice that XLA copies in full before a custom call can
read it: every layer's pool, every step. The per-layer signatures stay for research code that
holds one layer's pools (they reshape, never copy, those pools).

`interpret=None` runs compiled when the program is lowered for a GPU and in Pallas interpret mode
when lowered for anything else (slow, but exact): the target decides, not the host, so the same
step compiles for an H100 from a CPU machine.
The oracle for all of them is `jaxpaged.ops.attention.reference_paged_attention`.
"""

import functools

from pallas_kernels.decode import decode_attention, decode_attention_from_buffer
from pallas_kernels.ragged import ragged_paged_attention, ragged_paged_attention_from_buffer

paged_attention = ragged_paged_attention


def paged_attention_from_buffer(
    q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale, soft_cap=None,
    sliding_window: int | None = None, decode_only: bool = False, interpret: bool | None = None, sinks=None,
):
    """The model's backend: the whole-buffer decode kernel if `decode_only` (static), else the ragged one.

    `sinks` (gpt-oss): float32 [num_heads], one more logit per head in every softmax, of value 0.

    `decode_only=True` promises what `decode_attention` needs: one query token per sequence and
    `num_tokens == num_seqs` (the step was planned in a decode bucket).
    """
    if decode_only:
        if q.shape[0] != block_tables.shape[0]:
            raise ValueError(
                f"decode_only needs one token per sequence, got {q.shape[0]} tokens for "
                f"{block_tables.shape[0]} sequences; plan the step in a decode bucket"
            )
        return decode_attention_from_buffer(
            q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx=layer_idx, scale=scale,
            soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret, sinks=sinks,
        )
    return ragged_paged_attention_from_buffer(
        q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx=layer_idx, scale=scale,
        soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret, sinks=sinks,
    )


paged_attention_from_buffer.reads_whole_kv_buffer = True  # the model passes kv_pages and layer_idx
paged_attention_from_buffer.has_decode_kernel = True  # the model passes decode_only in decode steps


def pallas_backend(*, interpret: bool | None = None):
    """`paged_attention_from_buffer` with `interpret` fixed (e.g. False: lower for a GPU from any host)."""
    backend = functools.partial(paged_attention_from_buffer, interpret=interpret)
    backend.reads_whole_kv_buffer = True
    backend.has_decode_kernel = True
    return backend


__all__ = [
    "paged_attention",
    "paged_attention_from_buffer",
    "pallas_backend",
    "ragged_paged_attention",
    "ragged_paged_attention_from_buffer",
    "decode_attention",
    "decode_attention_from_buffer",
]
