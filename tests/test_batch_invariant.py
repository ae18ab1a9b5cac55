"""EngineConfig.batch_invariant: one request's tokens and logprobs bit for bit the same whatever else the
engine does, and equal to jaxpaged.rl.token_logprobs (the trainer's forward) bit for bit.

Tiny random models (tests/tp_fixtures.py), untied and tied heads, on the CPU kernels. The oracle of
every variation is the same request run alone; each variation changes one thing the request's
arithmetic must not see: the batch (and so the decode buckets and mixed steps), prefill chunking,
synchronous scheduling, prefix-cache hits, recompute and swap preemption, another replica's buckets.
Prompts of 40 tokens put whole prefills in a 64-token bucket, past the 4096-element size where
XLA:CPU's row reductions change order (ops/ordered_sum.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.config import EngineConfig
from jaxpaged.device.backends import attention_fn
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models.llama import init_params
from jaxpaged.planner.request import SamplingParams
from jaxpaged.rl import token_logprobs
from tests.tp_fixtures import TINY, SilentTokenizer

MODELS = {"untied": TINY, "tied": dataclasses.replace(TINY, tie_word_embeddings=True, attention_bias=False)}
ENGINE = dict(page_size=8, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96, warmup=False,
              batch_invariant=True, logprobs_mode="processed_logprobs")
TEMPERATURE = 0.8


def make_engine(model_config, params, **overrides):
    config = EngineConfig(**{**ENGINE, **overrides}).resolved(on_gpu=False, model_max_len=model_config.max_position_embeddings)
    return LLMEngine(model_config, params, SilentTokenizer(), config, num_pages=config.num_pages,
                     attention_fn=attention_fn("chunked", batch_invariant=True))


def sampling(seed, max_tokens=12, **kwargs):
    return SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, seed=seed, logprobs=0, ignore_eos=True, **kwargs)


def run(engine, requests):
    """requests: [(prompt, SamplingParams)] -> each request's final outputs (all its samples)."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs
    return [done[i] for i in ids]


def tokens_and_logprobs(sample):
    chosen = [entry[token].logprob for entry, token in zip(sample.logprobs, sample.token_ids)]
    return list(sample.token_ids), np.asarray(chosen, np.float32)


def prompts(seed=0):
    rng = np.random.default_rng(seed)
    target = rng.integers(0, TINY.vocab_size, 40).tolist()
    others = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (5, 23, 17, 31, 9)]
    return target, others


def setup(name):
    config = MODELS[name]
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(1)))
    target, others = prompts()
    alone = run(make_engine(config, params), [(target, sampling(7))])[0][0]
    return config, params, target, others, tokens_and_logprobs(alone)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    """Both heads: the tests of the step's shape and of the trainer's forward."""
    return setup(request.param)


@pytest.fixture(scope="module")
def tied():
    """The tied head only: the tests of the scheduler's variations (the same arithmetic as above)."""
    return setup("tied")


def assert_same(sample, alone):
    tokens, logprobs = tokens_and_logprobs(sample)
    assert tokens == alone[0]
    np.testing.assert_array_equal(logprobs, alone[1])  # bit for bit, not close


def test_other_requests_and_decode_buckets(model):
    config, params, target, others, alone = model
    requests = [(p, sampling(100 + i, max_tokens=3 + 4 * i)) for i, p in enumerate(others[:3])]
    outputs = run(make_engine(config, params), requests[:1] + [(target, sampling(7))] + requests[1:])
    assert_same(outputs[1][0], alone)


def test_prefill_chunking_and_synchronous_steps(model):
    config, params, target, others, alone = model
    chunked = make_engine(config, params, max_num_batched_tokens=8)  # the 40-token prompt in 5 chunks
    assert_same(run(chunked, [(others[0], sampling(1)), (target, sampling(7))])[1][0], alone)
    assert_same(run(make_engine(config, params, async_scheduling=False), [(target, sampling(7))])[0][0], alone)


