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

`gguf_panels_q8` multiplies the same panels in GGUF's integer arithmetic (`cpu/gguf_panels_q8.cc`): x
quantized to Q8_1 blocks (`quantize_q8_1`), integer sums per block, as vLLM's GGUF layers run on a GPU
and llama.cpp on a CPU (EngineConfig.gguf_activations="q8_1"). `reference_q8_1` is its plain form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpaged.ops import cpu_kernels

NAME = "gguf_panels"
Q8_NAME = "gguf_panels_q8"  # the same panels against Q8_1 activations
PANEL = 16  # columns per panel
BLOCK = 32  # GGUF values per scale: the Q8_1 block of x too


def available() -> bool:
    return cpu_kernels.register(NAME)


def enabled() -> bool:
    return cpu_kernels.enabled(NAME)


def q8_enabled() -> bool:
    return cpu_kernels.enabled(Q8_NAME)


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
    return _call(NAME, x, codes, scales, mins, layer, march)


def gguf_panels_q8(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: ArrayLike = 0, *,
                   march: str = "native") -> jax.Array:
    """As `gguf_panels`, with x quantized to Q8_1 blocks and each block's products summed as integers
    (`reference_q8_1`; cpu/gguf_panels_q8.cc): GGUF's arithmetic, not float32's."""
    return _call(Q8_NAME, x, codes, scales, mins, layer, march)


def _call(name: str, x, codes, scales, mins, layer, march: str) -> jax.Array:
    if codes.ndim == 3:  # one weight: a leading axis of 1 (a free reshape)
        codes, scales, mins = codes[None], scales[None], mins[None]
    check_shapes(x.shape, codes.shape, scales.shape, mins.shape)
    if not cpu_kernels.register(name, march):
        raise RuntimeError(f"{cpu_kernels.target(name, march)} could not be built on this machine (see the warning "
                           "logged); use XLA's path (weight())")
    m, n = x.shape[0], codes.shape[1] * PANEL
    call = jax.ffi.ffi_call(cpu_kernels.target(name, march), jax.ShapeDtypeStruct((m, n), jnp.float32))
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


def quantize_q8_1(x: ArrayLike) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [M, K] float32 as Q8_1 blocks of 32: qx int8 [M, K], dx and sx float32 [M, K/32], with dx =
    max |x| * (1 / 127) per block, qx = round(x * (1 / dx)) (to nearest even; 0 where dx is 0) and
    sx = dx * sum(qx). (llama.cpp divides by 127, within one ulp, and keeps dx and sx in float16.) Bit
    for bit the kernel's: XLA:CPU computes a division as a product by a reciprocal, so there is none."""
    m, k = x.shape
    blocks = jnp.asarray(x, jnp.float32).reshape(m, k // BLOCK, BLOCK)
    d = jnp.max(jnp.abs(blocks), axis=-1) * jnp.float32(1 / 127)
    inv = jnp.where(d != 0, jnp.float32(1) / jnp.where(d != 0, d, 1), 0)
    q = jnp.round(blocks * inv[..., None]).astype(jnp.int32)
    return q.astype(jnp.int8).reshape(m, k), d, d * jnp.sum(q, axis=-1).astype(jnp.float32)


def dequantized_q8_1(x: ArrayLike) -> jax.Array:
    """x [..., K] as its Q8_1 blocks hold it (dx * qx, float32): multiplied by float weights, the same
    products as `gguf_panels_q8`'s up to float32 rounding; XLA's form of GGUF's arithmetic."""
    shape = x.shape
    qx, dx, _ = quantize_q8_1(jnp.reshape(x, (-1, shape[-1])))
    return (qx.astype(jnp.float32).reshape(-1, shape[-1] // BLOCK, BLOCK) * dx[..., None]).reshape(shape)


def reference_q8_1(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, layer: int = 0) -> jax.Array:
    """The plain form of `gguf_panels_q8`: Q8_1 x, exact integer sums per block, then
    y = sum over blocks b of (scale * dx) * sum(code * qx) + min * sx, in float32."""
    if codes.ndim == 4:
        codes, scales, mins = codes[layer], scales[layer], mins[layer]
    num_panels, blocks = scales.shape[:2]
    qx, dx, sx = quantize_q8_1(x)
    m = qx.shape[0]
    code = unpacked(codes, blocks * BLOCK).astype(jnp.int32).reshape(num_panels, blocks, BLOCK, PANEL)
    dots = jnp.einsum("mbi,pbic->mbpc", qx.astype(jnp.int32).reshape(m, blocks, BLOCK), code)  # exact int32
    scaled = dots.astype(jnp.float32) * (scales.transpose(1, 0, 2)[None] * dx[:, :, None, None])
    shifted = mins.transpose(1, 0, 2)[None] * sx[:, :, None, None]  # [M, blocks, P, 16]
    return jnp.sum(scaled + shifted, axis=1).reshape(m, num_panels * PANEL)
