"""Expert parallelism by an all-to-all token exchange (the `shard_map` body of the MoE layer).

Experts are split over the mesh axis: device d holds experts [d E_l, (d+1) E_l), E_l = E / ep.
Activations between blocks are replicated (tensor parallelism), so each device first takes its
share of the tokens, then sends every (token, expert) pair to the device that owns the expert:

    tokens [T, D] replicated ── device d keeps rows [d T_l, (d+1) T_l) (T padded to ep T_l)
    pairs  [T_l k]           ── sorted by destination device, numbered within it (rank)
    send   [ep, C, D]           block j: the rows for device j at [j, rank]   C = T_l k (no pair is dropped)
       │ all_to_all
    recv   [ep, C, D]           block i: what device i sent here; local expert id per row (E_l: empty)
    grouped matmul (models/moe.py grouped_experts, top-1 weight 1 per row) ── [ep, C, D]
       │ all_to_all back
    back   [ep, C, D]           block j: device j's results for my rows, read at [j, rank]
    y_d    [T_l, D]             weighted sum over each token's k pairs
       │ all_gather
    y      [T, D] replicated

C is the worst case (every pair of a device to one expert owner), so the exchange is exact; a
`ragged_all_to_all` would send only the filled rows, but XLA:CPU does not implement it (the tests
run on forced host devices), so the fixed-size collective is used everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int


def all_to_all_experts(expert_fn: Callable, mesh, axis: str) -> Callable:
    """`expert_fn` (models/moe.py `grouped_experts`) with experts split over `axis` and tokens exchanged."""
    experts = P(axis)

    def local(x: Float[Array, "T D"], expert_ids: Int[Array, "T k"], weights: Float[Array, "T k"],
              w_gate, w_up, w_down, *, act: str):
        ep, d = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        num_local = w_gate.shape[0]
        num_tokens, top_k = expert_ids.shape
        tokens_per_device = -(-num_tokens // ep)
        pad = tokens_per_device * ep - num_tokens  # pad rows: weight 0, never sent (see `valid`)
        x_pad = jnp.pad(x, ((0, pad), (0, 0)))
        start = d * tokens_per_device
        x_d = jax.lax.dynamic_slice_in_dim(x_pad, start, tokens_per_device)  # [T_l, D]
        ids_d = jax.lax.dynamic_slice_in_dim(jnp.pad(expert_ids, ((0, pad), (0, 0))), start, tokens_per_device)
        w_d = jax.lax.dynamic_slice_in_dim(jnp.pad(weights, ((0, pad), (0, 0))), start, tokens_per_device)
        valid = (start + jnp.arange(tokens_per_device) < num_tokens)[:, None].repeat(top_k, 1).reshape(-1)

        # Pairs by destination device; rank = index among the pairs for the same device.
        capacity = tokens_per_device * top_k
        dest = ids_d.reshape(-1) // num_local  # [C]
        order = jnp.argsort(dest, stable=True)
        dest_sorted = dest[order]
        first_of_dest = jnp.searchsorted(dest_sorted, jnp.arange(ep), side="left")
        rank = jnp.arange(capacity) - first_of_dest[dest_sorted]
        rows = x_d[order // top_k]  # [C, D], token of pair p is p // k
        local_id = jnp.where(valid[order], ids_d.reshape(-1)[order] - dest_sorted * num_local, num_local)
        send = jnp.zeros((ep, capacity, x.shape[-1]), x.dtype).at[dest_sorted, rank].set(rows)
        send_ids = jnp.full((ep, capacity), num_local, jnp.int32).at[dest_sorted, rank].set(local_id)

        recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [ep, C, D]: block i from device i
        recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True)
        # Each received row is one pair: expert id (E_l = empty slot, zeroed), weight 1 (applied at home).
        flat_ids = recv_ids.reshape(-1, 1)
        out = expert_fn(recv.reshape(-1, x.shape[-1]), flat_ids, jnp.ones(flat_ids.shape, jnp.float32),
                        w_gate, w_up, w_down, act=act)
        back = jax.lax.all_to_all(out.reshape(ep, capacity, -1), axis, 0, 0, tiled=True)

        pair_out = back[dest_sorted, rank].astype(jnp.float32) * w_d.reshape(-1)[order][:, None]
        pair_out = jnp.where(valid[order][:, None], pair_out, 0.0)
        y_d = jnp.zeros((tokens_per_device, x.shape[-1]), jnp.float32).at[order // top_k].add(pair_out)
        y = jax.lax.all_gather(y_d.astype(x.dtype), axis, tiled=True)  # [ep T_l, D]
        return y[:num_tokens]

    def sharded(x, expert_ids, weights, w_gate, w_up, w_down, *, act):
        return jax.shard_map(
            lambda *args: local(*args, act=act), mesh=mesh, out_specs=P(), check_vma=False,
            in_specs=(P(), P(), P(), experts, experts, experts),
        )(x, expert_ids, weights, w_gate, w_up, w_down)

    return sharded
