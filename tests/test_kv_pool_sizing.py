"""KV pool sizing under tensor parallelism (issue 30 item 11): a page costs each device only its
share of the KV heads, so a device's free memory holds tp times the pages of an unsplit one (fewer
when tp exceeds the KV heads and they are repeated). Before, the whole page was budgeted against one
device's memory: a factor tp too few pages."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import tp_fixtures
from jaxpaged.device.kv_cache import bytes_per_page, device_bytes_per_page, num_pages_for_budget, per_device_param_bytes
from jaxpaged.device.sharding import TensorParallel

TINY = tp_fixtures.TINY  # 4 KV heads of head_dim 16, 2 layers


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_device_holds_its_share_of_each_page(kv_cache_dtype):
    whole = bytes_per_page(TINY, 8, kv_cache_dtype)
    assert whole == 2 * 2 * 4 * 8 * (16 * 4 if kv_cache_dtype == "auto" else 16 + 4)
    assert device_bytes_per_page(TINY, 8, kv_cache_dtype, 1) == whole
    assert device_bytes_per_page(TINY, 8, kv_cache_dtype, 2) == whole // 2  # 2 of the 4 heads
    assert device_bytes_per_page(TINY, 8, kv_cache_dtype, 4) == whole // 4  # 1 head
    assert device_bytes_per_page(TINY, 8, kv_cache_dtype, 8) == whole // 4  # 1 head, each repeated twice
    budget = 100 * whole
    assert num_pages_for_budget(TINY, 8, budget, kv_cache_dtype) == 100
    assert num_pages_for_budget(TINY, 8, budget, kv_cache_dtype, tensor_parallel_size=2) == 200
    assert num_pages_for_budget(TINY, 8, budget, kv_cache_dtype, tensor_parallel_size=8) == 400


def test_per_device_parameter_bytes_come_from_the_shard_shapes():
    params = tp_fixtures.tiny_params()
    total = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(params))
    one = TensorParallel.create(Mesh(np.array(jax.devices()[:1]), ("tp",)), TINY)
    assert per_device_param_bytes(params, one.param_shardings(params)) == total
    # Shard shapes need no devices: on an abstract 2-device mesh, a split leaf counts half.
    mesh = jax.sharding.AbstractMesh((2,), ("tp",))
    leaves = {"w": np.zeros((8, 4), np.float32), "norm": np.zeros((3,), np.float32)}
    shardings = {"w": NamedSharding(mesh, P("tp", None)), "norm": NamedSharding(mesh, P())}
    assert per_device_param_bytes(leaves, shardings) == 4 * 4 * 4 + 3 * 4
