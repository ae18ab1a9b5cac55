"""The decode kernel against the reference, in Pallas interpret mode on CPU.

Every case pages K/V through a random permutation of page ids with NaN in every page a sequence
does not own (and in the unused slots of its last page), so any read past a length fails; the
oracle gets the same values in a plain, separately built layout (pallas_kernels.testing).
Lengths 0 (batch padding), 1, page_size-1, page_size, page_size+1 and a long one share each batch.

Tolerances: float32 1e-5 (same arithmetic, different summation order); bfloat16 2e-2 (the kernel
rounds probabilities to bf16 before the PV matmul, as any bf16 GPU kernel does, and the output is
bf16: ~3 significant digits).
"""

import itertools

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from jaxpaged.ops.attention import reference_paged_attention
from pallas_kernels import decode_attention
from pallas_kernels.jax_compat import cuda_target
from pallas_kernels.testing import make_case

oracle = jax.jit(reference_paged_attention, static_argnames=("scale", "soft_cap"))
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def decode_lengths(page_size: int) -> list[int]:
    return [1, page_size - 1, page_size, page_size + 1, 0, 5 * page_size + 3]


def check_decode(
    *,
    page_size,
    head_dim,
    group,
    dtype,
    num_kv_heads=2,
    soft_cap=None,
    num_splits=3,
    pages_per_compute_block=2,
    seed=0,
    seq_lens=None,
    sinks=False,
):
    seq_lens = decode_lengths(page_size) if seq_lens is None else seq_lens
    q_lens = [1 if n else 0 for n in seq_lens]
    case = make_case(
        np.random.default_rng(seed),
        seq_lens=seq_lens,
        q_lens=q_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    # Decode layout: one row per sequence, padding rows included (q_len 0 -> its query row is unused).
    q = np.random.default_rng(seed + 1).standard_normal((len(seq_lens), num_kv_heads * group, head_dim))
    q = q.astype(dtype)
    scale = head_dim**-0.5
    # gpt-oss's sinks, spread wide enough that some outweigh the row's keys and some do not
    sink = jnp.asarray(np.random.default_rng(seed + 2).normal(0.0, 3.0, num_kv_heads * group), jnp.float32) if sinks else None
    got = decode_attention(
        q,
        case.k_pages,
        case.v_pages,
        case.block_tables,
        case.seq_lens,
        scale=scale,
        soft_cap=soft_cap,
        num_splits=num_splits,
        pages_per_compute_block=pages_per_compute_block,
        interpret=True,
        sinks=sink,
    )
    # The oracle sees each sequence as one query token: query_start_loc = 0, 1, 2, ...
    query_start_loc = np.arange(len(seq_lens) + 1, dtype=np.int32)
    want = oracle(
        q,
        case.oracle_k_pages,
        case.oracle_v_pages,
        case.oracle_block_tables,
        case.seq_lens,
        query_start_loc,
        scale=scale,
        soft_cap=soft_cap,
        sinks=sink,
    )
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.dtype == want.dtype and got.shape == q.shape
    assert not np.isnan(got).any(), "a NaN page leaked into the output: the kernel read past a length"
    padding = np.asarray(seq_lens) == 0
    np.testing.assert_array_equal(got[padding], 0.0)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    # The outputs are not trivially small: a kernel returning zeros would fail above.
    assert np.abs(want[~padding]).max() > 0.1


# A covering set: every page size, head_dim, GQA ratio and dtype appears, mixed across cases.
FAST_CASES = [
    (16, 64, 1, jnp.float32),
    (32, 128, 3, jnp.bfloat16),
    (16, 128, 4, jnp.bfloat16),
    (32, 64, 8, jnp.float32),
]


@pytest.mark.parametrize("page_size,head_dim,group,dtype", FAST_CASES)
def test_decode_matches_reference(page_size, head_dim, group, dtype):
    check_decode(page_size=page_size, head_dim=head_dim, group=group, dtype=dtype)


@pytest.mark.parametrize("num_splits,pages_per_compute_block", [(1, 1), (8, 1), (2, 4)])
def test_decode_split_and_block_sizes_agree(num_splits, pages_per_compute_block):
    # 1 split = plain online softmax; 8 splits of 1 page = many combined partials, most splits empty
    # for the short rows; 4-page blocks = the table is padded and whole blocks are masked.
    check_decode(
        page_size=16,
        head_dim=64,
        group=4,
        dtype=jnp.float32,
        num_splits=num_splits,
        pages_per_compute_block=pages_per_compute_block,
    )


@pytest.mark.parametrize("num_splits,group,dtype", [(1, 3, jnp.float32), (3, 4, jnp.float32), (2, 8, jnp.bfloat16)])
def test_decode_attention_sinks(num_splits, group, dtype):
    # gpt-oss: one split folds the sinks in the kernel, more in the combine; GQA 3 pads a tile's rows.
    check_decode(page_size=16, head_dim=64, group=group, dtype=dtype, num_splits=num_splits, sinks=True)


@pytest.fixture
def one_sm_gpu(monkeypatch):
    """Plan as if the GPU had 1 SM, so that a test's handful of sequences already "fills" it and
    the planner packs KV heads (decode_plan.heads_per_tile); jit caches are cleared around it."""
    from pallas_kernels import decode_plan

    jax.clear_caches()
    monkeypatch.setattr(decode_plan, "NUM_SMS", 1)
    yield
    jax.clear_caches()


@pytest.mark.parametrize("num_kv_heads,group,num_splits,sinks", [(8, 2, 1, False), (8, 2, 3, False), (4, 1, None, False),
                                                                  (2, 8, None, False), (4, 1, 1, True)])
def test_decode_packs_the_groups_of_several_kv_heads_per_tile(one_sm_gpu, num_kv_heads, group, num_splits, sinks):
    # Qwen3's GQA 2 with 8 KV heads: all 8 groups share one 16-row tile (every row real), one KV
    # head's block per loop step; GQA 1 packs 4 heads into 4 of 16 rows; GQA 8 packs 2 heads. One
    # split (the kernel normalises and writes q's dtype) and three (float32 partials, combined).
    from pallas_kernels.decode_plan import heads_per_tile

    assert heads_per_tile(num_kv_heads, group, 16, num_seqs=6) == min(num_kv_heads, 16 // group)
    check_decode(page_size=16, head_dim=128, group=group, dtype=jnp.bfloat16, num_kv_heads=num_kv_heads,
                 num_splits=num_splits, seed=num_kv_heads + group, sinks=sinks)


def test_decode_chooses_splits_that_fill_the_gpu_within_the_partials_budget():
    from pallas_kernels.decode_plan import NUM_SMS, PARTIALS_BUDGET, num_splits_for

    # Qwen3-0.6B, bf16, 16 rows x (128 + 2) floats per split, 8 KV heads x 16 tokens x K and V per page.
    qwen3 = dict(pages_per_block=4, partial_bytes_per_split=2 * 16 * 130 * 4, kv_bytes_per_page=8 * 16 * 2 * 256)
    assert num_splits_for(num_tiles=NUM_SMS, pages_per_seq=64, **qwen3) == 1  # the batch fills the GPU
    assert num_splits_for(num_tiles=256, pages_per_seq=256, **qwen3) == 1
    for num_tiles, pages_per_seq in [(1, 64), (1, 256), (16, 16), (16, 64), (64, 64), (100, 1024)]:
        splits = num_splits_for(num_tiles=num_tiles, pages_per_seq=pages_per_seq, **qwen3)
        assert 1 <= splits <= -(-2 * NUM_SMS // num_tiles)  # no more programs than ~2 per SM
        pages_per_split = pages_per_seq // splits  # a full split's partials stay inside the budget
        assert splits == 1 or qwen3["partial_bytes_per_split"] <= PARTIALS_BUDGET * pages_per_split * qwen3[
            "kv_bytes_per_page"]
    assert num_splits_for(num_tiles=1, pages_per_seq=256, **qwen3) == 32  # batch 1, 4096 tokens: 8 pages each
    assert num_splits_for(num_tiles=16, pages_per_seq=16, **qwen3) == 2  # short contexts: few splits


def _pallas_call_outputs(num_seqs, num_kv_heads, group, pages_per_seq, **kw):
    q = jnp.zeros((num_seqs, num_kv_heads * group, 128), jnp.bfloat16)
    pages = jnp.zeros((num_kv_heads, num_seqs * pages_per_seq + 1, 16, 128), jnp.bfloat16)
    tables = jnp.zeros((num_seqs, pages_per_seq), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda *a: decode_attention(*a, scale=0.1, interpret=True, **kw))(
        q, pages, pages, tables, jnp.zeros((num_seqs,), jnp.int32))

    def pallas_calls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
            for value in eqn.params.values():  # sub-jaxprs: jit, cond branches
                for item in value if isinstance(value, (tuple, list)) else [value]:
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        yield from pallas_calls(inner)

    (call,) = pallas_calls(jaxpr.jaxpr)
    return [v.aval for v in call.outvars]


def test_decode_writes_no_partials_when_the_batch_fills_the_gpu():
    # 256 sequences x 1 tile of 8 KV heads >= 132 SMs: one split, the output in bf16, [S, tiles, rows, H].
    (out,) = _pallas_call_outputs(256, 8, 2, 64)
    assert out.shape == (256, 1, 16, 128) and out.dtype == jnp.bfloat16
    # 64 sequences: 2 heads per tile still give 256 programs; the kernel stores their 4 real rows only.
    (out,) = _pallas_call_outputs(64, 8, 2, 64)
    assert out.shape == (64, 4, 4, 128) and out.dtype == jnp.bfloat16
    # 4 sequences: one KV head per program and splits; each split stores float32 partials of its 2
    # real rows only (not the 16-row tile).
    out, m, l = _pallas_call_outputs(4, 8, 2, 64)
    assert out.dtype == jnp.float32 and out.shape[:2] == (4, 8) and out.shape[2] > 1 and out.shape[3:] == (2, 128)
    assert m.shape == l.shape == out.shape[:4]


def test_decode_soft_cap():
    check_decode(page_size=16, head_dim=64, group=3, dtype=jnp.float32, soft_cap=2.0, num_kv_heads=3)


def test_decode_soft_cap_changes_the_result():
    """Guards the soft-cap test above: with a cap this small the outputs really differ."""
    case = make_case(
        np.random.default_rng(3),
        seq_lens=[40],
        q_lens=[1],
        num_kv_heads=1,
        group=2,
        head_dim=64,
        page_size=16,
        dtype=np.float32,
    )
    q = 4 * case.q  # large logits so that the cap bites
    outs = [
        np.asarray(
            decode_attention(
                q, case.k_pages, case.v_pages, case.block_tables, case.seq_lens, scale=0.125, soft_cap=cap, interpret=True
            )
        )
        for cap in (None, 1.0)
    ]
    assert np.abs(outs[0] - outs[1]).max() > 1e-2


def test_poison_is_live():
    """Guards the NaN design of every test here: gathering the whole block table rows and masking
    nothing gives NaN, so a kernel that reads past a length without masking fails the tests."""
    case = make_case(
        np.random.default_rng(0),
        seq_lens=[17],
        q_lens=[1],
        num_kv_heads=1,
        group=1,
        head_dim=64,
        page_size=16,
        dtype=np.float32,
    )
    pages = case.v_pages[0, case.block_tables[0]]  # [pages_per_seq, page_size, H]
    assert np.isnan(pages.reshape(-1, 64)[17:]).all()  # unused slots of the last page
    assert not np.isnan(pages.reshape(-1, 64)[:17]).any()


def _inputs(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, num_pages=8, pages_per_seq=3):
    return dict(
        q=jnp.zeros((num_seqs, num_heads, head_dim)),
        k_pages=jnp.zeros((num_kv_heads, num_pages, page_size, head_dim)),
        v_pages=jnp.zeros((num_kv_heads, num_pages, page_size, head_dim)),
        block_tables=jnp.zeros((num_seqs, pages_per_seq), jnp.int32),
        seq_lens=jnp.zeros((num_seqs,), jnp.int32),
    )


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(num_heads=6, num_kv_heads=4), "must be divisible by num_kv_heads"),
        (dict(page_size=12), "powers of two"),
        (dict(num_seqs=3), "block_tables has"),
    ],
)
def test_decode_rejects_bad_shapes(change, message, monkeypatch):
    # Production runs without the tests' jaxtyping checks (which would catch the block_tables
    # mismatch first): the kernel's own trace-time checks must hold alone.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    arguments = _inputs(**change)
    if "num_seqs" in change:
        arguments["block_tables"] = arguments["block_tables"][:2]
        arguments["seq_lens"] = arguments["seq_lens"][:2]
    with pytest.raises(ValueError, match=message):
        decode_attention(**arguments, scale=0.125, interpret=True)


