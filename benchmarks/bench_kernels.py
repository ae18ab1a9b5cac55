"""Kernel benchmarks K1 (decode) and K2 (ragged prefill) of BENCHMARKS.md, side by side.

K1: one query token per sequence over a paged bf16 cache, head_dim 128, GQA 32/8 and 16/8, page
    size 16 and 32. Peers: our `decode_attention`, our `paged_attention` (ragged kernel with q_len 1),
    the Mosaic GPU (Hopper) `pallas_kernels.mosaic` decode and ragged kernels, JAX's bundled `jax.experimental.pallas.ops.gpu.paged_attention` (where it exists) and dense
    `jax.nn.dot_product_attention` over contiguous K/V. Reported as achieved bandwidth over the bytes
    that must move (context x K and V x kv heads x head_dim x 2 bytes) and its fraction of the
    measured copy bandwidth.
K2: mixed batches of query chunks (1..2048 tokens) over cached prefixes. Peers: our `paged_attention`,
    the Mosaic GPU `ragged_paged_attention` and dense causal attention (explicit mask, contiguous K/V, padded batch). Reported as TFLOP/s of
    useful attention work (4 x heads x head_dim per visible query-key pair) and its fraction of the
    measured bf16 matmul rate.

Needs a GPU: on anything else it exits with code 2. `--dry-run` runs every code path (workload
construction, each peer in Pallas interpret mode, the limits, the table and the JSON) on tiny shapes,
so the script is exercised on CPU; its figures mean nothing. The Mosaic GPU peers are timed only on
a GPU (interpreting them takes seconds per CUDA block): a dry run lowers them for CUDA instead.

    python benchmarks/bench_kernels.py                    # GPU: K1 and K2, JSON to benchmarks/results/
    python benchmarks/bench_kernels.py --workloads K1 --repeats 50
    python benchmarks/bench_kernels.py --quick            # a representative subset (about a minute)
    python benchmarks/bench_kernels.py --check --workloads K1 --json OUT.json   # what gpu_check.sh runs
    python benchmarks/bench_kernels.py --dry-run          # CPU smoke run, JSON to a temp dir
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.kernel_cases import (
    CHECK, DRY, FULL, QUICK, Scale, build_paged, decode_splits, measure_copy_bandwidth, measure_matmul_rate, time_call,
)
from jaxpaged.ops.kv_quant import QuantizedKV, quantize
from pallas_kernels import decode_attention, paged_attention
from pallas_kernels import mosaic
from pallas_kernels.jax_compat import cuda_target, jax_paged_attention_module

jax_paged_attention_module = jax_paged_attention_module()  # None where this JAX ships none

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def mosaic_peers(peers: dict, dry_run: bool) -> dict:
    """The Mosaic GPU peers {name: (fn, args)} to time; on a dry run, lowered for CUDA and dropped."""
    if not dry_run:
        return peers
    for name, (fn, fn_args) in peers.items():
        with cuda_target():
            text = jax.jit(fn).trace(*fn_args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, f"{name} did not lower to a Mosaic GPU kernel"
        print(f"{name}: lowered for CUDA (dry run: Mosaic GPU peers are timed on a GPU only)")
    return {}


# ---------------------------------------------------------------------------------------------
# K1: decode


def run_k1(scale: Scale, args, limits: dict, rows: list[dict], save) -> list[dict]:
    """Appends K1's rows to `rows`, calling `save()` after each configuration (a run cut short keeps them)."""
    interpret = args.dry_run
    for page_size in scale.page_sizes:
        for num_heads, num_kv_heads in scale.k1_heads:
            for context in scale.k1_contexts:
                for num_seqs in scale.k1_batches:
                    if num_seqs * context > scale.max_k1_tokens:
                        continue
                    rows += k1_config(scale, args, limits, page_size, num_heads, num_kv_heads, context, num_seqs, interpret)
                    save()
    return rows


