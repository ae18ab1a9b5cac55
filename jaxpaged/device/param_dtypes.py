"""What dtypes of weights an engine takes: floats, cast to the engine's dtype with a warning (GGUF
block leaves, quantization="gguf", keep their own: uint8 codes, float32 scales and mins)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxpaged.models.gguf_blocks import is_kept_leaf, leaf_dtype, leaf_name


def check_param_dtypes(params, dtype) -> None:
    """ValueError for a leaf that is not floating point (casting integers to weights is never what
    was meant); a UserWarning when float leaves of another precision will be cast to `dtype` (bf16
    weights in a float32 engine run as float32, which is not what a bf16 engine computes)."""
    cast = []

    def check(path, x):
        x_dtype = getattr(x, "dtype", None)
        if is_kept_leaf(leaf_name(path)):  # GGUF codes, scales and mins (quantization="gguf") have fixed dtypes
            kept_dtype = leaf_dtype(path, dtype)
            if x_dtype is None or jnp.dtype(x_dtype) != kept_dtype:
                raise ValueError(f"param {jax.tree_util.keystr(path)} has dtype {x_dtype}; GGUF block leaves are "
                                 f"{kept_dtype} (models/gguf_blocks.py): pass them as llm.params has them")
            return
        if x_dtype is None or not jnp.issubdtype(x_dtype, jnp.floating):
            raise ValueError(f"param {jax.tree_util.keystr(path)} has dtype {x_dtype}; weights must be floating "
                             f"point (they are cast to the model dtype {dtype})")
        if jnp.dtype(x_dtype) != dtype:
            cast.append((jax.tree_util.keystr(path), jnp.dtype(x_dtype)))

    jax.tree_util.tree_map_with_path(check, params)
    if cast:
        warnings.warn(
            f"{len(cast)} params are not in the engine's dtype {dtype} (e.g. {cast[0][0]} is {cast[0][1]}) and are "
            f"cast to {dtype}; to run in {cast[0][1]} build the engine with dtype='{cast[0][1]}', to silence this "
            f"cast them first: jax.tree.map(lambda x: x.astype('{dtype}'), params)", UserWarning, stacklevel=2)
