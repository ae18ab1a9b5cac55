"""x @ W for a weight kept as GGUF block codes, as one XLA:CPU custom call (`gguf_matmul.cc`).

XLA:CPU otherwise dequantizes the layer's codes into a float32 weight and hands it to Eigen's GEMM,
which packs it again at every call; the kernel reads each code once and dequantizes it in registers
(benchmarks/peers/README.md, seventh pass). The library is compiled at first use with the host's C++
compiler (`-O3 -march=native`) into a cache directory keyed by the source, jaxlib and compiler, and
registered with XLA's FFI for the "cpu" platform. Where no compiler is found, `available()` is False
and the model keeps the XLA path (`models/gguf_blocks.py`), which computes the same values.

    x       float32 [M, K]           codes  uint8 [L, K/32, 32, N]      layer  int32 []
    scales  float32 [L, K/32, N]     mins   float32 [L, K/32, N]    ->  y float32 [M, N]
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
from jax.typing import ArrayLike

logger = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("gguf_matmul.cc")
TARGET = "jaxpaged_gguf_matmul"
DISABLE_ENV = "JAXPAGED_GGUF_KERNEL"  # "0": keep XLA's dequantize-then-dot on the CPU


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXPAGED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxpaged")
    return pathlib.Path(root) / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(cxx: str) -> pathlib.Path:
    """The shared library for this source, jaxlib and compiler: compiled once, then reused."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + jaxlib.__version__.encode() + version.encode()).hexdigest()[:16]
    library = _cache_dir() / f"gguf_matmul-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:  # compile aside, then rename: atomic
        built = pathlib.Path(tmp) / library.name
        cmd = [cxx, "-O3", "-march=native", "-std=gnu++17", "-shared", "-fPIC", "-fno-math-errno",
               f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
        os.replace(built, library)
    return library


def enabled() -> bool:
    """Whether engines built now use the kernel: it is available and JAXPAGED_GGUF_KERNEL is not "0"
    (read at each engine build, so one process can compare both paths: benchmarks/peers/cpu_step_ab.py)."""
    return os.environ.get(DISABLE_ENV, "1") != "0" and available()


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (False: no compiler or a failed build; the reason
    is logged once)."""
    cxx = _compiler()
    if cxx is None:
        logger.warning("no C++ compiler found (set CXX): GGUF weights dequantize through XLA on the CPU")
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("the GGUF CPU kernel is unavailable, XLA dequantizes instead: %s", e)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, TARGET)), platform="cpu")
    return True


def gguf_matmul(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: ArrayLike = 0) -> jax.Array:
    """x [M, K] float32 @ layer `layer` of the stacked weight
    W[l, k, n] = scales[l, k/32, n] * codes[l, k, n] + mins[l, k/32, n]  ->  y [M, N] float32.

    codes uint8 [L, K/32, 32, N], scales and mins float32 [L, K/32, N] (one layer: [K/32, 32, N] and
    [K/32, N], taken as L = 1); `layer` an int32 scalar, traced or not. CPU only: call `available()` first.
    """
    if codes.ndim == 3:  # one layer's weight: a leading axis of 1 (a free reshape)
        codes, scales, mins = codes[None], scales[None], mins[None]
    (m, k), (num_layers, _, _, n) = x.shape, codes.shape
    if codes.shape != (num_layers, k // 32, 32, n) or scales.shape != (num_layers, k // 32, n) or mins.shape != scales.shape:
        raise ValueError(f"gguf_matmul: {x.shape=} needs codes [L, {k // 32}, 32, N] and scales, mins "
                         f"[L, {k // 32}, N]; got {codes.shape}, {scales.shape}, {mins.shape}")
    if n % 16:
        raise ValueError(f"gguf_matmul: {n=} output columns must be a multiple of 16")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), codes, scales, mins, jnp.asarray(layer, jnp.int32))


def reference(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: int = 0) -> jax.Array:
    """The plain form: dequantize layer `layer` to float32, then one dot."""
    if codes.ndim == 4:
        codes, scales, mins = codes[layer], scales[layer], mins[layer]
    k, n = x.shape[-1], scales.shape[-1]
    weight = (scales[:, None, :] * codes.astype(jnp.float32) + mins[:, None, :]).reshape(k, n)
    return jnp.dot(x.astype(jnp.float32), weight, precision=jax.lax.Precision.HIGHEST)
