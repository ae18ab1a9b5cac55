"""The Mosaic GPU (Hopper) paged-attention kernel body shared by the ragged and the decode wrappers.

One CUDA block = one query tile of Hp KV heads (Hp = 1 for ragged tiles; decode packs the groups of
Hp heads into the tile's rows) and, for decode, one split of its keys; C consumer warpgroups (2 for
ragged tiles, 1 for decode) and one producer, warp-specialised as in JAX's `ops/gpu/attention_mgpu.py`
(FlashAttention-3). The loops run over units = (key step, local KV head), Hp units per key step;
below, "step" is a unit and the pages are those of the unit's KV head:

    wg C (producer)                          wg c < C (consumers, 64 query rows each)
    for step in my key steps:                 q rows -> SMEM (TMA), wait
      slot = step % D                         for step in my key steps:
      wait k/v_consumed[slot] (after D)         wait k_ready[slot]; S = Q K^T (wgmma)    [64, 64] f32
      for each page of the step:                arrive k_consumed[slot]
        page_id = block_tables[seq, page]       mask (causal, length); online softmax
        TMA K page -> k_smem[slot] rows         wait v_ready[slot]; last step: zero V rows past the
        TMA V page -> v_smem[slot] rows           length (consumer 0; all meet at v_clean[slot])
    wait the last D releases                    O += P V (wgmma)                          [64, H] f32
                                                arrive v_consumed[slot]
                                              O / l -> SMEM -> GMEM (TMA)

Tile shapes (SMEM, bf16, (8, 64) tiling + 128-byte swizzle as wgmma wants):
    q_smem  [C, 64, H]     the query tile: C * 64 rows = tokens_per_tile tokens x Gp query heads
    k_smem  [D, 64, H]     D slots of one key step = 64 // page_size pages, filled page by page
    v_smem  [D, 64, H]
    o_smem  [C, 64, H]     the output rows (bf16, or f32 partials when decode splits)
A key step is always 64 keys (a multiple of the wgmma K tile for P V and of the swizzle), so page
sizes 8..64 all give whole steps; pages are copied one TMA each, straight from the block table.
With D = 2, C = 2, H = 128: 32 + 64 + 32 KiB of SMEM, well inside Hopper's 227 KiB.

Rows of a tile (GQA packing, Gp = query heads per KV head padded to a power of two):

    row r = token_in_tile * Gp + head_in_group        position(r) = first_pos + r // Gp
    consumer c holds rows c * 64 .. c * 64 + 63

NaN safety: keys past the tile's causal limit `num_keys` are masked before the max, their
probabilities are zeroed, and the V rows of those keys are overwritten with zeros in SMEM before the
P V wgmma (0 * NaN = NaN inside the matmul otherwise); stale pages never reach the output.

Registers (ptxas for sm_90a, Qwen3-0.6B shapes): ragged, 3 warpgroups, the producer at 40 and the
consumers at 232 (`setmaxnreg`), no spills, 1 block per SM; decode, 2 warpgroups, 225-241 registers, no
spills, 1 block per SM. One block keeps its 2-slot ring of 64 K and 64 V rows in flight (64 KB at
H = 128), over twice what an SM's share of the HBM bandwidth needs (DESIGN.md).

Per-tile metadata (computed by the wrappers with a few jnp ops, read here as scalars from GMEM):
    tile_seq_idx[t]   block-table row of the tile's sequence
    tile_first_pos[t] position of the tile's first token
    tile_num_keys[t]  keys visible to the tile's last real row (0 for an empty tile)
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import MASK_VALUE
from pallas_kernels.jax_compat import InterpretGPUParams

TILE_ROWS = 64  # one wgmma M tile per consumer warpgroup
STEP_KEYS = 64  # keys per pipeline step (QK^T N dim, PV K dim)


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """Static facts the kernel body needs; all validated by the wrappers."""

    group_rows: int  # Gp: query heads per KV head, padded to a power of two (divides TILE_ROWS)
    page_size: int
    head_dim: int
    num_kv_heads: int
    num_pages: int  # pages per (layer, K/V, KV head) pool
    num_q_tiles: int
    num_splits: int  # key splits per tile (decode); 1 = each block sees all its keys
    num_slots: int  # D: pipeline depth in key steps
    num_consumers: int  # C: consumer warpgroups, 64 rows of the tile each (tile = C * 64 rows)
    heads_per_tile: int  # Hp: KV heads whose query heads share a tile (decode packing; 1 for ragged)
    group: int  # G: query heads per KV head; with Hp > 1, row r belongs to local KV head r // G
    real_rows: int  # decode: Hp * G rows hold queries, the rest are masked; ragged: TILE_ROWS

    @property
    def store_rows(self) -> int:  # rows of a block read from q and stored: the real ones, to 8-row tiles
        return -(-self.real_rows // 8) * 8
    scale: float
    soft_cap: float | None
    interpret: bool  # GPU interpret mode lowers no layout_cast: register layouts are left implicit
    # Decode: tile t is sequence t, its rows at the last position (num_keys - 1). The kernel then takes no
    # tile_seq_idx / tile_first_pos operands: two arrays XLA would build anew for every layer's launch.
    decode: bool = False
    # Also write each row's log-sum-exp with one split (gpt-oss's sinks are folded in by the wrappers with it).
    with_lse: bool = False

    @property
    def pages_per_step(self) -> int:
        return STEP_KEYS // self.page_size

    @property
    def num_head_tiles(self) -> int:  # the grid's "kv_head" axis: tiles of Hp KV heads
        return self.num_kv_heads // self.heads_per_tile


def _tile_index(head_tile, tile_idx, shape: KernelShape):
    """Where a (KV-head tile, query tile) block's rows sit in q_ref / out_ref: head-tile major for ragged
    tiles; sequence major for decode, so q [S, N, H] and the output are tiles without a transpose."""
    if shape.decode:
        return tile_idx * shape.num_head_tiles + head_tile
    return head_tile * shape.num_q_tiles + tile_idx


def _wgmma_layout(x, shape: KernelShape, *, reduced: bool = False):
    """Pins `x` to the wgmma accumulator layout (or its row-reduced form) when compiling."""
    if shape.interpret:
        return x
    layout = plgpu.Layout.WGMMA.reduce(1) if reduced else plgpu.Layout.WGMMA
    return plgpu.layout_cast(x, layout)


def _iota(dims, dimension: int, shape: KernelShape):
    if shape.interpret:
        return lax.broadcasted_iota(jnp.int32, dims, dimension)
    return plgpu.broadcasted_iota(jnp.int32, dims, dimension, layout=plgpu.Layout.WGMMA)


def _qk_matmul(q_smem, k_smem, shape: KernelShape):
    """Q K^T: [64, H] x [64 keys, H] -> f32 [64, 64 keys], on wgmma with K transposed in SMEM.

    GPU interpret mode (JAX 0.10/0.11) cannot apply a transpose to a wgmma operand, so there the
    same product is an ordinary dot of the SMEM contents (same bf16 inputs, f32 accumulation).
    """
    if shape.interpret:
        return lax.dot_general(
            q_smem[...], k_smem[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((TILE_ROWS, STEP_KEYS), jnp.float32))


def _pv_matmul(acc, probs, v_smem, shape: KernelShape):
    """O + P V: f32 [64, H] + registers [64, 64 keys] (bf16) x SMEM [64 keys, H], on wgmma.

    GPU interpret mode takes wgmma operands only from SMEM and has no run_state (to accumulate into
    the running O): there it is an ordinary dot of the same bf16 operands with f32 accumulation.
    """
    if shape.interpret:
        return acc + lax.dot_general(
            probs, v_smem[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, probs, v_smem)

    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _attention_kernel(
    layer_idx_ref,  # GMEM int32 [1]
    tile_seq_idx_ref,  # GMEM int32 [Q]
    tile_first_pos_ref,  # GMEM int32 [Q]
    tile_num_keys_ref,  # GMEM int32 [Q]
    block_tables_ref,  # GMEM int32 [S, padded_pages]
    q_ref,  # GMEM [K * Q * C, store_rows, H]: query tiles, 64 rows per consumer (decode: the real ones)
    kv_ref,  # GMEM [L * 2 * K * num_pages, page_size, H]: the whole KV buffer, one row per page
    out_ref,  # GMEM [K * Q * splits * C, store_rows, H] (store_rows = 64 for ragged tiles)
    lse_ref,  # GMEM f32 [K * Q * splits * C, store_rows] (splits > 1 or shape.with_lse) or None
    q_smem,  # SMEM [C, 64, H]: each consumer's query rows
    k_smem,  # SMEM [D, 64, H]
    v_smem,  # SMEM [D, 64, H]
    o_smem,  # SMEM [C, 64, H] in out_ref's dtype
    lse_smem,  # SMEM f32 [C, 64] or None
    q_barrier,  # C barriers, 1 arrival each
    k_ready,  # D barriers, pages_per_step arrivals each (one TMA per page)
    v_ready,
    k_consumed,  # D barriers, C arrivals each (every consumer)
    v_consumed,
    v_clean,  # D barriers, C arrivals each: the V tail is zeroed (only on a tile's last key step)
    *,
    shape: KernelShape,
):
    head_tile = lax.axis_index("kv_head")  # this block's Hp KV heads: head_tile * Hp ...
    tile_idx = lax.axis_index("q_tile")
    split_idx = lax.axis_index("split")
    wg_idx = lax.axis_index("wg")
    D, C = shape.num_slots, shape.num_consumers
    dtype = q_smem.dtype

    num_keys = tile_num_keys_ref[tile_idx]
    if shape.decode:
        seq_idx, first_pos = tile_idx, num_keys - 1
    else:
        seq_idx, first_pos = tile_seq_idx_ref[tile_idx], tile_first_pos_ref[tile_idx]
    # This block's key steps [step_begin, step_end): the tile's steps cut into num_splits ranges.
    num_steps = lax.div(num_keys + (STEP_KEYS - 1), STEP_KEYS)
    steps_per_split = lax.div(num_steps + (shape.num_splits - 1), shape.num_splits)
    step_begin = jnp.minimum(split_idx * steps_per_split, num_steps)
    step_end = jnp.minimum(step_begin + steps_per_split, num_steps)
    num_my_steps = step_end - step_begin
    # A unit is (key step, local KV head): Hp units per key step, each ONE KV head's 64 keys, which
    # update only that head's rows (decode packing: pallas_kernels/decode_plan.py). Hp = 1: units = steps.
    Hp = shape.heads_per_tile
    num_my_units = num_my_steps * Hp

    # Registers (compiled, C = 2: 3 warpgroups of 128 threads share one SM's 65536): the producer
    # only issues TMA, so it gives registers to the consumers (as JAX's attention_mgpu.py does):
    # 2 x 128 x 232 + 128 x 40 = 64512. Without it ptxas caps every thread at 168 and spills.
    rebalance = C == 2 and not shape.interpret

    @pl.when(wg_idx < C)
    def _consumer():
        if rebalance:
            plgpu.set_max_registers(232, action="increase")
        # Every consumer runs every key step of the block (the tile's causal limit is its last row's);
        # a consumer whose rows end earlier masks the extra keys out.
        q_smem_wg, o_smem_wg = q_smem.at[wg_idx], o_smem.at[wg_idx]
        q_tile = _tile_index(head_tile, tile_idx, shape) * C + wg_idx
        R = shape.store_rows  # rows R.. of q_smem are never loaded: they belong to no head (masked)
        q_rows = q_smem_wg if R == TILE_ROWS else q_smem_wg.at[pl.ds(0, R)]
        plgpu.copy_gmem_to_smem(q_ref.at[q_tile], q_rows, q_barrier.at[wg_idx])
        plgpu.barrier_wait(q_barrier.at[wg_idx])
        # Position of each row's token, for the causal mask: [64, 64] in the wgmma layout.
        row = wg_idx * TILE_ROWS + _iota((TILE_ROWS, STEP_KEYS), 0, shape)  # row of the C * 64-row tile
        col = _iota((TILE_ROWS, STEP_KEYS), 1, shape)
        row_pos = first_pos + lax.div(row, jnp.int32(shape.group_rows))

        row_head = lax.div(row, jnp.int32(shape.group))  # the local KV head of each row (Hp > 1)

        def step(unit, carry):
            acc, m_prev, l_prev = carry
            slot = lax.rem(unit, D)
            local_step = lax.div(unit, jnp.int32(Hp))
            key_start = (step_begin + local_step) * STEP_KEYS

            plgpu.barrier_wait(k_ready.at[slot])
            logits = _qk_matmul(q_smem_wg, k_smem.at[slot], shape)  # [64, 64] f32
            plgpu.barrier_arrive(k_consumed.at[slot])
            logits = logits * shape.scale
            if shape.soft_cap is not None:
                logits = shape.soft_cap * jnp.tanh(logits / shape.soft_cap)
            key_pos = key_start + col
            visible = (key_pos <= row_pos) & (key_pos < num_keys)
            if Hp > 1 or shape.real_rows < TILE_ROWS:  # other heads' rows (and padding) see nothing
                visible &= row_head == unit - local_step * Hp
            logits = jnp.where(visible, logits, MASK_VALUE)
            m_next = jnp.maximum(m_prev, logits.max(axis=1))  # [64]
            probs = jnp.where(visible, jnp.exp(logits - lax.broadcast_in_dim(m_next, logits.shape, [0])), 0.0)
            correction = jnp.exp(m_prev - m_next)
            l_next = l_prev * correction + probs.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])

            plgpu.barrier_wait(v_ready.at[slot])

            # The step holding the end of the keys: V rows past it may be NaN (stale or unowned pages).
            # Consumer 0 zeroes them; every consumer waits for that before its P V.
            @pl.when(key_start + STEP_KEYS > num_keys)
            def _zero_v_tail():
                @pl.when(wg_idx == 0)
                def _zero():
                    v_rows = _iota((STEP_KEYS, shape.head_dim), 0, shape)
                    v = v_smem[slot]
                    v_smem[slot] = jnp.where(key_start + v_rows < num_keys, v, jnp.zeros_like(v))
                    plgpu.commit_smem()  # make the stores visible to wgmma (async proxy)

                plgpu.barrier_arrive(v_clean.at[slot])
                plgpu.barrier_wait(v_clean.at[slot])

            acc = _pv_matmul(acc, probs.astype(dtype), v_smem.at[slot], shape)  # [64, H] f32
            plgpu.barrier_arrive(v_consumed.at[slot])
            return acc, m_next, l_next

        acc = _wgmma_layout(jnp.zeros((TILE_ROWS, shape.head_dim), jnp.float32), shape)
        m = _wgmma_layout(jnp.full((TILE_ROWS,), MASK_VALUE, jnp.float32), shape, reduced=True)
        l = _wgmma_layout(jnp.zeros((TILE_ROWS,), jnp.float32), shape, reduced=True)
        acc, m, l = lax.fori_loop(0, num_my_units, step, (acc, m, l))

        # Rows that saw no key (empty tile or split, rows past the chunk) have l = 0: zeros, not 0/0.
        has_keys = l > 0.0
        inv_l = jnp.where(has_keys, 1.0 / jnp.where(has_keys, l, 1.0), 0.0)
        o_smem_wg[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_smem.dtype)
        block = (_tile_index(head_tile, tile_idx, shape) * shape.num_splits + split_idx) * C + wg_idx
        if lse_smem is not None:
            lse_smem[wg_idx] = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)), MASK_VALUE)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem_wg if R == TILE_ROWS else o_smem_wg.at[pl.ds(0, R)], out_ref.at[block])
        if lse_smem is not None:
            plgpu.copy_smem_to_gmem(lse_smem.at[wg_idx, pl.ds(0, R)], lse_ref.at[block])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg_idx == C)
    def _producer():
        if rebalance:
            plgpu.set_max_registers(40, action="decrease")
        layer_idx = layer_idx_ref[0]
        @pl.loop(0, num_my_units)
        def _fill(unit):
            slot = lax.rem(unit, D)
            local_step = lax.div(unit, jnp.int32(Hp))
            kv_head = head_tile * Hp + (unit - local_step * Hp)
            k_base = (layer_idx * 2 * shape.num_kv_heads + kv_head) * shape.num_pages
            v_base = ((layer_idx * 2 + 1) * shape.num_kv_heads + kv_head) * shape.num_pages
            first_page = (step_begin + local_step) * shape.pages_per_step

            @pl.when(unit >= D)
            def _wait_free():
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])

            # Block-table entries of pages past the length are whatever the table holds (page 0 in
            # jaxpaged): the clip keeps a garbage id inside the pool; the consumer masks those keys.
            page_ids = []
            for j in range(shape.pages_per_step):
                page_id = block_tables_ref[seq_idx, first_page + j]
                page_ids.append(jnp.clip(page_id, 0, shape.num_pages - 1))
            for j, page_id in enumerate(page_ids):
                rows = pl.ds(j * shape.page_size, shape.page_size)
                plgpu.copy_gmem_to_smem(kv_ref.at[k_base + page_id], k_smem.at[slot, rows], k_ready.at[slot])
            for j, page_id in enumerate(page_ids):
                rows = pl.ds(j * shape.page_size, shape.page_size)
                plgpu.copy_gmem_to_smem(kv_ref.at[v_base + page_id], v_smem.at[slot, rows], v_ready.at[slot])

        # Observe the consumer's release of the last D steps too: every phase of a barrier is waited
        # on before the block exits (GPU interpret mode checks this when it frees the barriers).
        @pl.loop(jnp.maximum(num_my_units - D, 0), num_my_units)
        def _drain(unit):
            slot = lax.rem(unit, D)
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])


def attention_tiles(
    layer_idx,  # int32 [1]
    tile_seq_idx,  # int32 [Q]
    tile_first_pos,  # int32 [Q]
    tile_num_keys,  # int32 [Q]
    block_tables,  # int32 [S, padded_pages], padded to whole steps
    q_tiles,  # [K * Q, 64, H]
    kv_flat,  # [L * 2 * K * num_pages, page_size, H]
    *,
    shape: KernelShape,
    out_dtype,
):
    """Runs the kernel over (KV head, query tile, split).

    q_tiles holds C = num_consumers row groups of 64 per tile. Returns out [K * Q * splits * C, 64, H]
    (rows normalised per block) and, when splits > 1 or `shape.with_lse`, the log-sum-exp [K * Q * splits * C, 64] f32 of
    each block's rows for the wrapper's combine.
    """
    dtype = q_tiles.dtype
    C = shape.num_consumers
    num_blocks = shape.num_head_tiles * shape.num_q_tiles * shape.num_splits * C
    with_lse = shape.num_splits > 1 or shape.with_lse
    swizzled = (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))
    out_types = [jax.ShapeDtypeStruct((num_blocks, shape.store_rows, shape.head_dim), out_dtype)]
    if with_lse:
        out_types.append(jax.ShapeDtypeStruct((num_blocks, shape.store_rows), jnp.float32))

    operands = [layer_idx, tile_seq_idx, tile_first_pos, tile_num_keys, block_tables, q_tiles, kv_flat]
    if shape.decode:
        del operands[1:3]

    def entry(*refs):
        inputs, outputs = list(refs[:len(operands)]), refs[len(operands):]
        if shape.decode:
            inputs[1:1] = [None, None]  # tile_seq_idx_ref, tile_first_pos_ref: not read
        out_ref = outputs[0]
        lse_ref = outputs[1] if with_lse else None
        o_transforms = (
            (plgpu.TilingTransform((8, 128 // jnp.dtype(out_dtype).itemsize)), plgpu.SwizzleTransform(128))
        )
        scratch = [
            plgpu.SMEM((C, TILE_ROWS, shape.head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((shape.num_slots, STEP_KEYS, shape.head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((shape.num_slots, STEP_KEYS, shape.head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((C, TILE_ROWS, shape.head_dim), out_dtype, transforms=o_transforms),
            plgpu.SMEM((C, TILE_ROWS), jnp.float32) if with_lse else None,
        ]
        barriers = [
            plgpu.Barrier(num_barriers=C),
            plgpu.Barrier(num_arrivals=shape.pages_per_step, num_barriers=shape.num_slots),
            plgpu.Barrier(num_arrivals=shape.pages_per_step, num_barriers=shape.num_slots),
            plgpu.Barrier(num_arrivals=C, num_barriers=shape.num_slots),
            plgpu.Barrier(num_arrivals=C, num_barriers=shape.num_slots),
            plgpu.Barrier(num_arrivals=C, num_barriers=shape.num_slots),
        ]
        pl.run_scoped(
            lambda *scoped: _attention_kernel(*inputs, out_ref, lse_ref, *scoped, shape=shape),
            *scratch,
            *barriers,
            collective_axes="wg",
        )

    kernel = plgpu.kernel(
        entry,
        out_type=out_types,
        grid=(shape.num_head_tiles, shape.num_q_tiles, shape.num_splits),
        grid_names=("kv_head", "q_tile", "split"),
        num_threads=C + 1,
        thread_name="wg",
        interpret=InterpretGPUParams() if shape.interpret else None,
    )
    outs = kernel(*operands)
    return outs[0], (outs[1] if with_lse else None)