def test_decode_rejects_bad_scale_and_block():
    with pytest.raises(ValueError, match="scale"):
        decode_attention(**_inputs(), scale=0.0, interpret=True)
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        decode_attention(**_inputs(), scale=0.125, pages_per_compute_block=3, interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "page_size,head_dim,group,dtype",
    list(itertools.product([16, 32], [64, 128], [1, 3, 4, 8], [jnp.float32, jnp.bfloat16])),
)
def test_decode_full_grid(page_size, head_dim, group, dtype):
    check_decode(page_size=page_size, head_dim=head_dim, group=group, dtype=dtype, seed=7)



@pytest.mark.parametrize("group,dtype,num_splits", [(3, jnp.float32, 2), (8, jnp.bfloat16, None), (2, jnp.bfloat16, 3)])
def test_decode_lowers_to_triton_for_cuda(group, dtype, num_splits):
    """No GPU here, but the CUDA lowering (Pallas -> Triton IR) runs on CPU: it rejects shapes and
    ops the Triton backend cannot compile (non-power-of-two arrays, unsupported primitives)."""
    q = jnp.zeros((3, 2 * group, 64), dtype)
    pages = jnp.zeros((2, 11, 16, 64), dtype)
    block_tables = jnp.zeros((3, 5), jnp.int32)
    seq_lens = jnp.zeros((3,), jnp.int32)
    # num_splits 2 / 3: the partials store only the real rows (a split of the 16-row tile).
    with cuda_target():  # JAX >= 0.12's Triton lowering reads the GPU's kind; this host has none
        lowered = jax.jit(lambda *a: decode_attention(*a, scale=0.125, soft_cap=30.0, num_splits=num_splits,
                                                      interpret=False)).trace(
            q, pages, pages, block_tables, seq_lens
        ).lower(lowering_platforms=("cuda",))
        with_sinks = jax.jit(lambda *a: decode_attention(*a[:5], scale=0.125, num_splits=1, interpret=False,
                                                         sinks=a[5])).trace(
            q, pages, pages, block_tables, seq_lens, jnp.zeros((2 * group,), jnp.float32)
        ).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in with_sinks.as_text()
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


