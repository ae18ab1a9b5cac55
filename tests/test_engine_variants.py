"""Every engine variant, end to end, in the default suite, on a tiny random model.

Each variant serves the same greedy requests (lengths around the page size, chunked prefill) and
must give the tokens of the plain reference engine over the same KV storage: the attention backends
(chunked jnp, the Triton-backend Pallas kernels and the Mosaic GPU kernels, both interpreted here),
synchronous stepping, swap preemption and the host tier of the prefix cache, int8 and fp8 pages.
Slow tests add depth (the bundled model, HF parity); these keep every variant under the default suite.
"""

import dataclasses

import jax
import pytest

import tp_fixtures
from jaxpaged.config import EngineConfig
from jaxpaged.device.backends import attention_fn
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models.llama import init_params
from jaxpaged.ops import cpu_attention, cpu_kernels
from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.planner.request import SamplingParams


@pytest.fixture(scope="module")
def params():
    return tp_fixtures.tiny_params()


@pytest.fixture(scope="module")
def prompts():
    return tp_fixtures.prompts()


def _run(params, prompts, *, backend="reference", max_tokens=6, **overrides):
    engine = tp_fixtures.make_engine(params, attention_fn=attention_fn(backend), **overrides)
    tokens = tp_fixtures.run_greedy(engine, prompts, max_tokens=max_tokens)
    stats = engine.stats()
    assert stats["num_used_pages"] == 0 and stats["num_requests"] == 0, stats  # nothing leaks
    return tokens, stats


@pytest.fixture(scope="module")
def reference(params, prompts):
    return _run(params, prompts)[0]


@pytest.mark.parametrize("backend", ["chunked", "chunked-xla", "pallas"])
def test_attention_backends_equal_the_reference(params, prompts, reference, backend, monkeypatch):
    # "chunked" is the CPU default: its C++ kernels (decode and ragged) where they build; "chunked-xla"
    # the same backend with them switched off, XLA's own ops for every step.
    if backend == "chunked-xla":
        monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    engine = tp_fixtures.make_engine(params, attention_fn=attention_fn(backend.removesuffix("-xla")))
    runner = engine.runner
    targets = {f"jaxpaged_{name}" for name in (cpu_attention.NAME, cpu_attention.RAGGED)}
    if backend == "chunked" and cpu_attention.enabled_kernels() == {cpu_attention.NAME, cpu_attention.RAGGED}:
        for bucket, decode_only, kernel in ((runner.buckets[-1], False, "jaxpaged_ragged_attention"),
                                            (runner.decode_buckets[-1], True, "jaxpaged_paged_attention")):
            hlo = runner.trace_step(runner.dummy_step_input(bucket, decode_only=decode_only)).lower().as_text()
            assert [t for t in sorted(targets) if t in hlo] == [kernel], (bucket, decode_only)
    elif backend == "chunked-xla":
        hlo = runner.trace_step(runner.dummy_step_input(runner.buckets[-1])).lower().as_text()
        assert not any(t in hlo for t in targets)
    assert tp_fixtures.run_greedy(engine, prompts, max_tokens=6) == reference
    assert engine.stats()["num_used_pages"] == 0


def test_per_layer_weights_equal_the_reference(params, prompts, reference):
    # The GPU default (jaxpaged/device/layer_params.py), here on the CPU with the Pallas kernels:
    # one weight buffer per layer, the layers unrolled.
    engine = tp_fixtures.make_engine(params, attention_fn=attention_fn("pallas"), per_layer_weights=True)
    assert isinstance(engine.runner.served_params["params"]["layers"], tuple)
    assert tp_fixtures.run_greedy(engine, prompts, max_tokens=6) == reference
    assert engine.stats()["num_used_pages"] == 0


