"""The KV pool's size: bytes per page (the one place it is computed) and how many pages to make.

    kv_pages: [num_kv_layers, 2 (K, V), num_kv_heads, num_pages, page_size, head_dim]   (model dtype)
              or a QuantizedKV: int8 / float8 values of that shape plus float32 scales
              [num_layers, 2, num_kv_heads, num_pages, page_size]     (ops/kv_quant.py)

    bytes per page = num_kv_layers x 2 x num_kv_heads x page_size x bytes per (token, KV head)
    bytes per (token, KV head) = head_dim x value bytes (+ 4 for the scale when quantized)

Everything that turns pages into bytes or bytes into pages (the pool, swap space, the host tier,
the server's `jaxpaged_kv_used_bytes`) calls `bytes_per_page` here.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxpaged.config import EngineConfig
from jaxpaged.device.runner import ModelRunner  # the GPU pool is sized by compiling the runner's largest step
from jaxpaged.device.sharding import TensorParallel, kv_head_replicas, replica_meshes
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.qwen3_next import state_bytes_per_slot
from jaxpaged.ops.kv_quant import bytes_per_token_head
from jaxpaged.planner.state_pool import num_snapshot_slots

CPU_KV_BUDGET_BYTES = 2 << 30  # CPU default KV pool: at most 2 GiB of host memory
# GPU pool sizing leaves this much, besides the step's own scratch memory and the
# (1 - kv_memory_fraction) share, for the sampler, page copies and XLA/cuBLAS workspaces.
_GPU_MARGIN_BYTES = 512 << 20


def bytes_per_page(config: ModelConfig, page_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one page across all layers, K and V (and their scales when the cache is quantized)."""
    token_head = bytes_per_token_head(kv_cache_dtype, config.dtype, config.head_dim)
    return config.num_kv_layers * 2 * config.num_kv_heads * page_size * token_head


kv_cache_bytes_per_page = bytes_per_page  # the name benchmarks and tests have used


def host_page_counts(config: EngineConfig, page_bytes: int) -> tuple[int, int]:
    """(swap pages, host-tier pages) the host memory budgets hold; ValueError for a budget that holds
    no page, or host pages in a model spread over several processes."""
    num_swap_pages = (config.swap_space_bytes or 0) // page_bytes
    num_host_cache_pages = (config.host_cache_bytes or 0) // page_bytes
    for name, value, count in (("swap_space_bytes", config.swap_space_bytes, num_swap_pages),
                               ("host_cache_bytes", config.host_cache_bytes, num_host_cache_pages)):
        if value is not None and count == 0:
            raise ValueError(f"{name}={value} holds no page of {page_bytes} bytes; raise it")
    if (num_swap_pages or num_host_cache_pages) and jax.process_count() > 1:
        raise ValueError(
            "swap_space_bytes / host_cache_bytes keep pages in this process's memory, which a model spread "
            f"over {jax.process_count()} processes cannot gather; leave them unset (preemption_mode="
            "'recompute') when running under jax.distributed")
    return num_swap_pages, num_host_cache_pages


def split_swap_space(config: EngineConfig, state_bytes: int) -> tuple[int, int]:
    """A hybrid model's swap space: (host state slots, bytes left for swap pages). A swapped sequence keeps its
    recurrent state beside its pages, so max_num_seqs states (every running sequence's) come out of
    swap_space_bytes first, at most half of it; ValueError when half holds no state."""
    num_slots = min(config.max_num_seqs, config.swap_space_bytes // 2 // state_bytes)
    if num_slots == 0:
        raise ValueError(f"swap_space_bytes={config.swap_space_bytes} holds no swapped sequence's recurrent state "
                         f"({state_bytes} bytes, at most half the space); raise it to at least {2 * state_bytes}")
    return num_slots, config.swap_space_bytes - num_slots * state_bytes


def device_bytes_per_page(config: ModelConfig, page_size: int, kv_cache_dtype: str = "auto",
                          tensor_parallel_size: int = 1) -> int:
    """Bytes of one page on each device of a tensor-parallel mesh: its KV heads (repeated
    tp / num_kv_heads times when tp exceeds them, as device/sharding.py places them) split over tp."""
    replicas = kv_head_replicas(config, tensor_parallel_size)
    return bytes_per_page(config, page_size, kv_cache_dtype) * replicas // tensor_parallel_size


def per_device_param_bytes(params, shardings) -> int:
    """Bytes of the parameters on one device of a mesh, each leaf placed with its sharding (from the
    shard shapes; nothing is moved). `shardings`: a pytree like `params` (`TensorParallel.param_shardings`)."""
    return sum(math.prod(sharding.shard_shape(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize
               for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))


def num_pages_for_budget(config: ModelConfig, page_size: int, budget_bytes: int, kv_cache_dtype: str = "auto",
                         tensor_parallel_size: int = 1) -> int:
    """How many pages (the padding page 0 included) fit in `budget_bytes` of KV memory, counted per
    device under tensor parallelism (`device_bytes_per_page`), for the whole page otherwise."""
    num_pages = budget_bytes // device_bytes_per_page(config, page_size, kv_cache_dtype, tensor_parallel_size)
    if num_pages < 2:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes holds {num_pages} pages of {page_size} tokens; "
            "at least 2 are needed (page 0 is padding): raise the budget or lower page_size"
        )
    return int(num_pages)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def free_device_memory() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)


