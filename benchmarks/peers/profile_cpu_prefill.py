"""Where one jaxpaged prefill step's time goes on this CPU (issue 31: W2 without caching, 3x behind vLLM).

    python -m benchmarks.peers.profile_cpu_prefill [--tokens 256] [--cached 128] [--seqs 1] [--engine-args '{}']
        # writes benchmarks/results/cpu_prefill_profile_<tokens>.json, prints one table; ~3 min on 2 cores

The step: `seqs` sequences, each scheduling tokens/seqs new prompt tokens after `cached` tokens already
in the pool (a chunked prefill, as W2's 256-token steps are), in the engine's `tokens` bucket. Same
tools as `profile_cpu_decode` (machine peaks, XLA CPU trace split by category), with attention split
into its page gather, its two matmuls and the rest (masks, online softmax), and each category's
floor: its FLOPs at the jnp.dot rate or its bytes at the read bandwidth, whichever is larger.
Internals used, read-only: `llm.engine.runner` (`dummy_step_input`, `execute`, `trace_step`,
`page_size`, `num_pages`, `max_num_seqs`, `config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np

from benchmarks.common import environment, format_table
from benchmarks.peers.profile_cpu_decode import best_of, machine_peaks
from benchmarks.peers.xla_cpu_trace import trace_breakdown


def prefill_step_input(runner, tokens: int, cached: int, seqs: int):
    """`seqs` sequences of tokens // seqs new tokens each, after `cached` tokens; bucket `tokens`.

        sequence i owns pages 1 + i*pps ...; its new tokens sit at positions cached ... cached + n - 1
        logits are taken at each sequence's last new token (as the engine does for a prompt chunk)
    """
    p, n = runner.page_size, tokens // seqs
    pps = -(-(cached + n) // p)
    if pps > runner.pages_per_seq:
        raise ValueError(f"{cached + n} tokens per sequence exceed max_model_len ({runner.pages_per_seq * p})")
    if 1 + seqs * pps > runner.num_pages:
        raise ValueError(f"{seqs=} x {cached + n} tokens needs {1 + seqs * pps} pages; the pool has {runner.num_pages}")
    base = runner.dummy_step_input(tokens)
    rows = base.block_tables.shape[0]
    tables = np.zeros_like(base.block_tables)
    for i in range(seqs):
        tables[i, :pps] = 1 + i * pps + np.arange(pps)
    seq_of = np.repeat(np.arange(seqs), n)
    pos = cached + np.tile(np.arange(n), seqs)
    slots = np.full(tokens, runner.num_pages * p, np.int32)
    slots[: seqs * n] = tables[seq_of, pos // p] * p + pos % p
    qsl = np.minimum(np.arange(rows + 1) * n, seqs * n)
    seq_lens = np.where(np.arange(rows) < seqs, cached + n, 0)
    logits = np.where(np.arange(rows) < seqs, (np.arange(rows) + 1) * n - 1, 0)
    ids = np.zeros(tokens, np.int32)
    ids[: seqs * n] = np.random.default_rng(0).integers(100, 10000, seqs * n)
    positions = np.zeros(tokens, np.int32)
    positions[: seqs * n] = pos
    return dataclasses.replace(
        base, token_ids=ids, positions=positions, slot_mapping=slots, block_tables=tables,
        seq_lens=seq_lens.astype(np.int32), query_start_loc=qsl.astype(np.int32), logits_indices=logits.astype(np.int32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256, help="new tokens in the step (= its bucket)")
    parser.add_argument("--cached", type=int, default=128, help="tokens each sequence already has in the pool")
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine-args", default="{}", help="JSON of LLM keyword arguments")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from jaxpaged import LLM

    loads = {"start": os.getloadavg()}
    peaks = machine_peaks()
    engine_args = {"max_model_len": 1024, "enable_prefix_caching": False, "max_num_batched_tokens": args.tokens,
                   **json.loads(args.engine_args)}
    t = time.perf_counter()
    llm = LLM(**engine_args)
    build_s = time.perf_counter() - t
    runner = llm.engine.runner  # internal, read-only
    cfg = runner.config
    step_input = prefill_step_input(runner, args.tokens, args.cached, args.seqs)
    runner.execute(step_input).block_until_ready()
    loads["step"] = os.getloadavg()
    cpu0 = time.process_time()
    step_best, step_median = best_of(lambda: runner.execute(step_input).block_until_ready(), args.steps)
    step_cpu = (time.process_time() - cpu0) / args.steps
    d, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    trace = trace_breakdown(runner, step_input, args.steps, {d, f, kv, cfg.num_heads * cfg.head_dim},
                            split_attention=True)
    loads["end"] = os.getloadavg()

    # Floors: FLOPs at the dot rate vs bytes at the read bandwidth, per category.
    gflops, gbs = peaks["matmul_gflop_s"] * 1e9, peaks["read_gb_s"] * 1e9
    t_real, logits_rows = args.seqs * (args.tokens // args.seqs), len(step_input.logits_indices)
    context = args.cached + args.tokens // args.seqs
    L = cfg.num_layers

    def floor(flops, nbytes):
        return max(flops / gflops, nbytes / gbs) * 1e3

    qkvo = L * d * (2 * cfg.num_heads * cfg.head_dim + 2 * kv)
    mlp = L * 3 * d * f
    # Causal attention of the new tokens: each reads keys up to its position (QK^T and PV: 4 flops a key-dim).
    keys_read = sum(args.cached + i + 1 for i in range(args.tokens // args.seqs)) * args.seqs
    attn_flops = 4 * keys_read * cfg.num_heads * cfg.head_dim * L
    attn_bytes = args.seqs * context * kv * 2 * 4 * L  # each sequence's K and V read once
    floors = {
        "attention projections (q, k, v, o)": floor(2 * t_real * qkvo, 4 * qkvo),
        "MLP matmuls (gate, up, down)": floor(2 * t_real * mlp, 4 * mlp),
        "LM head matmul": floor(2 * args.seqs * cfg.vocab_size * d, 4 * cfg.vocab_size * d),
        "attention: QK^T and PV matmuls": floor(attn_flops, 0),
        "attention: page gather": floor(0, attn_bytes),
        "attention: C++ ragged kernel": floor(attn_flops, attn_bytes),
        "KV write (scatter)": floor(0, t_real * kv * 2 * 4 * L),
    }
    step_flops = 2 * t_real * (qkvo + mlp) + 2 * args.seqs * cfg.vocab_size * d + attn_flops
    floors["whole step"] = floor(step_flops, 4 * (qkvo + mlp + cfg.vocab_size * d) + attn_bytes)
    rows = [{"category": cat, "wall_ms": ms, "share": ms / trace["traced_step_ms"], "thread_ms": trace["thread_ms"].get(cat),
             "floor_ms": floors.get(cat)} for cat, ms in sorted(trace["wall_ms"].items(), key=lambda kv_: -kv_[1])]
    rows.append({"category": "outside thunks (dispatch, executor gaps, tracing)",
                 "wall_ms": trace["traced_step_ms"] - trace["busy_wall_ms"],
                 "share": (trace["traced_step_ms"] - trace["busy_wall_ms"]) / trace["traced_step_ms"]})
    rows.append({"category": "compiled step, untraced (best)", "wall_ms": step_best * 1e3, "floor_ms": floors["whole step"]})
    report = {
        "benchmark": "profile_cpu_prefill", "environment": environment(), "loadavg": loads,
        "workload": {"tokens": args.tokens, "cached": args.cached, "seqs": args.seqs, "steps": args.steps,
                     "logits_rows": logits_rows, "dtype": cfg.dtype},
        "engine_args": engine_args, "llm_build_s": build_s, "machine": peaks,
        "step_ms": {"best": step_best * 1e3, "median": step_median * 1e3, "process_cpu_mean": step_cpu * 1e3},
        "step_gflop": step_flops / 1e9, "matmul_peak_share": step_flops / step_best / gflops,
        "trace": trace, "floors_ms": floors, "rows": rows,
    }
    out = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                                   f"cpu_prefill_profile_{args.tokens}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"prefill step: {args.seqs} x {args.tokens // args.seqs} new tokens after {args.cached} cached "
          f"({logits_rows} logits rows); built in {build_s:.0f} s; best {step_best * 1e3:.1f} ms, median "
          f"{step_median * 1e3:.1f}, process CPU {step_cpu * 1e3:.1f} ms/step; {step_flops / 1e9:.1f} GFLOP = "
          f"{step_flops / step_best / gflops:.0%} of the jnp.dot rate")
    print(f"machine: matmul {peaks['matmul_gflop_s']:.1f} GFLOP/s, read {peaks['read_gb_s']:.1f} GB/s; "
          f"load {loads['start'][0]:.1f} -> {loads['end'][0]:.1f}")
    print(format_table(rows, [(f"prefill step, {args.tokens} tokens", "category"), ("wall ms", "wall_ms"),
                              ("share", "share"), ("thread ms", "thread_ms"), ("floor ms", "floor_ms")]))


if __name__ == "__main__":
    main()
