"""x @ W for a 4-bit weight kept packed (W4A16), as one Pallas kernel that dequantizes inside the GEMM.

On a GPU, XLA given the packed codes dequantizes the whole weight into a bf16 buffer and hands that to
its GEMM: 0.75 bytes per weight read, 2 written, 2 read again. This kernel reads each packed byte once
and dequantizes it in registers next to the dot, so a decode step reads the weights as they are stored
(models/gguf_blocks.py's layout; AWQ / GPTQ / compressed-tensors W4A16 load into it, models/hf_quant.py):

    x       bf16 or float32 [M, K]
    codes   uint8 [K/32, 16, N]      byte j of block b: k row 32b + j in its low nibble, 32b + j + 16 in its high
    scales  float32 [K/32, N]        W[k, n] = scales[k/32, n] * code[k, n] + mins[k/32, n]
    mins    float32 [K/32, N]
    ->  y   float32 [M, N]           products in x's dtype (the weight tile rounded to it), sums in float32

The nibble order means a block's low nibbles multiply x's first 16 values of that block and its high
nibbles the next 16: x is viewed as [M, K/32, 2, 16] (a free reshape) and each step of the K loop does
two dots, x[:, b, 0, :] @ dequant(low) and x[:, b, 1, :] @ dequant(high), never interleaving nibbles.

Tiles (legend: M rows, K in-features, N out-features, S splits of K):

    grid (N / BN, cdiv(M, BM), S)   program (n, m, s): rows [m BM, m BM + BM), columns [n BN, n BN + BN),
                                    blocks of 32 in-features [s K/32/S, (s + 1) K/32/S), in steps of
                                    `blocks_per_step` blocks (a [BM, 16 bps] x [16 bps, BN] dot per nibble half)
    BM  16..64 (Triton's dot takes at least 16 rows): rows past M are masked on load and store, so a
        decode step's 2 rows read and write 2 rows, never a padded copy
    S   more than one where the (N, M) tiles alone would leave the GPU's SMs idle (a decode step's
        narrow k_proj), bounded so the float32 partial sums [S, M, N] stay small beside the weight;
        XLA adds them up

More than MAX_ROWS rows (a prefill) take XLA's path instead (`linear` in models/gguf_blocks.py:
dequantize, then one GEMM): those steps are bound by compute, where the dequantized weight is read
once per hundreds of rows and the kernel's BM <= 64 tiles would re-read the codes M / 64 times.

Pallas's Triton backend, as pallas_kernels/ (compiled when the program is lowered for a CUDA GPU,
interpreted anywhere else: `interpret=None`); `reference` is gguf_matmul.reference, the plain form.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.jax_compat import TRITON_COMPILER_PARAMS

NAME = "w4a16_matmul"  # in a runner's matmul kernels (models/gguf_blocks.py linear): packed 4-bit codes on a GPU
BLOCK, HALF = 32, 16  # in-features per scale; per nibble half of a block
MAX_ROWS = 256  # more rows than this: XLA's dequantize + GEMM (module docstring)
TARGET_PROGRAMS = 132  # one program per H100 SM: the splits of K fill at least this many where the tiles do not
NUM_WARPS, NUM_STAGES = 4, 3

if TRITON_COMPILER_PARAMS is not None:  # the Triton backend, explicitly (pallas_kernels/_common.py: why)
    from jax.experimental.pallas import triton as _triton

    _masked_load, _masked_store = _triton.load, _triton.store
else:  # pragma: no cover - a JAX without the Triton backend
    _masked_load = _masked_store = None


def supports(x_shape, codes_shape) -> bool:
    """Whether the kernel multiplies x of `x_shape` by packed codes of `codes_shape` (else: XLA's path)."""
    if len(x_shape) != 2 or len(codes_shape) != 3 or _masked_load is None:
        return False
    (m, k), (kb, half, n) = x_shape, codes_shape
    return half == HALF and k == kb * BLOCK and n % 16 == 0 and 1 <= m <= MAX_ROWS


def _kernel(x_ref, codes_ref, scales_ref, mins_ref, out_ref, *, rows: int, block_m: int, blocks_per_step: int,
            steps: int, precision):
    # x_ref      [BM, K/32/S, 2, 16]   this program's rows (those past `rows` masked) and blocks of K
    # codes_ref  [K/32/S, 16, BN]      uint8, two codes a byte
    # scales_ref [K/32/S, BN]          float32; mins_ref the same
    # out_ref    [BM, BN]              float32 (split s of the sum over K)
    block_n = out_ref.shape[-1]
    first = pl.program_id(1) * block_m
    live = first + lax.broadcasted_iota(jnp.int32, (block_m, blocks_per_step, 1, HALF), 0) < rows
    width = blocks_per_step * HALF  # in-features of one nibble half per step

    def half_product(x_half, codes, scales, mins):
        # [BM, bps, 1, 16] @ the [bps, 16, BN] codes of one half, dequantized in x's dtype
        weight = (codes.astype(jnp.float32) * scales[:, None, :] + mins[:, None, :]).astype(x_half.dtype)
        return lax.dot_general(x_half.reshape(block_m, width), weight.reshape(width, block_n), (((1,), (0,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)

    def step(i, acc):
        blocks = pl.ds(pl.multiple_of(i * blocks_per_step, blocks_per_step), blocks_per_step)
        packed = codes_ref[blocks, :, :].astype(jnp.int32)  # [bps, 16, BN]
        scales, mins = scales_ref[blocks, :], mins_ref[blocks, :]  # [bps, BN]
        x_low = _masked_load(x_ref.at[:, blocks, pl.ds(0, 1), :], mask=live, other=0)  # in-features 32b + j
        x_high = _masked_load(x_ref.at[:, blocks, pl.ds(1, 1), :], mask=live, other=0)  # 32b + 16 + j
        acc += half_product(x_low, packed & 15, scales, mins)
        return acc + half_product(x_high, packed >> 4, scales, mins)

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    row_live = first + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0) < rows
    _masked_store(out_ref, acc, mask=row_live)


def tiles(m: int, k: int, n: int) -> tuple[int, int, int, int]:
    """(BM, BN, blocks_per_step, S) for x [m, k] @ W [k, n] (module docstring)."""
    block_m = min(64, max(16, pl.next_power_of_2(m)))
    block_n = next(b for b in (64, 32, 16) if n % b == 0)
    num_blocks = k // BLOCK
    # A power of two dividing K/32: up to 8 blocks (256 in-features) a step, 4 with 64 rows (ptxas for the
    # H100: 8 took 255 registers and spilled, 4 takes 174 and does not; h100_static_quantized.json "kernels").
    blocks_per_step = math.gcd(num_blocks, 8 if block_m < 64 else 4)
    steps = num_blocks // blocks_per_step
    tiles_mn = (n // block_n) * pl.cdiv(m, block_m)
    # Splits of K: enough programs for every SM, while the partial sums (S x M x N float32, written and read
    # back) stay under an eighth of the codes and scales (0.75 bytes a weight) they stand for.
    splits = 1
    while (splits * 2 <= steps and steps % (splits * 2) == 0 and tiles_mn * splits < TARGET_PROGRAMS
           and 2 * splits * 2 * min(m, block_m) * 4 <= k * 0.75 / 8):
        splits *= 2
    return block_m, block_n, blocks_per_step, splits


@functools.partial(jax.jit, static_argnames=("interpret", "block_n", "splits"))
def w4a16_matmul(x, codes, scales, mins, *, interpret: bool | None = None, block_n: int | None = None,
                 splits: int | None = None) -> jax.Array:
    """x [M, K] (bfloat16 or float32) @ W, W [K, N] as packed 4-bit codes with float32 scales and mins
    per 32 in-features (module docstring) -> y float32 [M, N].

    `interpret`: None compiles the kernel where the program is lowered for a CUDA GPU and interprets it
    elsewhere; True / False as given. `block_n`, `splits`: override `tiles` (tests)."""
    if x.ndim != 2 or codes.ndim != 3 or codes.dtype != jnp.uint8:
        raise ValueError(f"w4a16_matmul: x must be [M, K] and codes uint8 [K/32, 16, N]; got {x.shape} and "
                         f"{codes.shape} {codes.dtype}")
    (m, k), (kb, half, n) = x.shape, codes.shape
    if half != HALF or k != kb * BLOCK or scales.shape != (kb, n) or mins.shape != (kb, n):
        raise ValueError(f"w4a16_matmul: x {x.shape} needs codes [{k // BLOCK}, 16, N] (K a multiple of 32) and "
                         f"scales, mins [{k // BLOCK}, N]; got {codes.shape}, {scales.shape}, {mins.shape}")
    if n % 16:
        raise ValueError(f"w4a16_matmul: {n=} out-features must be a multiple of 16; use XLA's dequantized path")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"w4a16_matmul: x is {x.dtype}; bfloat16 or float32")
    if _masked_load is None:
        raise RuntimeError("w4a16_matmul needs Pallas's Triton backend, which this JAX does not ship; use XLA's path")
    block_m, auto_n, blocks_per_step, auto_splits = tiles(m, k, n)
    block_n, splits = block_n or auto_n, splits or auto_splits
    steps = kb // blocks_per_step
    if n % block_n or steps % splits:
        raise ValueError(f"w4a16_matmul: {block_n=} must divide {n=} and {splits=} the {steps} steps of K")
    blocks = kb // splits  # blocks of 32 in-features per split
    # float32 products must be float32's (Triton's default for float32 dots is TF32)
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, rows=m, block_m=block_m, blocks_per_step=blocks_per_step,
                               steps=steps // splits, precision=precision)

    def call(interpret_mode: bool):
        return pl.pallas_call(
            kernel,
            grid=(n // block_n, pl.cdiv(m, block_m), splits),
            in_specs=[
                pl.BlockSpec((block_m, blocks, 2, HALF), lambda j, i, s: (i, s, 0, 0)),
                pl.BlockSpec((blocks, HALF, block_n), lambda j, i, s: (s, 0, j)),
                pl.BlockSpec((blocks, block_n), lambda j, i, s: (s, j)),
                pl.BlockSpec((blocks, block_n), lambda j, i, s: (s, j)),
            ],
            out_specs=pl.BlockSpec((None, block_m, block_n), lambda j, i, s: (s, i, j)),
            out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
            compiler_params=TRITON_COMPILER_PARAMS(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
            interpret=interpret_mode,
            name="w4a16_matmul",
        )(x.reshape(m, kb, 2, HALF), codes, scales, mins)  # x: a free reshape, [M, K/32, 2, 16]

    if interpret is None:  # by the target the program is lowered for (pallas_kernels/_common.py by_target)
        partial = lax.platform_dependent(cuda=lambda: call(False), default=lambda: call(True))
    else:
        partial = call(bool(interpret))
    return partial[0] if splits == 1 else partial.sum(axis=0)