def num_pages_for(config: EngineConfig, model_config: ModelConfig, params, attention_fn) -> int:
    """Pool size: explicit, from a byte budget, from free GPU memory, or enough for a full CPU batch.

    GPU: the parameters go to the device first; then the budget is

        kv_memory_fraction x (free memory - the compiled largest step's scratch memory - 512 MiB)

    so warm-up and the largest step still fit beside the pool. Under tensor parallelism the budget is
    one device's (the first of replica 0's mesh): its share of the weights is subtracted, and each
    page costs it only its share of the KV heads (`device_bytes_per_page`), so a tp-way mesh holds
    tp times the pages of one device (fewer when KV heads are repeated). `kv_memory_bytes` counts
    whole pages, on every platform.
    """
    if config.num_pages is not None:
        return config.num_pages
    if config.kv_memory_bytes is not None:
        return num_pages_for_budget(model_config, config.page_size, config.kv_memory_bytes, config.kv_cache_dtype)
    if on_gpu():
        # a hybrid model's running slots and prefix-cache snapshots (planner/state_pool.py)
        num_state_slots = config.max_num_seqs + num_snapshot_slots(config) if model_config.is_hybrid else 0
        tp_size = config.tensor_parallel_size
        if tp_size == 1:
            params = jax.block_until_ready(jax.device_put(params))  # the engine's copy will sit where these do
            free = free_device_memory()
        else:  # the weights are not placed here: the runner splits them leaf by leaf
            mesh = replica_meshes(config.data_parallel_size, tp_size)[0]
            shardings = TensorParallel.create(mesh, model_config).param_shardings(params)
            free = free_device_memory() - per_device_param_bytes(params, shardings)
            # The probe below compiles the unsplit step (its scratch: an upper bound per device) from
            # abstract weights, so nothing lands whole on one device.
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=device), params)
        # The largest step, compiled over a 2-page pool: its scratch does not grow with the pool.
        probe = ModelRunner(
            model_config, params, num_pages=2, page_size=config.page_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            attention_fn=attention_fn, decode_buckets=(), kv_cache_dtype=config.kv_cache_dtype,
            per_layer_weights=config.per_layer_weights,  # the engine's own step program
            num_state_slots=num_state_slots,
        )
        step_temp = probe.step_temp_bytes()
        del probe
        # A hybrid model's recurrent states (a slot per sequence, models/qwen3_next.py) sit beside the pages.
        free -= step_temp + _GPU_MARGIN_BYTES + (num_state_slots + 1) * state_bytes_per_slot(model_config)
        if free <= 0:
            raise ValueError(
                f"after the weights, the largest step needs {step_temp / 2**30:.2f} GiB of scratch memory plus a "
                f"{_GPU_MARGIN_BYTES >> 20} MiB margin and nothing is left for KV pages; lower "
                "max_num_batched_tokens, use a smaller model or dtype, or free device memory"
            )
        return num_pages_for_budget(model_config, config.page_size, int(free * config.kv_memory_fraction),
                                    config.kv_cache_dtype, tensor_parallel_size=tp_size)
    full_batch = config.max_num_seqs * math.ceil(config.max_model_len / config.page_size) + 1
    page_bytes = bytes_per_page(model_config, config.page_size, config.kv_cache_dtype)
    return max(2, min(full_batch, CPU_KV_BUDGET_BYTES // page_bytes))
