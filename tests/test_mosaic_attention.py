"""The Mosaic GPU kernels (pallas_kernels.mosaic) against the reference, in GPU interpret mode on CPU.

GPU interpret mode simulates the two warpgroups, the mbarriers, the TMA page copies through the
block table and the SMEM ring of the real kernel; only the two matmuls run as ordinary dots there
(the interpreter has no transposed or register wgmma operands; see kernel.py). The compiled path is
checked by lowering for CUDA on the CPU (the last tests).

Each case is hostile (pallas_kernels.testing.make_case): random page permutation, NaN in every page
a sequence does not own and in the unused slots of its last page, block-table entries past a length
pointing at a NaN page. The kernel reads the whole buffer [num_layers, 2, ...] with the case in
layer 1 and layer 0 all NaN, so a wrong layer offset poisons the output too. The oracle gets the same
values in an independently built plain layout.

Tolerance: bfloat16 only (wgmma has no float32 path here), 2e-2 absolute and relative: probabilities
are rounded to bf16 before the PV matmul and the output is bf16.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.ops.attention import reference_paged_attention
from pallas_kernels.mosaic import decode_attention, ragged_paged_attention
from pallas_kernels.testing import make_case

oracle = jax.jit(reference_paged_attention, static_argnames=("scale", "soft_cap"))
TOL = 2e-2
NUM_PADDING_TOKENS = 3
LAYER = 1  # the case lives in layer 1 of 2; layer 0 is all NaN


def whole_buffer(case) -> np.ndarray:
    """[num_layers=2, 2, K, num_pages, page_size, H]: NaN layer 0, the case's hostile pages in layer 1."""
    kv = np.full((2, 2, *case.k_pages.shape), np.nan, case.k_pages.dtype)
    kv[LAYER, 0], kv[LAYER, 1] = case.k_pages, case.v_pages
    return kv


def check_close(got, want, num_real):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), "a NaN page leaked: the kernel read past a length, a causal limit or its layer"
    np.testing.assert_array_equal(got[num_real:], 0.0)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    assert np.abs(want[:num_real]).max() > 0.1  # not trivially zero


def mixed_batch(p: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens) for page size p: decode rows, whole prompts around page boundaries,
    chunks starting mid-page, a padding sequence, and a chunk whose keys fill more 64-key steps
    than the kernel's SMEM ring has slots (the producer must wait for the consumer)."""
    batch = [
        (p + 1, 1),  # decode row whose token opens a new page
        (1, 1),  # one-token prompt
        (p - 1, p - 1),  # whole prompt, last page not full
        (p, p),  # whole prompt, exactly one page
        (0, 0),  # padding sequence
        (p + 1, p + 1),  # whole prompt, one token into page 2
        (5 + 20, 20),  # chunk starting mid-page after 5 cached tokens
        (2 * p + 7, 1),  # decode row in the middle of a page
        (200, 70),  # 130 cached + a 70-token chunk starting mid-page: 4 key steps, 2 slots
    ]
    return [n for n, _ in batch], [q for _, q in batch]


def some_sinks(num_heads, seed):
    """gpt-oss's attention sinks, spread so that some outweigh a row's keys and some do not."""
    return jnp.asarray(np.random.default_rng(seed + 2).normal(0.0, 3.0, num_heads), jnp.float32)


def run_ragged(case, *, head_dim, soft_cap=None, layer_idx=LAYER, interpret=True, num_consumers=None, sinks=None):
    return ragged_paged_attention(
        case.q,
        whole_buffer(case),
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        layer_idx=layer_idx,
        scale=head_dim**-0.5,
        soft_cap=soft_cap,
        num_consumers=num_consumers,
        interpret=interpret,
        sinks=sinks,
    )


def check_ragged(
    *, page_size, head_dim, group, num_kv_heads=2, soft_cap=None, batch=None, seed=0, interpret=True, num_consumers=None,
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
        dtype=jnp.bfloat16,
        num_padding_tokens=NUM_PADDING_TOKENS,
    )
    sink = some_sinks(num_kv_heads * group, seed) if sinks else None
    got = run_ragged(case, head_dim=head_dim, soft_cap=soft_cap, interpret=interpret, num_consumers=num_consumers,
                     sinks=sink)
    want = oracle(
        case.q,
        case.oracle_k_pages,
        case.oracle_v_pages,
        case.oracle_block_tables,
        case.seq_lens,
        case.query_start_loc,
        scale=head_dim**-0.5,
        soft_cap=soft_cap,
        sinks=sink,
    )
    assert got.dtype == case.q.dtype and got.shape == case.q.shape
    check_close(got, want, int(case.query_start_loc[-1]))


