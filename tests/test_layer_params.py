"""One weight buffer per layer (device/layer_params.py): the unrolled step equals the scan over stacked
weights, bit for bit in float32, for a dense, a sliding-window/Gemma-style and a MoE model; the
canonical tree, update_params and sleep/wake keep working on a runner that serves per-layer weights."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import make_scheduler_output, make_seq

from jaxpaged.device.layer_params import split_layers, stack_layers
from jaxpaged.device.runner import ModelRunner
from jaxpaged.device.sleep import sleep_runner, wake_runner
from jaxpaged.models import ModelConfig, init_params

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=16, dtype="float32")
CONFIGS = {
    "qwen3": ModelConfig(**BASE, qk_norm=True, attention_bias=True),
    "gemma": ModelConfig(**BASE, sliding_window=4, layer_types=("sliding_attention", "full_attention",
                         "sliding_attention"), local_rope_theta=10_000.0, norm_plus_one=True, sandwich_norms=True,
                         hidden_act="gelu_tanh", attn_soft_cap=50.0, final_soft_cap=30.0),
    "moe": ModelConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
}


def _runner(config, params, per_layer):
    return ModelRunner(config, params, num_pages=32, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                       max_model_len=32, buckets=(16,), decode_buckets=(), per_layer_weights=per_layer)


def _step(runner):
    """Two prompts (6 and 9 tokens), one prefill step: both sample."""
    a = make_seq([3, 9, 4, 1, 5, 9], num_computed_tokens=0, block_table=[1, 2])
    b = make_seq([2, 6, 5, 3, 5, 8, 9, 7, 9], num_computed_tokens=0, block_table=[3, 4, 5])
    return runner.prepare(make_scheduler_output([a, b], [6, 9]))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_per_layer_step_equals_the_scan_over_stacked_weights(family):
    config = CONFIGS[family]
    params = init_params(config, jax.random.key(1))
    stacked, per_layer = _runner(config, params, False), _runner(config, params, True)
    assert isinstance(per_layer.served_params["params"]["layers"], tuple)
    assert len(per_layer.served_params["params"]["layers"]) == config.num_layers
    step = _step(stacked)
    want = np.asarray(stacked.execute(step))
    np.testing.assert_allclose(np.asarray(per_layer.execute(step)), want, rtol=1e-5, atol=1e-5)
    # The pages written are the same too: a decode step reading them gives the same logits.
    decode = dataclasses.replace(step, token_ids=np.roll(step.token_ids, 1))
    np.testing.assert_allclose(np.asarray(per_layer.execute(decode)), np.asarray(stacked.execute(decode)),
                               rtol=1e-5, atol=1e-5)


def test_canonical_tree_update_and_sleep_on_a_per_layer_runner():
    config = CONFIGS["qwen3"]
    params = init_params(config, jax.random.key(2))
    runner = _runner(config, params, True)
    # The canonical view is the stacked tree, value for value, as update_params and LLM.params speak it.
    assert jax.tree.structure(runner.params) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(runner.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    step = _step(runner)
    before = np.asarray(runner.execute(step))

    new = init_params(config, jax.random.key(3))
    runner.update_params(new)
    assert isinstance(runner.served_params["params"]["layers"], tuple)
    want = np.asarray(_runner(config, new, False).execute(step))
    np.testing.assert_allclose(np.asarray(runner.execute(step)), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want, before)

    sleep_runner(runner, 1)  # weights to the host, per layer; back as they were
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(runner.served_params))
    wake_runner(runner)
    np.testing.assert_allclose(np.asarray(runner.execute(step)), want, rtol=1e-5, atol=1e-5)


def test_split_and_stack_are_inverse_and_leave_other_trees_alone():
    params = init_params(CONFIGS["moe"], jax.random.key(4))
    host = jax.tree.map(np.asarray, params)
    served = split_layers(host)  # host leaves: views, the input untouched
    assert served["params"]["layers"][1]["moe"]["expert_gate"].shape == host["params"]["layers"]["moe"]["expert_gate"].shape[1:]
    back = stack_layers(served)
    assert jax.tree.structure(back) == jax.tree.structure(host)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(host)):
        np.testing.assert_array_equal(got, want)
    assert split_layers(None) is None and stack_layers(host) is host