def test_prefix_cache_hits(tied):
    config, params, target, others, alone = tied
    engine = make_engine(config, params)
    run(engine, [(target[:32] + others[0], sampling(3))])  # registers the target's first 4 pages
    assert engine.stats()["prefix_hit_tokens"] == 0
    assert_same(run(engine, [(target, sampling(7))])[0][0], alone)
    assert engine.stats()["prefix_hit_tokens"] == 32


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(tied, mode):
    config, params, target, others, alone = tied
    extra = dict(swap_space_bytes=1 << 20) if mode == "swap" else {}
    # 15 usable pages of 8 tokens for requests of up to 52 tokens (7 pages): they cannot all run at once.
    engine = make_engine(config, params, num_pages=16, preemption_mode=mode, **extra)
    requests = [(p, sampling(50 + i, max_tokens=20)) for i, p in enumerate(others[1:4])]
    outputs = run(engine, requests[:2] + [(target, sampling(7))] + requests[2:])
    assert engine.stats()["num_preemptions"] > 0
    assert_same(outputs[2][0], alone)


def test_another_replica_with_other_buckets(tied):
    config, params, target, others, alone = tied
    replica = make_engine(config, params, max_num_seqs=2, max_num_batched_tokens=32)
    assert_same(run(replica, [(others[4], sampling(2)), (target, sampling(7))])[1][0], alone)


def test_token_logprobs_equals_the_engine_bit_for_bit(model):
    """The trainer's forward over the rollouts gives the engine's logprobs: ratios of exactly 1."""
    config, params, target, others, _ = model
    requests = [(target, sampling(7, n=2))] + [(p, sampling(20 + i)) for i, p in enumerate(others[:3])]
    outputs = run(make_engine(config, params), requests)
    rows, starts, lengths, want = [], [], [], []
    width = max(len(p) for p, _ in requests) + 12
    for (prompt, _), samples in zip(requests, outputs):
        for sample in samples:
            tokens, logprobs = tokens_and_logprobs(sample)
            rows.append(prompt + tokens + [0] * (width - len(prompt) - len(tokens)))
            starts.append(len(prompt)), lengths.append(len(prompt) + len(tokens)), want.append(logprobs)
    policy = jax.jit(lambda p, s, b, e: token_logprobs(p, config, s, b, lengths=e, temperature=TEMPERATURE,
                                                       page_size=ENGINE["page_size"]))
    got = np.asarray(policy(params, np.asarray(rows), np.asarray(starts), np.asarray(lengths)))
    assert len(rows) == 5
    for b in range(len(rows)):
        np.testing.assert_array_equal(got[b, starts[b]:lengths[b]], want[b])
        assert np.all(got[b, :starts[b]] == 0) and np.all(got[b, lengths[b]:] == 0)
    ratios = np.exp(np.concatenate([got[b, starts[b]:lengths[b]] - want[b] for b in range(len(rows))]))
    assert np.all(ratios == 1.0)


