"""The routed mixture-of-experts MLP (Mixtral, Qwen3-MoE, gpt-oss): top-k routing, one grouped matmul per projection.

    router logits [T, E] = x @ router (+ router_bias: gpt-oss);  probs = softmax (float32);  w, e = top_k(probs, k)
    (Mixtral, Qwen3-MoE with norm_topk_prob, gpt-oss: w /= sum(w), i.e. softmax over the top-k logits)
    y[t] = sum_j w[t, j] * down_e(gated(act, gate_e(x[t]), up_e(x[t]))),  e = e[t, j]
    (gpt-oss: each projection with its expert's bias, `gated` its clamped "swigluoai")

The T*k (token, expert) pairs are sorted by expert, the tokens gathered in that order, and each
projection is one grouped matmul over the sorted rows (group g = the rows routed to expert g):
`jax.lax.ragged_dot` on the CPU, whose work there is O(T * k * D * F). XLA:GPU lowers ragged_dot as a
dense GEMM over every expert on masked copies of the rows, O(T * k * E * D * F); on a CUDA GPU
(`experts_for`) the projections are ops/grouped_matmul.py's Pallas kernel instead, which computes only
the routed rows and reads only the experts some row is routed to.

Expert parallelism (`expert_fn`, device/sharding.py `TensorParallel.shard_experts`): each device
holds E/ep experts; tokens are exchanged by all-to-all so that each device runs `grouped_experts` on
the pairs routed to its experts only (device/expert_parallel.py).
"""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.ops import grouped_matmul as gm

_init = nn.initializers.normal(stddev=0.02)
ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": lambda x: nn.gelu(x, approximate=True)}
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU ("swigluoai", vLLM's name)


def gated(act: str, gate, up):
    """The expert's hidden activation from its gate and up projections: act(gate) * up, or gpt-oss's
    "swigluoai": gate clamped above at 7, up to [-7, 7], then (up + 1) * gate * sigmoid(1.702 gate)."""
    if act == "swigluoai":
        gate, up = jnp.minimum(gate, SWIGLU_LIMIT), jnp.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * SWIGLU_ALPHA))
    return ACTIVATIONS[act](gate) * up