def small_batch(p: int) -> tuple[list[int], list[int]]:
    """The default suite's batch (GPU interpret mode costs seconds per CUDA block): a decode row
    opening a page, a whole prompt one short of a page, a mid-page chunk, a padding sequence, and a
    chunk whose 3 key steps wrap the 2-slot SMEM ring."""
    batch = [(p + 1, 1), (p - 1, p - 1), (5 + 20, 20), (0, 0), (140, 9)]
    return [n for n, _ in batch], [q for _, q in batch]


# Default suite: both page sizes, both head_dims, GQA 1 (tile rows = 64 tokens x 1 head) and 8
# (8 tokens x 8 heads, with soft_cap bending the logits); GQA 4 is in the decode test; every
# combination on the full mixed batch is the slow sweep.
@pytest.mark.parametrize("page_size,head_dim,group,soft_cap", [(32, 64, 1, None), (16, 128, 8, 5.0)])
def test_ragged_matches_reference_on_a_small_batch(page_size, head_dim, group, soft_cap):
    check_ragged(
        page_size=page_size, head_dim=head_dim, group=group, num_kv_heads=1, soft_cap=soft_cap,
        batch=small_batch(page_size),
    )


@pytest.mark.slow
def test_ragged_soft_cap_and_a_group_that_is_not_a_power_of_two():
    # 3 query heads per KV head are padded to 4 rows per token; soft_cap bends the logits first.
    check_ragged(page_size=32, head_dim=64, group=3, num_kv_heads=1, soft_cap=5.0, batch=([40, 33, 9], [40, 2, 9]))


def test_ragged_takes_a_traced_layer_index_inside_a_scan():
    # The model's layer loop: layer_idx is a traced int32. Layer 0 is NaN, so only layer 1 is usable:
    # the scan runs layer 1 twice, identically, and matches the oracle.
    page_size, head_dim = 16, 64
    seq_lens, q_lens = [37], [5]  # 32 cached, a 5-token chunk from mid-page 3: one tile of 16 tokens x 4 heads
    case = make_case(
        np.random.default_rng(3),
        seq_lens=seq_lens,
        q_lens=q_lens,
        num_kv_heads=1,
        group=4,
        head_dim=head_dim,
        page_size=page_size,
        dtype=jnp.bfloat16,
        num_padding_tokens=1,
    )
    kv = jnp.asarray(whole_buffer(case))

    @jax.jit
    def two_layers(q, kv):
        def layer(carry, layer_idx):
            out = ragged_paged_attention(
                q, kv, case.block_tables, case.seq_lens, case.query_start_loc,
                layer_idx=layer_idx, scale=head_dim**-0.5, interpret=True,
            )
            return carry, out

        return jax.lax.scan(layer, 0, jnp.array([LAYER, LAYER], jnp.int32))[1]

    outs = np.asarray(two_layers(case.q, kv), np.float32)
    np.testing.assert_array_equal(outs[0], outs[1])
    want = oracle(
        case.q, case.oracle_k_pages, case.oracle_v_pages, case.oracle_block_tables, case.seq_lens,
        case.query_start_loc, scale=head_dim**-0.5,
    )
    check_close(outs[0], want, int(case.query_start_loc[-1]))


def check_decode(*, page_size, head_dim, group, seq_lens, num_splits, num_kv_heads=2, seed=0, interpret=True,
                 sinks=False):
    case = make_case(
        np.random.default_rng(seed),
        seq_lens=seq_lens,
        q_lens=[1 if n else 0 for n in seq_lens],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        page_size=page_size,
        dtype=jnp.bfloat16,
    )
    # make_case gives padding rows no token; decode has one q row per sequence: padding rows get
    # random queries too, and must come out as zeros (seq_len 0).
    q = np.random.default_rng(seed + 1).standard_normal((len(seq_lens), *case.q.shape[1:])).astype(case.q.dtype)
    real = np.flatnonzero(np.asarray(seq_lens) > 0)
    q[real] = case.q
    query_start_loc = np.arange(len(seq_lens) + 1, dtype=np.int32)
    sink = some_sinks(num_kv_heads * group, seed) if sinks else None
    got = decode_attention(
        q,
        whole_buffer(case),
        case.block_tables,
        case.seq_lens,
        layer_idx=LAYER,
        scale=head_dim**-0.5,
        num_splits=num_splits,
        interpret=interpret,
        sinks=sink,
    )
    want = np.asarray(
        oracle(
            q, case.oracle_k_pages, case.oracle_v_pages, case.oracle_block_tables, case.seq_lens,
            query_start_loc, scale=head_dim**-0.5, sinks=sink,
        ),
        np.float32,
    )
    want[np.asarray(seq_lens) == 0] = 0.0  # the oracle's zero-length rows are already zero; be explicit
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any(), "a NaN page leaked: the kernel read past a length or its layer"
    np.testing.assert_array_equal(got[np.asarray(seq_lens) == 0], 0.0)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def decode_lens(p: int) -> list[int]:
    # Around page boundaries, one padding row, and contexts of 3-5 key steps (splits, ring reuse).
    return [1, p - 1, p, p + 1, 0, 2 * p + 7, 200, 300]


