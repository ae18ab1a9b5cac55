"""Test support (numpy only): build one paged-attention case twice, hostile and plain.

`make_case` draws each sequence's contiguous K/V, then lays it out two independent ways:

  * for the kernel: page ids are a random permutation, every page a sequence does not own (page 0,
    spare pages) and every unused slot of a sequence's last page holds NaN, and block-table entries
    past a sequence's length point at page 0 (NaN). Any read past a length poisons the output.
  * for the oracle: sequence s's logical page j is physical page `1 + s * pages_per_seq + j`, the
    rest is zeros. Nothing here is shared with the kernels' index arithmetic.

Both layouts hold bit-identical values, so kernel and oracle differ only by arithmetic.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PagedCase:
    q: np.ndarray  # [num_tokens, num_heads, head_dim]
    seq_lens: np.ndarray  # int32 [num_seqs]
    query_start_loc: np.ndarray  # int32 [num_seqs + 1]
    k_pages: np.ndarray  # hostile layout, [num_kv_heads, num_pages, page_size, head_dim]
    v_pages: np.ndarray
    block_tables: np.ndarray  # int32 [num_seqs, pages_per_seq], random page ids
    oracle_k_pages: np.ndarray  # plain layout
    oracle_v_pages: np.ndarray
    oracle_block_tables: np.ndarray  # int32, identity-like page ids


def make_case(
    rng: np.random.Generator,
    *,
    seq_lens: list[int],
    q_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype,
    num_padding_tokens: int = 0,
    num_spare_pages: int = 3,
) -> PagedCase:
    """seq_lens[s] = cached + new tokens of sequence s; q_lens[s] its new (query) tokens (0 = padding row)."""
    if len(seq_lens) != len(q_lens) or any(q > n for q, n in zip(q_lens, seq_lens)):
        raise ValueError(f"need q_len <= seq_len per sequence, got {seq_lens=} {q_lens=}")
    num_seqs = len(seq_lens)
    pages_needed = [-(-n // page_size) for n in seq_lens]
    pages_per_seq = max(1, max(pages_needed))
    num_pages = 1 + sum(pages_needed) + num_spare_pages

    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, dtype)
    v_pages = np.full_like(k_pages, np.nan)
    block_tables = np.zeros((num_seqs, pages_per_seq), np.int32)  # past-length entries: page 0 (NaN)
    oracle_pages = 1 + num_seqs * pages_per_seq
    oracle_k_pages = np.zeros((num_kv_heads, oracle_pages, page_size, head_dim), dtype)
    oracle_v_pages = np.zeros_like(oracle_k_pages)
    oracle_block_tables = 1 + np.arange(num_seqs * pages_per_seq, dtype=np.int32).reshape(num_seqs, pages_per_seq)

    free_page_ids = iter(rng.permutation(np.arange(1, num_pages)))
    for seq_idx, seq_len in enumerate(seq_lens):
        k = rng.standard_normal((num_kv_heads, seq_len, head_dim)).astype(dtype)  # contiguous K/V
        v = rng.standard_normal((num_kv_heads, seq_len, head_dim)).astype(dtype)
        for page_idx in range(pages_needed[seq_idx]):
            start, end = page_idx * page_size, min((page_idx + 1) * page_size, seq_len)
            page_id = next(free_page_ids)
            block_tables[seq_idx, page_idx] = page_id
            k_pages[:, page_id, : end - start] = k[:, start:end]
            v_pages[:, page_id, : end - start] = v[:, start:end]
        padded = pages_per_seq * page_size  # oracle: the whole contiguous row, zeros past the length
        k_row = np.zeros((num_kv_heads, padded, head_dim), dtype)
        v_row = np.zeros_like(k_row)
        k_row[:, :seq_len], v_row[:, :seq_len] = k, v
        first = 1 + seq_idx * pages_per_seq
        oracle_k_pages[:, first : first + pages_per_seq] = k_row.reshape(num_kv_heads, pages_per_seq, page_size, head_dim)
        oracle_v_pages[:, first : first + pages_per_seq] = v_row.reshape(num_kv_heads, pages_per_seq, page_size, head_dim)

    num_tokens = sum(q_lens) + num_padding_tokens
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(dtype)
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return PagedCase(
        q=q,
        seq_lens=np.asarray(seq_lens, np.int32),
        query_start_loc=query_start_loc,
        k_pages=k_pages,
        v_pages=v_pages,
        block_tables=block_tables,
        oracle_k_pages=oracle_k_pages,
        oracle_v_pages=oracle_v_pages,
        oracle_block_tables=oracle_block_tables,
    )
