"""update_params with weights on another sharding (run by tests/test_tensor_parallel.py on 8 forced
host devices): a trainer's 2-device mesh, on devices the engine does not use or on two it does,
updates a tp=4 engine. The weights land on the engine's own layout, leaf by leaf: the same shardings
and greedy tokens as weights given on the host, no device ever holds the whole model, and the
engine keeps its own copy (the trainer may delete its arrays)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tp_fixtures
from jaxpaged.device.sharding import make_mesh, per_device_bytes
from jaxpaged.models.llama import init_params
from tp_fixtures import TINY, make_engine, run_greedy, tiny_params


def _trainer_sharded(params, devices):
    """Each leaf split over a 2-device "fsdp" mesh on its first even axis (as an FSDP trainer keeps them)."""
    mesh = Mesh(np.array(devices), ("fsdp",))

    def place(x):
        axis = next((i for i, n in enumerate(np.shape(x)) if n % 2 == 0), None)
        spec = [None] * np.ndim(x)
        if axis is not None:
            spec[axis] = "fsdp"
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    return jax.tree.map(place, params)


def _bytes_per_device(params) -> dict[int, int]:
    held: dict[int, int] = {}
    for leaf in jax.tree.leaves(params):
        for device_id, n in per_device_bytes(leaf).items():
            held[device_id] = held.get(device_id, 0) + n
    return held


@pytest.mark.parametrize("trainer_devices", [(4, 5), (0, 1)])
def test_params_from_a_trainer_mesh_reshard_to_the_engine_layout(trainer_devices):
    prompts = tp_fixtures.prompts()
    new_host = jax.tree.map(np.asarray, init_params(TINY, jax.random.key(1)))
    want_engine = make_engine(new_host, mesh=make_mesh(4))
    want = run_greedy(want_engine, prompts)

    engine = make_engine(tiny_params(), mesh=make_mesh(4))
    compiles = engine.stats()["num_compiles"]
    trainer = _trainer_sharded(new_host, [jax.devices()[i] for i in trainer_devices])
    engine.update_params(trainer)
    got_leaves, want_leaves = jax.tree.leaves(engine.params), jax.tree.leaves(want_engine.params)
    for got, ref in zip(got_leaves, want_leaves):
        assert got.sharding == ref.sharding
    total = sum(x.nbytes for x in got_leaves)
    held = _bytes_per_device(engine.params)
    assert set(held) == {0, 1, 2, 3} and max(held.values()) < total / 2, (held, total)
    for leaf in jax.tree.leaves(trainer):  # the trainer frees its arrays: the engine has its own
        leaf.delete()
    assert run_greedy(engine, prompts) == want
    assert engine.stats()["num_compiles"] == compiles
