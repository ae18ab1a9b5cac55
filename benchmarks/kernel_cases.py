"""The kernel benchmarks' cases and instruments: the scales (full, quick, dry run), timing, the
measured copy bandwidth and matmul rate, and paged inputs built from a list of sequence lengths."""

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Scale:
    """Sizes of one run: the real workloads or the tiny dry-run ones."""

    k1_batches: tuple[int, ...]
    k1_contexts: tuple[int, ...]
    k1_heads: tuple[tuple[int, int], ...]  # (num_heads, num_kv_heads)
    page_sizes: tuple[int, ...]
    head_dim: int
    max_k1_tokens: int  # skip K1 configs whose batch x context exceeds this (memory)
    k2_batches: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # name, ((cached, q_len), ...)
    k2_heads: tuple[int, int]
    copy_bytes: int
    matmul_size: int
    dense_logits_budget_bytes: int  # K2's dense peer is skipped when its padded logits exceed this


def _k2_random(seed: int, num_seqs: int, max_q: int, max_cached: int) -> tuple[tuple[int, int], ...]:
    rng = np.random.default_rng(seed)
    return tuple((int(rng.integers(0, max_cached + 1)), int(rng.integers(1, max_q + 1))) for _ in range(num_seqs))


FULL = Scale(
    k1_batches=(1, 8, 64, 256),
    k1_contexts=(512, 4096, 32768),
    k1_heads=((32, 8), (16, 8)),
    page_sizes=(16, 32),
    head_dim=128,
    max_k1_tokens=256 * 8192,
    k2_batches=(
        ("prefill 1x2048", ((0, 2048),)),
        ("prefill 8x512", ((0, 512),) * 8),
        ("chunked 4x512 after 1536 cached", ((1536, 512),) * 4),
        ("1x2048 prefill + 64 decode rows at 1024", ((0, 2048),) + ((1023, 1),) * 64),
        ("random 8 seqs q 1..1024 cached 0..1024", _k2_random(0, 8, 1024, 1024)),
    ),
    k2_heads=(32, 8),
    copy_bytes=1 << 30,
    matmul_size=8192,
    dense_logits_budget_bytes=16 * 10**9,
)

# A representative subset for scripts/gpu_check.sh (about a minute on an H100): K1 at batch 1, 64 and
# 256 over short, medium and long contexts with GQA 32/8, page size 16; K2 a long prefill, chunks after
# a cached prefix, and a prefill mixed with decode rows.
QUICK = dataclasses.replace(
    FULL,
    k1_batches=(1, 64, 256),
    k1_heads=((32, 8),),
    page_sizes=(16,),
    k2_batches=tuple(b for b in FULL.k2_batches if b[0] in (
        "prefill 1x2048", "chunked 4x512 after 1536 cached", "1x2048 prefill + 64 decode rows at 1024")),
)

# scripts/gpu_check.sh's K1: the decode kernel at Qwen3-0.6B's heads (16/8, what its decode-bucket
# stage runs), batch 1, 64 and 256, contexts 1024 and 4096, page size 16.
CHECK = dataclasses.replace(QUICK, k1_batches=(1, 64, 256), k1_contexts=(1024, 4096), k1_heads=((16, 8),))

DRY = Scale(
    k1_batches=(2,),
    k1_contexts=(64,),
    k1_heads=((4, 2),),
    page_sizes=(16,),
    head_dim=64,
    max_k1_tokens=1 << 20,
    k2_batches=(("tiny prefill", ((0, 16), (3, 5))), ("tiny mix, dense skipped", ((0, 20), (5, 1), (16, 9)))),
    k2_heads=(4, 2),
    copy_bytes=1 << 20,
    matmul_size=128,
    dense_logits_budget_bytes=20_000,  # the first tiny batch fits, the second exercises the skip
)


# ---------------------------------------------------------------------------------------------
# Timing and physical limits


def time_call(fn, *args, repeats: int) -> float:
    """Median wall seconds of fn(*args) after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of `x + 1` over a large float32 array, counting bytes read plus bytes written."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    seconds = time_call(jax.jit(lambda a: a + 1.0), x, repeats=repeats)
    return 2 * num_bytes / seconds


def measure_matmul_rate(size: int, repeats: int) -> float:
    """FLOP/s of a size^3 bf16 matmul with f32 accumulation."""
    a = jnp.ones((size, size), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    seconds = time_call(matmul, a, a, repeats=repeats)
    return 2 * size**3 / seconds


# ---------------------------------------------------------------------------------------------
# Paged inputs (built on the device; block tables are a random permutation of page ids)


def build_paged(key, seq_lens: list[int], num_kv_heads: int, head_dim: int, page_size: int):
    """Pages for `seq_lens`, plus the same K/V gathered contiguously for the dense peer."""
    num_seqs = len(seq_lens)
    pages_per_seq = max(1, -(-max(seq_lens) // page_size))
    num_pages = 1 + num_seqs * pages_per_seq  # page 0 is the padding page
    k_key, v_key, perm_key = jax.random.split(key, 3)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = jax.random.normal(k_key, shape, jnp.bfloat16)
    v_pages = jax.random.normal(v_key, shape, jnp.bfloat16)
    page_ids = 1 + jax.random.permutation(perm_key, num_seqs * pages_per_seq)
    block_tables = page_ids.reshape(num_seqs, pages_per_seq).astype(jnp.int32)
    # Dense contiguous copy: [K, S, pages_per_seq, page_size, H] -> [S, L, K, H].
    max_len = pages_per_seq * page_size
    k_dense = k_pages[:, block_tables].reshape(num_kv_heads, num_seqs, max_len, head_dim).transpose(1, 2, 0, 3)
    v_dense = v_pages[:, block_tables].reshape(num_kv_heads, num_seqs, max_len, head_dim).transpose(1, 2, 0, 3)
    return k_pages, v_pages, block_tables, k_dense, v_dense


def decode_splits(num_seqs: int, num_kv_heads: int, pages: int, block: int, dry_run: bool) -> int:
    """Enough context splits for ~2 programs per SM of an H100 (132 SMs), never empty of pages."""
    if dry_run:
        return 2
    wanted = -(-264 // (num_seqs * num_kv_heads))
    return max(1, min(wanted, pages // block))
