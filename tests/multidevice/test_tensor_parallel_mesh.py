"""Tensor parallelism on 8 forced host devices (run by tests/test_tensor_parallel.py in its own process).

The story: one random-weight model with 8 query / 4 KV heads generates greedily with the whole
model on one device; the same engine split over 2, 4 and 8 devices must give the same tokens. At 8
devices each KV head is held twice (8 > 4 KV heads). Along the way: the buffer and the parameters
really are split (their shardings and the bytes on each device), the compiled step communicates
only activations, and nothing compiles after warm-up.
"""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tp_fixtures
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer, reference_paged_attention
from jaxpaged.device.runner import ModelRunner
from jaxpaged.models.llama import init_params
from jaxpaged.planner.request import SamplingParams
from jaxpaged.device.sharding import kv_head_replicas, logical_to_spec, make_mesh, per_device_bytes
from tp_fixtures import NUM_PAGES, PAGE_SIZE, TINY, make_engine, run_greedy, tiny_params


def test_eight_devices_are_visible():
    assert jax.device_count() == 8, "run this module through tests/test_tensor_parallel.py (it sets XLA_FLAGS)"


@pytest.fixture(scope="module")
def params():
    return tiny_params()


@pytest.fixture(scope="module")
def prompts():
    return tp_fixtures.prompts()


class CompileCounter:
    """Counts every trace, lowering and backend compilation JAX reports, from `start()` on."""

    def __init__(self):
        self.events, self.active = [], False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if self.active and event.startswith("/jax/core/compile/"):
            self.events.append(event)

    def start(self):
        self.events, self.active = [], True


_COUNTER = CompileCounter()


def generate(params, prompts, *, tp, attention_fn=chunked_paged_attention_from_buffer):
    """Greedy tokens of every prompt; returns (tokens, engine, compile events after warm-up)."""
    _COUNTER.start()
    engine = make_engine(params, mesh=make_mesh(tp) if tp > 1 else None, attention_fn=attention_fn)
    assert _COUNTER.events, "warm-up compiled nothing that the counter saw: the counter is blind"
    _COUNTER.start()
    tokens = run_greedy(engine, prompts)
    _COUNTER.active = False
    return tokens, engine, list(_COUNTER.events)


