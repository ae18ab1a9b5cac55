"""W1 at one KV byte budget with a float, an int8 and an fp8 KV cache: pages, peak sequences, throughput.

    python -m benchmarks.bench_kv_quant --preset cpu [--kv-budget-tokens 512] [--kv-cache-dtypes auto,int8,float8_e4m3fn]

The budget is `kv_budget_tokens` tokens of the float cache in bytes (model dtype, all layers, K and
V); each KV dtype gets as many pages as fit in those bytes (`num_pages_for_budget`, scales counted),
then runs W1 (BENCHMARKS.md, the preset's W1 requests) after its own warm-up, as bench_throughput
does. The CPU default budget (512 tokens, 32 float pages) is below W1's demand (16 sequences of up
to 128 tokens), so the float cache runs fewer sequences at once and preempts; the quantized caches
hold ~3.8x the pages (68 bytes per token and head instead of 256 in float32). Writes
`benchmarks/results/kv_quant_<preset>.json` and prints one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_throughput import (
    PRESETS,
    RESULTS_DIR,
    check_device,
    load_cpu_model,
    load_h100_model,
    make_engine,
    workload_w1,
)
from benchmarks.common import environment, format_table
from jaxpaged.baseline.drivers import run_jaxpaged, warmup_requests
from jaxpaged.baseline.measure import summarize

COLUMNS = [
    ("kv dtype", "kv_cache_dtype"), ("pages", "num_pages"), ("bytes/page", "bytes_per_page"),
    ("out tok/s", "output_tok_s"), ("total tok/s", "total_tok_s"), ("peak seqs", "peak_running"),
    ("preempt", "preemptions"), ("recomp tok", "recomputed_tokens"), ("TPOT p50", "tpot_median_s"),
    ("wall s", "wall_s"),
]


def main(argv=None) -> dict:
    from jaxpaged.device.kv_cache import kv_cache_bytes_per_page, num_pages_for_budget

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--kv-budget-tokens", type=int, default=512,
                        help="the byte budget, in tokens of the float (model dtype) cache")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,float8_e4m3fn")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    check_device(preset)
    started = time.perf_counter()
    model_config, params, tokenizer = load_cpu_model() if preset.name == "cpu" else load_h100_model()
    budget_bytes = args.kv_budget_tokens // preset.page_size * kv_cache_bytes_per_page(model_config, preset.page_size)
    w1 = workload_w1(**preset.w1)
    rows = []
    for kv_dtype in [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]:
        num_pages = num_pages_for_budget(model_config, preset.page_size, budget_bytes, kv_dtype)
        engine = make_engine(preset, model_config, params, tokenizer, num_pages=num_pages, kv_cache_dtype=kv_dtype)
        assert engine.runner.kv_cache_bytes() <= budget_bytes, "the pool must fit the budget"
        capacity = num_pages * preset.page_size
        run_jaxpaged(engine, warmup_requests(w1), system="warmup", workload="W1", capacity_tokens=capacity)
        engine.reset_prefix_cache()
        run, _ = run_jaxpaged(engine, w1, system=f"jaxpaged kv={kv_dtype}", workload="W1", capacity_tokens=capacity)
        row = summarize(run)
        row.update(kv_cache_dtype=kv_dtype, num_pages=num_pages, kv_cache_bytes=engine.runner.kv_cache_bytes(),
                   bytes_per_page=kv_cache_bytes_per_page(model_config, preset.page_size, kv_dtype),
                   wall_s=round(run.wall_s, 2))
        rows.append(row)
        print(format_table([row], COLUMNS), flush=True)
        del engine
    result = {
        "benchmark": "bench_kv_quant",
        "preset": dataclasses.asdict(preset),
        "environment": environment(),
        "kv_budget_tokens_float": args.kv_budget_tokens,
        "kv_budget_bytes": budget_bytes,
        "results": rows,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "total_benchmark_s": round(time.perf_counter() - started, 1),
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kv_quant_{preset.name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nW1 at {budget_bytes} KV bytes ({args.kv_budget_tokens} float tokens), preset {preset.name}:")
    print(format_table(rows, COLUMNS))
    print(f"wrote {path} ({result['total_benchmark_s']} s)")
    return result


if __name__ == "__main__":
    main()
