"""The device path on a real GPU (marked `gpu`: skipped elsewhere; `scripts/gpu_check.sh` runs them).

- both kernels compiled (not interpreted) at real sizes, bf16, against the reference;
- a pool of more than 2^31 elements, addressed at its far end (64-bit offsets in the kernels);
- the engine with the Pallas backend gives the reference backend's greedy tokens on a random-weight
  Qwen3-0.6B-shaped model;
- the KV buffer is donated, the compiled step's scratch memory is far below the pool, and nothing
  compiles after warm-up.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.models import ModelConfig, init_params
from jaxpaged.models.llama import write_kv
from pallas_kernels.testing import make_case

pytestmark = pytest.mark.gpu

# Qwen3-0.6B shapes (BENCHMARKS.md W1), random weights.
QWEN3_0_6B = ModelConfig(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
    max_position_embeddings=40960, dtype="bfloat16",
)
BF16_TOLERANCE = 2e-2  # bf16 pages and outputs: ~3 significant digits; probabilities rounded to bf16
oracle = jax.jit(reference_paged_attention, static_argnames=("scale", "soft_cap"))


def _compare(got, want, atol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), "NaN/inf: a kernel read a page or slot it does not own"
    np.testing.assert_allclose(got, want, atol=atol)


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_kernel_compiled_at_real_sizes(page_size, group):
    seq_lens = [1, page_size - 1, page_size, page_size + 1, 0, 1000, 4095, 2 * page_size + 3]
    case = make_case(np.random.default_rng(0), seq_lens=seq_lens, q_lens=[1 if n else 0 for n in seq_lens],
                     num_kv_heads=8, group=group, head_dim=128, page_size=page_size, dtype=jnp.bfloat16)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((len(seq_lens), 8 * group, 128)), jnp.bfloat16)
    kv_pages = jnp.stack([case.k_pages, case.v_pages])[None]  # [1, 2, K, P, page_size, H]
    got = pallas_kernels.decode_attention_from_buffer(
        q, kv_pages, case.block_tables, case.seq_lens, layer_idx=0, scale=128**-0.5, num_splits=8, interpret=False)
    want = oracle(q, case.oracle_k_pages, case.oracle_v_pages, case.oracle_block_tables, case.seq_lens,
                  np.arange(len(seq_lens) + 1, dtype=np.int32), scale=128**-0.5)
    _compare(got, want, BF16_TOLERANCE)


@pytest.mark.parametrize("page_size", [16, 32])
def test_ragged_kernel_compiled_at_real_sizes(page_size):
    # Decode rows, a long prefill, chunks after cached prefixes, a padding row, padding tokens.
    seq_lens = [1, 700, 513, 2000, 0, 17, 40]
    q_lens = [1, 700, 100, 64, 0, 1, 33]
    case = make_case(np.random.default_rng(2), seq_lens=seq_lens, q_lens=q_lens, num_kv_heads=8, group=2,
                     head_dim=128, page_size=page_size, dtype=jnp.bfloat16, num_padding_tokens=5)
    kv_pages = jnp.stack([case.k_pages, case.v_pages])[None]
    got = pallas_kernels.ragged_paged_attention_from_buffer(
        case.q, kv_pages, case.block_tables, case.seq_lens, case.query_start_loc, layer_idx=0, scale=128**-0.5,
        interpret=False)
    want = oracle(case.q, case.oracle_k_pages, case.oracle_v_pages, case.oracle_block_tables, case.seq_lens,
                  case.query_start_loc, scale=128**-0.5)
    _compare(got, want, BF16_TOLERANCE)


def test_pool_beyond_2_31_elements_is_addressed_at_its_far_end():
    # Qwen3-0.6B-shaped buffer of 2600 pages: 28 * 2 * 8 * 2600 * 16 * 128 = 2.39e9 elements (4.8 GB
    # bf16). The last layer's V pool of the last KV head lies past element 2^31: int32 offsets would
    # wrap around and read the wrong memory.
    num_layers, num_kv_heads, num_pages, page_size, head_dim, group = 28, 8, 2600, 16, 128, 2
    shape = (num_layers, 2, num_kv_heads, num_pages, page_size, head_dim)
    assert np.prod(shape) > 2**31
    kv_pages = jnp.full(shape, jnp.nan, jnp.bfloat16)  # every slot not written below is NaN
    rng = np.random.default_rng(3)
    seq_len, layer_idx = 200, num_layers - 1
    page_ids = np.arange(num_pages - 13, num_pages, dtype=np.int32)  # the pool's last 13 pages
    k = jnp.asarray(rng.standard_normal((seq_len, num_kv_heads, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((seq_len, num_kv_heads, head_dim)), jnp.bfloat16)
    positions = np.arange(seq_len)
    slots = page_ids[positions // page_size] * page_size + positions % page_size
    kv_pages = jax.jit(write_kv, donate_argnums=0)(kv_pages, jnp.int32(layer_idx), k, v, jnp.asarray(slots))

    block_tables = page_ids[None, :]
    q = jnp.asarray(rng.standard_normal((1, num_kv_heads * group, head_dim)), jnp.bfloat16)
    seq_lens = np.array([seq_len], np.int32)
    # Oracle: the same K/V in a small plain pool (pages 1..13), built from k and v directly.
    plain = np.zeros((2, num_kv_heads, 14, page_size, head_dim), np.float32)
    padded = np.zeros((2, 13 * page_size, num_kv_heads, head_dim), np.float32)
    padded[0, :seq_len], padded[1, :seq_len] = np.asarray(k, np.float32), np.asarray(v, np.float32)
    plain[:, :, 1:] = padded.reshape(2, 13, page_size, num_kv_heads, head_dim).transpose(0, 3, 1, 2, 4)
    plain_table = np.arange(1, 14, dtype=np.int32)[None, :]
    plain = jnp.asarray(plain, jnp.bfloat16)

    decode = pallas_kernels.decode_attention_from_buffer(
        q, kv_pages, block_tables, seq_lens, layer_idx=layer_idx, scale=head_dim**-0.5, interpret=False)
    want = oracle(q, plain[0], plain[1], plain_table, seq_lens, np.array([0, 1], np.int32), scale=head_dim**-0.5)
    _compare(decode, want, BF16_TOLERANCE)
    ragged = pallas_kernels.ragged_paged_attention_from_buffer(
        q, kv_pages, block_tables, seq_lens, np.array([0, 1], np.int32), layer_idx=layer_idx,
        scale=head_dim**-0.5, interpret=False)
    _compare(ragged, want, BF16_TOLERANCE)


# --- the engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_params():
    return init_params(QWEN3_0_6B, jax.random.key(0))


def _engine(model_config, params, backend: str, **overrides):
    from tp_fixtures import SilentTokenizer as _SilentTokenizer
    from jaxpaged.engine.engine import LLMEngine
    from jaxpaged.config import EngineConfig
    from jaxpaged.device.backends import attention_fn as _attention_fn

    kwargs = dict(page_size=16, num_pages=1024, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                  dtype=model_config.dtype, attention_backend=backend, warmup=False)
    config = EngineConfig(**{**kwargs, **overrides}).resolved(
        on_gpu=True, model_max_len=model_config.max_position_embeddings)
    return LLMEngine(model_config, params, _SilentTokenizer(), config, num_pages=config.num_pages,
                     attention_fn=_attention_fn(backend))


def _prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 10000, size=int(n)).tolist() for n in rng.integers(5, 300, size=num)]


def _greedy(engine, prompts, max_tokens):
    from jaxpaged.planner.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return [tokens[i] for i in ids]


def test_engine_on_pallas_gives_the_reference_greedy_tokens():
    # float32 with full-precision matmuls everywhere (the kernels use IEEE f32 dots for f32 pages), so
    # only the attention's summation order differs between the two backends: random weights give
    # close logits, and bf16 or TF32 rounding alone could swap a greedy choice.
    config = dataclasses.replace(QWEN3_0_6B, dtype="float32")
    params = init_params(config, jax.random.key(1))
    prompts = _prompts(6)
    with jax.default_matmul_precision("highest"):
        want = _greedy(_engine(config, params, "reference"), prompts, max_tokens=12)
        got = _greedy(_engine(config, params, "pallas"), prompts, max_tokens=12)
    assert got == want


def test_donation_scratch_memory_and_no_compilation_after_warmup(qwen3_params, record_property):
    from jaxpaged.baseline.measure import CompileCounter

    engine = _engine(QWEN3_0_6B, qwen3_params, "pallas", num_pages=4096, warmup=True)
    runner = engine.runner
    pool_bytes = runner.kv_cache_bytes()
    assert pool_bytes == 28 * 2 * 8 * 4096 * 16 * 128 * 2  # 3.8 GB
    step_temp = runner.step_temp_bytes()  # the largest bucket
    print(f"compiled largest step: {step_temp / 2**20:.1f} MiB scratch, pool {pool_bytes / 2**30:.2f} GiB")
    record_property("step_temp_bytes", step_temp)  # gpu_check.sh quotes these two
    record_property("pool_bytes", pool_bytes)
    assert step_temp < pool_bytes / 20

    old = runner.kv_pages
    with CompileCounter() as compiles:
        _greedy(engine, _prompts(12, seed=5), max_tokens=40)  # prefill, mixed and decode buckets of 1..8
    assert old.is_deleted() and not runner.kv_pages.is_deleted()
    assert compiles.count == 0, f"{compiles.count} compilations after warm-up"
    assert runner.num_compiles == runner.num_step_programs
    assert engine.stats()["num_used_pages"] == 0
