"""The GPU device path, checked on the CPU: the kernels read the model's whole KV buffer, decode-only
steps run the decode kernel in their own small buckets, nothing compiles after warm-up, and the GPU
pool leaves room for the step's scratch memory.

The kernels run in Pallas interpret mode here; where the test needs what a GPU would run, the step
is lowered for CUDA (the CPU jaxlib can lower the Triton custom calls, though not run them).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_scheduler_output, make_seq

import pallas_kernels
from jaxpaged.device import backends, kv_cache
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.config import EngineConfig
from jaxpaged.device.kv_cache import kv_cache_bytes_per_page
from jaxpaged.device.runner import ModelRunner
from jaxpaged.models import ModelConfig, init_params
from jaxpaged.device.step_input import default_decode_buckets, prepare_step_input
from pallas_kernels.jax_compat import cuda_target
from pallas_kernels.testing import make_case

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
# 40 pages of 4 slots: one layer's K pool is 2*40*4*16 = 5120 elements, the whole buffer 20480;
# no other array of the step has either size.
NUM_PAGES, PAGE_SIZE = 40, 4
LAYER_POOL_SIZE = TINY.num_kv_heads * NUM_PAGES * PAGE_SIZE * TINY.head_dim
WHOLE_BUFFER_SIZE = TINY.num_layers * 2 * LAYER_POOL_SIZE


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(TINY, jax.random.key(0))


def _runner(params, attention_fn, **overrides):
    kwargs = dict(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=4, max_num_batched_tokens=16,
                  max_model_len=64, buckets=(16,), attention_fn=attention_fn)
    return ModelRunner(TINY, params, **{**kwargs, **overrides})


# --- the kernels over the whole buffer -------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_whole_buffer_kernels_read_only_their_layer(kernel):
    # Layer 1 of a 3-layer buffer holds a hostile case (random page ids, NaN in every page a
    # sequence does not own); layers 0 and 2 are all NaN, so reading another layer poisons the output.
    page_size, num_kv_heads, group, head_dim = 4, 2, 2, 16
    seq_lens = [1, 3, 4, 5, 0, 13]
    q_lens = [1 if n else 0 for n in seq_lens] if kernel == "decode" else [1, 3, 2, 5, 0, 4]
    case = make_case(np.random.default_rng(0), seq_lens=seq_lens, q_lens=q_lens, num_kv_heads=num_kv_heads,
                     group=group, head_dim=head_dim, page_size=page_size, dtype=np.float32)
    kv_pages = np.full((3, 2, *case.k_pages.shape), np.nan, np.float32)
    kv_pages[1, 0], kv_pages[1, 1] = case.k_pages, case.v_pages
    scale = head_dim**-0.5
    if kernel == "decode":  # one row per sequence, padding rows included
        q = np.random.default_rng(1).standard_normal((len(seq_lens), num_kv_heads * group, head_dim), np.float32)
        query_start_loc = np.arange(len(seq_lens) + 1, dtype=np.int32)
        got = pallas_kernels.decode_attention_from_buffer(
            q, kv_pages, case.block_tables, case.seq_lens, layer_idx=jnp.int32(1), scale=scale, num_splits=2,
            pages_per_compute_block=2, interpret=True)
    else:
        q, query_start_loc = case.q, case.query_start_loc
        got = pallas_kernels.ragged_paged_attention_from_buffer(
            q, kv_pages, case.block_tables, case.seq_lens, query_start_loc, layer_idx=jnp.int32(1), scale=scale,
            block_q=4, pages_per_compute_block=2, interpret=True)
    want = reference_paged_attention(*map(jnp.asarray, (q, case.oracle_k_pages, case.oracle_v_pages,
                                                         case.oracle_block_tables, case.seq_lens, query_start_loc)),
                                     scale=scale)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_host_seq_lens_past_the_block_table_are_refused():
    kv_pages = np.zeros((1, 2, 2, 8, 4, 16), np.float32)
    q = np.zeros((1, 4, 16), np.float32)
    block_tables = np.array([[1, 2]], np.int32)  # addresses 2 pages x 4 slots = 8 positions
    with pytest.raises(ValueError, match="length 9 needs more than the block table's 2 pages"):
        pallas_kernels.decode_attention_from_buffer(
            q, kv_pages, block_tables, np.array([9], np.int32), layer_idx=0, scale=0.25, interpret=True)
    with pytest.raises(ValueError, match="length 9 needs more than"):
        pallas_kernels.ragged_paged_attention(
            q, kv_pages[0, 0], kv_pages[0, 1], block_tables, np.array([9], np.int32), np.array([0, 1], np.int32),
            scale=0.25, interpret=True)


# --- the step as a GPU would compile it -------------------------------------------------------------


def _kernel_operand_sizes(module_text: str) -> list[list[int]]:
    """Element counts of the operands of every Triton kernel custom call in a StableHLO module."""
    sizes = []
    for line in module_text.splitlines():
        if "stablehlo.custom_call @__gpu$xla.gpu.triton" not in line:
            continue
        operand_types = line[line.rfind(" : (") + 4 : line.rfind(") -> ")]
        sizes.append([
            int(np.prod([int(d) for d in shape.split("x")[:-1]]))
            for shape in re.findall(r"tensor<([0-9x]*[a-z][a-z0-9]*)>", operand_types)
        ])
    return sizes


def test_step_lowered_for_cuda_hands_the_kernels_the_whole_buffer(tiny_params, monkeypatch):
    # The engine's Pallas backend lowered for CUDA from this CPU host: the target picks the compiled
    # kernels (pallas_kernels._common.by_target), nothing is patched. Before the kernels took the
    # whole buffer, every kernel got `kv_pages[layer_idx, 0]` and `[layer_idx, 1]`: dynamic slices that
    # XLA materialises, a copy of every layer's pool on every step.
    backend = backends.attention_fn("pallas")
    runner = _runner(tiny_params, backend)
    mixed = runner.dummy_step_input(16)
    decode = runner.prepare(make_scheduler_output(  # the decode-only planning path, if there is one
        [make_seq([1, 2, 3], 2, [1]), make_seq([4, 5], 1, [2]), make_seq([6], 0, [3])], [1, 1, 1]))
    for step_input in (mixed, decode):
        with cuda_target():  # JAX >= 0.12's Triton lowering reads the GPU's kind; this host has none
            lowered = runner.trace_step(step_input).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        kernels = _kernel_operand_sizes(text)
        assert kernels, "no Triton kernel in the step lowered for CUDA"
        for operand_sizes in kernels:
            assert WHOLE_BUFFER_SIZE in operand_sizes, f"a kernel without the whole KV buffer: {operand_sizes}"
            assert LAYER_POOL_SIZE not in operand_sizes, f"a kernel got one layer's pool: {operand_sizes}"
        pool_slices = [line for line in text.splitlines() if "dynamic_slice" in line
                       and re.search(rf"-> tensor<1x1x{TINY.num_kv_heads}x{NUM_PAGES}x", line)]
        assert not pool_slices, f"a layer's pool is sliced out of the buffer: {pool_slices[0][:200]}"
    jax.clear_caches()


# --- decode-only steps ----------------------------------------------------------------------------


def test_decode_only_steps_take_decode_buckets():
    # Three sequences decode one token each: decode bucket 4 (of 1, 2, 4), not the 16-token bucket.
    seqs = [make_seq([1, 2, 3], 2, [5]), make_seq([4, 5, 6, 7, 8], 4, [6, 7]), make_seq([9], 0, [8])]
    kwargs = dict(page_size=4, num_pages=10, pages_per_seq=4, max_num_seqs=4, buckets=(16,),
                  decode_buckets=default_decode_buckets(4))
    assert default_decode_buckets(4) == (1, 2, 4) and default_decode_buckets(6) == (1, 2, 4, 6)
    step = prepare_step_input(make_scheduler_output(seqs, [1, 1, 1]), **kwargs)
    assert step.decode_only and step.num_tokens == step.num_seqs == 4
    np.testing.assert_array_equal(step.token_ids, [3, 8, 9, 0])
    np.testing.assert_array_equal(step.positions, [2, 4, 0, 0])
    np.testing.assert_array_equal(step.slot_mapping, [5 * 4 + 2, 7 * 4 + 0, 8 * 4 + 0, 40])
    np.testing.assert_array_equal(step.seq_lens, [3, 5, 1, 0])
    np.testing.assert_array_equal(step.query_start_loc, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(step.logits_indices, [0, 1, 2, 0])
    # One sequence decodes alone: bucket 1, no padding at all.
    alone = prepare_step_input(make_scheduler_output(seqs[:1], [1]), **kwargs)
    assert alone.decode_only and alone.num_tokens == 1
    # A prefill chunk among them, or no decode buckets: the token buckets, as before.
    seqs[2].num_computed_tokens, seqs[2].token_ids = 0, [9, 10]
    mixed = prepare_step_input(make_scheduler_output(seqs, [1, 1, 2]), **kwargs)
    assert not mixed.decode_only and (mixed.num_tokens, mixed.num_seqs) == (16, 4)
    plain = prepare_step_input(make_scheduler_output(seqs[:2], [1, 1]), **{**kwargs, "decode_buckets": ()})
    assert not plain.decode_only and plain.num_tokens == 16


def test_decode_only_step_runs_the_decode_kernel_and_matches_the_reference(tiny_params):
    backend = pallas_kernels.paged_attention_from_buffer
    runners = {"pallas": _runner(tiny_params, backend), "reference": _runner(tiny_params, None)}
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2], "b": [2, 7, 1, 8, 2]}
    logits = {}
    for name, runner in runners.items():
        runner.kv_pages = jnp.full_like(runner.kv_pages, jnp.nan)  # unwritten slots must never be read
        a, b = make_seq(prompts["a"], 0, [4, 9]), make_seq(prompts["b"], 0, [7, 2])
        runner.run(make_scheduler_output([a, b], [6, 4]))  # prefill all but the last token: ragged kernel
        a.num_computed_tokens, b.num_computed_tokens = 6, 4
        out = make_scheduler_output([a, b], [1, 1])
        step_input = runner.prepare(out)
        assert step_input.decode_only and step_input.num_tokens == 2
        jaxpr = str(runner.trace_step(step_input).jaxpr)
        if name == "pallas":
            assert "paged_decode_attention" in jaxpr and "ragged_paged_attention" not in jaxpr
        logits[name] = np.asarray(runner.run(out))
    assert np.isfinite(logits["pallas"]).all()
    np.testing.assert_allclose(logits["pallas"], logits["reference"], atol=1e-5)


def test_no_compilation_after_warmup_with_decode_buckets(tiny_params):
    runner = _runner(tiny_params, None, max_num_batched_tokens=32, buckets=(8, 32))
    runner.warmup()
    # A GPU's smallest decode bucket is 2 rows (a one-row dot lowers to multiply + reduce there).
    expected = (1, 2, 4) if jax.default_backend() == "cpu" else (2, 4)
    assert runner.decode_buckets == expected
    assert runner.num_compiles == runner.num_step_programs == 2 * 2 + len(expected)  # buckets with and without prompt logprobs
    seqs = [make_seq(list(range(1, n + 1)), n - 1, [i + 1, i + 11]) for i, n in enumerate((5, 7, 2, 6))]
    for count in (1, 2, 3, 4):  # decode buckets 1, 2, 4, 4 (on a GPU 2, 2, 4, 4)
        runner.run(make_scheduler_output(seqs[:count], [1] * count))
    runner.run(make_scheduler_output([seqs[0], make_seq(range(20, 40), 0, [30, 31, 32, 33, 34])], [1, 20]))
    assert runner.num_compiles == runner.num_step_programs


# --- GPU pool sizing ------------------------------------------------------------------------------


def test_gpu_pool_leaves_room_for_the_largest_step(tiny_params, monkeypatch):
    # A fake GPU with `free` bytes after the weights: the pool gets kv_memory_fraction of what the
    # compiled largest step's scratch memory and the margin leave.
    config = EngineConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, dtype="float32")
    config = config.resolved(on_gpu=True, model_max_len=TINY.max_position_embeddings)
    free = kv_cache._GPU_MARGIN_BYTES + (64 << 20)
    monkeypatch.setattr(kv_cache, "on_gpu", lambda: True)
    monkeypatch.setattr(kv_cache, "free_device_memory", lambda: free)
    num_pages = kv_cache.num_pages_for(config, TINY, tiny_params, None)

    step_temp = _runner(tiny_params, None, num_pages=2, page_size=4, max_num_batched_tokens=32,
                        buckets=None).step_temp_bytes()
    assert step_temp > 32 * TINY.vocab_size * 4  # at least the largest bucket's logits
    page_bytes = kv_cache_bytes_per_page(TINY, 4)
    budget = config.kv_memory_fraction * (free - step_temp - kv_cache._GPU_MARGIN_BYTES)
    assert num_pages * page_bytes <= budget < (num_pages + 1) * page_bytes

    monkeypatch.setattr(kv_cache, "free_device_memory", lambda: kv_cache._GPU_MARGIN_BYTES)
    with pytest.raises(ValueError, match="nothing is left for KV pages; lower max_num_batched_tokens"):
        kv_cache.num_pages_for(config, TINY, tiny_params, None)


def test_auto_on_a_gpu_is_triton_while_jax_ships_it_then_mosaic_where_it_serves():
    import dataclasses

    model = dataclasses.replace(TINY, head_dim=128)
    bf16 = EngineConfig(dtype="bfloat16")
    pick = functools.partial(backends.gpu_auto_backend, compute_capability="9.0")
    assert pick(model, bf16) == "pallas"  # this JAX ships the Triton backend (jax_compat.TRITON_COMPILER_PARAMS)
    assert pick(model, bf16, triton_available=True) == "pallas"
    assert pick(model, bf16, triton_available=False) == "mosaic"
    # Where Mosaic cannot serve, XLA's ops: no wgmma (Ampere, Blackwell), quantized or float32 pages,
    # a head_dim the wgmma tiles lack, a sliding window.
    for capability in ("8.0", "10.0"):
        assert backends.gpu_auto_backend(model, bf16, compute_capability=capability, triton_available=False) == "chunked"
    for config in (EngineConfig(dtype="bfloat16", kv_cache_dtype="int8"), EngineConfig(dtype="float32")):
        assert pick(model, config, triton_available=False) == "chunked"
    assert pick(TINY, bf16, triton_available=False) == "chunked"  # head_dim 16
    assert pick(dataclasses.replace(model, sliding_window=64), bf16, triton_available=False) == "chunked"
