"""Expert parallelism on forced host devices (run by tests/test_tensor_parallel.py in its own process):
the all-to-all MoE layer over 4 and 8 devices equals one device's (token counts below, at and above
the device count); a tiny MoE model (8 experts, top-2) generates greedily on one device and with its
experts split over 8 devices; the tokens must be equal and each device must hold only its experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import tp_fixtures
from jaxpaged.config import EngineConfig
from jaxpaged.device.sharding import TensorParallel, make_mesh, per_device_bytes
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models.llama import init_params
from jaxpaged.models.moe import grouped_experts, route
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from tp_fixtures import ENGINE, TINY, SilentTokenizer, run_greedy

MOE = dataclasses.replace(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def _engine(params, mesh):
    config = EngineConfig(**ENGINE).resolved(on_gpu=False, model_max_len=MOE.max_position_embeddings)
    return LLMEngine(MOE, params, SilentTokenizer(), config, num_pages=config.num_pages,
                     attention_fn=chunked_paged_attention_from_buffer, mesh=mesh)


def _primitives(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _primitives(inner)


# (devices, tokens, top-k): fewer tokens than devices (a decode step), a count no device count divides.
@pytest.mark.parametrize("ep,num_tokens,top_k", [(4, 5, 1), (8, 1, 2), (8, 13, 2)])
def test_all_to_all_experts_equal_one_device(ep, num_tokens, top_k):
    rng = np.random.default_rng(ep + num_tokens)
    dim, ffn, experts = 8, 12, 8
    w_gate, w_up = (jnp.asarray(rng.standard_normal((experts, dim, ffn), np.float32) * 0.3) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((experts, ffn, dim), np.float32) * 0.3)
    tp = TensorParallel.create(make_mesh(ep), dataclasses.replace(MOE, num_experts=experts))
    placed = [jax.device_put(w, NamedSharding(tp.mesh, P("tp"))) for w in (w_gate, w_up, w_down)]
    sharded = jax.jit(tp.shard_experts(grouped_experts), static_argnames="act")
    x = jnp.asarray(rng.standard_normal((num_tokens, dim), np.float32))
    # Skewed routing: most pairs to expert 0, so one device receives most of the traffic.
    logits = rng.standard_normal((num_tokens, experts), np.float32) + 4.0 * (np.arange(experts) == 0)
    weights, ids = route(jnp.asarray(logits), top_k, True)
    expected = grouped_experts(x, ids, weights, w_gate, w_up, w_down, act="silu")
    got = sharded(x, ids, weights, *placed, act="silu")
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)
    names = set(_primitives(jax.make_jaxpr(lambda *a: sharded(*a, act="silu"))(x, ids, weights, *placed).jaxpr))
    assert "all_to_all" in names and "psum" not in names, names


def test_expert_parallel_greedy_equals_one_device():
    # Router weights larger than init's 0.02 so that tokens really spread over the experts.
    params = jax.tree.map(np.asarray, init_params(MOE, jax.random.key(1)))
    router = params["params"]["layers"]["moe"]["router"]
    params["params"]["layers"]["moe"]["router"] = router * 50
    prompts = tp_fixtures.prompts()[2:5]  # 8, 9 and 23 tokens: one chunked prefill
    expected = run_greedy(_engine(params, None), prompts)
    for tp in (8,):  # 1 expert per device; KV heads replicated twice as well
        engine = _engine(params, make_mesh(tp))
        gate = engine.runner.params["params"]["layers"]["moe"]["expert_gate"]
        held = per_device_bytes(gate)
        assert len(held) == tp and set(held.values()) == {gate.nbytes // tp}, held  # E/tp experts each
        assert run_greedy(engine, prompts) == expected, f"tp={tp}"


def test_experts_not_divisible_by_the_mesh_are_refused():
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4"):
        TensorParallel.create(make_mesh(4), dataclasses.replace(MOE, num_experts=6))
