"""Tensor parallelism: a device mesh with one `tp` axis, and one table from logical axes to it.

Megatron-style splitting, expressed as GSPMD shardings of the parameters plus a `shard_map` around
the paged attention (every backend, Pallas included, then runs unchanged on its own heads):

    x [T, D] replicated
      q/k/v_proj [D, N|K, H]  column-split by head  -> q [T, N/tp, H], k/v [T, K/tp, H] per device
      write_kv + attention    per device, on its own KV heads' pages (no communication)
      o_proj [N, H, D]        row-split by head     -> partial [T, D], all-reduced by XLA
      gate/up [D, F]          column-split          -> [T, F/tp] per device
      down [F, D]             row-split             -> partial [T, D], all-reduced
      embedding [V, D], lm_head [D, V]  split by vocabulary; logits come back replicated

The model code never names a device: parameters and the KV buffer carry logical axis names (the
tables below), `LOGICAL_AXIS_RULES` maps those to mesh axes, and a dimension the mesh axis does not
divide stays replicated.

KV heads fewer than devices (SmolLM2-135M: 3 KV heads; a 4-KV-head model on 8 devices): each KV
head is replicated `tp // num_kv_heads` times, as vLLM does, so that every device holds exactly the
KV heads its query heads read. Copy j of KV head k becomes head `k * r + j`; query head h, which
read KV head `h // (N // K)`, now reads `h // (N // (K r))` = its own copy of the same head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpaged.device.expert_parallel import all_to_all_experts
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.gguf_blocks import EMBEDDING, PROJECTIONS, SUFFIXES, leaf_dtype

TP = "tp"

# Logical axis -> mesh axis (None: replicated). The one place that decides what is split.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "layers": None,
    "embed": None,  # hidden_size: activations between blocks are replicated
    "heads": TP,  # query heads
    "kv_heads": TP,  # KV heads, in the projections and in the page buffer
    "head_dim": None,
    "mlp": TP,  # intermediate_size
    "vocab": TP,
    "norm": None,  # RMSNorm scales
    "kv": None,  # the K / V axis of the page buffer
    "pages": None,
    "page_slots": None,
    "experts": TP,  # expert parallelism: each device holds num_experts / tp whole experts
    "expert_mlp": None,
    "router_experts": None,  # the router's output axis: every device routes every token
    "gguf_blocks": None,  # GGUF block leaves: [in / 32, 32 or 16 (packed), out] codes, [in / 32, out] scales and mins
    "gguf_block": None,
    "gguf_out": None,
}

# Parameter name (the last key of its path) -> logical axes. Parameters under "layers" carry a
# leading stacked "layers" axis (nn.scan), added by `param_logical_axes`.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embedding": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "q_proj": ("embed", "heads", "head_dim"),
    "k_proj": ("embed", "kv_heads", "head_dim"),
    "v_proj": ("embed", "kv_heads", "head_dim"),
    "o_proj": ("heads", "head_dim", "embed"),
    "q_bias": ("heads", "head_dim"),
    "k_bias": ("kv_heads", "head_dim"),
    "v_bias": ("kv_heads", "head_dim"),
    "o_bias": ("embed",),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
    "scale": ("norm",),
    "router": ("embed", "router_experts"),
    "expert_gate": ("experts", "embed", "expert_mlp"),
    "expert_up": ("experts", "embed", "expert_mlp"),
    "expert_down": ("experts", "expert_mlp", "embed"),
    # GGUF block leaves (quantization="gguf", models/gguf_blocks.py): replicated, as tensor_parallel_size
    # must be 1 with them; a data-parallel replica's one-device mesh places them whole.
    **{f"{name}_codes": ("gguf_blocks", "gguf_block", "gguf_out") for name in PROJECTIONS},
    **{f"{name}_{part}": ("gguf_blocks", "gguf_out") for name in PROJECTIONS for part in ("scales", "mins")},
    # A tied embedding kept as codes: [vocab / 16, hidden or hidden / 32, 16] panels, replicated too.
    **{f"{EMBEDDING}{suffix}": ("gguf_blocks", "gguf_block", "gguf_out") for suffix in SUFFIXES},
    # FP8 projections of a quantized Hugging Face checkpoint (models/hf_quant.py): [in, out] values, [G, out]
    # scales, a scalar input scale; replicated (build_engine refuses tensor_parallel_size > 1 with them).
    **{f"{name}{suffix}": ("gguf_blocks", "gguf_out") for name in PROJECTIONS for suffix in ("_fp8", "_fp8_scale")},
    **{f"{name}_input_scale": () for name in PROJECTIONS},
}
# A quantized cache's scales [layers, kv, kv_heads, pages, page_slots] take the same names minus the
# last: split on kv_heads like their pages (every spec below is cut to the leaf's rank).
KV_PAGES_AXES = ("layers", "kv", "kv_heads", "pages", "page_slots", "head_dim")
# Attention operands inside the layer loop.
Q_AXES = (None, "heads", "head_dim")  # [num_tokens, num_heads, head_dim]
LAYER_KV_AXES = ("kv_heads", "pages", "page_slots", "head_dim")  # one layer's K or V pool


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named `tp` over the first `tensor_parallel_size` devices (or over `devices`)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} but only {len(devices)} devices are visible; "
            "lower it, or on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax"
        )
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,))


def replica_meshes(data_parallel_size: int, tensor_parallel_size: int) -> list[Mesh | None]:
    """One mesh per data-parallel replica over consecutive devices; `[None]` (no mesh) for 1 x 1."""
    if data_parallel_size == tensor_parallel_size == 1:
        return [None]
    devices = jax.devices()
    needed = data_parallel_size * tensor_parallel_size
    if len(devices) < needed:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} needs "
            f"{needed} devices but only {len(devices)} are visible; lower them, or on a CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before importing jax"
        )
    step = tensor_parallel_size
    return [make_mesh(step, devices[r * step:(r + 1) * step]) for r in range(data_parallel_size)]


def tp_size(mesh: Mesh) -> int:
    return mesh.shape[TP]


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec of an array whose dimensions have logical names `axes`.

    A dimension whose mesh axis does not divide it stays replicated (e.g. a vocabulary of 49153
    on 2 devices): correct, only less memory-saving.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    spec = []
    for name, size in zip(axes, shape):
        mesh_axis = LOGICAL_AXIS_RULES[name] if name is not None else None
        spec.append(mesh_axis if mesh_axis is not None and size % mesh.shape[mesh_axis] == 0 else None)
    return P(*spec)


def param_logical_axes(path, ndim: int) -> tuple[str, ...]:
    """Logical axes of the parameter at `path` (a jax key path into the params tree)."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    name = keys[-1]
    if name not in PARAM_AXES:
        raise KeyError(f"parameter {'/'.join(map(str, keys))} has no entry in sharding.PARAM_AXES; add one")
    axes = PARAM_AXES[name]
    if "layers" in keys:
        axes = ("layers",) + axes
    if len(axes) != ndim:
        raise ValueError(f"parameter {'/'.join(map(str, keys))} has {ndim} dims but PARAM_AXES gives {axes}")
    return axes