def k1_config(scale, args, limits, page_size, num_heads, num_kv_heads, context, num_seqs, interpret):
    head_dim = scale.head_dim
    key = jax.random.key(context * 1000 + num_seqs)
    k_pages, v_pages, block_tables, k_dense, v_dense = build_paged(key, [context] * num_seqs, num_kv_heads, head_dim, page_size)
    q = jax.random.normal(jax.random.fold_in(key, 1), (num_seqs, num_heads, head_dim), jnp.bfloat16)
    seq_lens = jnp.full((num_seqs,), context, jnp.int32)
    query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)
    softmax_scale = head_dim**-0.5
    pages_per_seq = block_tables.shape[1]
    block = max(1, 64 // page_size)  # 64 keys per compute block
    splits = decode_splits(num_seqs, num_kv_heads, pages_per_seq, block, args.dry_run)

    peers = {
        "ours decode_attention": lambda q, kp, vp, bt, sl: decode_attention(
            q, kp, vp, bt, sl, scale=softmax_scale, pages_per_compute_block=block, num_splits=splits, interpret=interpret
        ),
        "ours paged_attention (ragged)": lambda q, kp, vp, bt, sl: paged_attention(
            q, kp, vp, bt, sl, query_start_loc, scale=softmax_scale, pages_per_compute_block=block, interpret=interpret
        ),
    }
    if jax_paged_attention_module is not None:
        jax_splits = min(16, pages_per_seq)  # power of two dividing pages_per_seq (contexts are powers of two)
        jax_block = min(8, pages_per_seq // jax_splits)
        peers["jax ops.gpu.paged_attention"] = lambda q, kp, vp, bt, sl: jax_paged_attention_module.paged_attention(
            q * softmax_scale, kp, vp, bt, sl, k_splits=jax_splits, pages_per_compute_block=jax_block, interpret=interpret
        )
    dense = jax.jit(
        lambda q, k, v, sl: jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=sl, scale=softmax_scale)[:, 0]
    )

    dense_out = dense(q, k_dense, v_dense, seq_lens)
    must_move = num_seqs * context * num_kv_heads * head_dim * 2 * 2  # K and V, bf16
    rows = []
    results = {name: (fn, (q, k_pages, v_pages, block_tables, seq_lens)) for name, fn in peers.items()}
    results["dense jax.nn.dot_product_attention"] = (dense, (q, k_dense, v_dense, seq_lens))
    # Quantized KV caches (--kv-cache-dtypes): our two kernels over int8 / fp8 pages with a float32
    # scale per (token, head), dequantized as read; they must move fewer bytes (values + scales).
    moved = {name: (must_move, "auto") for name in results}
    for kv_dtype in [d for d in args.kv_cache_dtypes if d != "auto"]:
        k_q, v_q = (QuantizedKV(*quantize(pages, kv_dtype)) for pages in (k_pages, v_pages))
        for name in ("ours decode_attention", "ours paged_attention (ragged)"):
            results[f"{name} kv={kv_dtype}"] = (peers[name], (q, k_q, v_q, block_tables, seq_lens))
            moved[f"{name} kv={kv_dtype}"] = (num_seqs * context * num_kv_heads * (head_dim + 4) * 2, kv_dtype)
    kv_pages = jnp.stack([k_pages, v_pages])[None]  # the whole-buffer form, one layer
    mosaic_splits = max(1, min(splits, -(-context // 64)))  # never more splits than 64-key steps
    results |= mosaic_peers(
        {
            "mosaic decode_attention": (
                lambda q, kv, bt, sl: mosaic.decode_attention(
                    q, kv, bt, sl, layer_idx=0, scale=softmax_scale, num_splits=mosaic_splits, interpret=False
                ),
                (q, kv_pages, block_tables, seq_lens),
            ),
            "mosaic ragged_paged_attention": (
                lambda q, kv, bt, sl: mosaic.ragged_paged_attention(
                    q, kv, bt, sl, query_start_loc, layer_idx=0, scale=softmax_scale, interpret=False
                ),
                (q, kv_pages, block_tables, seq_lens),
            ),
        },
        args.dry_run,
    )
    for name, (fn, fn_args) in results.items():
        fn = jax.jit(fn)
        num_bytes, kv_dtype = moved.get(name, (must_move, "auto"))  # Mosaic peers: bf16 pages
        row = dict(workload="K1", impl=name, batch=num_seqs, context=context, num_heads=num_heads,
                   num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, kv_cache_dtype=kv_dtype,
                   bytes=num_bytes)
        try:  # a peer that fails to compile or run is reported as such; the others still run
            seconds = time_call(fn, *fn_args, repeats=args.repeats)
            error = float(jnp.abs(fn(*fn_args).astype(jnp.float32) - dense_out.astype(jnp.float32)).max())
        except Exception as e:  # noqa: BLE001
            print(f"K1 {name} B={num_seqs} ctx={context}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append(dict(row, ms=None, gb_per_s=None, fraction_of_copy_bw=None, max_abs_diff_vs_dense=None,
                             error=f"{type(e).__name__}: {str(e)[:500]}"))
            continue
        bandwidth = num_bytes / seconds
        rows.append(dict(row, ms=seconds * 1e3, gb_per_s=bandwidth / 1e9,
                         fraction_of_copy_bw=bandwidth / limits["copy_bytes_per_s"], max_abs_diff_vs_dense=error))
    return rows


# ---------------------------------------------------------------------------------------------
# K2: ragged prefill


def run_k2(scale: Scale, args, limits: dict, rows: list[dict], save) -> list[dict]:
    num_heads, num_kv_heads = scale.k2_heads
    head_dim = scale.head_dim
    for page_size in scale.page_sizes:
        for name, batch in scale.k2_batches:
            rows += k2_config(args, limits, name, batch, page_size, num_heads, num_kv_heads, head_dim, scale.dense_logits_budget_bytes)
            save()
    return rows


def k2_config(args, limits, name, batch, page_size, num_heads, num_kv_heads, head_dim, dense_budget_bytes):
    cached = [c for c, _ in batch]
    q_lens = [n for _, n in batch]
    seq_lens_list = [c + n for c, n in batch]
    num_seqs, num_tokens = len(batch), sum(q_lens)
    key = jax.random.key(num_tokens)
    k_pages, v_pages, block_tables, k_dense, v_dense = build_paged(key, seq_lens_list, num_kv_heads, head_dim, page_size)
    q = jax.random.normal(jax.random.fold_in(key, 1), (num_tokens, num_heads, head_dim), jnp.bfloat16)
    seq_lens = jnp.asarray(seq_lens_list, jnp.int32)
    query_start_loc = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    softmax_scale = head_dim**-0.5

    ours = jax.jit(
        lambda q, kp, vp, bt, sl, qsl: paged_attention(q, kp, vp, bt, sl, qsl, scale=softmax_scale, block_q=args.block_q, interpret=args.dry_run)
    )
    peers = [("ours paged_attention (ragged)", ours, (q, k_pages, v_pages, block_tables, seq_lens, query_start_loc))]
    mosaic_ragged = lambda q, kv, bt, sl, qsl: mosaic.ragged_paged_attention(  # noqa: E731
        q, kv, bt, sl, qsl, layer_idx=0, scale=softmax_scale, interpret=False
    )
    kv_pages = jnp.stack([k_pages, v_pages])[None]  # the whole-buffer form, one layer
    for impl, (fn, fn_args) in mosaic_peers(
        {"mosaic ragged_paged_attention": (mosaic_ragged, (q, kv_pages, block_tables, seq_lens, query_start_loc))},
        args.dry_run,
    ).items():
        peers.append((impl, jax.jit(fn), fn_args))
    useful_flops = sum(4 * num_heads * head_dim * (c + i + 1) for c, n in batch for i in range(n))

    # Dense peer: queries padded to [S, max_q, N, H]; query i of sequence s sits at cached[s] + i.
    # XLA's dense attention materialises [S, N, max_q, L] f32 logits: skipped past a memory budget.
    max_q, max_len = max(q_lens), k_dense.shape[1]
    dense_logit_bytes = num_seqs * num_heads * max_q * max_len * 4
    dense_out = None
    if dense_logit_bytes <= dense_budget_bytes:
        token_seq = np.repeat(np.arange(num_seqs), q_lens)
        token_row = np.concatenate([np.arange(n) for n in q_lens])
        q_dense = jnp.zeros((num_seqs, max_q, num_heads, head_dim), jnp.bfloat16).at[token_seq, token_row].set(q)
        query_pos = np.asarray(cached)[:, None] + np.arange(max_q)[None, :]  # [S, max_q]
        key_pos = np.arange(max_len)[None, None, :]  # [1, 1, L]
        mask = (key_pos <= query_pos[:, :, None]) & (key_pos < np.asarray(seq_lens_list)[:, None, None])
        mask = jnp.asarray(mask[:, None])  # [S, 1, max_q, L]
        dense = jax.jit(
            lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, scale=softmax_scale)[token_seq, token_row]
        )
        dense_out = dense(q_dense, k_dense, v_dense, mask)
        peers.append(("dense jax.nn.dot_product_attention (masked)", dense, (q_dense, k_dense, v_dense, mask)))
    else:
        print(f"K2 {name}: dense peer skipped, its padded logits would need {dense_logit_bytes / 1e9:.0f} GB")
    rows = []
    for impl, fn, fn_args in peers:
        seconds = time_call(fn, *fn_args, repeats=args.repeats)
        error = float("nan") if dense_out is None else float(jnp.abs(fn(*fn_args).astype(jnp.float32) - dense_out.astype(jnp.float32)).max())
        rate = useful_flops / seconds
        rows.append(
            dict(
                workload="K2",
                impl=impl,
                batch_name=name,
                num_seqs=num_seqs,
                num_tokens=num_tokens,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                page_size=page_size,
                ms=seconds * 1e3,
                useful_flops=useful_flops,
                tflop_per_s=rate / 1e12,
                fraction_of_matmul_rate=rate / limits["matmul_flop_per_s"],
                max_abs_diff_vs_dense=error,
            )
        )
    return rows


# ---------------------------------------------------------------------------------------------


def print_table(rows: list[dict]) -> None:
    for row in rows:
        if row.get("error"):
            print(f"{row['workload']}  {row['impl']}: {row['error'][:120]}")
            continue
        if row["workload"] == "K1":
            shape = f"B={row['batch']:<4} ctx={row['context']:<6} {row['num_heads']}/{row['num_kv_heads']} ps={row['page_size']}"
            figure = f"{row['gb_per_s']:9.1f} GB/s  {row['fraction_of_copy_bw']:6.1%} of copy bw"
        else:
            shape = f"{row['batch_name'][:40]:<40} ps={row['page_size']}"
            figure = f"{row['tflop_per_s']:9.2f} TFLOP/s {row['fraction_of_matmul_rate']:6.1%} of matmul"
        print(f"{row['workload']}  {shape:<44} {row['impl']:<44} {row['ms']:9.3f} ms {figure}  diff {row['max_abs_diff_vs_dense']:.1e}")


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=os.path.dirname(RESULTS_DIR)
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=("K1", "K2"), default=["K1", "K2"])
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=("auto", "int8", "float8_e4m3fn"), default=["auto"],
                        help="K1: also time our kernels over int8 / fp8 pages (quantized KV cache); "
                             "diff vs dense then includes the quantization error")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median is reported)")
    parser.add_argument("--block-q", type=int, default=16, help="query tokens per program of the ragged kernel in K2")
    parser.add_argument("--quick", action="store_true", help="a representative subset of K1 and K2 (about a minute)")
    parser.add_argument("--check", action="store_true", help="the subset scripts/gpu_check.sh runs (kernel_cases.CHECK)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, interpret mode, any device: checks the script runs")
    parser.add_argument("--out", default=None, help="JSON output directory (default benchmarks/results/, a temp dir for --dry-run)")
    parser.add_argument("--json", default=None, help="the JSON file itself (instead of a dated name under --out)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    backend = jax.default_backend()
    if backend != "gpu" and not args.dry_run:
        print(
            f"bench_kernels needs a GPU (JAX backend is {backend!r}): kernel timings elsewhere mean nothing. "
            "Run it on a CUDA machine, or pass --dry-run to smoke-test the script in interpret mode.",
            file=sys.stderr,
        )
        return 2
    scale = DRY if args.dry_run else CHECK if args.check else QUICK if args.quick else FULL
    if args.dry_run:
        args.repeats = 1
        args.block_q = 8
    limits = {
        "copy_bytes_per_s": measure_copy_bandwidth(scale.copy_bytes, args.repeats),
        "matmul_flop_per_s": measure_matmul_rate(scale.matmul_size, args.repeats),
    }
    print(
        f"device {jax.devices()[0].device_kind}: copy bandwidth {limits['copy_bytes_per_s'] / 1e9:.1f} GB/s (read+write), "
        f"bf16 matmul {limits['matmul_flop_per_s'] / 1e12:.2f} TFLOP/s"
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    report = dict(
        device=jax.devices()[0].device_kind,
        backend=backend,
        jax_version=jax.__version__,
        commit=git_commit(),
        date=now.isoformat(timespec="seconds"),
        dry_run=args.dry_run,
        quick=args.quick,
        repeats=args.repeats,
        limits=limits,
        rows=rows,
        status="running",
    )
    if args.json:
        path = args.json
    else:
        out_dir = args.out or (tempfile.mkdtemp(prefix="bench_kernels_") if args.dry_run else RESULTS_DIR)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"kernels-{now:%Y%m%dT%H%M%S}{'-dry-run' if args.dry_run else ''}.json")

    def save():  # rewritten after every configuration
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)

    save()
    if "K1" in args.workloads:
        run_k1(scale, args, limits, rows, save)
    if "K2" in args.workloads:
        run_k2(scale, args, limits, rows, save)
    report["status"] = "done"
    save()
    print_table(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
