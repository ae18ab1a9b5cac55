"""Expert parallelism on forced host devices (run by tests/test_tensor_parallel.py in its own process):
a tiny MoE model (8 experts, top-2) generates greedily on one device and with its experts split
over 8 devices; the tokens must be equal and each device must hold only its experts."""

import dataclasses

import jax
import numpy as np
import pytest

import tp_fixtures
from jaxpaged.config import EngineConfig
from jaxpaged.device.sharding import TensorParallel, make_mesh, per_device_bytes
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.models.llama import init_params
from jaxpaged.ops.attention import chunked_paged_attention_from_buffer
from tp_fixtures import ENGINE, TINY, SilentTokenizer, run_greedy

MOE = dataclasses.replace(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def _engine(params, mesh):
    config = EngineConfig(**ENGINE).resolved(on_gpu=False, model_max_len=MOE.max_position_embeddings)
    return LLMEngine(MOE, params, SilentTokenizer(), config, num_pages=config.num_pages,
                     attention_fn=chunked_paged_attention_from_buffer, mesh=mesh)


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
