"""x @ W for a weight kept as GGUF block codes in 16-column panels, as one XLA:CPU custom call
(`cpu/gguf_panels.cc`): a tied LM head, logits = x @ E^T with the embedding E's codes.

XLA:CPU reads the float32 embedding for every step's logits (SmolLM2: 113 MB, a third of a one-row
decode step); the kernel reads its Q8_0 codes, scales and minimums (35 MB), each panel a contiguous
run, and dequantizes them in registers. Built at first use (`cpu_kernels.py`); where it cannot be,
`available()` is False and the model dequantizes the embedding with XLA (`models/gguf_blocks.py`).

    x  float32 [M, K]    codes uint8 [N/16, K, 16]    scales, mins float32 [N/16, K/32, 16]  ->  y [M, N]
    W[k, 16p + j] = scales[p, k/32, j] * codes[p, k, j] + mins[p, k/32, j]
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


def check_shapes(x_shape: tuple, codes_shape: tuple, scales_shape: tuple, mins_shape: tuple) -> None:
    if len(x_shape) != 2 or len(codes_shape) != 3:
        raise ValueError(f"gguf_panels: x must be [M, K] and codes [N/16, K, 16]; got {x_shape} and {codes_shape}")
    k, num_panels = x_shape[1], codes_shape[0]
    want = (num_panels, k // 32, PANEL)
    if k % 32 or codes_shape[1:] != (k, PANEL) or tuple(scales_shape) != want or tuple(mins_shape) != want:
        raise ValueError(f"gguf_panels: {x_shape=} needs codes [N/16, {k}, 16] and scales, mins [N/16, {k // 32}, 16] "
                         f"with K % 32 == 0; got {codes_shape}, {scales_shape}, {mins_shape}")


def gguf_panels(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, *,
                march: str = "native") -> jax.Array:
    """x [M, K] float32 @ W [K, N] kept as panels (module docstring) -> y [M, N] float32.
    CPU only: call `available()` first. `march`: the build to run (tests; cpu_kernels.register)."""
    check_shapes(x.shape, codes.shape, scales.shape, mins.shape)
    if not cpu_kernels.register(NAME, march):
        raise RuntimeError(f"{cpu_kernels.target(NAME, march)} could not be built on this machine (see the warning "
                           "logged); use XLA's path (weight())")
    m, n = x.shape[0], codes.shape[0] * PANEL
    call = jax.ffi.ffi_call(cpu_kernels.target(NAME, march), jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.astype(jnp.float32), codes, scales, mins)


def weight(codes: ArrayLike, scales: ArrayLike, mins: ArrayLike) -> jax.Array:
    """W [K, N] float32 from its panels: the floats the kernel multiplies by."""
    num_panels, k, _ = codes.shape
    w = (jnp.repeat(scales, 32, axis=1) * codes.astype(jnp.float32) + jnp.repeat(mins, 32, axis=1))  # [P, K, 16]
    return w.transpose(1, 0, 2).reshape(k, num_panels * PANEL)


def rows(codes: ArrayLike, scales: ArrayLike, mins: ArrayLike, ids: ArrayLike) -> jax.Array:
    """W[:, ids]^T, [len(ids), K] float32: the embedding rows of token ids, dequantized alone."""
    panel, j = ids // PANEL, ids % PANEL
    return jnp.repeat(scales[panel, :, j], 32, axis=-1) * codes[panel, :, j].astype(jnp.float32) + jnp.repeat(
        mins[panel, :, j], 32, axis=-1)


def reference(x: ArrayLike, codes: ArrayLike, scales: ArrayLike, mins: ArrayLike) -> jax.Array:
    """The plain form: dequantize, then one dot."""
    return jnp.dot(x.astype(jnp.float32), weight(codes, scales, mins), precision=jax.lax.Precision.HIGHEST)
