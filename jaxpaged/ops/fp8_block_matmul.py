"""x @ W for a block-scaled FP8 weight on a GPU: a Pallas (Triton) GEMM that reads each weight byte once.

The weight and its scales in ops/fp8_matmul.py's layout: w float8_e4m3fn [K, N], scale float32 [G, N]
with G > 1 blocks of B = K / G rows (Hugging Face's `weight_block_size` [128, 128]: each column block's
scale repeated over its 128 columns). XLA has no block-scaled dot on Hopper: its forms of the product
write a dequantized bf16 copy of the weight and read it back, or write [M, G, N] float32 partial
products (or, at one row, a weight-sized product); `jax.nn.scaled_matmul` falls back to the first.
On the H100 profile that is 2.1x the ideal bytes of a Qwen3-8B decode step, 4.7-35x one projection's.

The kernel: a grid over tiles of N columns, all M rows in one tile; each program walks K one block
(B rows) at a time, loads the FP8 tile w[gB:(g+1)B, n tile] and the block's scale row, and adds

    "float" (W8A16)  acc += dot(x[:, block g], float(w tile)) * scale[g, n tile]
    "fp8"   (W8A8)   acc += dot(q[:, block g], w tile) * x_scale[:, g] * scale[g, n tile]

to a float32 accumulator, where q, x_scale are x quantized per token and block of K (fp8_matmul's
dynamic per-token-group arithmetic) inside the kernel: each program quantizes the x tile it loads,
no launches of its own. Each block's partial is scaled and added in float32 on its own, so an FP8
tensor-core dot never sums more than one block (Hopper's FP8 MMA keeps fewer accumulator bits than
float32). W8A16 multiplies x by the FP8 values in x's dtype (exact in bf16) and scales in float32:
the dequantized weight is never rounded to bf16 (fp8_matmul's XLA form rounds it).

Columns: the grid covers the largest multiple of the tile width `block_n` in N; the last N % block_n
columns (none at every Qwen3 / DeepSeek shape: the tile is chosen to divide N) go through
fp8_matmul's XLA form, reading only those columns. Rows: M is padded to the row tile (16 at least,
Triton's smallest dot), at most `MAX_ROWS`; `use_kernel` says which calls the kernel serves, the rest
(prefill-sized M, a static activation scale, per-channel scales) stay on fp8_matmul's XLA form.

On a CPU the kernel runs in Pallas's interpret mode (tests); a GPU runner selects it with `NAME` in its
matmul kernels (models/gguf_blocks.py cpu_matmul_kernels, `linear`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxpaged.ops import fp8_matmul
from pallas_kernels.jax_compat import TRITON_COMPILER_PARAMS

NAME = "fp8_block_matmul"  # in a runner's matmul kernels: block-scaled FP8 projections through this kernel
MAX_ROWS = 128  # the most rows of x the kernel serves (decode and small steps); more: XLA's GEMM (compute bound)
BLOCK_N = (128, 64, 32, 16)  # tile widths tried, widest first: the first that divides N (else 16 and a tail)
# Launch shapes with no register spills on the H100 (ptxas, from the compiled program, W8A8 the larger):
# 16 rows x 128 columns on 4 warps; up to 64 x 128 on 8; 128 rows only with 64 columns on 8.
WIDEST_TILE = {16: 128, 32: 128, 64: 128, 128: 64}  # block_m -> the widest block_n


def available() -> bool:
    """Whether this JAX has Pallas's Triton backend (the kernel is written for it; pallas_kernels.jax_compat)."""
    return TRITON_COMPILER_PARAMS is not None


def use_kernel(x, scale, input_scale=None) -> bool:
    """Whether `block_matmul` serves this call: block scales (G > 1) of B rows, B a power of two in
    [16, 256] (Triton's tile shapes), at most MAX_ROWS rows, dynamic activations."""
    groups, k = scale.shape[0], x.shape[-1]
    rows = k // groups if groups > 1 and k % groups == 0 else 0
    return (x.ndim == 2 and groups > 1 and rows in (16, 32, 64, 128, 256) and x.shape[0] <= MAX_ROWS
            and input_scale is None)


def block_m_for(m: int) -> int:
    """The row tile: M padded to a power of two, 16 at least (Triton's smallest dot)."""
    return max(16, 1 << (m - 1).bit_length())


def block_n_for(n: int, block_m: int = 16) -> int:
    return next((b for b in BLOCK_N if n % b == 0 and b <= WIDEST_TILE[block_m]), BLOCK_N[-1])