def test_decode_matches_reference_with_splits():
    # 3 blocks per tile over [17, 0, 150] keys: 1, 0 and 3 key steps, so one sequence's splits are
    # all empty but one, the padding row's are all empty, and the long one's are one step each.
    check_decode(page_size=16, head_dim=128, group=4, seq_lens=[17, 0, 150], num_splits=3, num_kv_heads=1)


def test_decode_tiles_of_several_kv_heads_and_sequences():
    # 2 KV heads, one per tile (too few sequences to pack), 3 sequences: 6 tiles whose queries and
    # outputs sit sequence-major in q / out (kernel._tile_index); one split, a padding row.
    check_decode(page_size=16, head_dim=64, group=2, seq_lens=[5, 0, 70], num_splits=1, num_kv_heads=2)


@pytest.mark.parametrize("num_splits", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_decode_packs_the_groups_of_several_kv_heads_per_tile(num_splits, monkeypatch):
    # GQA 2 with 4 KV heads: the 4 groups share one 64-row tile (8 real rows, the only rows loaded
    # and stored), the block loops over (key step, KV head) units. Planned as on a 1-SM GPU, so
    # these 4 sequences already "fill" it and the planner packs; None then picks one split, 2 takes
    # the float32 partials path.
    from pallas_kernels import decode_plan

    jax.clear_caches()
    monkeypatch.setattr(decode_plan, "NUM_SMS", 1)
    assert decode_plan.heads_per_tile(4, 2, 64, num_seqs=4) == 4
    check_decode(page_size=16, head_dim=64, group=2, num_kv_heads=4, seq_lens=[1, 17, 0, 70],
                 num_splits=num_splits, seed=5)


@pytest.mark.parametrize("num_splits", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_decode_attention_sinks(num_splits):
    # gpt-oss: with one split the kernel writes each row's log-sum-exp for the sinks; with three they join the
    # combine as one more split. GQA 4 on one KV head, a padding row.
    check_decode(page_size=16, head_dim=64, group=4, seq_lens=[17, 0, 80], num_splits=num_splits, num_kv_heads=1,
                 sinks=True, seed=3)


def test_ragged_attention_sinks():
    # a decode row, a prompt one short of a page, a padding sequence, a chunk over 2 key steps
    check_ragged(page_size=32, head_dim=64, group=2, num_kv_heads=1, batch=([33, 31, 0, 90], [1, 31, 0, 20]),
                 sinks=True, seed=4)


def test_rejects_float32_pages_with_a_message():
    q = jnp.zeros((4, 2, 64), jnp.float32)
    kv = jnp.zeros((1, 2, 1, 4, 16, 64), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        ragged_paged_attention(
            q, kv, jnp.zeros((2, 2), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32),
            layer_idx=0, scale=0.125,
        )


def test_attributes_mark_the_whole_buffer_form():
    assert ragged_paged_attention.reads_whole_kv_buffer is True
    assert decode_attention.reads_whole_kv_buffer is True


@pytest.mark.parametrize("head_dim,page_size,group", [(64, 16, 1), (128, 32, 8)])
def test_kernels_lower_to_the_mosaic_gpu_custom_call_for_cuda(head_dim, page_size, group):
    # Compiled path (wgmma with K transposed in SMEM, P from registers, WGMMA layouts): lowering
    # for CUDA on the CPU runs the whole Mosaic GPU lowering, which rejects unsupported layouts,
    # shapes and transforms, and must produce the mosaic_gpu custom call, with a traced layer index.
    num_kv_heads = 2
    kv = jax.ShapeDtypeStruct((3, 2, num_kv_heads, 40, page_size, head_dim), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((4, 6), jnp.int32)
    lens = jax.ShapeDtypeStruct((4,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)

    def ragged(q, kv, tables, lens, starts, layer, num_consumers=None):
        return ragged_paged_attention(
            q, kv, tables, lens, starts, layer_idx=layer, scale=0.1, soft_cap=30.0,
            num_consumers=num_consumers, interpret=False,
        )

    def decode(q, kv, tables, lens, layer):
        return decode_attention(q, kv, tables, lens, layer_idx=layer, scale=0.1, num_splits=2, interpret=False)

    q = jax.ShapeDtypeStruct((24, num_kv_heads * group, head_dim), jnp.bfloat16)
    starts = jax.ShapeDtypeStruct((5,), jnp.int32)
    lowered = jax.jit(ragged).trace(q, kv, tables, lens, starts, layer).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()  # 2 consumer warpgroups (the compiled default)
    one_consumer = functools.partial(ragged, num_consumers=1)  # the interpreted default, as tested above
    lowered = jax.jit(one_consumer).trace(q, kv, tables, lens, starts, layer).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()
    q = jax.ShapeDtypeStruct((4, num_kv_heads * group, head_dim), jnp.bfloat16)
    lowered = jax.jit(decode).trace(q, kv, tables, lens, layer).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()
    # gpt-oss's sinks: the kernels also write each row's log-sum-exp with one split
    sinks = jax.ShapeDtypeStruct((num_kv_heads * group,), jnp.float32)
    ragged_sinks = lambda q, kv, tables, lens, starts, layer, sinks: ragged_paged_attention(
        q, kv, tables, lens, starts, layer_idx=layer, scale=0.1, interpret=False, sinks=sinks)
    decode_sinks = lambda q, kv, tables, lens, layer, sinks: decode_attention(
        q, kv, tables, lens, layer_idx=layer, scale=0.1, num_splits=1, interpret=False, sinks=sinks)
    lowered = jax.jit(decode_sinks).trace(q, kv, tables, lens, layer, sinks).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()
    q = jax.ShapeDtypeStruct((24, num_kv_heads * group, head_dim), jnp.bfloat16)
    lowered = jax.jit(ragged_sinks).trace(q, kv, tables, lens, starts, layer, sinks).lower(lowering_platforms=("cuda",))
    assert "custom_call @mosaic_gpu" in lowered.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_ragged_full_sweep(page_size, head_dim, group):
    check_ragged(page_size=page_size, head_dim=head_dim, group=group, seed=page_size + head_dim + group)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group,num_splits", [(1, 1), (4, 3), (8, 4)])
def test_decode_full_sweep(page_size, head_dim, group, num_splits):
    check_decode(
        page_size=page_size, head_dim=head_dim, group=group, seq_lens=decode_lens(page_size),
        num_splits=num_splits, seed=page_size + head_dim,
    )


def test_engine_selects_the_mosaic_kernels_and_requires_bfloat16():
    from jaxpaged.config import EngineConfig
    from jaxpaged.device.backends import attention_fn as _attention_fn

    backend = _attention_fn("mosaic")
    assert backend.reads_whole_kv_buffer and backend.has_decode_kernel
    # Decode-bucket steps (the model passes decode_only) run the split decode kernel, others the ragged one.
    args = (jnp.zeros((2, 4, 64), jnp.bfloat16), jnp.zeros((1, 2, 1, 4, 16, 64), jnp.bfloat16),
            jnp.zeros((2, 2), jnp.int32), jnp.ones(2, jnp.int32), jnp.arange(3, dtype=jnp.int32))
    decode_jaxpr = str(jax.make_jaxpr(lambda *a: backend(*a, layer_idx=0, scale=0.125, decode_only=True))(*args))
    mixed_jaxpr = str(jax.make_jaxpr(lambda *a: backend(*a, layer_idx=0, scale=0.125))(*args))
    assert "name=decode_attention" in decode_jaxpr and "name=ragged_paged_attention" not in decode_jaxpr
    assert "name=ragged_paged_attention" in mixed_jaxpr and "name=decode_attention" not in mixed_jaxpr
    EngineConfig(attention_backend="mosaic", dtype="bfloat16")  # accepted
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        EngineConfig(attention_backend="mosaic")
    # "auto" keeps the Triton kernels on a GPU until a committed GPU benchmark shows Mosaic faster.
    resolved = EngineConfig().resolved(on_gpu=True, model_max_len=128)
    assert resolved.attention_backend == "pallas"


def _on_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and any(name in device.device_kind for name in ("H100", "H200", "H800", "GH200"))


@pytest.mark.skipif(not _on_hopper(), reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_compiled_kernels_match_reference_on_hopper(page_size, head_dim, group):
    # The real wgmma path (transposed K operand, P from registers), which interpret mode replaces by dots.
    check_ragged(page_size=page_size, head_dim=head_dim, group=group, interpret=False)
    check_decode(
        page_size=page_size, head_dim=head_dim, group=group, seq_lens=decode_lens(page_size), num_splits=3,
        interpret=False,
    )


@pytest.mark.slow
@pytest.mark.skipif(
    (os.cpu_count() or 1) < 4,
    reason="3 interpreted warpgroups need a host thread each that can block; XLA's CPU runtime gives one per core",
)
@pytest.mark.parametrize("page_size,head_dim,group", [(16, 64, 1), (32, 128, 4)])
def test_ragged_with_two_consumer_warpgroups_in_interpret_mode(page_size, head_dim, group):
    # The compiled default: 128-row tiles, two consumers sharing each K/V step and the V-tail barrier.
    check_ragged(page_size=page_size, head_dim=head_dim, group=group, num_consumers=2)