def kv_head_replicas(config: ModelConfig, tensor_parallel_size: int) -> int:
    """How many copies of each KV head the mesh needs (1 unless tp > num_kv_heads)."""
    n, k, tp = config.num_heads, config.num_kv_heads, tensor_parallel_size
    if n % tp:
        raise ValueError(
            f"num_heads={n} is not divisible by tensor_parallel_size={tp}; choose a divisor of {n}"
        )
    if tp <= k:
        if k % tp:
            raise ValueError(f"num_kv_heads={k} is not divisible by tensor_parallel_size={tp}; choose a divisor of {k}")
        return 1
    if tp % k:
        raise ValueError(
            f"tensor_parallel_size={tp} exceeds num_kv_heads={k} and is not a multiple of it; "
            f"choose a divisor or a multiple of {k}"
        )
    return tp // k


def replicate_kv_heads(params, replicas: int):
    """Repeats every KV head `replicas` times (k/v projections and biases); other leaves untouched."""
    if replicas == 1:
        return params

    def repeat(path, leaf):
        axes = param_logical_axes(path, np.ndim(leaf))
        if "kv_heads" not in axes:
            return leaf
        return np.repeat(np.asarray(leaf), replicas, axis=axes.index("kv_heads"))

    return jax.tree_util.tree_map_with_path(repeat, params)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Everything the model runner needs to run one model over `mesh`."""

    mesh: Mesh
    config: ModelConfig  # the model as the devices see it: num_kv_heads includes replicas
    kv_head_replicas: int

    @classmethod
    def create(cls, mesh: Mesh, config: ModelConfig) -> "TensorParallel":
        if config.attention_sinks or config.moe_bias:
            raise ValueError("gpt-oss (attention sinks, router and expert biases) runs on one device only for now: "
                             "sharding does not pass sinks to the per-device attention nor biases to the experts; "
                             "use tensor_parallel_size=1 and data_parallel_size=1")
        replicas = kv_head_replicas(config, tp_size(mesh))
        if config.num_experts % tp_size(mesh):
            raise ValueError(
                f"num_experts={config.num_experts} is not divisible by tensor_parallel_size={tp_size(mesh)}; "
                "experts are split whole over the devices, so choose a divisor"
            )
        sharded = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * replicas)
        return cls(mesh, sharded, replicas)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def kv_pages_sharding(self, shape: Sequence[int]) -> NamedSharding:
        """Of the page buffer, or (rank 5) of a quantized cache's scales: split on kv_heads alike."""
        return NamedSharding(self.mesh, logical_to_spec(KV_PAGES_AXES[: len(shape)], shape, self.mesh))

    def param_shardings(self, params):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: NamedSharding(self.mesh, logical_to_spec(param_logical_axes(path, np.ndim(x)), np.shape(x), self.mesh)),
            params,
        )

    def place_params(self, params):
        """Puts each leaf on the mesh with its sharding, one leaf at a time.

        A host (numpy) leaf is cast on the host and `device_put` sends each device only its slice,
        so no device ever holds a whole split parameter. A device leaf on another sharding (a
        trainer's mesh, other devices) is resharded by `device_put` straight into this layout, slice
        by slice; one already in it is copied (`may_alias=False`), so the caller may donate or delete
        its arrays afterwards. In several processes every process passes the same values and each
        places its own devices' slices. (KV projections repeated for tp > num_kv_heads go through
        the host: `replicate_kv_heads`.)
        """
        dtype = jnp.dtype(self.config.dtype)
        params = replicate_kv_heads(params, self.kv_head_replicas)

        def place(path, leaf, sharding):
            leaf_type = leaf_dtype(path, dtype)  # GGUF codes, scales and mins keep theirs
            if isinstance(leaf, jax.Array):  # already on a device (a checkpoint restore, a trainer's step)
                return jax.device_put(leaf, sharding, may_alias=False).astype(leaf_type)
            return jax.device_put(np.asarray(leaf).astype(leaf_type), sharding)

        return jax.tree_util.tree_map_with_path(place, params, self.param_shardings(params))

    def abstract_params(self, params):
        """Shapes only (a compile-only runner): each leaf as `place_params` would lay it out, KV heads
        repeated for tp > num_kv_heads, as a ShapeDtypeStruct carrying its NamedSharding on the mesh."""
        dtype = jnp.dtype(self.config.dtype)

        def lay_out(path, leaf):
            axes = param_logical_axes(path, len(leaf.shape))
            shape = [n * (self.kv_head_replicas if a == "kv_heads" else 1) for a, n in zip(axes, leaf.shape)]
            sharding = NamedSharding(self.mesh, logical_to_spec(axes, shape, self.mesh))
            return jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(path, dtype), sharding=sharding)

        return jax.tree_util.tree_map_with_path(lay_out, params)

    def zeros_kv_pages(self, shape: Sequence[int], dtype) -> jax.Array:
        """The page buffer, created in place shard by shard (never whole on one device)."""
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.kv_pages_sharding(shape))()

    def shard_attention(self, attention_fn: Callable) -> Callable:
        """`attention_fn` run per device on its own heads under `shard_map`; same signature and marker."""
        mesh = self.mesh

        def spec(axes, ndim):  # shapes are not known here; the tp axis must divide heads (checked above)
            return P(*[LOGICAL_AXIS_RULES[a] if a is not None else None for a in axes][:ndim])

        q_spec = spec(Q_AXES, 3)
        if getattr(attention_fn, "reads_whole_kv_buffer", False):

            def whole_buffer(q, kv_pages, block_tables, seq_lens, query_start_loc, *, layer_idx, scale,
                             soft_cap=None, **static):  # static: e.g. decode_only, for backends with a decode kernel
                def local(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx):
                    return attention_fn(q, kv_pages, block_tables, seq_lens, query_start_loc,
                                        layer_idx=layer_idx, scale=scale, soft_cap=soft_cap, **static)

                return jax.shard_map(
                    local, mesh=mesh, out_specs=q_spec, check_vma=False,
                    in_specs=(q_spec, jax.tree.map(lambda x: spec(KV_PAGES_AXES, x.ndim), kv_pages),
                              P(), P(), P(), P()),
                )(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx)

            whole_buffer.reads_whole_kv_buffer = True
            whole_buffer.has_decode_kernel = getattr(attention_fn, "has_decode_kernel", False)
            return whole_buffer

        def per_layer(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *, scale, soft_cap=None, **static):
            def local(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc):
                return attention_fn(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                                    scale=scale, soft_cap=soft_cap, **static)

            kv_spec = jax.tree.map(lambda x: spec(LAYER_KV_AXES, x.ndim), k_pages)  # a QuantizedKV: both leaves
            return jax.shard_map(
                local, mesh=mesh, out_specs=q_spec, check_vma=False,
                in_specs=(q_spec, kv_spec, kv_spec, P(), P(), P()),
            )(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc)

        return per_layer


    def shard_experts(self, expert_fn: Callable) -> Callable:
        """`expert_fn` (models/moe.py `grouped_experts`) with experts split over `tp`: expert parallelism.

        Device d holds experts [d E/tp, (d+1) E/tp); each device takes 1/tp of the (replicated) tokens
        and sends every (token, expert) pair to the expert's device by all-to-all, and the results
        come back the same way (device/expert_parallel.py).
        """
        return all_to_all_experts(expert_fn, self.mesh, TP)


def per_device_bytes(array: jax.Array) -> dict[int, int]:
    """Bytes each (addressable) device holds of `array`: device id -> bytes."""
    held: dict[int, int] = {}
    for shard in array.addressable_shards:
        held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held