# --- benchmarks/bench_kernels.py, run as CI runs it: the paths that can run without a GPU ---------


def _run_bench(*args):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_kernels", *args], cwd=root, capture_output=True,
                          text=True, timeout=1800)


def test_bench_refuses_without_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: the refusal path does not apply")
    proc = _run_bench()
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr, proc.stderr[-2000:]
    proc = _run_bench("--repeats", "0")
    assert proc.returncode == 2 and "--repeats=0 must be >= 1" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_bench_dry_run_writes_json(tmp_path):
    import json

    proc = _run_bench("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("kernels-*-dry-run.json")
    report = json.loads(path.read_text())
    impls = {row["impl"] for row in report["rows"]}
    assert {"ours decode_attention", "ours paged_attention (ragged)", "dense jax.nn.dot_product_attention"} <= impls
    # bf16 inputs: every peer agrees with dense attention to bf16 precision, where dense ran.
    compared = [row for row in report["rows"] if row.get("batch_name") != "tiny mix, dense skipped"]
    assert all(row["max_abs_diff_vs_dense"] < 5e-2 for row in compared)
    skipped = [row for row in report["rows"] if row.get("batch_name") == "tiny mix, dense skipped"]
    assert [row["impl"] for row in skipped] == ["ours paged_attention (ragged)"]
