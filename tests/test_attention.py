"""The reference paged attention against attention written from scratch over contiguous K/V.

The test keeps each sequence's K/V contiguous (its "logical" cache), scatters it into a page pool
through a random permutation of page ids, fills every other page with NaN, and compares the
reference with a per-token loop over the contiguous cache in numpy float64.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.ops.attention import (
    QueryBlocks,
    chunked_paged_attention,
    chunked_paged_attention_from_buffer,
    reference_paged_attention,
)


def _naive(q, ks, vs, q_lens, seq_lens, scale, soft_cap):
    """Per sequence, per token, over contiguous float64 K/V; returns [num_tokens, N, H]."""
    outs = []
    num_heads = q.shape[1]
    group = num_heads // ks[0].shape[1]
    t = 0
    for k, v, q_len, seq_len in zip(ks, vs, q_lens, seq_lens):
        for i in range(q_len):
            pos = seq_len - q_len + i
            row = np.zeros((num_heads, q.shape[2]))
            for h in range(num_heads):
                s = k[: pos + 1, h // group] @ q[t, h].astype(np.float64) * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                p = np.exp(s - s.max())
                row[h] = (p / p.sum()) @ v[: pos + 1, h // group]
            outs.append(row)
            t += 1
    return np.stack(outs)


# chunked with 2 pages per chunk: sequences span 1 to 3 chunks, and the loop must stop early.
def _from_buffer(q, k_pages, v_pages, *args, **kwargs):
    """The whole-buffer entry point, on a 3-layer buffer whose other layers are NaN."""
    poison = jnp.full_like(k_pages, jnp.nan)
    kv_pages = jnp.stack([jnp.stack([poison, poison]), jnp.stack([k_pages, v_pages]), jnp.stack([poison, poison])])
    return chunked_paged_attention_from_buffer(q, kv_pages, *args, layer_idx=jnp.int32(1), pages_per_chunk=2, **kwargs)


ATTENTION_FNS = {"reference": reference_paged_attention,
                 "chunked": functools.partial(chunked_paged_attention, pages_per_chunk=2),
                 "chunked-from-buffer": _from_buffer,
                 # Query blocks of at most 4 tokens: the two decode rows as one by-token run, then
                 # blocks finishing one sequence's tokens (max_seqs 1) or two (2), the last
                 # one-token prompt as a run of its own; the padding tokens are never a block.
                 "chunked-blocks-of-4": functools.partial(chunked_paged_attention, pages_per_chunk=2,
                                                          query_blocks=QueryBlocks(4, 1, 2)),
                 "chunked-from-buffer-blocks-of-4": functools.partial(_from_buffer, query_blocks=QueryBlocks(4, 2, 2)),
                 # Chunks of 2 pages, then 1-page tail chunks once at most a page is left: the
                 # (2 page_size + 3)-key prompt takes a whole chunk and then a tail chunk.
                 "chunked-blocks-with-tails": functools.partial(chunked_paged_attention, pages_per_chunk=2,
                                                                query_blocks=QueryBlocks(8, 2, 2, 1)),
                 "chunked-from-buffer-blocks-with-tails": functools.partial(_from_buffer,
                                                                            query_blocks=QueryBlocks(4, 1, 2, 1))}


def _check_against_naive(fn, page_size, num_heads, num_kv_heads, soft_cap, seq_lens, q_lens, pages_per_seq,
                         num_pages=24, seed=0):
    """Sequences of `seq_lens` keys whose last `q_lens` tokens are queries, on random pages of a
    NaN-filled pool, plus a padding row and 3 padding tokens: `fn` must give the float64 naive result."""
    rng = np.random.default_rng(seed)
    head_dim = 16
    scale = head_dim**-0.5
    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    free = list(rng.permutation(np.arange(1, num_pages)))
    block_tables = np.zeros((len(seq_lens) + 1, pages_per_seq), np.int32)  # one padding row
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        k = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32)
        ks.append(k.astype(np.float64))
        vs.append(v.astype(np.float64))
        for p in range(-(-n // page_size)):
            page_id = free.pop()
            block_tables[i, p] = page_id
            chunk = slice(p * page_size, min(n, (p + 1) * page_size))
            num = chunk.stop - chunk.start
            k_pages[:, page_id, :num] = k[chunk].transpose(1, 0, 2)
            v_pages[:, page_id, :num] = v[chunk].transpose(1, 0, 2)

    num_real = sum(q_lens)
    q = rng.standard_normal((num_real + 3, num_heads, head_dim)).astype(np.float32)  # 3 padding tokens
    query_start_loc = np.array([0, *np.cumsum(q_lens), num_real], np.int32)
    out = fn(
        jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(block_tables),
        jnp.asarray(np.array([*seq_lens, 0], np.int32)), jnp.asarray(query_start_loc),
        scale=scale, soft_cap=soft_cap,
    )
    out = np.asarray(out)
    expected = _naive(q, ks, vs, q_lens, seq_lens, scale, soft_cap)
    np.testing.assert_allclose(out[:num_real], expected, atol=2e-5, rtol=1e-5)
    assert np.all(out[num_real:] == 0), "padding tokens must give zeros"


@pytest.mark.parametrize("fn_name", sorted(ATTENTION_FNS))
@pytest.mark.parametrize("page_size,num_heads,num_kv_heads,soft_cap", [(4, 4, 2, None), (8, 6, 2, None), (4, 3, 3, 5.0)])
def test_matches_naive_over_contiguous_cache(fn_name, page_size, num_heads, num_kv_heads, soft_cap):
    # Sequences: two decode rows, a prefill chunk starting mid-page, a whole prompt, a 1-token prompt.
    _check_against_naive(ATTENTION_FNS[fn_name], page_size, num_heads, num_kv_heads, soft_cap,
                         seq_lens=[9, 6, 2 * page_size + 3, page_size, 1], q_lens=[1, 1, page_size + 1, page_size, 1],
                         pages_per_seq=5)


@pytest.mark.parametrize("field", ["tokens", "max_seqs", "pages_per_chunk", "tail_pages"])
def test_query_blocks_refuse_sizes_below_one(field):
    with pytest.raises(ValueError, match=rf"QueryBlocks.{field}=0; it must be an int >= 1"):
        QueryBlocks(**{field: 0})


@pytest.mark.parametrize("from_buffer", [False, True])
def test_tail_chunks_walk_a_sequence_page_by_page(from_buffer):
    """Chunks of 4 pages, then 1-page tail chunks once at most 2 pages are left: the 23-key prompt
    chunk reads a whole chunk (keys 0-15) then tails at pages 4 and 5; the 6-key prompt tails only
    (pages 0 and 1); with a decode row and a 1-token prompt around them."""
    blocks = QueryBlocks(tokens=8, max_seqs=2, pages_per_chunk=4, tail_pages=1)
    fn = (functools.partial(_from_buffer, query_blocks=blocks) if from_buffer
          else functools.partial(chunked_paged_attention, pages_per_chunk=2, query_blocks=blocks))
    _check_against_naive(fn, 4, 4, 2, None, seq_lens=[9, 23, 6, 1], q_lens=[1, 7, 6, 1], pages_per_seq=8, num_pages=32)


@pytest.mark.parametrize("from_buffer", [False, True])
def test_decode_only_path_matches_naive(from_buffer):
    """decode_only=True (the model's decode-bucket steps): one token per sequence, gathered per token."""
    rng = np.random.default_rng(1)
    page_size, num_heads, num_kv_heads, head_dim, num_pages, pages_per_seq = 4, 4, 2, 16, 16, 4
    seq_lens = [1, 6, 13]
    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    block_tables = np.zeros((4, pages_per_seq), np.int32)  # one padding row
    free, ks, vs = list(rng.permutation(np.arange(1, num_pages))), [], []
    for i, n in enumerate(seq_lens):
        k, v = (rng.standard_normal((n, num_kv_heads, head_dim)).astype(np.float32) for _ in range(2))
        ks.append(k.astype(np.float64))
        vs.append(v.astype(np.float64))
        for p in range(-(-n // page_size)):
            block_tables[i, p] = page_id = free.pop()
            rows = slice(p * page_size, min(n, (p + 1) * page_size))
            k_pages[:, page_id, : rows.stop - rows.start] = k[rows].transpose(1, 0, 2)
            v_pages[:, page_id, : rows.stop - rows.start] = v[rows].transpose(1, 0, 2)
    q = rng.standard_normal((4, num_heads, head_dim)).astype(np.float32)  # 3 real tokens + 1 padding
    fn = _from_buffer if from_buffer else functools.partial(chunked_paged_attention, pages_per_chunk=2)
    out = np.asarray(fn(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(block_tables),
                        jnp.asarray(np.array([*seq_lens, 0], np.int32)), jnp.asarray(np.array([0, 1, 2, 3, 3], np.int32)),
                        scale=0.25, decode_only=True))
    np.testing.assert_allclose(out[:3], _naive(q, ks, vs, [1, 1, 1], seq_lens, 0.25, None), atol=2e-5, rtol=1e-5)
    assert np.all(out[3] == 0)


@pytest.mark.parametrize("fn_name", sorted(ATTENTION_FNS))
def test_rejects_bad_head_ratio(fn_name):
    q = jnp.zeros((2, 5, 8))
    pages = jnp.zeros((2, 3, 4, 8))
    with pytest.raises(ValueError, match="divisible"):
        ATTENTION_FNS[fn_name](q, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.ones(1, jnp.int32),
                                  jnp.array([0, 1], jnp.int32), scale=1.0)
