"""Reference ragged paged attention: plain jnp, float32 softmax, nothing clever.

This is the CPU attention path and the oracle for the Pallas kernels in `pallas_kernels/`.
It follows the attention backend contract of DESIGN.md; any backend with the same signature can be
passed to the model.

The batch is a flat list of query tokens from many sequences ("ragged"). Worked example with
page_size 4, two sequences:

    query_start_loc = [0, 3, 4]      seq 0 owns tokens 0..2, seq 1 owns token 3
    seq_lens        = [7, 10]        seq 0 had 4 cached tokens + 3 new; seq 1 had 9 cached + 1 new

    token t:          0  1  2 | 3
    sequence:         0  0  0 | 1
    position:         4  5  6 | 9      position = seq_len - q_len + (t - query_start_loc[seq])
    attends to keys:  0..4 0..5 0..6 | 0..9   (causal, its own sequence only)

Every key position p of sequence s lives at page `block_tables[s, p // page_size]`, offset
`p % page_size`. Tokens at or past `query_start_loc[-1]` are batch padding and get zeros.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.ops.kv_quant import QuantizedKV, dequantize, dequantize_pool

# One layer's K or V pool: a float array, or int8/fp8 values with one scale per (head, page, slot)
# (a quantized cache, jaxpaged/ops/kv_quant.py), dequantized here as it is read.
Pool = Float[Array, "num_kv_heads num_pages page_size head_dim"] | QuantizedKV

# Legend: T=num_tokens S=num_seqs K=num_kv_heads G=query heads per KV head H=head_dim
#         L=pages_per_seq*page_size (the longest context a block table can address)


@dataclasses.dataclass(frozen=True)
class QueryBlocks:
    """How the CPU path splits a step that is not decode-only (`chunked_paged_attention`).

    tokens: query tokens per block (at most). max_seqs: a block finishes the tokens of at most this
    many sequences, reading each of them once; a run of decode tokens is a block of its own, each
    token reading its own keys. pages_per_chunk: pages of one sequence read and scored at a time.
    tail_pages: once no more than half a chunk of a sequence's keys is left, they are read in chunks
    of this many pages, so that a short prompt is not scored against a whole chunk of masked keys.
    """

    tokens: int = 64
    max_seqs: int = 4
    pages_per_chunk: int = 16
    tail_pages: int = 4

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if type(value) is not int or value < 1:
                raise ValueError(f"QueryBlocks.{name}={value!r}; it must be an int >= 1")


def reference_paged_attention(
    q: Float[Array, "num_tokens num_heads head_dim"],
    k_pages: Pool,
    v_pages: Pool,
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    seq_lens: Int[Array, "num_seqs"],
    query_start_loc: Int[Array, "num_seqs_plus_1"],
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    sinks: Float[Array, "num_heads"] | None = None,
) -> Float[Array, "num_tokens num_heads head_dim"]:
    """Causal attention of each query token over its own sequence's paged K/V.

    Args:
      q: queries, any float dtype.
      k_pages, v_pages: the page pool of one layer, already holding this step's K/V.
      block_tables: int32, page ids of each sequence; entries past a sequence's length are ignored.
      seq_lens: int32, context length of each sequence after this step (0 for padding rows).
      query_start_loc: int32, cumulative query lengths (sequence i owns tokens
        `query_start_loc[i]:query_start_loc[i+1]`); padding rows repeat the total.
      scale: softmax scale, usually `head_dim ** -0.5`.
      soft_cap: if set, scores become `soft_cap * tanh(scores / soft_cap)` before masking.
      sliding_window: if set, the token at position p sees only keys p - sliding_window + 1 .. p
        (Mistral/Gemma/HF semantics); pages wholly before that may have been freed and hold anything.
      sinks: if set (gpt-oss), float32 [num_heads]: head h's softmax has one more logit, sinks[h], whose
        value is 0 (it joins the denominator only): out = sum_j e^(s_j) v_j / (e^(sinks[h]) + sum_j e^(s_j)).

    Returns:
      Attention output in q's dtype; zeros for padding tokens.
    """
    num_tokens, num_heads, head_dim = q.shape
    # A quantized pool is dequantized whole (NaN-poisoned slots stay NaN and are masked below).
    k_pages, v_pages = dequantize_pool(k_pages), dequantize_pool(v_pages)
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = block_tables.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have shape ({num_seqs + 1},), got {query_start_loc.shape}")
    group = num_heads // num_kv_heads
    max_len = pages_per_seq * page_size

    # Which sequence owns each token, and where in that sequence it sits.
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_idx = jnp.searchsorted(query_start_loc[1:], token_idx, side="right")  # [T]
    is_real = token_idx < query_start_loc[-1]
    seq_idx = jnp.where(is_real, seq_idx, 0)
    q_len = query_start_loc[seq_idx + 1] - query_start_loc[seq_idx]
    position = seq_lens[seq_idx] - q_len + (token_idx - query_start_loc[seq_idx])  # [T]

    # Contiguous K/V of each token's sequence: [K, T, pages_per_seq, page_size, H] -> [K, T, L, H].
    pages = block_tables[seq_idx]  # [T, pages_per_seq]
    k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, max_len, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, max_len, head_dim)

    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, K, G, H]
    scores = jnp.einsum("tkgh,ktlh->tkgl", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)

    key_pos = jnp.arange(max_len, dtype=jnp.int32)
    visible = (key_pos[None, :] <= position[:, None]) & is_real[:, None]  # [T, L]
    if sliding_window is not None:
        visible &= key_pos[None, :] > position[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    # A row with no visible key (padding) would be softmax over all -inf = NaN; give it zeros.
    has_key = jnp.any(visible, axis=-1)[:, None, None, None]
    scores = jnp.where(has_key, scores, 0.0)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink's logit joins the softmax, its probability is dropped
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1), (*scores.shape[:3], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    # Masked probabilities are exactly 0, but 0 * NaN is NaN and pages a sequence does not own may
    # hold anything: zero the values each token may not see.
    v = jnp.where(visible[None, :, :, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("tkgl,ktlh->tkgh", probs, v)
    out = jnp.where(has_key, out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def chunked_paged_attention(
    q: Float[Array, "num_tokens num_heads head_dim"],
    k_pages: Pool,
    v_pages: Pool,
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    seq_lens: Int[Array, "num_seqs"],
    query_start_loc: Int[Array, "num_seqs_plus_1"],
    *,
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_chunk: int = 8,
    decode_only: bool = False,
    query_blocks: QueryBlocks | None = None,
    sinks: Float[Array, "num_heads"] | None = None,
) -> Float[Array, "num_tokens num_heads head_dim"]:
    """The CPU path: the reference's result, reading only as many pages as the batch's longest context.

    `reference_paged_attention` reads every slot a block table can address (max_model_len per token)
    whatever the real lengths; here keys come in chunks of `pages_per_chunk` pages with an online
    softmax, and the loop stops after the chunk holding the longest context in the batch (a
    `while_loop` with a data-dependent trip count: one compiled program serves every length).

        chunk c covers key positions [c * C, (c + 1) * C), C = pages_per_chunk * page_size
        running per (token, head): m = max score so far, l = sum exp(score - m), acc = sum exp(..) v
        new chunk: m' = max(m, max s);  l = l e^(m - m') + sum e^(s - m');  acc likewise;  out = acc / l

    `decode_only` (static; the model passes it in decode-bucket steps): every token gathers its own
    sequence's keys. Otherwise tokens go in `query_blocks` (default `QueryBlocks()`); a block
    spanning few sequences reads each of them once, and only up to its own last position.

    Same contract and padding rules as the reference; tested against it.
    """

    def read(pool, head, pages):  # [(K if head is a slice,) *pages.shape, page_size, H], dequantized if quantized
        quantized = isinstance(pool, QuantizedKV)
        return dequantize(pool.pages[head, pages], pool.scales[head, pages]) if quantized else pool[head, pages]

    def gather(chunk_pages, head):  # [T, P_c] -> K and V of KV head `head` as [T, P_c, page_size, H]
        return read(k_pages, head, chunk_pages), read(v_pages, head, chunk_pages)

    def read_seq(pool, pages):  # [P_c] -> [K, P_c * page_size, H]
        x = read(pool, slice(None), pages)
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def gather_seq(pages):  # one sequence's pages [P_c] -> K and V as [K, P_c * page_size, H]
        return read_seq(k_pages, pages), read_seq(v_pages, pages)

    return _chunked_attention(q, gather, gather_seq, k_pages.shape[0], k_pages.shape[2], block_tables, seq_lens,
                              query_start_loc, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                              pages_per_chunk=pages_per_chunk, decode_only=decode_only, query_blocks=query_blocks,
                              sinks=sinks)


def chunked_paged_attention_from_buffer(
    q: Float[Array, "num_tokens num_heads head_dim"],
    kv_pages: Float[Array, "num_layers 2 num_kv_heads num_pages page_size head_dim"] | QuantizedKV,
    block_tables: Int[Array, "num_seqs pages_per_seq"],
    seq_lens: Int[Array, "num_seqs"],
    query_start_loc: Int[Array, "num_seqs_plus_1"],
    *,
    layer_idx: Int[Array, ""],
    scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_chunk: int = 8,
    decode_only: bool = False,
    query_blocks: QueryBlocks | None = None,
    sinks: Float[Array, "num_heads"] | None = None,
) -> Float[Array, "num_tokens num_heads head_dim"]:
    """`chunked_paged_attention` of layer `layer_idx`, gathering straight from the model's whole buffer.

    Inside the model's layer loop, `kv_pages[layer_idx, 0]` is a dynamic slice that XLA copies in
    full (the layer's whole pool, every layer, every step) before a gather can read it; indexing the
    whole buffer in one gather reads only the pages the chunks need. The model calls backends
    marked `reads_whole_kv_buffer` this way.
    """

    def read(kv, head, pages):  # advanced indices first: [*pages.shape, (K if head is a slice,) page_size, H]
        if isinstance(kv_pages, QuantizedKV):  # dequantize only the gathered pages
            return dequantize(kv_pages.pages[layer_idx, kv, head, pages], kv_pages.scales[layer_idx, kv, head, pages])
        return kv_pages[layer_idx, kv, head, pages]

    def gather(chunk_pages, head):  # [T, P_c] -> K and V of KV head `head` as [T, P_c, page_size, H]
        return read(0, head, chunk_pages), read(1, head, chunk_pages)

    def read_seq(kv, pages):  # [P_c] -> [P_c, K, page_size, H] -> [K, P_c * page_size, H]
        x = jnp.swapaxes(read(kv, slice(None), pages), 0, 1)
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def gather_seq(pages):  # one sequence's pages [P_c] -> K and V as [K, P_c * page_size, H]
        return read_seq(0, pages), read_seq(1, pages)

    return _chunked_attention(q, gather, gather_seq, kv_pages.shape[2], kv_pages.shape[4], block_tables, seq_lens,
                              query_start_loc, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                              pages_per_chunk=pages_per_chunk, decode_only=decode_only, query_blocks=query_blocks,
                              sinks=sinks)


chunked_paged_attention_from_buffer.reads_whole_kv_buffer = True
chunked_paged_attention_from_buffer.has_decode_kernel = True  # told decode_only: the by-token path


def _chunked_attention(q, gather, gather_seq, num_kv_heads, page_size, block_tables, seq_lens, query_start_loc, *,
                       scale, soft_cap, sliding_window, pages_per_chunk, decode_only, query_blocks, sinks=None):
    """Decode-only steps: every token gathers its own sequence's keys (`_by_token`, one token per
    sequence). Other steps go by query blocks (`_by_query_block`): a prompt chunk's tokens share one
    read of their sequence's keys, scored in one matmul. Gathering per token read every key once per
    query token: 87% of a 1024-token prefill step on the CPU (benchmarks/peers/README.md)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, pages_per_seq = block_tables.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
    group = num_heads // num_kv_heads
    blocks = query_blocks or QueryBlocks()
    pages_per_chunk = min(pages_per_chunk, pages_per_seq)
    # Each sequence's pages, padded with the padding page to a whole number of chunks of both sizes.
    seq_chunk_pages = min(blocks.pages_per_chunk, pages_per_seq)
    tail_pages = math.gcd(seq_chunk_pages, blocks.tail_pages)  # divides a whole chunk: tails stay in the padding
    width = max(-(-pages_per_seq // n) * n for n in (pages_per_chunk, seq_chunk_pages))
    seq_pages = jnp.pad(block_tables, ((0, 0), (0, width - pages_per_seq)))

    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_idx = jnp.searchsorted(query_start_loc[1:], token_idx, side="right")  # [T]
    is_real = token_idx < query_start_loc[-1]
    seq_idx = jnp.where(is_real, seq_idx, 0)
    q_len = query_start_loc[seq_idx + 1] - query_start_loc[seq_idx]
    position = jnp.where(is_real, seq_lens[seq_idx] - q_len + (token_idx - query_start_loc[seq_idx]), -1)

    qf = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale  # [T, K, G, H]
    by_token = _Chunks(pages_per_chunk, pages_per_chunk * page_size, soft_cap, sliding_window)
    if decode_only:
        m, l, acc = _by_token(by_token, gather, qf, position, seq_pages[seq_idx])
    else:
        by_seq = _Chunks(seq_chunk_pages, seq_chunk_pages * page_size, soft_cap, sliding_window)
        by_tail = _Chunks(tail_pages, tail_pages * page_size, soft_cap, sliding_window)
        m, l, acc = _by_query_block(by_token, by_seq, by_tail, gather, gather_seq, qf, position, seq_idx, q_len == 1,
                                    seq_pages, query_start_loc[-1], min(blocks.tokens, num_tokens), blocks.max_seqs)
    if sinks is not None:  # the sink joins the denominator as one more key whose value is 0 (gpt-oss)
        m, l, acc = fold_sinks(m, l, acc, sinks.astype(jnp.float32).reshape(num_kv_heads, group))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def fold_sinks(m, l, acc, sink):
    """An online softmax's (max m, sum l, weighted values acc) with one more logit `sink` (broadcast to m)
    of value 0: the new max, l rescaled to it plus e^(sink - max), acc rescaled. A row that saw no key
    (m at its floor, l = 0, acc = 0) keeps acc = 0, so its output stays 0."""
    m_new = jnp.maximum(m, sink)
    correction = jnp.exp(m - m_new)
    return m_new, l * correction + jnp.exp(sink - m_new), acc * correction[..., None]


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """Keys come in chunks of `pages` pages (`length` key positions); the online-softmax math."""

    pages: int
    length: int
    soft_cap: float | None
    sliding_window: int | None

    def range(self, positions):
        """Chunks holding a key visible to some of `positions` (-1: padding, sees nothing)."""
        first, end = 0, (jnp.max(positions) + self.length) // self.length  # end 0 when all padding
        if self.sliding_window is not None:  # chunks wholly before every token's window are skipped
            oldest = jnp.min(jnp.where(positions >= 0, positions - self.sliding_window + 1, jnp.iinfo(jnp.int32).max))
            first = jnp.clip(oldest // self.length, 0, end)
        return first, end

    def visible_from(self, first_key, positions):  # chunk keys from `first_key` seen by each of `positions`: [B, C]
        key_pos = first_key + jnp.arange(self.length, dtype=jnp.int32)
        out = key_pos[None, :] <= positions[:, None]
        if self.sliding_window is not None:
            out &= key_pos[None, :] > positions[:, None] - self.sliding_window
        return out

    def update(self, carry, s, visible, v, pv: str):
        """One online-softmax step: scores s [..., C], `visible` broadcast to s, values v (`pv` contracts)."""
        m, l, acc = carry
        if self.soft_cap is not None:
            s = self.soft_cap * jnp.tanh(s / self.soft_cap)
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])  # exactly 0 where not visible
        correction = jnp.exp(m - m_new)
        acc = acc * correction[..., None] + jnp.einsum(pv, p, v)
        return m_new, l * correction + jnp.sum(p, axis=-1), acc


def _init(*shape):  # (m, l, acc) of queries [*shape, H]; m's finite floor keeps e^(m - m') defined at the start
    return jnp.full(shape[:-1], jnp.float32(-1e30)), jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape, jnp.float32)


def _by_token(chunks: _Chunks, gather, qf, position, pages):
    """Each token reads its own copy of its sequence's keys: qf [B, K, G, H], position [B], pages [B, P]; one KV
    head at a time, [B, C, H] as the pool holds it (all heads at once XLA:CPU transposed: 1.3-1.4x slower)."""
    num_tokens, num_kv_heads = qf.shape[:2]

    def chunk_step(c, carry):
        chunk_pages = jax.lax.dynamic_slice_in_dim(pages, c * chunks.pages, chunks.pages, axis=1)
        visible = chunks.visible_from(c * chunks.length, position)  # [B, C]
        def head_step(head):  # this KV head's (m, l, acc), its pages [B, P_c, page_size, H] read as [B, C, H]
            k, v = (x.reshape(num_tokens, chunks.length, -1).astype(jnp.float32) for x in gather(chunk_pages, head))
            v = jnp.where(visible[:, :, None], v, 0.0)  # 0 * NaN would be NaN
            return chunks.update(tuple(x[:, head] for x in carry), jnp.einsum("tgh,tch->tgc", qf[:, head], k),
                                 visible[:, None, :], v, "tgc,tch->tgh")

        return tuple(jnp.stack(x, axis=1) for x in zip(*map(head_step, range(num_kv_heads))))  # [B, K, G(, H)]

    return jax.lax.fori_loop(*chunks.range(position), chunk_step, _init(*qf.shape))


def _by_query_block(by_token: _Chunks, by_seq: _Chunks, by_tail: _Chunks, gather, gather_seq, qf, position, seq_idx,
                    single, seq_pages, num_real, block, max_seqs):
    """Blocks of up to `block` tokens in order, each starting where the last one stopped:

      - a run of one-token sequences (decode tokens; `single`) goes by token;
      - otherwise the block finishes the tokens of its first `max_seqs` sequences (up to `block`) and
        reads each of those sequences once: its chunks up to its last token in the block, scored
        against the whole block (the other sequences' tokens masked). Chunks are `by_seq`'s while
        more than half of one is left, then `by_tail`'s: 36 keys cost a 64-key chunk, not 256.

    The block's tokens past where it stops are masked (they stay "nothing seen yet") and the next
    block starts there.
    """
    num_tokens, num_kv_heads, group, head_dim = qf.shape
    page_size = by_seq.length // by_seq.pages
    qf = jnp.pad(qf, ((0, block), (0, 0), (0, 0), (0, 0)))  # a block may start at any real token
    position = jnp.pad(position, (0, block), constant_values=-1)
    seq_idx, single = jnp.pad(seq_idx, (0, block)), jnp.pad(single, (0, block))

    def by_sequence(qb, pos_b, seq_b):
        qk = jnp.moveaxis(qb, 1, 0)  # [K, B, G, H]: one matmul per KV head over the block's B * G rows

        def seq_step(s, carry):
            mine = jnp.where(seq_b == s, pos_b, -1)  # positions of s's tokens, -1 for the others
            stop = jnp.max(mine) + 1  # keys [.., stop) are seen; 0 when no token of the block is s's

            def chunk_step(chunks: _Chunks):
                def step(first_key, carry):  # `chunks.pages` pages of s from key position first_key
                    k, v = gather_seq(jax.lax.dynamic_slice_in_dim(seq_pages[s], first_key // page_size, chunks.pages))
                    visible = chunks.visible_from(first_key, mine)  # [B, C]
                    # Keys no token of the block sees may be stale or NaN: zero their values.
                    v = jnp.where(jnp.any(visible, axis=0)[:, None], v.astype(jnp.float32), 0.0)  # [K, C, H]
                    s_ = jnp.einsum("kbgh,kch->kbgc", qk, k.astype(jnp.float32))
                    return chunks.update(carry, s_, visible[None, :, None, :], v, "kbgc,kch->kbgh")

                return step

            def walk(state):  # whole chunks while more than half of one is left, then tail chunks
                first_key, carry = state
                whole = stop - first_key > by_seq.length // 2
                carry = jax.lax.cond(whole, chunk_step(by_seq), chunk_step(by_tail), first_key, carry)
                return first_key + jnp.where(whole, by_seq.length, by_tail.length), carry

            first_chunk, _ = by_seq.range(mine)  # a sliding window skips whole chunks
            return jax.lax.while_loop(lambda state: state[0] < stop, walk, (first_chunk * by_seq.length, carry))[1]

        last = jnp.max(jnp.where(pos_b >= 0, seq_b, seq_b[0]))
        m, l, acc = jax.lax.fori_loop(seq_b[0], last + 1, seq_step, _init(*qk.shape))
        return jnp.moveaxis(m, 0, 1), jnp.moveaxis(l, 0, 1), jnp.moveaxis(acc, 0, 1)

    def per_token(qb, pos_b, seq_b):
        return _by_token(by_token, gather, qb, pos_b, seq_pages[seq_b])

    def block_step(carry):
        start, out = carry  # the token at `start` is real and not done
        qb, pos_b, seq_b, single_b = (jax.lax.dynamic_slice_in_dim(x, start, block)
                                      for x in (qf, position, seq_idx, single))
        run = jnp.sum(jnp.cumprod((single_b & (pos_b >= 0)).astype(jnp.int32)))  # leading one-token sequences
        first_seqs = jnp.sum((pos_b >= 0) & (seq_b < seq_b[0] + max_seqs))  # sequences ascend: a prefix
        take = jnp.maximum(jnp.where(run > 0, run, first_seqs), 1)  # a token at position < 0 sees nothing
        pos_b = jnp.where(jnp.arange(block) < take, pos_b, -1)
        done = jax.lax.cond(run > 0, per_token, by_sequence, qb, pos_b, seq_b)
        return start + take, tuple(jax.lax.dynamic_update_slice_in_dim(x, y, start, 0) for x, y in zip(out, done))

    _, (m, l, acc) = jax.lax.while_loop(lambda carry: carry[0] < num_real, block_step,
                                        (jnp.int32(0), _init(num_tokens + block, num_kv_heads, group, head_dim)))
    return m[:num_tokens], l[:num_tokens], acc[:num_tokens]
