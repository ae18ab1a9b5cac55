"""Sleep mode: give the device memory of a `ModelRunner` back while a trainer uses it (vLLM's names).

    sleep(level=1)  KV page buffer (and a hybrid model's recurrent states) deleted; weights copied to host memory (numpy), device copy deleted
    sleep(level=2)  KV page buffer deleted; weights deleted (the next update_params brings new ones)
    wake_up()       a zeroed page buffer with the same shape, dtype and sharding; weights back on the
                    device with their own sharding (level 1) -- the compiled step is reused as is

The page buffer holds no live K/V across a sleep (the engine sleeps only with no request in flight
and resets its prefix cache), so it comes back as zeros, exactly as at start-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.models.qwen3_next import zeros_linear_state
from jaxpaged.ops.kv_quant import zeros_kv_cache

SLEEP_LEVELS = (1, 2)


def _delete(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def sleep_runner(runner, level: int) -> None:
    """Frees the runner's page buffer, and moves its weights to the host (1) or drops them (2)."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level={level}; use 1 (weights kept on the host) or 2 (weights dropped)")
    jax.block_until_ready(runner.kv_pages)  # the last step's writes are done before the buffer goes
    _delete(runner.kv_pages)
    runner.kv_pages = None
    if getattr(runner, "linear_state", None) is not None:  # a hybrid model's slots hold nothing live either
        _delete(runner.linear_state)
        runner.linear_state = None
    # The weights as the runner stores them (one buffer per layer on a single device: layer_params.py).
    if runner.served_params is None:  # slept at level 2 before and never given weights since
        return
    host = jax.device_get(runner.served_params) if level == 1 else None
    _delete(runner.served_params)
    runner.served_params = host
    runner.params_on_host = level == 1


def wake_runner(runner) -> None:
    """A fresh zeroed page buffer; host weights back on the device as they were placed."""
    c = runner.config  # as the devices see it (KV heads replicated under tensor parallelism)
    kv_shape = (c.num_kv_layers, 2, c.num_kv_heads, runner.num_pages, runner.page_size, c.head_dim)
    zeros = runner.tp.zeros_kv_pages if runner.tp is not None else runner.zeros_on_device
    runner.kv_pages = zeros_kv_cache(kv_shape, c.dtype, runner.kv_cache_dtype, zeros=zeros)
    if getattr(runner, "hybrid", False):
        runner.linear_state = zeros_linear_state(c, runner.num_state_slots + 1, zeros)
    if getattr(runner, "params_on_host", False):
        if runner.tp is not None:  # already KV-head-replicated: placed as is, slice by slice
            runner.served_params = jax.device_put(runner.served_params, runner.tp.param_shardings(runner.served_params))
        else:
            runner.served_params = jax.tree.map(lambda x: jnp.array(x, copy=True), runner.served_params)
        runner.params_on_host = False
