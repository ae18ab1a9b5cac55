"""The weights as the step reads them: one buffer per layer, so no step copies a weight.

The canonical parameter tree (what loading, sharding, `update_params` and `LLM.params` speak) stacks
every layer's parameter on a leading num_layers axis. A loop over stacked weights must take layer
i's slice of each, and XLA materialises those slices: on an H100 every dynamic-slice fusion of the
scan is a memcpy (1.76 GB per Qwen3-0.6B decode step, 28 GB for Llama-3-8B), on the CPU a copy
thunk (20% of a decode step); even unrolled, static slices feeding a merged QKV / gate-up GEMM are
copied. So the runner keeps the weights in a serving layout instead:

    canonical   params["params"]["layers"] = {"attn": {"q_proj": [L, D, N, H], ...}, ...}
    serving     params["params"]["layers"] = ({"attn": {"q_proj": [D, N, H], ...}, ...},   # layer 0
                                              ...)                                         # layer L-1

and the model unrolls the layers over it (models/llama.py), each GEMM reading its own buffer in
place. Same bytes, split once when weights arrive (`split_layers`, leaf by leaf: the peak is one
stacked leaf more); `stack_layers` rebuilds the canonical tree when someone reads it (a copy).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.device.param_dtypes import check_param_dtypes
from jaxpaged.models import gguf_blocks
from jaxpaged.models.gguf_blocks import leaf_dtype
from jaxpaged.ops import gguf_panels


def _with_layers(params, layers):
    """`params` with `params["params"]["layers"]` replaced (same mapping types)."""
    inner = dict(params["params"])
    inner["layers"] = layers
    outer = dict(params)
    outer["params"] = type(params["params"])(inner) if not isinstance(params["params"], dict) else inner
    return type(params)(outer) if not isinstance(params, dict) else outer


def has_stacked_layers(params) -> bool:
    return isinstance(params, Mapping) and isinstance(params.get("params"), Mapping) and isinstance(
        params["params"].get("layers"), Mapping)


def _unstack(leaf, num_layers: int, delete: bool) -> list:
    if isinstance(leaf, jax.ShapeDtypeStruct):  # a compile-only runner: shapes, no memory
        sharding = leaf.sharding  # on a mesh (tensor parallel): the layer's spec, the stacked one's past its layers axis
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
        return [jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)] * num_layers
    if not isinstance(leaf, jax.Array):
        return list(np.asarray(leaf))  # host arrays: views, no copy
    parts = jnp.unstack(leaf)  # one op; each part is a buffer of its own
    if isinstance(leaf.sharding, jax.sharding.NamedSharding):  # tensor parallel: each part split as the stack was
        layer = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec(*leaf.sharding.spec[1:]))
        parts = [jax.device_put(part, layer) for part in parts]
    if delete:  # the runner's own copy (device/runner.py `_to_device`): its bytes now live in parts
        leaf.delete()
    return list(parts)


def split_layers(params, *, delete: bool = False):
    """The serving layout of a canonical tree (anything else is returned as is). `delete`: the device
    leaves are the caller's own copies, each stacked leaf deleted once split (the peak: one leaf more)."""
    if not has_stacked_layers(params):
        return params
    stacked = params["params"]["layers"]
    leaves, treedef = jax.tree.flatten(stacked)
    num_layers = leaves[0].shape[0]
    per_leaf = [_unstack(leaf, num_layers, delete) for leaf in leaves]
    layers = tuple(jax.tree.unflatten(treedef, [parts[i] for parts in per_leaf]) for i in range(num_layers))
    return _with_layers(params, layers)


def _stack(parts):
    first = parts[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(parts), *first.shape), first.dtype, sharding=first.sharding)
    if isinstance(first, jax.Array):
        return jnp.stack(parts)
    return np.stack(parts)


def stack_layers(params):
    """The canonical tree of a serving-layout one (a new stacked copy of the layer weights)."""
    if params is None or has_stacked_layers(params):
        return params
    layers = params["params"]["layers"]
    treedef = jax.tree.structure(layers[0])
    per_layer = [jax.tree.leaves(layer) for layer in layers]
    stacked = [_stack([leaves[j] for leaves in per_layer]) for j in range(len(per_layer[0]))]
    return _with_layers(params, jax.tree.unflatten(treedef, stacked))


def serving_layout(params, *, per_layer: bool, kernels: frozenset):
    """The tree the step reads, from the runner's own canonical copy (whose device leaves it consumes):
    GGUF projections as panels where the gguf_panels kernel serves them (models/gguf_blocks.py
    `to_panels`), then one buffer per layer with `per_layer`."""
    if gguf_panels.NAME in kernels and gguf_blocks.SERVE_PANELS:
        params = gguf_blocks.to_panels(params, delete=True)
    return split_layers(params, delete=True) if per_layer else params


def canonical_layout(served):
    """The canonical tree of a served one (new arrays where the layout differs)."""
    return gguf_blocks.from_panels(stack_layers(served))


def own_copy(params, dtype, tp=None):
    """The engine's own float copy of `params` in `dtype` (canonical layout).

    Always a copy (`jnp.array(copy=True)`; `jnp.asarray` returns the caller's buffer when the
    dtype matches): a training loop that later donates or deletes its arrays must not leave the
    engine holding deleted buffers. Float leaves of another precision are cast, with a warning;
    any other dtype is refused (device/param_dtypes.py). `tp`: a
    `device.sharding.TensorParallel`, whose `place_params` puts each leaf on its mesh.
    """
    check_param_dtypes(params, dtype)
    if tp is not None:  # placed shard by shard (device_put copies); no device sees the whole model
        return tp.place_params(params)
    # One device holds the whole model: a leaf on other devices (a trainer's mesh) comes via the host.
    default = jax.devices()[0]
    return jax.tree_util.tree_map_with_path(lambda path, x: jnp.array(
        np.asarray(x) if isinstance(x, jax.Array) and x.sharding.device_set != {default} else x,
        dtype=leaf_dtype(path, dtype), copy=True), params)
