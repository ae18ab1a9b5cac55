"""The routed MoE MLP (models/moe.py): against a per-token loop over the chosen experts, split over
expert ranges (what expert parallelism sums), and the traced step holds no dense all-experts matmul."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import CausalLM, init_params
from jaxpaged.models.moe import grouped_experts, route


def _loop_reference(x, ids, weights, w_gate, w_up, w_down):
    """y[t] = sum_j w[t, j] * down(silu(gate(x[t])) * up(x[t])) with expert ids[t, j], one token at a time."""
    silu = lambda v: v / (1 + np.exp(-v))
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            y[t] += weights[t, j] * ((silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e])
    return y


@pytest.mark.parametrize("top_k", [1, 2])
def test_grouped_experts_equals_the_per_token_loop_and_splits_by_expert_range(top_k):
    rng = np.random.default_rng(top_k)
    tokens, dim, ffn, experts = 11, 8, 12, 6
    x = rng.standard_normal((tokens, dim), np.float32)
    w_gate, w_up = (rng.standard_normal((experts, dim, ffn), np.float32) * 0.3 for _ in range(2))
    w_down = rng.standard_normal((experts, ffn, dim), np.float32) * 0.3
    weights, ids = route(jnp.asarray(rng.standard_normal((tokens, experts), np.float32)), top_k, True)
    weights, ids = np.asarray(weights), np.asarray(ids)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)
    expected = _loop_reference(x, ids, weights, w_gate, w_up, w_down)
    x, ids, weights, w_gate, w_up, w_down = map(jnp.asarray, (x, ids, weights, w_gate, w_up, w_down))
    whole = grouped_experts(x, ids, weights, w_gate, w_up, w_down, act="silu")
    np.testing.assert_allclose(whole, expected, atol=1e-5, rtol=1e-5)
    # Three devices' worth of experts (2 each): each computes only its own pairs; the sum is the whole.
    parts = [grouped_experts(x, ids, weights, w_gate[o:o + 2], w_up[o:o + 2], w_down[o:o + 2], act="silu",
                             expert_offset=o) for o in (0, 2, 4)]
    assert all(np.abs(np.asarray(p)).sum() > 0 for p in parts)
    np.testing.assert_allclose(sum(np.asarray(p) for p in parts), expected, atol=1e-5, rtol=1e-5)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _all_eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _all_eqns(sub)


def test_traced_step_has_ragged_dot_and_no_dense_all_experts_matmul():
    config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
    params = init_params(config, jax.random.key(0))
    kv = jnp.zeros((2, 2, 1, 4, 4, 8))
    ints = lambda *shape: jnp.zeros(shape, jnp.int32)
    jaxpr = jax.make_jaxpr(CausalLM(config).apply)(params, kv, ints(6), ints(6), ints(6), ints(1, 4), ints(1),
                                                   ints(2), ints(1))
    eqns = list(_all_eqns(jaxpr.jaxpr))
    ragged = [e for e in eqns if e.primitive.name == "ragged_dot_general"]
    assert len(ragged) == 3  # gate, up, down, once in the scanned layer body
    expert_shapes = {(8, 16, 24), (8, 24, 16)}
    for eqn in eqns:
        if eqn.primitive.name == "dot_general":
            shapes = {tuple(v.aval.shape) for v in eqn.invars}
            assert not shapes & expert_shapes, f"dense matmul over all experts: {shapes}"
    # and the dense-MLP model of the same shape has no ragged_dot at all
    dense = dataclasses.replace(config, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    dense_jaxpr = jax.make_jaxpr(CausalLM(dense).apply)(init_params(dense, jax.random.key(0)), kv, ints(6), ints(6),
                                                        ints(6), ints(1, 4), ints(1), ints(2), ints(1))
    assert not [e for e in _all_eqns(dense_jaxpr.jaxpr) if e.primitive.name.startswith("ragged_dot")]

