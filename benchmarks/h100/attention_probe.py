"""Decode attention alone, compiled for an H100 on this CPU: the bytes it moves besides the K/V it
must read, and its kernels' registers / spills / occupancy (Triton from XLA's dump, Mosaic from
Mosaic GPU's own PTX dump).

    python benchmarks/h100/target.py benchmarks/h100/attention_probe.py [--quick]

One layer of Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128, page_size 16) read
from a 2-layer whole buffer with a traced layer index, as the engine's layer loop calls it:

    kv_bytes     the live K/V (and scales) of that layer: num_seqs x context x 8 x 2 x bytes per token-head
    extra_bytes  every other byte of the attention's launches (the kernel's outputs, the split
                 partials and their combine, q padding) less the step's own q in and output out
    extra/kv     the issue's target for the float32 partials round trip: <= 5%

Every figure is an estimate read from the compiled program; nothing runs on a GPU.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MOSAIC_DUMP = tempfile.mkdtemp(prefix="mosaic-ptx-")
os.environ.setdefault("MOSAIC_GPU_DUMP_PTX", "1")
os.environ.setdefault("MOSAIC_GPU_DUMP_TO", MOSAIC_DUMP)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.h100.hlo_accounting import BufferOverride, account, entry_param_number  # noqa: E402
from benchmarks.h100.ptxas_report import occupancy, ptxas_info  # noqa: E402
from benchmarks.h100.ptxas_report import report as ptxas_report  # noqa: E402
from benchmarks.h100.target import compile_for_h100, spec  # noqa: E402
from jaxpaged.device.backends import attention_fn  # noqa: E402
from jaxpaged.ops.kv_quant import bytes_per_token_head, storage_dtype, zeros_kv_cache  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, NUM_LAYERS = 16, 8, 128, 16, 2


def tile_flops(q_len: int, seq_len: int, *, tokens_per_tile: int, rows_per_tile: int, block_keys: int) -> int:
    """Attention FLOPs one KV head's tiles execute for one sequence's chunk (QK^T and PV, 4 x H per
    row and key): each tile of `tokens_per_tile` tokens runs all its rows over the keys up to its
    last token's causal limit, in whole blocks of `block_keys` (the kernels' loops)."""
    flops, first_pos = 0, seq_len - q_len
    for start in range(0, q_len, tokens_per_tile):
        keys = first_pos + min(start + tokens_per_tile, q_len)
        flops += rows_per_tile * -(-keys // block_keys) * block_keys * 4 * HEAD_DIM
    return flops


def mixed_flops(backend: str, q_lens: list[int], seq_lens: list[int]) -> dict:
    """Executed vs useful attention FLOPs of a mixed step, from the kernels' tiling (an analytic
    count: the HLO accounting does not see inside a Pallas kernel). Triton ragged: block_q 16
    tokens x Gp rows, 64-key blocks; Mosaic ragged: 128-row tiles (2 consumers) of 128 // Gp tokens,
    64-key steps."""
    group_rows = 1 << (NUM_HEADS // NUM_KV_HEADS - 1).bit_length()
    tokens, rows = (16, 16 * group_rows) if backend == "pallas" else (128 // group_rows, 128)
    executed = NUM_KV_HEADS * sum(tile_flops(q, n, tokens_per_tile=tokens, rows_per_tile=rows, block_keys=64)
                                  for q, n in zip(q_lens, seq_lens))
    useful = sum(NUM_HEADS * 4 * HEAD_DIM * (n - q + i + 1) for q, n in zip(q_lens, seq_lens) for i in range(q))
    return {"executed_attention_flops": executed, "useful_attention_flops": useful,
            "executed_to_useful": round(executed / useful, 4)}


def probe_mixed(backend: str, q_lens: list[int], seq_lens: list[int]) -> dict:
    """The ragged kernel on a mixed step (one layer): its registers and features, and its FLOPs."""
    num_seqs, num_tokens = len(q_lens), sum(q_lens)
    pages_per_seq = -(-max(seq_lens) // PAGE_SIZE)
    kv = spec((NUM_LAYERS, 2, NUM_KV_HEADS, num_seqs * pages_per_seq + 1, PAGE_SIZE, HEAD_DIM), jnp.bfloat16)
    fn = attention_fn(backend, platform="cuda")

    def step(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx):
        return fn(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx=layer_idx, scale=HEAD_DIM**-0.5)

    args = (spec((num_tokens, NUM_HEADS, HEAD_DIM), jnp.bfloat16), kv, spec((num_seqs, pages_per_seq), jnp.int32),
            spec((num_seqs,), jnp.int32), spec((num_seqs + 1,), jnp.int32), spec((), jnp.int32))
    for old in glob.glob(os.path.join(MOSAIC_DUMP, "*")):
        os.remove(old)
    out = compile_for_h100(step, args, dump_dir=True)
    kernels = [k.__dict__ for k in ptxas_report(out.dump_dir)] if backend == "pallas" else _mosaic_kernels()
    return {"backend": backend, "num_tokens": num_tokens, "num_seqs": num_seqs, "kernels": kernels,
            **mixed_flops(backend, q_lens, seq_lens)}


def probe(backend: str, kv_cache_dtype: str, num_seqs: int, context: int) -> dict:
    pages_per_seq = -(-context // PAGE_SIZE)
    num_pages = num_seqs * pages_per_seq + 1
    shape = (NUM_LAYERS, 2, NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    kv = jax.eval_shape(lambda: zeros_kv_cache(shape, jnp.bfloat16, kv_cache_dtype))
    kv = jax.tree.map(lambda x: spec(x.shape, x.dtype), kv)
    fn = attention_fn(backend, platform="cuda")

    def step(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx):
        return fn(q, kv_pages, block_tables, seq_lens, query_start_loc, layer_idx=layer_idx,
                  scale=HEAD_DIM**-0.5, decode_only=True)

    args = (spec((num_seqs, NUM_HEADS, HEAD_DIM), jnp.bfloat16), kv, spec((num_seqs, pages_per_seq), jnp.int32),
            spec((num_seqs,), jnp.int32), spec((num_seqs + 1,), jnp.int32), spec((), jnp.int32))
    for old in glob.glob(os.path.join(MOSAIC_DUMP, "*")):
        os.remove(old)
    out = compile_for_h100(step, args, dump_dir=True)
    token_head = bytes_per_token_head(kv_cache_dtype, jnp.bfloat16, HEAD_DIM)
    kv_bytes = num_seqs * context * NUM_KV_HEADS * 2 * token_head
    param = (entry_param_number(out.hlo_text, "kv_pages") if kv_cache_dtype == "auto" else
             tuple(entry_param_number(out.hlo_text, f"kv_pages.{leaf}") for leaf in ("pages", "scales")))
    acc = account(out.hlo_text, BufferOverride(param, bytes_read=kv_bytes))
    q_and_out = 2 * num_seqs * NUM_HEADS * HEAD_DIM * 2  # bf16 in, bf16 out
    kernels = [k.__dict__ for k in ptxas_report(out.dump_dir)] if backend == "pallas" else _mosaic_kernels()
    return {
        "backend": backend, "kv_cache_dtype": kv_cache_dtype, "num_seqs": num_seqs, "context": context,
        "storage": str(storage_dtype(kv_cache_dtype, jnp.bfloat16)), "kv_bytes": kv_bytes,
        "attention_bytes": acc.hbm_bytes, "extra_bytes": acc.hbm_bytes - kv_bytes - q_and_out,
        "extra_to_kv": round((acc.hbm_bytes - kv_bytes - q_and_out) / kv_bytes, 4), "launches": acc.num_launches,
        "launch_detail": [f"{l.kind}:{l.detail} {l.hbm_bytes}" for l in acc.launches][:8], "kernels": kernels,
    }


def _mosaic_kernels() -> list[dict]:
    """Mosaic GPU's own PTX dump, through the same ptxas; occupancy from registers and threads only
    (the kernel's dynamic SMEM is not in its PTX)."""
    out = []
    for path in sorted(glob.glob(os.path.join(MOSAIC_DUMP, "*.ptx"))):
        text = Path(path).read_text()
        ntid = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", text)
        threads = int(ntid.group(1)) if ntid else 128
        for name, info in ptxas_info(path).items():
            blocks, occ, limiter = occupancy(info["registers"], info["static_smem"], threads)
            out.append({"kernel": name, **info, "threads_per_block": threads, "blocks_per_sm": blocks,
                        "occupancy": occ, "limiter": limiter,
                        "features": [f for f, p in (("wgmma", "wgmma.mma_async"), ("tma", "cp.async.bulk.tensor"))
                                     if p in text]})
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    cases = [("pallas", "auto", 256, 1024), ("mosaic", "auto", 256, 1024)]
    if not quick:
        cases += [("pallas", kv, 256, 1024) for kv in ("int8", "float8_e4m3fn")]
        cases += [("pallas", "auto", b, ctx) for b, ctx in ((1, 1024), (1, 4096), (16, 256), (16, 1024), (64, 1024))]
        cases += [("mosaic", "auto", b, ctx) for b, ctx in ((1, 1024), (16, 1024), (64, 1024))]
    rows = []
    for case in cases:
        row = probe(*case)
        rows.append(row)
        k = row["kernels"][0] if row["kernels"] else {}
        print(f"{row['backend']:<6} {row['kv_cache_dtype']:<14} b={row['num_seqs']:<4} ctx={row['context']:<5} "
              f"kv_MB={row['kv_bytes'] / 1e6:8.2f} attn_MB={row['attention_bytes'] / 1e6:8.2f} "
              f"extra_MB={row['extra_bytes'] / 1e6:7.2f} extra/kv={row['extra_to_kv']:.3f} "
              f"launches={row['launches']} regs={k.get('registers')} spills={k.get('spill_store_bytes')} "
              f"occ={k.get('occupancy')}", flush=True)
    # A W1-like mixed step: 16 sequences of 512 new tokens over 512 cached (8192 tokens); and one
    # with 256 decode rows beside 15 such chunks (decode rows fill a whole tile each).
    mixes = {"w1": ([512] * 16, [1024] * 16), "w1+decode": ([512] * 15 + [1] * 256, [1024] * 15 + [1024] * 256)}
    for name, (q_lens, seq_lens) in mixes.items():
        for backend in ("pallas", "mosaic"):
            row = probe_mixed(backend, q_lens, seq_lens) if name == "w1" else {
                "backend": backend, **mixed_flops(backend, q_lens, seq_lens)}
            rows.append({"mix": name, **row})
            k = row["kernels"][0] if row.get("kernels") else {}
            print(f"{backend:<6} mixed {name:<10} executed/useful attention FLOPs={row['executed_to_useful']:.3f} "
                  f"regs={k.get('registers')} spills={k.get('spill_store_bytes')} occ={k.get('occupancy')} "
                  f"features={k.get('features')}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
