"""x @ W for a float32 layer projection read from the whole stack of layers, as one XLA:CPU custom call
(`cpu/dense_matmul.cc`).

Inside the model's scan over stacked layers XLA:CPU copies each layer's weight out of the stack (a
dynamic-slice fusion per weight, every step) and hands the copy to Eigen's GEMM; the kernel reads the
layer's weight where it lies, each thread one contiguous range of its rows (`cpu/matmul.h`,
benchmarks/peers/README.md, ninth pass). Built at first use (`cpu_kernels.py`); where it cannot be,
`available()` is False and the model keeps XLA's path (`models/gguf_blocks.linear`).

    x  float32 [M, K]      w  float32 [L, K, N] (one layer: [K, N])      layer  int32 []   ->  y float32 [M, N]

Differentiable (`jax.custom_vjp`): the forward is the kernel, the backward XLA's dots (dx = dy W^T,
dW[layer] = x^T dy), so a trainer's forward can be the engine's own arithmetic (jaxpaged/rl/). Each
output row's sum over k runs in an order fixed by K and the thread count, never by M or the other
rows: a row's result does not depend on the batch it is in (EngineConfig.batch_invariant).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxpaged.ops import cpu_kernels

NAME = "dense_matmul"


def available() -> bool:
    return cpu_kernels.register(NAME)


def enabled() -> bool:
    return cpu_kernels.enabled(NAME)


def dense_matmul(x: ArrayLike, w: ArrayLike, layer: ArrayLike = 0, *, march: str = "native") -> jax.Array:
    """x [M, K] float32 @ layer `layer` of the stacked float32 weight w [L, K, N] (one layer [K, N]: L = 1)
    -> y [M, N] float32; `layer` an int32 scalar, traced or not. CPU only: call `available()` first.
    `march`: the build to run (another instruction set than the host's: tests; cpu_kernels.register)."""
    if w.ndim == 2:  # one layer's weight: a leading axis of 1 (a free reshape)
        w = w[None]
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1] or w.dtype != jnp.float32:
        raise ValueError(f"dense_matmul: x [M, K] needs a float32 w [L, K, N] or [K, N] with the same K; "
                         f"got x {x.shape}, w {w.shape} {w.dtype}")
    if w.shape[2] % 16:
        raise ValueError(f"dense_matmul: N={w.shape[2]} output columns must be a multiple of 16")
    if not cpu_kernels.register(NAME, march):
        raise RuntimeError(f"{cpu_kernels.target(NAME, march)} could not be built on this machine (see the warning logged); use XLA's path")
    return _differentiable(march, jnp.asarray(x, jnp.float32), w, jnp.asarray(layer, jnp.int32))


def _kernel(march, x, w, layer):
    call = jax.ffi.ffi_call(cpu_kernels.target(NAME, march), jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    return call(x, w, layer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(march, x, w, layer):
    return _kernel(march, x, w, layer)


def _forward(march, x, w, layer):
    return _kernel(march, x, w, layer), (x, w, layer)


def _backward(march, saved, dy):
    x, w, layer = saved
    w_layer = jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)  # [K, N]
    dx = dy @ w_layer.T
    dw = jnp.zeros_like(w).at[layer].set(x.T @ dy)  # one layer's share of the stack
    return dx, dw, None  # the layer index is an integer: no cotangent


_differentiable.defvjp(_forward, _backward)