def test_token_logprobs_gradient(model):
    """Finite, and the derivative along a random direction matches central differences."""
    config, params, target, others, _ = model
    rows = np.asarray([target[:24], others[3][:24]], np.int32)
    starts = np.asarray([10, 6], np.int32)
    params = jax.tree.map(jnp.asarray, params)
    loss = jax.jit(lambda p: jnp.sum(token_logprobs(p, config, rows, starts, temperature=TEMPERATURE, page_size=8)))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(token_logprobs(p, config, rows, starts, temperature=TEMPERATURE,
                                                                page_size=8))))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    rng = np.random.default_rng(0)
    direction = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
    norm = np.sqrt(sum(float(jnp.sum(d * d)) for d in jax.tree.leaves(direction)))
    direction = jax.tree.map(lambda d: d / norm, direction)
    eps = 1e-2
    moved = lambda s: jax.tree.map(lambda x, d: x + s * eps * d, params, direction)
    numeric = (float(loss(moved(1))) - float(loss(moved(-1)))) / (2 * eps)
    analytic = sum(float(jnp.sum(g * d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    assert abs(numeric - analytic) <= 0.02 * abs(analytic) + 1e-3, (numeric, analytic)


def test_settings_that_cannot_be_invariant_are_refused(monkeypatch):
    for bad in (dict(kv_cache_dtype="int8"), dict(dtype="bfloat16"), dict(tensor_parallel_size=2),
                dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2})):
        with pytest.raises(ValueError, match="batch_invariant"):
            EngineConfig(batch_invariant=True, **bad)
    with pytest.raises(ValueError, match="attention_backend='reference'"):
        attention_fn("reference", batch_invariant=True)
    params = jax.tree.map(np.asarray, init_params(TINY, jax.random.key(1)))
    with pytest.raises(ValueError, match="one kernel in every step"):  # the default CPU backend has two paths
        config = EngineConfig(**ENGINE).resolved(on_gpu=False, model_max_len=TINY.max_position_embeddings)
        LLMEngine(TINY, params, SilentTokenizer(), config, num_pages=64, attention_fn=attention_fn("chunked"))
    # vLLM's switch: VLLM_BATCH_INVARIANT=1 turns the mode on when batch_invariant is left None.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().resolved(on_gpu=False, model_max_len=128).batch_invariant is True
    assert EngineConfig(batch_invariant=False).resolved(on_gpu=False, model_max_len=128).batch_invariant is False
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(kv_cache_dtype="int8").resolved(on_gpu=False, model_max_len=128)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert EngineConfig().resolved(on_gpu=False, model_max_len=128).batch_invariant is False


def test_gpu_is_refused_saying_what_is_not_invariant():
    from jaxpaged.device.batch_invariant import check_batch_invariant

    with pytest.raises(ValueError, match="GEMM .* by the number of rows"):
        check_batch_invariant(TINY, platform="gpu", matmul_kernels=frozenset(), one_attention_path=True,
                              kv_cache_dtype="auto", page_size=8, sharded=False)
    # The GPU's attention (the static profile compiles it: bench_h100_static --batch-invariant) is
    # the ragged kernel in every step; on the CPU it would break parity with the trainer's forward.
    gpu_attention = attention_fn("pallas", platform="cuda", batch_invariant=True)
    assert gpu_attention.one_path and not getattr(gpu_attention, "has_decode_kernel", False)
    with pytest.raises(ValueError, match="on the CPU use 'chunked'"):
        attention_fn("pallas", batch_invariant=True)


def test_the_pallas_ragged_kernel_gives_a_row_the_same_bits_in_any_batch():
    """The attention a GPU batch-invariant mode would run in every step (device/batch_invariant.py):
    one decode row of the Pallas ragged kernel (interpret mode), alone and beside other sequences'
    chunks of several lengths, is the same bits."""
    from pallas_kernels.ragged import ragged_paged_attention

    rng = np.random.default_rng(0)
    num_kv_heads, num_heads, head_dim, page_size, num_pages, width = 2, 4, 16, 4, 64, 16
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)), jnp.float32)
                        for _ in range(2))
    row = rng.standard_normal((1, num_heads, head_dim)).astype(np.float32)

    def first_row(others):  # others: (seq_len, q_len) of the sequences after the decode row (seq_len 37)
        lens = [(37, 1), *others]
        q = np.concatenate([row] + [rng.standard_normal((q_len, num_heads, head_dim)).astype(np.float32)
                                    for _, q_len in others])
        q = np.concatenate([q, np.zeros((-len(q) % 16, num_heads, head_dim), np.float32)])  # a bucket's padding
        tables = np.array([[(s * width + i) % (num_pages - 1) + 1 for i in range(width)] for s in range(len(lens))],
                          np.int32)
        starts = np.concatenate([[0], np.cumsum([q_len for _, q_len in lens])]).astype(np.int32)
        out = ragged_paged_attention(jnp.asarray(q), k_pages, v_pages, jnp.asarray(tables),
                                     jnp.asarray(np.array([s for s, _ in lens], np.int32)), jnp.asarray(starts),
                                     scale=head_dim ** -0.5, interpret=True)
        return np.asarray(out[0])

    alone = first_row([])
    np.testing.assert_array_equal(first_row([(20, 5), (50, 1), (9, 9), (61, 3)]), alone)
    np.testing.assert_array_equal(first_row([(64, 1)] * 7), alone)
