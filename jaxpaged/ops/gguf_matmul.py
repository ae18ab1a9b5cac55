"""x @ W for a weight kept as GGUF block codes, as one XLA:CPU custom call (`cpu/gguf_matmul.cc`).

XLA:CPU otherwise dequantizes the layer's codes into a float32 weight and hands it to Eigen's GEMM,
which packs it again at every call; the kernel reads each code once and dequantizes it in registers
(benchmarks/peers/README.md, seventh pass). Built at first use (`cpu_kernels.py`); where it cannot be,
`available()` is False and the model keeps the XLA path (`models/gguf_blocks.py`), which computes the
same dequantized weights.

    x       float32 [M, K]           codes  uint8 [L, K/32, 32, N]      layer  int32 []
    scales  float32 [L, K/32, N]     mins   float32 [L, K/32, N]    ->  y float32 [M, N]

4-bit codes may come packed, two per byte: codes uint8 [L, K/32, 16, N], byte j of a block holding
k row j in its low nibble and row j + 16 in its high (GGUF's own order; models/gguf_blocks.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpaged.ops import cpu_kernels

NAME = "gguf_matmul"
TARGET = f"jaxpaged_{NAME}"


def available() -> bool:
    return cpu_kernels.register(NAME)


def enabled() -> bool:
    return cpu_kernels.enabled(NAME)


def gguf_matmul(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: ArrayLike = 0, *,
                march: str = "native") -> jax.Array:
    """x [M, K] float32 @ layer `layer` of the stacked weight
    W[l, k, n] = scales[l, k/32, n] * codes[l, k, n] + mins[l, k/32, n]  ->  y [M, N] float32.

    codes uint8 [L, K/32, 32, N] (or packed 4-bit codes [L, K/32, 16, N]), scales and mins float32
    [L, K/32, N] (one layer: [K/32, 32 or 16, N] and [K/32, N], taken as L = 1); `layer` an int32
    scalar, traced or not. CPU only: call `available()` first.
    `march`: the build to run (another instruction set than the host's: tests; cpu_kernels.register).
    """
    if codes.ndim == 3:  # one layer's weight: a leading axis of 1 (a free reshape)
        codes, scales, mins = codes[None], scales[None], mins[None]
    if codes.ndim != 4 or x.ndim != 2:
        raise ValueError(f"gguf_matmul: x must be [M, K] and codes [L, K/32, 32 or 16, N] (one layer: "
                         f"[K/32, 32 or 16, N]); got {x.shape} and {codes.shape}")
    (m, k), (num_layers, _, rows, n) = x.shape, codes.shape
    if (codes.shape != (num_layers, k // 32, rows, n) or rows not in (16, 32) or k % 32
            or scales.shape != (num_layers, k // 32, n) or mins.shape != scales.shape):
        raise ValueError(f"gguf_matmul: {x.shape=} needs codes [L, {k // 32}, 32, N] (packed: [L, {k // 32}, 16, N]) "
                         f"and scales, mins [L, {k // 32}, N]; got {codes.shape}, {scales.shape}, {mins.shape}")
    if n % 16:
        raise ValueError(f"gguf_matmul: {n=} output columns must be a multiple of 16")
    if not cpu_kernels.register(NAME, march):
        raise RuntimeError(f"{cpu_kernels.target(NAME, march)} could not be built on this machine (see the warning logged); use XLA's path")
    call = jax.ffi.ffi_call(cpu_kernels.target(NAME, march), jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), codes, scales, mins, jnp.asarray(layer, jnp.int32))


def unpacked(codes):
    """Codes one per byte, [..., 32, N], from either layout ([..., 16, N] packed: rows j from the low
    nibbles, then rows j + 16 from the high)."""
    if codes.shape[-2] != 16:
        return codes
    return jnp.concatenate([codes & 15, codes >> 4], axis=-2)


def reference(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: int = 0) -> jax.Array:
    """The plain form: dequantize layer `layer` to float32, then one dot."""
    if codes.ndim == 4:
        codes, scales, mins = codes[layer], scales[layer], mins[layer]
    k, n = x.shape[-1], scales.shape[-1]
    codes = unpacked(codes)
    weight = (scales[:, None, :] * codes.astype(jnp.float32) + mins[:, None, :]).reshape(k, n)
    return jnp.dot(x.astype(jnp.float32), weight, precision=jax.lax.Precision.HIGHEST)
