"""The ragged kernel (`pallas_kernels.paged_attention`) against the reference, interpret mode on CPU.

Each batch mixes, in one call: decode rows (1 new token after a cached context), whole prompts of
lengths 1, page_size-1, page_size, page_size+1, chunks that start mid-page after a cached prefix
(chunked prefill / prefix-cache hits), a long chunk spanning several query blocks, a padding
sequence (q_len 0, seq_len 0) and padding tokens past query_start_loc[-1].
K/V pages: random permutation of page ids, NaN everywhere a sequence does not own (see
pallas_kernels.testing); the oracle gets the same values in an independently built plain layout.

Tolerances: float32 1e-5; bfloat16 2e-2 (probabilities rounded to bf16 before the PV matmul, bf16 output).
"""

import itertools

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from jaxpaged.ops.attention import reference_paged_attention
from pallas_kernels import paged_attention
from pallas_kernels.jax_compat import cuda_target
from pallas_kernels.testing import make_case

oracle = jax.jit(reference_paged_attention, static_argnames=("scale", "soft_cap"))
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
NUM_PADDING_TOKENS = 3


def mixed_batch(page_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): what each sequence holds after this step, and how many tokens are new."""
    p = page_size
    batch = [
        (p + 1, 1),  # decode row whose token opens a new page
        (1, 1),  # one-token prompt
        (p - 1, p - 1),  # whole prompt, last page not full
        (p, p),  # whole prompt, exactly one page
        (p + 1, p + 1),  # whole prompt, one token into page 2
        (5 + 20, 20),  # chunk starting mid-page after 5 cached tokens
        (0, 0),  # padding sequence
        (2 * p + 7, 1),  # decode row in the middle of a page
        (p + p - 1, p - 1),  # prefix-cache hit of one full page, chunk of p-1
        (3 * p + 9, 2 * p + 3),  # long chunk over several query blocks, starting mid-page
    ]
    return [n for n, _ in batch], [q for _, q in batch]


def check_ragged(
    *,
    page_size,
    head_dim,
    group,
    dtype,
    num_kv_heads=2,
    soft_cap=None,
    block_q=8,
    pages_per_compute_block=2,
    batch=None,
    seed=0,
    sinks=False,
):
    seq_lens, q_lens = batch or mixed_batch(page_size)
    case = make_case(
        np.random.default_rng(seed),
        seq_lens=seq_lens,
        q_lens=q_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        num_padding_tokens=NUM_PADDING_TOKENS,
    )
    scale = head_dim**-0.5
    # gpt-oss's sinks, spread wide enough that some outweigh the row's keys and some do not
    sink = jnp.asarray(np.random.default_rng(seed + 2).normal(0.0, 3.0, num_kv_heads * group), jnp.float32) if sinks else None
    got = paged_attention(
        case.q,
        case.k_pages,
        case.v_pages,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale=scale,
        soft_cap=soft_cap,
        block_q=block_q,
        pages_per_compute_block=pages_per_compute_block,
        interpret=True,
        sinks=sink,
    )
    want = oracle(
        case.q,
        case.oracle_k_pages,
        case.oracle_v_pages,
        case.oracle_block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale=scale,
        soft_cap=soft_cap,
        sinks=sink,
    )
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), "a NaN page leaked into the output: the kernel read past a length or the causal limit"
    num_real = int(case.query_start_loc[-1])
    np.testing.assert_array_equal(got[num_real:], 0.0)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert np.abs(want[:num_real]).max() > 0.1  # not trivially zero


# A covering set: every page size, head_dim, GQA ratio and dtype appears, mixed across cases;
# the full product runs in the slow test at the end.
FAST_CASES = [
    (16, 128, 1, jnp.bfloat16),
    (32, 64, 3, jnp.float32),
    (32, 128, 4, jnp.float32),
    (16, 64, 8, jnp.bfloat16),
]


@pytest.mark.parametrize("page_size,head_dim,group,dtype", FAST_CASES)
def test_ragged_matches_reference_on_a_mixed_batch(page_size, head_dim, group, dtype):
    check_ragged(page_size=page_size, head_dim=head_dim, group=group, dtype=dtype)


@pytest.mark.parametrize("block_q,pages_per_compute_block", [(1, 1), (4, 4), (32, 1)])
def test_ragged_block_sizes_agree(block_q, pages_per_compute_block):
    # block_q 1: one token per program; block_q 32: chunks share nothing but the grid, most rows of
    # a block are past its chunk; 4-page compute blocks: whole blocks past the causal limit masked.
    check_ragged(
        page_size=16,
        head_dim=64,
        group=3,
        dtype=jnp.float32,
        block_q=block_q,
        pages_per_compute_block=pages_per_compute_block,
    )


@pytest.mark.slow
def test_ragged_pure_decode_and_pure_prefill_batches():
    # All decode rows (what the decode kernel also serves) and one single long prompt.
    check_ragged(page_size=16, head_dim=64, group=4, dtype=jnp.float32, batch=([1, 16, 17, 40, 0], [1, 1, 1, 1, 0]))
    check_ragged(page_size=16, head_dim=64, group=4, dtype=jnp.float32, batch=([50], [50]))


def test_ragged_soft_cap():
    check_ragged(page_size=16, head_dim=64, group=2, dtype=jnp.float32, soft_cap=1.5, num_kv_heads=1)


@pytest.mark.parametrize("group,dtype,block_q", [(3, jnp.float32, 8), (8, jnp.bfloat16, 4)])
def test_ragged_attention_sinks(group, dtype, block_q):
    # gpt-oss: a sink per query head; GQA 3 pads each token's rows to 4 (the padding row's sink is masked).
    check_ragged(page_size=16, head_dim=64, group=group, dtype=dtype, block_q=block_q, sinks=True)


def test_ragged_is_causal():
    """Changing a later token's K/V must not change an earlier token's output, and must change its own."""
    case = make_case(
        np.random.default_rng(5),
        seq_lens=[20],
        q_lens=[20],
        num_kv_heads=1,
        group=1,
        head_dim=64,
        page_size=16,
        dtype=np.float32,
    )
    arguments = (case.q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, case.query_start_loc)
    before = np.asarray(paged_attention(*arguments, scale=0.125, block_q=8, interpret=True))
    v_pages = case.v_pages.copy()
    v_pages[0, case.block_tables[0, 1], 0] += 10.0  # the V of position 16 (page 1, slot 0)
    after = np.asarray(paged_attention(case.q, case.k_pages, v_pages, *arguments[3:], scale=0.125, block_q=8, interpret=True))
    np.testing.assert_array_equal(before[:16], after[:16])
    assert np.abs(before[16:] - after[16:]).min() > 0  # every later token sees it


def _inputs(num_tokens=4, num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, num_pages=8):
    return dict(
        q=jnp.zeros((num_tokens, num_heads, head_dim)),
        k_pages=jnp.zeros((num_kv_heads, num_pages, page_size, head_dim)),
        v_pages=jnp.zeros((num_kv_heads, num_pages, page_size, head_dim)),
        block_tables=jnp.zeros((num_seqs, 3), jnp.int32),
        seq_lens=jnp.zeros((num_seqs,), jnp.int32),
        query_start_loc=jnp.zeros((num_seqs + 1,), jnp.int32),
    )


def test_ragged_rejects_bad_arguments(monkeypatch):
    # Production runs without the tests' jaxtyping checks (which would catch the v_pages mismatch
    # first): the kernel's own trace-time checks must hold alone.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(ValueError, match="must be divisible by num_kv_heads"):
        paged_attention(**_inputs(num_heads=6, num_kv_heads=4), scale=0.125, interpret=True)
    bad = _inputs()
    bad["query_start_loc"] = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        paged_attention(**bad, scale=0.125, interpret=True)
    bad = _inputs()
    bad["v_pages"] = bad["v_pages"][:, :4]
    with pytest.raises(ValueError, match="same shape"):
        paged_attention(**bad, scale=0.125, interpret=True)
    with pytest.raises(ValueError, match="block_q"):
        paged_attention(**_inputs(), scale=0.125, block_q=6, interpret=True)
    with pytest.raises(ValueError, match="soft_cap"):
        paged_attention(**_inputs(), scale=0.125, soft_cap=-1.0, interpret=True)



@pytest.mark.parametrize("group,dtype", [(3, jnp.float32), (8, jnp.bfloat16)])
def test_ragged_lowers_to_triton_for_cuda(group, dtype):
    """No GPU here, but the CUDA lowering (Pallas -> Triton IR) runs on CPU: it rejects shapes and
    ops the Triton backend cannot compile (non-power-of-two arrays, unsupported primitives)."""
    q = jnp.zeros((7, 2 * group, 128), dtype)
    pages = jnp.zeros((2, 13, 32, 128), dtype)
    block_tables = jnp.zeros((3, 5), jnp.int32)
    seq_lens = jnp.zeros((3,), jnp.int32)
    query_start_loc = jnp.array([0, 2, 5, 6], jnp.int32)
    with cuda_target():  # JAX >= 0.12's Triton lowering reads the GPU's kind; this host has none
        lowered = jax.jit(lambda *a: paged_attention(*a, scale=0.1, interpret=False)).trace(
            q, pages, pages, block_tables, seq_lens, query_start_loc
        ).lower(lowering_platforms=("cuda",))
        with_sinks = jax.jit(lambda *a: paged_attention(*a[:6], scale=0.1, interpret=False, sinks=a[6])).trace(
            q, pages, pages, block_tables, seq_lens, query_start_loc, jnp.zeros((2 * group,), jnp.float32)
        ).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
    assert "__gpu$xla.gpu.triton" in with_sinks.as_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "page_size,head_dim,group,dtype",
    list(itertools.product([16, 32], [64, 128], [1, 3, 4, 8], [jnp.float32, jnp.bfloat16])),
)
def test_ragged_full_grid(page_size, head_dim, group, dtype):
    check_ragged(page_size=page_size, head_dim=head_dim, group=group, dtype=dtype, seed=11)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_ragged_random_batches(seed):
    """Random mixes of cached prefixes and chunk lengths, against the reference."""
    rng = np.random.default_rng(100 + seed)
    num_seqs = int(rng.integers(1, 7))
    q_lens = [int(x) for x in rng.integers(1, 40, num_seqs)]
    seq_lens = [q + int(rng.integers(0, 50)) for q in q_lens]
    check_ragged(
        page_size=16,
        head_dim=64,
        group=int(rng.choice([1, 3, 4])),
        dtype=jnp.float32,
        block_q=int(rng.choice([4, 8, 16])),
        batch=(seq_lens, q_lens),
        seed=seed,
    )


@pytest.mark.slow
def test_ragged_float32_queries_over_bfloat16_pages():
    """A drop-in for the reference also when q and the pages differ in dtype: q is cast to the
    pages' dtype for the matmuls and the output keeps q's dtype."""
    case = make_case(
        np.random.default_rng(9),
        seq_lens=[20, 5],
        q_lens=[3, 5],
        num_kv_heads=1,
        group=2,
        head_dim=64,
        page_size=16,
        dtype=jnp.bfloat16,
        num_padding_tokens=1,
    )
    q = case.q.astype(np.float32)
    got = paged_attention(q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, case.query_start_loc, scale=0.125, interpret=True)
    want = oracle(q, case.oracle_k_pages, case.oracle_v_pages, case.oracle_block_tables, case.seq_lens, case.query_start_loc, scale=0.125)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE[jnp.bfloat16], rtol=TOLERANCE[jnp.bfloat16])