def block_matmul(x, w, scale, *, activations: str = "float", dtype=None, block_n: int | None = None,
                 interpret: bool | None = None, num_warps: int | None = None, num_stages: int = 3) -> jax.Array:
    """x [M, K] @ W [K, N] -> [M, N] in `dtype` (default x's); W = float(w) * scale by blocks of K rows.

    block_n: the N tile (default `block_n_for`); num_warps: default 4 for one 16-row tile, else 8
    (WIDEST_TILE); interpret: None = compiled when lowered for a CUDA GPU and interpreted otherwise
    (pallas_kernels/_common.by_target), True / False as given."""
    dtype = dtype or x.dtype
    (m, k), (groups, n) = x.shape, scale.shape
    if w.shape != (k, n) or w.dtype != jnp.float8_e4m3fn or not use_kernel(x, scale):
        raise ValueError(f"block_matmul: x [M <= {MAX_ROWS}, K], w float8_e4m3fn [K, N], scale [G, N] with K / G in "
                         f"16..256 a power of two; got {x.shape}, {w.shape} {w.dtype}, {scale.shape} (use "
                         "fp8_matmul.fp8_matmul)")
    if activations not in fp8_matmul.ACTIVATIONS:
        raise ValueError(f"block_matmul: activations={activations!r} must be one of {fp8_matmul.ACTIVATIONS}")
    block_n = block_n or block_n_for(n, block_m_for(m))
    num_warps = num_warps or (4 if block_m_for(m) == 16 else 8)
    main = n - n % block_n
    parts = []
    if main:
        parts.append(_kernel_part(x, w, scale, activations, main, block_n, dtype, interpret, num_warps, num_stages))
    if main < n:  # the columns past the last whole tile: XLA's form reads only those
        parts.append(fp8_matmul.fp8_matmul(x, w[:, main:], scale[:, main:], activations=activations, dtype=dtype))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _kernel_part(x, w, scale, activations, columns, block_n, dtype, interpret, num_warps, num_stages):
    """[M, columns] in `dtype` (summed in float32, rounded once): the kernel over the first `columns` (a
    multiple of block_n) of W."""
    (m, k), groups = x.shape, scale.shape[0]
    rows = k // groups
    block_m = block_m_for(m)
    lhs = jnp.pad(x, ((0, block_m - m), (0, 0)))  # zero rows: their FP8 scale is TINY, their products 0
    kernel = functools.partial(_block_kernel, groups=groups, rows=rows, w8a8=activations == "fp8")

    def call(interpret_mode: bool):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((block_m, columns), dtype),
            grid=(columns // block_n,),
            in_specs=[pl.BlockSpec((block_m, k), lambda j: (0, 0)),
                      pl.BlockSpec((k, block_n), lambda j: (0, j)),
                      pl.BlockSpec((groups, block_n), lambda j: (0, j))],
            out_specs=pl.BlockSpec((block_m, block_n), lambda j: (0, j)),
            compiler_params=(None if TRITON_COMPILER_PARAMS is None
                             else TRITON_COMPILER_PARAMS(num_warps=num_warps, num_stages=num_stages)),
            interpret=interpret_mode,
        )(lhs, w, scale)

    out = call(bool(interpret)) if interpret is not None else lax.platform_dependent(
        cuda=lambda: call(False), default=lambda: call(True))
    return out[:m]


def _block_kernel(x_ref, w_ref, scale_ref, out_ref, *, groups: int, rows: int, w8a8: bool):
    """One tile of N columns: acc [block_m, block_n] float32 over the G blocks of K."""

    def step(g, acc):
        start = pl.multiple_of(g * rows, rows)
        xb = x_ref[:, pl.ds(start, rows)]  # [block_m, B]
        wb = w_ref[pl.ds(start, rows), :]  # [B, block_n] float8
        if w8a8:  # x quantized per token and block as fp8_matmul's dynamic W8A8; FP8 x FP8 exact in float32
            xf = xb.astype(jnp.float32)
            x_scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=1) / fp8_matmul.FP8_MAX, fp8_matmul.TINY)  # [block_m]
            q = jnp.clip(xf / x_scale[:, None], -fp8_matmul.FP8_MAX, fp8_matmul.FP8_MAX).astype(wb.dtype)
            part = lax.dot_general(q, wb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            part = part * x_scale[:, None]
        else:  # the FP8 values are exact in x's dtype (bf16 or wider)
            precision = lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None
            part = lax.dot_general(xb, wb.astype(xb.dtype), (((1,), (0,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)
        return acc + part * scale_ref[g, :][None, :]

    acc = lax.fori_loop(0, groups, step, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)