def route(router_logits: Float[Array, "T E"], top_k: int, norm_topk_prob: bool):
    """(weights [T, k] float32, expert ids [T, k] int32), as HF's TopKRouter: softmax, then top-k."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def grouped_experts(
    x: Float[Array, "T D"],
    expert_ids: Int[Array, "T k"],
    weights: Float[Array, "T k"],
    w_gate: Float[Array, "E_local D F"],
    w_up: Float[Array, "E_local D F"],
    w_down: Float[Array, "E_local F D"],
    *,
    act: str,
    expert_offset: Int[Array, ""] | int = 0,
    biases: tuple[Float[Array, "E_local F"], Float[Array, "E_local F"], Float[Array, "E_local D"]] | None = None,
    matmul: Callable = jax.lax.ragged_dot,
) -> Float[Array, "T D"]:
    """Sum over the pairs routed to experts [offset, offset + E_local) of weight * expert(x).

    `biases` (gpt-oss): (gate, up, down) biases of each expert, added after its projections.
    `matmul`: the grouped matmul, ragged_dot's contract (`experts_for` picks it by platform).

    With offset 0 and every expert local this is the whole MoE MLP; under expert parallelism each
    device passes its slice of the weights and its offset, and the caller sums over devices.
    """
    num_tokens, top_k = expert_ids.shape
    num_local = w_gate.shape[0]
    local = expert_ids.reshape(-1) - expert_offset  # [T*k]
    # Pairs of other devices' experts get key num_local: they sort after every local group.
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    rows = x[order // top_k]  # [T*k, D], token of pair p is p // k
    gate = matmul(rows, w_gate, group_sizes)
    up = matmul(rows, w_up, group_sizes)
    row_expert = jnp.minimum(sorted_key, num_local - 1)  # rows past the local groups are zeroed below
    if biases is not None:
        gate, up = gate + biases[0][row_expert], up + biases[1][row_expert]
    hidden = gated(act, gate, up).astype(x.dtype)
    out = matmul(hidden, w_down, group_sizes)  # [T*k, D]
    if biases is not None:
        out = out + biases[2][row_expert]
    # Rows past the local groups are not computed by the grouped matmul (may hold anything): zero them.
    pair_weight = jnp.where(sorted_key < num_local, weights.reshape(-1)[order], 0.0)
    out = jnp.where((sorted_key < num_local)[:, None], out.astype(jnp.float32), 0.0) * pair_weight[:, None]
    return jnp.zeros((num_tokens, x.shape[-1]), jnp.float32).at[order // top_k].add(out).astype(x.dtype)


ExpertFn = Callable[..., Float[Array, "T D"]]


def gpu_ragged_matmul(rows, w, group_sizes):
    """ragged_dot's contract by ops/grouped_matmul.py's Pallas kernel where it takes the shapes (K and N
    multiples of 16), else ragged_dot."""
    if gm.supports(rows.shape, w.shape):
        return gm.grouped_matmul(rows, w, group_sizes)
    return jax.lax.ragged_dot(rows, w, group_sizes)


def experts_for(platform: str) -> ExpertFn:
    """The expert function a runner on `platform` serves the MoE with: `grouped_experts` with the Pallas
    grouped matmul on a CUDA GPU (where this JAX has Pallas's Triton backend), with ragged_dot elsewhere."""
    if platform in ("cuda", "gpu") and gm.available():
        return functools.partial(grouped_experts, matmul=gpu_ragged_matmul)
    return grouped_experts


def apply_returning_routed_experts(model: nn.Module, enabled: bool, params, *args):
    """`(model.apply(params, *args), ids [T, L, k] int16 | None)`: with `enabled` (static), the top-k
    expert ids every MoE layer sowed, token-major; without, the default program and None."""
    if not enabled:
        return model.apply(params, *args), None
    out, state = model.apply(params, *args, mutable=["intermediates"])
    (ids,) = state["intermediates"]["layers"]["moe"]["routed_experts"]  # [L, T, k]: the layer scan stacks them
    return out, jnp.swapaxes(ids, 0, 1)


class MoE(nn.Module):
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    act: str
    dtype: jnp.dtype
    expert_fn: ExpertFn = grouped_experts
    bias: bool = False  # gpt-oss: router and expert biases (ModelConfig.moe_bias)

    @nn.compact
    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        dim, e, f = x.shape[-1], self.num_experts, self.intermediate_size
        router_logits = jnp.einsum("TD,DE->TE", x, self.param("router", _init, (dim, e), self.dtype))
        extra = {}
        if self.bias:
            router_logits = router_logits + self.param("router_bias", _init, (e,), self.dtype)
            extra["biases"] = tuple(self.param(f"expert_{name}_bias", _init, shape, self.dtype)
                                    for name, shape in (("gate", (e, f)), ("up", (e, f)), ("down", (e, dim))))
        weights, ids = route(router_logits, self.top_k, self.norm_topk_prob)
        # Routed expert ids for RL users (engine/routed_experts.py): kept only when the caller makes
        # "intermediates" mutable; otherwise sow does nothing and the program is unchanged.
        self.sow("intermediates", "routed_experts", ids.astype(jnp.int16))
        return self.expert_fn(
            x, ids, weights,
            self.param("expert_gate", _init, (e, dim, f), self.dtype),
            self.param("expert_up", _init, (e, dim, f), self.dtype),
            self.param("expert_down", _init, (e, f, dim), self.dtype),
            act=self.act, **extra,
        )


def moe_params_from_hf(num_experts: int, intermediate_size: int, layer_tensor: Callable, has: Callable) -> dict:
    """One layer's MoE params from HF names; `layer_tensor(suffix)` reads `model.layers.{i}.{suffix}`.

    transformers >= 5 state dicts fuse the experts (`mlp.experts.gate_up_proj` [E, 2F, D], gate
    rows first; `mlp.experts.down_proj` [E, D, F]); Hub checkpoints keep one tensor per expert
    (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`; Qwen3-MoE: `mlp.experts.{e}.gate/up/down_proj`).
    """
    f = intermediate_size
    if has("mlp.router.weight"):  # gpt-oss: [E, D, 2F] with gate and up interleaved (column 2j gate, 2j+1 up)
        gate_up = layer_tensor("mlp.experts.gate_up_proj")
        gate_up_bias = layer_tensor("mlp.experts.gate_up_proj_bias")  # [E, 2F], interleaved alike
        return {"router": layer_tensor("mlp.router.weight").T, "router_bias": layer_tensor("mlp.router.bias"),
                "expert_gate": gate_up[..., 0::2], "expert_up": gate_up[..., 1::2],
                "expert_down": layer_tensor("mlp.experts.down_proj"),  # [E, F, D] as jaxpaged keeps it
                "expert_gate_bias": gate_up_bias[:, 0::2], "expert_up_bias": gate_up_bias[:, 1::2],
                "expert_down_bias": layer_tensor("mlp.experts.down_proj_bias")}
    if has("mlp.experts.gate_up_proj"):
        gate_up = layer_tensor("mlp.experts.gate_up_proj")  # [E, 2F, D]
        gate, up = gate_up[:, :f].transpose(0, 2, 1), gate_up[:, f:].transpose(0, 2, 1)
        down = layer_tensor("mlp.experts.down_proj").transpose(0, 2, 1)  # [E, D, F] -> [E, F, D]
        router = layer_tensor("mlp.gate.weight").T
    else:
        import numpy as np

        if has("block_sparse_moe.gate.weight"):  # Mixtral's original names
            prefix, names = "block_sparse_moe", ("w1", "w3", "w2")
        else:
            prefix, names = "mlp", ("gate_proj", "up_proj", "down_proj")
        expert = lambda e, n: layer_tensor(f"{prefix}.experts.{e}.{n}.weight").T
        gate, up, down = (np.stack([expert(e, n) for e in range(num_experts)]) for n in names)
        router = layer_tensor(f"{prefix}.gate.weight").T  # (E, D) -> (D, E)
    return {"router": router, "expert_gate": gate, "expert_up": up, "expert_down": down}
