"""A disk cache of converted parameters (orbax), so the second start skips GGUF dequantization.

Layout, one directory per cache entry:

    $JAXPAGED_CACHE_DIR/params/<key>/          (default ~/.cache/jaxpaged/params/<key>/)
        state/          orbax StandardCheckpointer output (any pytree of arrays)
        COMPLETE        written last: its JSON records the key's inputs and every leaf's path,
                        shape and dtype; no COMPLETE, no cache hit (a save cut short is ignored)

`params_cache_key` hashes the source files' identity (absolute path, size, mtime) with the dtype and
a caller-chosen format tag, so a changed file, another dtype, or a new conversion layout each get a
new entry. An entry that fails to restore or does not match its record is deleted and reported as a
miss (`restore_params` returns None): the caller converts again and saves, it never crashes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Any
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "JAXPAGED_CACHE_DIR"
_COMPLETE = "COMPLETE"


def cache_root() -> str:
    """`$JAXPAGED_CACHE_DIR/params`, default `~/.cache/jaxpaged/params`."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged")
    return os.path.join(os.path.abspath(base), "params")


def params_cache_key(source_files: Sequence[str], dtype: Any, format_tag: str = "v1") -> str:
    """A short hex key naming the converted parameters of `source_files` in `dtype`.

    Bump `format_tag` when the conversion changes (another parameter layout) to leave old entries.
    """
    if not source_files:
        raise ValueError("params_cache_key needs at least one source file; pass the model's weight files")
    parts = [f"format={format_tag}", f"dtype={np.dtype(dtype).name}"]
    for path in sorted(os.path.abspath(p) for p in source_files):
        stat = os.stat(path)
        parts.append(f"{path}|{stat.st_size}|{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def entry_dir(key: str) -> str:
    return os.path.join(cache_root(), key)


def _leaf_record(params: Any) -> list[list]:
    import jax

    leaves = jax.tree_util.tree_leaves_with_path(params)
    return [[jax.tree_util.keystr(path), list(np.shape(leaf)), np.dtype(leaf.dtype).name] for path, leaf in leaves]


def save_params(params: Any, key: str) -> str:
    """Write `params` (any pytree of jax or numpy arrays) under `key`; returns the entry directory.

    Overwrites an existing entry. Written into a temporary sibling and renamed, then marked
    COMPLETE, so a crash mid-save leaves no entry that `restore_params` would trust.
    """
    import orbax.checkpoint as ocp

    final = entry_dir(key)
    staging = f"{final}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(staging, "state"), params)
        checkpointer.wait_until_finished()
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    with open(os.path.join(final, _COMPLETE), "w") as f:
        json.dump({"key": key, "leaves": _leaf_record(params)}, f)
    return final


def restore_params(key: str, like: Any = None) -> Any | None:
    """The parameters saved under `key`, or None on a miss (absent, partial, or corrupted entry).

    `like`: a pytree of the expected structure (arrays or `jax.ShapeDtypeStruct`s); the result has its
    tree type and each leaf its shape/dtype. Without it, the saved structure comes back (nested dicts).
    A corrupted entry is deleted, so the caller's following `save_params` starts clean.
    """
    import jax
    import orbax.checkpoint as ocp

    final = entry_dir(key)
    marker = os.path.join(final, _COMPLETE)
    if not os.path.isfile(marker):
        if os.path.exists(final):
            logger.warning("params cache entry %s is incomplete; deleting it", final)
            shutil.rmtree(final, ignore_errors=True)
        return None
    try:
        with open(marker) as f:
            record = json.load(f)
        with ocp.StandardCheckpointer() as checkpointer:  # closed (threads joined) even on a failed read
            state = os.path.join(final, "state")
            if like is None:  # the saved structure: leaves' shapes and dtypes from the entry's metadata
                item = checkpointer.metadata(state).item_metadata
                like = getattr(item, "tree", item)
            # Into host memory, as a converted GGUF is: the engine splits the parameters over its
            # devices leaf by leaf. Restored onto the default device, the whole model would first
            # land on one accelerator (under tensor parallelism, a model that fits only split).
            host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
            abstract = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, sharding=host), like,
                is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
            params = jax.block_until_ready(checkpointer.restore(state, abstract))
        saved, restored = record["leaves"], _leaf_record(params)
        if like is not None:
            # The restored tree takes `like`'s type, so compare structure-free: shapes and dtypes in order.
            saved, restored = [leaf[1:] for leaf in saved], [leaf[1:] for leaf in restored]
        if saved != restored:
            raise ValueError(f"restored leaves do not match the saved record ({len(restored)} vs {len(saved)})")
    except Exception as error:  # noqa: BLE001 (any unreadable entry is a miss, never a crash)
        logger.warning("params cache entry %s is unreadable (%s: %s); deleting it", final, type(error).__name__, error)
        shutil.rmtree(final, ignore_errors=True)
        return None
    return params


def cached_params(source_files: Sequence[str], dtype: Any, convert, *, format_tag: str = "v1", like: Any = None):
    """`(params, hit)`: the cached conversion of `source_files` in `dtype`, or `convert()` saved for next time.

    `convert` is a zero-argument callable returning the parameter pytree (e.g. dequantize the GGUF
    and run `params_from_hf`). A failed save (read-only or full disk) is logged, not raised: the
    cache only ever makes a start faster.
    """
    key = params_cache_key(source_files, dtype, format_tag)
    params = restore_params(key, like=like)
    if params is not None:
        return params, True
    params = convert()
    try:
        save_params(params, key)
    except OSError as error:
        logger.warning("could not write params cache entry %s (%s); continuing without it", entry_dir(key), error)
    return params, False