@pytest.fixture(scope="module")
def one_device(params, prompts):
    tokens, engine, _ = generate(params, prompts, tp=1)
    return tokens, np.asarray(engine.runner.kv_pages)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_greedy_tokens_equal_one_device(params, prompts, one_device, tp):
    want_tokens, want_kv = one_device
    assert len({tuple(t) for t in want_tokens}) == len(want_tokens)  # the prompts really differ
    tokens, engine, compiles = generate(params, prompts, tp=tp)
    assert tokens == want_tokens
    assert compiles == [], f"compiled after warm-up: {compiles}"
    assert engine.runner.num_compiles == engine.runner.num_step_programs  # each bucket once, at warm-up

    # The KV buffer is split on its KV-head axis; each device holds 4/tp heads, or one copy of one
    # head at tp=8 (8 > 4 KV heads: every head held twice).
    runner = engine.runner
    kv = runner.kv_pages
    assert kv.sharding.spec == P(None, None, "tp", None, None, None)
    replicas = kv_head_replicas(TINY, tp)
    assert replicas == (2 if tp == 8 else 1)
    assert kv.shape[2] == TINY.num_kv_heads * replicas
    one_head = TINY.num_layers * 2 * NUM_PAGES * PAGE_SIZE * TINY.head_dim * 4
    assert per_device_bytes(kv) == {d.id: one_head * kv.shape[2] // tp for d in jax.devices()[:tp]}
    # The pages hold what one device's pages hold (copy j of head k sits at k * replicas + j).
    np.testing.assert_allclose(np.asarray(kv), np.repeat(want_kv, replicas, axis=2), rtol=1e-5, atol=1e-5)

    # Parameters: heads, MLP columns/rows and vocabulary split; norms replicated.
    p = runner.params["params"]
    expected = {
        ("layers", "attn", "q_proj"): P(None, None, "tp", None),
        ("layers", "attn", "k_proj"): P(None, None, "tp", None),
        ("layers", "attn", "k_bias"): P(None, "tp", None),
        ("layers", "attn", "o_proj"): P(None, "tp", None, None),
        ("layers", "mlp", "gate_proj"): P(None, None, "tp"),
        ("layers", "mlp", "down_proj"): P(None, "tp", None),
        ("embedding",): P("tp", None),
        ("lm_head",): P(None, "tp"),
        ("final_norm", "scale"): P(None),
    }
    for path, spec in expected.items():
        leaf = p
        for key in path:
            leaf = leaf[key]
        assert leaf.sharding.spec == spec, path
        split = spec != P(None)
        assert set(per_device_bytes(leaf).values()) == {leaf.nbytes // tp if split else leaf.nbytes}, path

    # No device holds the whole model: each holds 1/tp of every split leaf plus the small replicated ones.
    leaves = jax.tree.leaves(runner.params)
    held = {d.id: 0 for d in jax.devices()[:tp]}
    for leaf in leaves:
        for device_id, num_bytes in per_device_bytes(leaf).items():
            held[device_id] += num_bytes
    replicated = sum(leaf.nbytes for leaf in leaves if leaf.sharding.is_fully_replicated)
    split = sum(leaf.nbytes for leaf in leaves if not leaf.sharding.is_fully_replicated)
    assert set(held.values()) == {split // tp + replicated}
    whole_model = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(params))
    assert split // tp + replicated < whole_model / (tp / 2 if tp > 2 else 1.5)


def test_reference_backend_per_layer_path_tp4(params, prompts, one_device):
    """The reference backend takes per-layer pools (the DESIGN.md contract), wrapped the same way."""
    tokens, _, compiles = generate(params, prompts, tp=4, attention_fn=reference_paged_attention)
    assert tokens == one_device[0]
    assert compiles == []


def test_per_layer_weights_split_each_layer_and_equal_one_device(params, prompts, one_device):
    """per_layer_weights (a GPU's default, under a mesh too): each layer's own buffers, split as the
    stacked leaf was (no device holds a whole layer weight), the same greedy tokens as one device, and
    the canonical tree rebuilt from them keeps the stacked split."""
    engine = make_engine(params, mesh=make_mesh(2), per_layer_weights=True)
    runner = engine.runner
    layers = runner.served_params["params"]["layers"]
    assert runner.per_layer_weights and isinstance(layers, tuple) and len(layers) == TINY.num_layers
    for layer in layers:
        for (module, name), spec in ((("attn", "q_proj"), P(None, "tp", None)), (("attn", "o_proj"), P("tp", None, None)),
                                     (("mlp", "gate_proj"), P(None, "tp")), (("mlp", "down_proj"), P("tp", None))):
            leaf = layer[module][name]
            assert leaf.sharding.spec == spec, (name, leaf.sharding.spec)
            assert set(per_device_bytes(leaf).values()) == {leaf.nbytes // 2}, name
    assert runner.params["params"]["layers"]["mlp"]["gate_proj"].sharding.spec == P(None, None, "tp")
    assert run_greedy(engine, prompts) == one_device[0]


def test_compiled_step_communicates_only_activations(params):
    """Per layer two all-reduces of [num_tokens, hidden] (after o_proj and down_proj), then the
    embedding's all-reduce and the logits' all-gather: no collective moves a weight or the KV buffer."""
    runner = ModelRunner(TINY, params, num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=4,
                         max_num_batched_tokens=16, max_model_len=64,
                         attention_fn=chunked_paged_attention_from_buffer, mesh=make_mesh(4))
    hlo = runner.trace_step(runner.dummy_step_input(16)).lower().compile().as_text()
    collectives = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|all-to-all|reduce-scatter|"
                             r"collective-permute)\(", hlo)
    assert collectives, "no collective at all: the step is not split"
    shapes = sorted({(kind, tuple(int(d) for d in dims.split(","))) for _, dims, kind in collectives})
    activations = {("all-reduce", (16, TINY.hidden_size)), ("all-gather", (4, TINY.vocab_size))}
    assert set(shapes) <= activations, shapes


def test_pallas_kernel_runs_per_shard_in_interpret_mode(params, prompts, one_device):
    """The Pallas ragged kernel (interpret mode on the CPU) under shard_map on 2 devices."""
    import pallas_kernels

    tokens, _, _ = generate(params, prompts[:3], tp=2, attention_fn=pallas_kernels.paged_attention)
    assert tokens == one_device[0][:3]


def test_undividable_dimension_stays_replicated():
    mesh = make_mesh(8)
    assert logical_to_spec(("vocab", "embed"), (49153, 64), mesh) == P(None, None)
    assert logical_to_spec(("vocab", "embed"), (49152, 64), mesh) == P("tp", None)


@pytest.mark.slow
def test_smollm2_tp3_greedy_equals_one_device():
    """The bundled SmolLM2-135M (9 query / 3 KV heads) split over its 3 KV heads, then 2 replicas of that."""
    from jaxpaged import LLM

    small = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "def fibonacci(n):"]
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in LLM(quantization="dequantize", **small).generate(questions, sampling)]
    llm = LLM(tensor_parallel_size=3, **small)  # quantization None on a .gguf: float weights under TP (a warning)
    _COUNTER.start()
    got = [o.outputs[0].token_ids for o in llm.generate(questions, sampling)]
    _COUNTER.active = False
    assert got == want
    assert _COUNTER.events == []
    kv = llm.engine.runner.kv_pages
    assert kv.sharding.spec == P(None, None, "tp", None, None, None) and kv.shape[2] == 3
    assert len(set(per_device_bytes(kv).values())) == 1 and sum(per_device_bytes(kv).values()) == kv.nbytes
    q_proj = llm.params["params"]["layers"]["attn"]["q_proj"]
    assert set(per_device_bytes(q_proj).values()) == {q_proj.nbytes // 3}
    # The same through LLM's data-parallel path: two replicas of the tp=3 engine on devices 0-2 and 3-5.
    replicated = LLM(tensor_parallel_size=3, data_parallel_size=2, **small)
    assert [o.outputs[0].token_ids for o in replicated.generate(questions, sampling)] == want
    assert replicated.stats()["num_used_pages"] == 0


# ---------------------------------------------------------------- data parallelism


def _w1_requests(num_seqs=16, min_len=16, max_len=64):
    """benchmarks/README.md's W1 on the CPU preset, with prompt ids in the tiny vocabulary."""
    import random

    random.seed(0)
    prompts = [[random.randint(0, TINY.vocab_size - 1) for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, max_tokens=random.randint(min_len, max_len), ignore_eos=True, seed=i)
              for i in range(num_seqs)]
    return prompts, params


def _serve(engine, prompts, params):
    ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


@pytest.mark.parametrize(
    "tp, w1_size",
    [(1, (8, 8, 24)),  # W1's shape, smaller: 8 sequences of 8-24 tokens
     pytest.param(1, (16, 16, 64), marks=pytest.mark.slow),  # W1's CPU preset exactly
     pytest.param(2, (16, 16, 64), marks=pytest.mark.slow)],  # two replicas of a tp=2 engine
)
def test_data_parallel_w1_equals_one_replica(params, tp, w1_size):
    """Two replicas serve a W1 batch (temperature 0.6, seeded per request) with one replica's outputs."""
    from jaxpaged.engine.build import engine_from_parts as build_engine
    from jaxpaged.engine.data_parallel import DataParallelEngine
    from jaxpaged.config import EngineConfig

    prompts, sampling = _w1_requests(*w1_size)
    engine_args = dict(page_size=8, num_pages=160, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=160,
                       warmup=False)  # compile only the buckets this batch uses

    def build(dp):
        config = EngineConfig(**engine_args, data_parallel_size=dp, tensor_parallel_size=tp).resolved(
            on_gpu=False, model_max_len=TINY.max_position_embeddings)
        return build_engine(TINY, params, tp_fixtures.SilentTokenizer(), config, num_pages=160,
                            attention_fn=chunked_paged_attention_from_buffer)

    want = _serve(build(1), prompts, sampling)
    engine = build(2)
    assert isinstance(engine, DataParallelEngine)
    replica_devices = [set(e.runner.kv_pages.sharding.device_set) for e in engine.engines]
    assert replica_devices[0].isdisjoint(replica_devices[1]) and all(len(d) == tp for d in replica_devices)
    got = _serve(engine, prompts, sampling)
    assert got == want
    per_replica = [s["num_generated_tokens"] for s in engine.stats()["replicas"]]
    assert all(n > 0 for n in per_replica) and sum(per_replica) == sum(len(t) for t in want)
    assert engine.stats()["num_used_pages"] == 0  # nothing leaked on either replica


def test_update_params_places_new_weights_split_without_recompiling(params, fake_step):
    """Weights swapped into a tp=2 runner land split like the first ones, reuse the compiled step, and
    give the logits a one-device runner gives with the new weights."""
    make_seq, make_scheduler_output = fake_step
    new_params = jax.tree.map(np.asarray, init_params(TINY, jax.random.key(1)))

    def runner(mesh, weights):
        return ModelRunner(TINY, weights, num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=4,
                           max_num_batched_tokens=16, max_model_len=64,
                           attention_fn=chunked_paged_attention_from_buffer, mesh=mesh)

    def prefill_logits(r):  # one sequence of 11 tokens on pages 3 and 5
        out = make_scheduler_output([make_seq(list(range(10, 21)), 0, [3, 5])], [11])
        return np.asarray(r.run(out))[0]

    split = runner(make_mesh(2), params)
    before = prefill_logits(split)
    split.update_params(new_params)
    assert split.params["params"]["layers"]["mlp"]["down_proj"].sharding.spec == P(None, "tp", None)
    after = prefill_logits(split)
    assert split.num_compiles == 1
    np.testing.assert_allclose(after, prefill_logits(runner(None, new_params)), rtol=1e-5, atol=1e-5)
    assert not np.allclose(before, after)  # the weights really changed


@pytest.mark.slow  # ~2 min each on a shared 2-core CPU: kept out of the default mesh suite's 400 s
@pytest.mark.parametrize("kv_cache_dtype,tp,attention_fn", [
    ("int8", 2, chunked_paged_attention_from_buffer), ("float8_e4m3fn", 4, reference_paged_attention)])
def test_quantized_kv_cache_is_split_like_its_pages(params, prompts, kv_cache_dtype, tp, attention_fn):
    """A quantized cache (jaxpaged/ops/kv_quant.py): values and scales both split on KV heads, whole-buffer
    and per-layer backends, and the same greedy tokens and cache contents as one device."""
    want = make_engine(params, kv_cache_dtype=kv_cache_dtype, attention_fn=attention_fn)
    want_tokens = run_greedy(want, prompts)
    engine = make_engine(params, mesh=make_mesh(tp), kv_cache_dtype=kv_cache_dtype, attention_fn=attention_fn)
    assert run_greedy(engine, prompts) == want_tokens
    kv = engine.runner.kv_pages
    assert kv.pages.sharding.spec == P(None, None, "tp", None, None, None)
    assert kv.scales.sharding.spec == P(None, None, "tp", None, None)
    if kv_cache_dtype == "int8":  # its centres (device/kv_centres.py): split on KV heads, equal to one device's
        assert engine.runner.kv_centres.sharding.spec == P(None, None, "tp", None)
        np.testing.assert_allclose(np.asarray(engine.runner.kv_centres), np.asarray(want.runner.kv_centres), atol=1e-5)
    one = want.runner.kv_pages
    np.testing.assert_allclose(np.asarray(kv.scales), np.asarray(one.scales), rtol=1e-5, atol=1e-7)
    # Values: equal up to a rare rounding-boundary flip (the sharded K/V projection may differ in the last bit).
    assert np.mean(np.asarray(kv.pages) != np.asarray(one.pages)) < 1e-3


def test_logprobs_prompt_logprobs_and_penalties_split_equal_one_device(params, prompts):
    """The extended sampler's token state is replicated like the logits: tp=2 gives one device's
    tokens, logprobs and prompt logprobs, and an n = 2 fan-out its samples, and compiles nothing after
    warm-up."""
    from test_async_engine import run

    requests = [
        (prompts[4], SamplingParams(temperature=0.0, max_tokens=5, logprobs=4, prompt_logprobs=2, ignore_eos=True)),
        # n = 1: a fan-out whose rows outgrow a decode bucket's logits rows compiles that (logits
        # rows, rows) pair of the sampler (plain or extended) on first use; warm-up covers equal counts.
        (prompts[5], SamplingParams(temperature=0.9, seed=3, max_tokens=5, repetition_penalty=1.4,
                                    logit_bias={7: 3.0}, presence_penalty=0.5, logprobs=0, ignore_eos=True)),
        # n = 2 without the extended sampler: its prefill step has 1 logits row and 2 sample rows, so
        # the step pads its logits (sampling.pad_logit_rows), which warm-up must have compiled split too.
        (prompts[2], SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=4, ignore_eos=True)),
    ]
    results = []
    for tp in (1, 2):
        engine = make_engine(params, mesh=make_mesh(tp) if tp > 1 else None)
        _COUNTER.start()
        results.append(run(engine, requests)[1])
        _COUNTER.active = False
        assert _COUNTER.events == [], f"tp={tp}: compiled after warm-up: {_COUNTER.events}"
    for want, got in zip(*results):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        for wc, gc in zip(want.outputs, got.outputs):
            np.testing.assert_allclose([lp.logprob for e in gc.logprobs or [] for lp in e.values()],
                                       [lp.logprob for e in wc.logprobs or [] for lp in e.values()], atol=1e-5)
    np.testing.assert_allclose([e[t].logprob for e, t in zip(results[1][0].prompt_logprobs[1:], prompts[4][1:])],
                               [e[t].logprob for e, t in zip(results[0][0].prompt_logprobs[1:], prompts[4][1:])],
                               atol=1e-5)
