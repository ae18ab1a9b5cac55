"""x @ W for a weight kept as GGUF block codes in 16-column panels, as one XLA:CPU custom call
(`cpu/gguf_panels.cc`): the layer projections as the runner serves them, and a tied LM head,
logits = x @ E^T with the embedding E's codes (models/gguf_blocks.py).

Each panel's codes, scales and minimums are contiguous runs, read in order and dequantized in
registers (SmolLM2's head: 35 MB of Q8_0 codes a step instead of 113 MB of float32). Built at first
use (`cpu_kernels.py`); where it cannot be, `available()` is False and the model dequantizes with XLA.

    x       float32 [M, K]              layer  int32 []
    codes   uint8 [L, N/16, K, 16]      (4-bit codes packed two per byte: [L, N/16, K/2, 16], byte row j
                                        of each block of 32 k rows holding row j low, row j + 16 high)
    scales, mins  float32 [L, N/16, K/32, 16]                                   ->  y float32 [M, N]
    W[l, k, 16p + c] = scales[l, p, k/32, c] * code[l, p, k, c] + mins[l, p, k/32, c]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpaged.ops import cpu_kernels

NAME = "gguf_panels"
PANEL = 16  # columns per panel


def available() -> bool:
    return cpu_kernels.register(NAME)


def enabled() -> bool:
    return cpu_kernels.enabled(NAME)


def is_packed(codes_shape: tuple, k: int) -> bool:
    """Whether panels of K rows ([..., N/16, K or K/2, 16]) hold two 4-bit codes per byte."""
    return codes_shape[-2] * 2 == k


def check_shapes(x_shape: tuple, codes_shape: tuple, scales_shape: tuple, mins_shape: tuple) -> None:
    if len(x_shape) != 2 or len(codes_shape) != 4:
        raise ValueError(f"gguf_panels: x must be [M, K] and codes [L, N/16, K or K/2, 16] (one weight: "
                         f"[N/16, K or K/2, 16]); got {x_shape} and {codes_shape}")
    k, (num_layers, num_panels) = x_shape[1], codes_shape[:2]
    want = (num_layers, num_panels, k // 32, PANEL)
    if (k % 32 or codes_shape[2:] not in ((k, PANEL), (k // 2, PANEL)) or tuple(scales_shape) != want
            or tuple(mins_shape) != want):
        raise ValueError(f"gguf_panels: {x_shape=} needs codes [L, N/16, {k}, 16] (packed: [L, N/16, {k // 2}, 16]) and "
                         f"scales, mins [L, N/16, {k // 32}, 16] with K % 32 == 0; got {codes_shape}, {scales_shape}, "
                         f"{mins_shape}")


def gguf_panels(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: ArrayLike = 0, *,
                march: str = "native") -> jax.Array:
    """x [M, K] float32 @ layer `layer` of a stacked weight W [L, K, N] kept as panels (module
    docstring) -> y [M, N] float32. One weight ([N/16, K or K/2, 16] and [N/16, K/32, 16]) is taken as
    L = 1. `layer` an int32 scalar, traced or not. CPU only: call `available()` first.
    `march`: the build to run (tests; cpu_kernels.register)."""
    if codes.ndim == 3:  # one weight: a leading axis of 1 (a free reshape)
        codes, scales, mins = codes[None], scales[None], mins[None]
    check_shapes(x.shape, codes.shape, scales.shape, mins.shape)
    if not cpu_kernels.register(NAME, march):
        raise RuntimeError(f"{cpu_kernels.target(NAME, march)} could not be built on this machine (see the warning "
                           "logged); use XLA's path (weight())")
    m, n = x.shape[0], codes.shape[1] * PANEL
    call = jax.ffi.ffi_call(cpu_kernels.target(NAME, march), jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), codes, scales, mins, jnp.asarray(layer, jnp.int32))


def unpacked(codes: ArrayLike, k: int) -> ArrayLike:
    """One code per byte, [..., N/16, K, 16], from either layout of K rows."""
    if not is_packed(codes.shape, k):
        return codes
    blocks = codes.reshape(*codes.shape[:-2], k // 32, 16, PANEL)  # byte row j: rows j (low) and j + 16 (high)
    return jnp.concatenate([blocks & 15, blocks >> 4], axis=-2).reshape(*codes.shape[:-2], k, PANEL)


def weight(codes: ArrayLike, scales: ArrayLike, mins: ArrayLike) -> jax.Array:
    """W [K, N] float32 of one weight's panels: the floats the kernel multiplies by."""
    num_panels, k = scales.shape[0], scales.shape[1] * 32
    codes = unpacked(codes, k)
    w = jnp.repeat(scales, 32, axis=1) * codes.astype(jnp.float32) + jnp.repeat(mins, 32, axis=1)  # [P, K, 16]
    return w.transpose(1, 0, 2).reshape(k, num_panels * PANEL)


def rows(codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, ids: ArrayLike) -> jax.Array:
    """W[:, ids]^T, [len(ids), K] float32: the embedding rows of token ids, dequantized alone."""
    panel, j = ids // PANEL, ids % PANEL
    return jnp.repeat(scales[panel, :, j], 32, axis=-1) * codes[panel, :, j].astype(jnp.float32) + jnp.repeat(
        mins[panel, :, j], 32, axis=-1)


def reference(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: int = 0) -> jax.Array:
    """The plain form: dequantize (layer `layer` of a stack), then one dot."""
    if codes.ndim == 4:
        codes, scales, mins = codes[layer], scales[layer], mins[layer]
    return jnp.dot(x.astype(jnp.float32), weight(codes, scales, mins), precision=jax.lax.Precision.HIGHEST)