def test_mosaic_backend_equals_the_reference_in_bfloat16(prompts):
    # The wgmma tiles need head_dim 64/128/256: one layer, 2 query heads of 64 per KV head. GPU
    # interpret mode runs every warpgroup on the host (minutes for the whole variant matrix), so this
    # test serves one prompt that crosses a page, prefill then decode, without warm-up.
    config = dataclasses.replace(tp_fixtures.TINY, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
                                 dtype="bfloat16")
    params = init_params(config, jax.random.key(1))
    engine_config = EngineConfig(**tp_fixtures.ENGINE, dtype="bfloat16", warmup=False).resolved(
        on_gpu=False, model_max_len=256)
    tokens = {}
    for backend in ("reference", "mosaic"):
        engine = LLMEngine(config, params, tp_fixtures.SilentTokenizer(), engine_config,
                           num_pages=engine_config.num_pages, attention_fn=attention_fn(backend))
        tokens[backend] = tp_fixtures.run_greedy(engine, [prompts[3]], max_tokens=2)
        assert engine.stats()["num_used_pages"] == 0
    assert tokens["mosaic"] == tokens["reference"]


def test_synchronous_stepping_equals_async(params, prompts, reference):
    assert _run(params, prompts, async_scheduling=False)[0] == reference


def test_swap_preemption_recomputes_nothing(params, prompts, reference):
    # 6 usable pages of 8 slots for requests growing to 7..46 tokens: running ones must make room.
    tokens, stats = _run(params, prompts, num_pages=7, preemption_mode="swap", swap_space_bytes=1 << 24)
    assert tokens == reference
    assert stats["num_swaps_out"] > 0 and stats["num_recomputed_tokens"] == 0


def test_recompute_preemption(params, prompts, reference):
    tokens, stats = _run(params, prompts, num_pages=7)
    assert tokens == reference and stats["num_preemptions"] > 0


def test_host_tier_serves_evicted_prefixes(params, prompts):
    long_prompt = prompts[-1]  # 40 tokens: 4 full pages
    engine = tp_fixtures.make_engine(params, attention_fn=reference_paged_attention, num_pages=7,
                                     host_cache_bytes=1 << 24)
    first = tp_fixtures.run_greedy(engine, [long_prompt])
    tp_fixtures.run_greedy(engine, [prompts[-2]])  # 23 tokens: evicts the first prompt's pages to the host
    again = tp_fixtures.run_greedy(engine, [long_prompt])
    assert again == first and engine.stats()["prefix_hit_tokens_host"] > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("backend", ["chunked", "pallas"])
def test_quantized_pages_equal_the_quantized_reference(params, prompts, backend, kv_cache_dtype):
    want = _run(params, prompts, kv_cache_dtype=kv_cache_dtype)[0]
    assert _run(params, prompts, backend=backend, kv_cache_dtype=kv_cache_dtype)[0] == want


@pytest.mark.parametrize("backend,kv_cache_dtype", [("reference", "auto"), ("chunked", "auto"), ("pallas", "auto"),
                                                    ("chunked", "int8")])
def test_requests_sharing_a_prefix_hit_it_in_the_step_that_computes_it(params, prompts, backend, kv_cache_dtype):
    # Page size 8, budget 16: a 9-token prompt and two sharing its first page arrive together. The first
    # computes that page in step 1, and the others hit it in the same step (as vLLM registers blocks when
    # it schedules them): each layer writes the step's K/V before attention reads them. Oracle: the
    # reference engine without a prefix cache.
    head = prompts[4][:8]
    shared = [head + [5], head + [6, 7], head + [9, 9, 9]]
    oracle = tp_fixtures.make_engine(params, attention_fn=reference_paged_attention, kv_cache_dtype=kv_cache_dtype,
                                     enable_prefix_caching=False)
    want = tp_fixtures.run_greedy(oracle, shared, max_tokens=6)
    engine = tp_fixtures.make_engine(params, attention_fn=attention_fn(backend), kv_cache_dtype=kv_cache_dtype)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in shared]
    done = {out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished}
    assert engine.stats()["prefix_hit_tokens"] == 16  # the 2nd and 3rd prompts' first page, in step 1
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.outputs[0].token_ids) for out in engine.step() if out.finished)
    assert [done[i] for i in ids] == want
    assert engine.stats()["num_used_pages"] == 0
