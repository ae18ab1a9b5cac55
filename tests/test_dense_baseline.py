"""The dense-cache baseline of the benchmarks: correct first, so that the comparison is fair.

Its attention is checked against jaxpaged's reference over the same K/V laid out as pages; its
greedy tokens against jaxpaged's engine on the same random model and prompts (and, in a slow
test, on the bundled SmolLM2); its schedule against the static-batch design it stands for.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.baseline.dense_kv import DenseBaseline, batch_size_for_budget, dense_attention, pow2_buckets
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.config import EngineConfig
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import init_params
from jaxpaged.planner.request import SamplingParams
from tp_fixtures import SilentTokenizer

TINY = ModelConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, max_position_embeddings=256,
)
MAX_MODEL_LEN = 64
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def tiny_params():
    params = init_params(TINY, jax.random.key(0))
    # std 0.02 weights give nearly flat logits (argmax ties hide nothing but prove little): sharpen.
    return jax.tree.map(lambda x: np.asarray(x) * 5, params)


@pytest.fixture(scope="module")
def dense(tiny_params):
    baseline = DenseBaseline(TINY, tiny_params, max_model_len=MAX_MODEL_LEN, batch_size=3, page_size=PAGE_SIZE,
                             max_prefill_tokens=64)
    baseline.warmup()
    return baseline


def _requests(seed=0, num=7):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, TINY.vocab_size, int(rng.integers(1, 34))).tolist() for _ in range(num)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 30)), ignore_eos=True) for _ in prompts]
    return prompts, params


# ------------------------------------------------------------------- attention


def _pages_of(rows_kv, pages_per_row, page_size):
    """[K, B, max_len, H] contiguous rows -> [K, B * pages_per_row, page_size, H] pages."""
    k, b, _, h = rows_kv.shape
    return rows_kv.reshape(k, b * pages_per_row, page_size, h)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_dense_attention_equals_paged_reference(kind):
    """Same queries and K/V: the dense rectangle equals the paged reference over shuffled pages."""
    num_kv_heads, group, head_dim, page_size, pages_per_row, batch = 2, 2, 16, 4, 4, 3
    max_len = page_size * pages_per_row
    rng = np.random.default_rng(1)
    rows_k = rng.normal(size=(num_kv_heads, batch, max_len, head_dim)).astype(np.float32)
    rows_v = rng.normal(size=(num_kv_heads, batch, max_len, head_dim)).astype(np.float32)
    if kind == "prefill":  # rows 2 and 0, queries at positions 0..7 (a rectangle of 8); a padding row
        rows, q_len, seq_lens = [2, 0, 0], 8, np.array([8, 8, 0], np.int32)
    else:  # every row, one query each, contexts 1, 16 and 9
        rows, q_len, seq_lens = [0, 1, 2], 1, np.array([1, 16, 9], np.int32)
    num_rows = len(rows)
    q = rng.normal(size=(num_rows * q_len, num_kv_heads * group, head_dim)).astype(np.float32)

    args = (q, _pages_of(rows_k, pages_per_row, page_size), _pages_of(rows_v, pages_per_row, page_size),
            np.array([[r * pages_per_row] for r in rows], np.int32), seq_lens,
            np.arange(num_rows + 1, dtype=np.int32) * q_len)
    got = dense_attention(  # annotated: jax arrays (jaxtyping checks jaxpaged's annotations under test)
        *map(jnp.asarray, args), scale=0.25, pages_per_row=pages_per_row,
        kv_len=max_len if kind == "decode" else q_len, gather_rows=kind == "prefill",
    )

    # The oracle: the same K/V scattered over a shuffled paged pool (page 0 is padding), ragged
    # queries with the padding row's tokens left out.
    perm = rng.permutation(np.arange(1, 1 + batch * pages_per_row))
    k_pool = np.full((num_kv_heads, 1 + batch * pages_per_row, page_size, head_dim), np.nan, np.float32)
    v_pool = k_pool.copy()
    tables = perm.reshape(batch, pages_per_row)
    for b in range(batch):
        k_pool[:, tables[b]] = rows_k[:, b].reshape(num_kv_heads, pages_per_row, page_size, head_dim)
        v_pool[:, tables[b]] = rows_v[:, b].reshape(num_kv_heads, pages_per_row, page_size, head_dim)
    real = seq_lens > 0
    q_lens = np.where(real, q_len, 0)
    oracle_args = (q[: q_lens.sum()], k_pool, v_pool, tables[rows][real], seq_lens[real],
                   np.concatenate([[0], np.cumsum(q_lens[real])]).astype(np.int32))
    want = reference_paged_attention(*map(jnp.asarray, oracle_args), scale=0.25)  # annotated: jax arrays
    np.testing.assert_allclose(np.asarray(got[: q_lens.sum()]), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[q_lens.sum():]), 0.0)  # padding row: zeros, not NaN


def test_buckets_and_budget():
    assert pow2_buckets(16, 100) == (16, 32, 64, 100)
    assert pow2_buckets(16, 64) == (16, 32, 64)
    assert batch_size_for_budget(4096 * 3 + 4095, 4096) == 3
    with pytest.raises(ValueError, match="raise the budget"):
        batch_size_for_budget(100, 4096)


# ------------------------------------------------------------------- end to end


def _engine_greedy(params, prompts, sampling, num_pages):
    config = EngineConfig(page_size=PAGE_SIZE, num_pages=num_pages, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=MAX_MODEL_LEN).resolved(on_gpu=False, model_max_len=256)
    engine = LLMEngine(TINY, params, SilentTokenizer(), config, num_pages=num_pages,
                       attention_fn=reference_paged_attention)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, sampling)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def test_greedy_tokens_equal_jaxpaged_engine(tiny_params, dense):
    prompts, sampling = _requests()
    want = _engine_greedy(tiny_params, prompts, sampling, num_pages=40)
    steps = []
    got = dense.generate(prompts, sampling, on_step=steps.append)
    for i, (g, w, s) in enumerate(zip(got, want, sampling)):
        assert len(g.token_ids) == s.max_tokens, f"request {i}: {len(g.token_ids)} tokens, asked {s.max_tokens}"
        assert g.token_ids == w, f"request {i}: dense {g.token_ids} != jaxpaged {w}"
        assert g.finish_reason == "length" and g.first_token_time <= g.finish_time
    # Warm-up compiled every bucket: serving compiled nothing.
    compiles = dense.num_compiles
    dense.generate(prompts, sampling)
    assert dense.num_compiles == compiles


def test_static_batches_wait_for_the_slowest(tiny_params, dense):
    """7 requests, batch 3: batches {0,1,2}, {3,4,5}, {6}; each decodes until its longest is done."""
    prompts = [[1, 2, 3]] * 7
    max_tokens = [2, 9, 4, 5, 5, 1, 3]
    sampling = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    steps = []
    dense.generate(prompts, sampling, on_step=steps.append)
    kinds = "".join("p" if s.kind == "prefill" else "d" for s in steps)
    # One prefill call per batch (equal prompt lengths), then max(max_tokens) - 1 decode steps.
    assert kinds == "p" + "d" * 8 + "p" + "d" * 4 + "p" + "d" * 2
    decodes = [s for s in steps if s.kind == "decode"]
    # Every decode step computes all 3 rows, whoever is still running (the design's idle compute).
    assert {s.num_padded_tokens for s in decodes} == {3}
    # Batch 1 after its first decode: request 0 (2 tokens) has finished, 1 and 2 still run.
    assert decodes[0].num_tokens == 3 and decodes[0].num_running == 2
    assert max(s.num_running for s in steps) <= 3
    assert {s.num_reserved_tokens for s in steps} == {3 * MAX_MODEL_LEN}


def test_eos_stops_and_min_tokens_holds(tiny_params, dense):
    prompt = [5, 6, 7]
    free = dense.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    eos = free[2]
    first = free.index(eos)
    stopping = DenseBaseline(TINY, tiny_params, max_model_len=MAX_MODEL_LEN, batch_size=1, page_size=PAGE_SIZE,
                             eos_token_id=eos)
    out = stopping.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    held = stopping.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8))[0]
    # eos is masked under min_tokens (the engine's rule): the next best token is drawn instead.
    assert held.token_ids[:first] == free[:first] and eos not in held.token_ids
    assert len(held.token_ids) == 8 and held.finish_reason == "length"


def test_request_longer_than_a_row_is_rejected(dense):
    with pytest.raises(ValueError, match="raise max_model_len"):
        dense.generate([[1] * 60], SamplingParams(max_tokens=10))


@pytest.mark.slow
def test_greedy_tokens_equal_jaxpaged_on_smollm2():
    """The bundled SmolLM2-135M: the benchmark's two systems agree token for token."""
    from jaxpaged import LLM

    llm = LLM(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, quantization="dequantize")  # float params
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "def fibonacci(n):",
                 "Why is the sky blue?", "List three prime numbers."]
    prompts = [llm.tokenizer.encode(q) for q in questions]
    sampling = [SamplingParams(temperature=0.0, max_tokens=24 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]
    engine = llm.engine
    dense = DenseBaseline(engine.model_config, engine.runner.params, max_model_len=256, batch_size=2,
                          max_prefill_tokens=256)
    got = [o.token_ids for o in dense.generate(prompts, sampling)]
    assert got == want


# ------------------------------------------------------------------- the benchmark's arithmetic


def test_summary_figures_and_shared_pages_counted_once():
    import types

    from jaxpaged.baseline.measure import RequestTimes, Run, StepSample, live_tokens, summarize

    # Two sequences share page 7 (a full prefix page of 4 tokens); one has 2 more tokens in page 3,
    # the other 1 more in page 5: 4 + 2 + 1 = 7 live tokens, not 11.
    a = types.SimpleNamespace(num_computed_tokens=6, block_table=[7, 3])
    b = types.SimpleNamespace(num_computed_tokens=5, block_table=[7, 5, 9])  # page 9: allocated, empty
    assert live_tokens([a, b], page_size=4) == 7

    # Two steps: 1 s holding 8 of 16 allocated slots, then 3 s holding 12 of 16.
    steps = [
        StepSample(1.0, "prefill", 2, 10, 2, 8, 16, {"schedule": 0.1, "prepare": 0.1, "device": 0.7, "postprocess": 0.1}),
        StepSample(4.0, "decode", 6, 2, 2, 12, 16, {"schedule": 0.0, "prepare": 0.2, "device": 2.8, "postprocess": 0.0}),
    ]
    run = Run("x", "W", wall_s=4.0, num_prompt_tokens=10, steps=steps, kv_capacity_tokens=32,
              requests=[RequestTimes(4, 1.0, 4.0), RequestTimes(4, 1.0, 2.5)])
    s = summarize(run)
    assert s["output_tok_s"] == 2.0 and s["total_tok_s"] == 4.5
    assert s["kv_waste_pct"] == pytest.approx(100 * (1 - (8 + 3 * 12) / (4 * 16)), abs=0.01)
    assert s["tpot_median_s"] == pytest.approx((1.0 + 0.5) / 2)
    assert s["host_share_total"] == pytest.approx(0.5 / 4.0) and s["device_share"] == pytest.approx(3.5 / 4.0)
    assert s["by_step_kind"]["decode"]["device_share"] == pytest.approx(2.8 / 3.0, abs=1e-3)


def test_harness_under_memory_pressure_compiles_nothing_and_keeps_tokens(tiny_params, dense):
    """W3 in miniature through the benchmark's own drivers: a 6-page pool forces preemptions."""
    from jaxpaged.baseline.drivers import run_dense, run_jaxpaged, warmup_requests

    prompts, sampling = _requests(seed=3, num=5)
    requests = list(zip(prompts, sampling))
    config = EngineConfig(page_size=PAGE_SIZE, num_pages=6, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=MAX_MODEL_LEN).resolved(on_gpu=False, model_max_len=256)
    engine = LLMEngine(TINY, tiny_params, SilentTokenizer(), config, num_pages=6,
                       attention_fn=reference_paged_attention)
    run_jaxpaged(engine, warmup_requests(requests), system="warmup", workload="W3", capacity_tokens=96)
    paged, paged_tokens = run_jaxpaged(engine, requests, system="jaxpaged", workload="W3", capacity_tokens=96)
    base, base_tokens = run_dense(dense, requests, system="dense", workload="W3", capacity_tokens=3 * MAX_MODEL_LEN)

    assert paged.extra["preemptions"] > 0 and paged.extra["recomputed_tokens"] > 0
    assert paged_tokens == base_tokens
    assert paged.num_compiles == 0 and base.num_compiles == 0  # warm-up covered every bucket
    assert sum(r.num_output_tokens for r in paged.requests) == sum(s.max_tokens for s in sampling)
    assert max(s.num_allocated_tokens for s in paged.steps) <= 5 * PAGE_SIZE  # never more than the pool


def test_min_tokens_masks_stop_tokens_as_the_engine_does(tiny_params, dense):
    """Under min_tokens the engine masks the stop tokens in the logits (vLLM's and HF's rule) and
    draws its best other token; at b8feddf the dense baseline drew the stop token and ignored it, so
    the two systems generated different tokens and the comparison was not like for like."""
    prompt = [5, 6, 7]
    free = dense.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    stop = free[1]  # greedy output 2: banned while fewer than min_tokens outputs are out
    held = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, stop_token_ids=[stop], ignore_eos=True)
    want = _engine_greedy(tiny_params, [prompt], [held], num_pages=40)[0]
    got = dense.generate([prompt], held)[0].token_ids
    assert want[1] != stop and stop not in want[:6]  # the mask did act
    assert got == want
