"""The MoE's grouped matmul on a GPU: rows sorted by expert times each row's expert's weight, as one Pallas kernel.

    rows         [M, K]       the (token, expert) pairs' inputs, sorted by expert (models/moe.py grouped_experts)
    w            [G, K, N]    one weight per local expert
    group_sizes  [G] int32    rows of group g: [start_g, start_g + size_g), start_g = size_0 + ... + size_{g-1}
    ->  out      [M, N]       rows.dtype; row r of group g = rows[r] @ w[g]; rows past the groups are zero

The contract of `jax.lax.ragged_dot(rows, w, group_sizes)`. XLA:GPU lowers ragged_dot as one dense GEMM
over every expert on masked copies of the rows (G x the work, a [G, M, N] product written), which for a
decode step of Qwen3-Next (512 experts) is two orders of magnitude more FLOPs than the routed rows need.
This kernel computes only the routed rows and reads each touched expert's weight columns once per
tile of its rows (the megablox / vLLM fused_moe idea):

    tiles     group g's rows cut into cdiv(size_g, BM) tiles of at most BM rows; experts with no rows
              have none. Tile t of the whole list: (group, first row, end row), computed in XLA from
              group_sizes (`tile_table`). The list's length is data dependent; the grid holds its bound
              (M - G') // BM + G', G' = min(G, M) (every group non-empty, each wasting < BM rows).
    grid      (tiles bound, N / BN)   program (t, n): tile t's rows [first, end) (rows of the next group
              in its BM window masked on load and store), columns [n BN, n BN + BN), a loop over K in
              steps of BK; programs past the tile count exit at once
    BM        16 (Triton's dot takes at least 16 rows) up to 64, by the mean rows per expert: a decode
              step's 1-8 rows an expert read and write those rows only (masked), never a padded copy

Where the program is lowered for a CUDA GPU the kernel is compiled by Pallas's Triton backend; anywhere
else it is interpreted (tests), after padding the rows by BM so the interpreter's dynamic slices never clamp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.jax_compat import TRITON_COMPILER_PARAMS

NAME = "grouped_matmul"  # models/moe.py grouped_experts's ragged matmul on a CUDA GPU (device/runner.py)
NUM_WARPS, NUM_STAGES = 4, 3

if TRITON_COMPILER_PARAMS is not None:  # the Triton backend, explicitly (pallas_kernels/_common.py: why)
    from jax.experimental.pallas import triton as _triton

    _masked_load, _masked_store = _triton.load, _triton.store
else:  # pragma: no cover - a JAX without the Triton backend
    _masked_load = _masked_store = None


def available() -> bool:
    """Whether this JAX ships Pallas's Triton backend (else: ragged_dot, XLA's lowering)."""
    return _masked_load is not None


def supports(rows_shape, w_shape) -> bool:
    """Whether the kernel multiplies rows of `rows_shape` by a [G, K, N] weight of `w_shape` (else: ragged_dot)."""
    return (available() and len(rows_shape) == 2 and len(w_shape) == 3 and rows_shape[1] == w_shape[1]
            and w_shape[1] % 16 == 0 and w_shape[2] % 16 == 0)


def tiles(m: int, g: int, k: int, n: int) -> tuple[int, int, int, int]:
    """(BM, BK, BN, tiles bound) for M sorted rows over G groups, K in-features, N out-features."""
    block_m = min(64, max(16, pl.next_power_of_2(pl.cdiv(m, g))))
    block_k = next(b for b in (64, 32, 16) if k % b == 0)
    block_n = next(b for b in (64, 32, 16) if n % b == 0)
    nonempty = min(g, m)
    return block_m, block_k, block_n, (m - nonempty) // block_m + nonempty


def tile_table(group_sizes, block_m: int, num_tiles: int):
    """(group, first row, end row) int32 [num_tiles] each: group g's rows in tiles of block_m, in group
    order; entries past the tile count have first == end (no rows)."""
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    per_group = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(per_group)  # tiles of groups 0..g
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # The group of tile t: how many groups end at or before it (one compare-and-sum fusion; searchsorted's
    # default is a loop of log2(G) steps, each its own launches).
    group = jnp.minimum(jnp.sum(tile_ends[None, :] <= t[:, None], axis=1, dtype=jnp.int32), sizes.shape[0] - 1)
    first = starts[group] + (t - (tile_ends[group] - per_group[group])) * block_m
    end = starts[group] + sizes[group]
    live = t < tile_ends[-1]
    first = jnp.where(live, first, 0)
    return group, first, jnp.where(live, jnp.minimum(end, first + block_m), first)


def _kernel(group_ref, first_ref, end_ref, x_ref, w_ref, out_ref, *, block_m: int, block_k: int, steps: int,
            precision):
    # group_ref, first_ref, end_ref [tiles]   the tile table (tile_table)
    # x_ref   [M (+ BM interpreted), K]        every sorted row; this program's [first, end) masked in
    # w_ref   [G, K, BN]                       column block n of every expert's weight
    # out_ref [M (+ BM interpreted), BN]       column block n of every row
    t = pl.program_id(0)
    first, end = first_ref[t], end_ref[t]

    @pl.when(first < end)
    def _():
        g = group_ref[t]
        live = first + lax.broadcasted_iota(jnp.int32, (block_m, block_k), 0) < end

        def step(i, acc):
            cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            x = _masked_load(x_ref.at[pl.ds(first, block_m), cols], mask=live, other=0)
            w = w_ref[g, cols, :]
            return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, out_ref.shape[-1]), jnp.float32))
        row_live = first + lax.broadcasted_iota(jnp.int32, acc.shape, 0) < end
        _masked_store(out_ref.at[pl.ds(first, block_m), :], acc.astype(out_ref.dtype), mask=row_live)


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_matmul(rows, w, group_sizes, *, interpret: bool | None = None) -> jax.Array:
    """`jax.lax.ragged_dot(rows, w, group_sizes)` (module docstring) by the Pallas kernel.

    `interpret`: None compiles the kernel where the program is lowered for a CUDA GPU and interprets it
    elsewhere; True / False as given."""
    if rows.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or rows.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_matmul: rows must be [M, K], w [G, K, N] and group_sizes [G]; got {rows.shape}, "
                         f"{w.shape}, {group_sizes.shape}")
    (m, k), (g, _, n) = rows.shape, w.shape
    if k % 16 or n % 16:
        raise ValueError(f"grouped_matmul: {k=} and {n=} must be multiples of 16 (Triton's dot); use ragged_dot")
    if not available():
        raise RuntimeError("grouped_matmul needs Pallas's Triton backend, which this JAX does not ship; use ragged_dot")
    block_m, block_k, block_n, num_tiles = tiles(m, g, k, n)
    table = tile_table(group_sizes, block_m, num_tiles)
    # float32 products must be float32's (Triton's default for float32 dots is TF32)
    precision = lax.Precision.HIGHEST if rows.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, block_m=block_m, block_k=block_k, steps=k // block_k, precision=precision)
    w = w.astype(rows.dtype)

    def call(interpret_mode: bool):
        # Interpreted, a BM window starting near M would be clamped back by the dynamic slice: pad the rows.
        x = jnp.pad(rows, ((0, block_m), (0, 0))) if interpret_mode else rows
        whole = lambda shape: pl.BlockSpec(shape, lambda t, j: (0,) * len(shape))
        out = pl.pallas_call(
            kernel,
            grid=(num_tiles, n // block_n),
            in_specs=[whole((num_tiles,)), whole((num_tiles,)), whole((num_tiles,)), whole(x.shape),
                      pl.BlockSpec((g, k, block_n), lambda t, j: (0, 0, j))],
            out_specs=pl.BlockSpec((x.shape[0], block_n), lambda t, j: (0, j)),
            out_shape=jax.ShapeDtypeStruct((x.shape[0], n), rows.dtype),
            compiler_params=TRITON_COMPILER_PARAMS(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
            interpret=interpret_mode,
            name="grouped_matmul",
        )(*table, x, w)
        return out[:m]

    if interpret is None:  # by the target the program is lowered for (pallas_kernels/_common.py by_target)
        out = lax.platform_dependent(cuda=lambda: call(False), default=lambda: call(True))
    else:
        out = call(bool(interpret))
    # Rows past the groups are written by no program (ragged_dot's zeros).
    return jnp.where((jnp.arange(m) < jnp.sum(group_sizes))[:, None], out, jnp.zeros((), out.dtype))
