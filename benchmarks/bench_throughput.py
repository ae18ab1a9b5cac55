"""Throughput of jaxpaged against the dense-cache baseline (and, on the CPU, Hugging Face), W1-W3.

    python -m benchmarks.bench_throughput --preset cpu     # bundled SmolLM2-135M, ~5 min on 2 cores
    python -m benchmarks.bench_throughput --preset h100    # Qwen3-0.6B shapes, random bf16 weights
    python -m benchmarks.bench_throughput --preset cpu --workloads w1 --no-hf --no-dense \
        --name throughput_cpu_w1_sync_vs_async            # W1 only: async vs synchronous stepping

Every system runs the same requests in one process, each after its own warm-up (all buckets
compiled, then one small untimed call), under the same KV memory budget. Workloads (BENCHMARKS.md):

    W1  offline throughput: random prompts and output lengths, temperature 0.6, ignore_eos; jaxpaged
        also with synchronous stepping (`jaxpaged-sync`), to show what overlapping host and device buys
    W2  shared prefix: prefix caching on / off, and a run whose prompts share nothing (0% hits)
    W3  memory pressure: a pool too small for the batch; greedy outputs must equal an unconstrained run
    W3-swap  (--workloads w3swap) W3's small pool, preemption by recompute vs by swap to host memory
    W2-host  (--workloads w2host) W2 with several shared prefixes that do not fit the device pool,
             requests cycling through them: the prefix cache's host tier on vs off

Prints one table and writes `benchmarks/results/throughput_<preset>.json` and one PNG per workload
(output throughput and KV utilisation over time, every system).
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

from tqdm.auto import tqdm

from benchmarks.common import environment, format_table, plot_runs
from benchmarks.runners import run_hf
from benchmarks.workloads import (
    PRESETS, QWEN3_0_6B_SHAPES, Preset, SilentTokenizer, workload_w1, workload_w2, workload_w2_host, workload_w3,
)
from jaxpaged.baseline.dense_kv import DenseBaseline, batch_size_for_budget
from jaxpaged.baseline.drivers import run_dense, run_jaxpaged, warmup_requests
from jaxpaged.baseline.measure import Run, summarize

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load_cpu_model():
    from jaxpaged.models.weights import load_model

    model_config, params, tokenizer = load_model(None, dtype="float32")
    return model_config, params, tokenizer


def load_h100_model():
    import jax

    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.llama import init_params

    model_config = ModelConfig(**QWEN3_0_6B_SHAPES)
    params = init_params(model_config, jax.random.key(0))  # random bf16, on the device
    return model_config, params, SilentTokenizer()


def make_engine(preset: Preset, model_config, params, tokenizer, *, num_pages: int, prefix_caching: bool = True,
                async_scheduling: bool = True, **engine_args):
    from jaxpaged.engine.engine import LLMEngine
    from jaxpaged.config import EngineConfig

    on_gpu = preset.name != "cpu"
    config = EngineConfig(
        page_size=preset.page_size, num_pages=num_pages, max_num_seqs=preset.max_num_seqs,
        max_num_batched_tokens=preset.max_num_batched_tokens, max_model_len=preset.max_model_len,
        enable_prefix_caching=prefix_caching, dtype=model_config.dtype,
        attention_backend="pallas" if on_gpu else "reference", async_scheduling=async_scheduling, **engine_args,
    ).resolved(on_gpu=on_gpu, model_max_len=model_config.max_position_embeddings)
    if on_gpu:
        import pallas_kernels

        # The engine's own GPU backend: whole-buffer kernels, the decode kernel in decode-only steps.
        attention_fn = pallas_kernels.pallas_backend(interpret=False)
    else:
        from jaxpaged.ops.attention import reference_paged_attention

        attention_fn = reference_paged_attention
    return LLMEngine(model_config, params, tokenizer, config, num_pages=num_pages, attention_fn=attention_fn)


def gpu_kv_budget_tokens(model_config, params, fraction: float = 0.4) -> int:
    """A share of the device memory left after the weights (jaxpaged's rule, at half its default
    fraction: two pools of this size, jaxpaged's and the baseline's, live at once)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    token_bytes = model_config.num_layers * 2 * model_config.num_kv_heads * model_config.head_dim * 2
    return int(free * fraction) // token_bytes


# ----------------------------------------------------------------------------- main


def check_device(preset: Preset) -> None:
    import jax

    backend = jax.default_backend()
    if preset.name != "cpu" and backend != "gpu":
        raise SystemExit(
            f"--preset {preset.name} needs a CUDA GPU, but JAX's backend here is {backend!r} "
            f"(devices: {jax.devices()}); run it on an H100 with jax[cuda12] installed, or use --preset cpu"
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--workloads", default="w1,w2,w3",
                        help="comma-separated subset of w1,w2,w3,w3swap,w2host")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer on the CPU preset")
    parser.add_argument("--no-dense", action="store_true", help="W1: skip the dense-cache baseline")
    parser.add_argument("--no-sync-peer", action="store_true",
                        help="W1: skip jaxpaged with synchronous stepping (async_scheduling=False)")
    parser.add_argument("--name", default=None, help="JSON and plot file name stem (default throughput_<preset>)")
    parser.add_argument("--out", default=RESULTS_DIR, help="directory for the JSON and the plots")
    parser.add_argument("--hf-threads", type=int, default=None,
                        help="torch threads for the Hugging Face peer (default: torch's). On a CPU shared with "
                             "other work use 1: OpenMP threads that spin-wait for a descheduled peer made torch "
                             "6x slower per step here with 2 threads")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    check_device(preset)
    workloads = [w.strip().lower() for w in args.workloads.split(",") if w.strip()]
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]

    model_config, params, tokenizer = load_cpu_model() if preset.name == "cpu" else load_h100_model()
    budget = preset.kv_budget_tokens or gpu_kv_budget_tokens(model_config, params)
    num_pages = budget // preset.page_size  # the same bytes as the dense cache (page 0 included)
    dense_batch = batch_size_for_budget(budget, preset.max_model_len)
    print(f"KV budget {budget} tokens: jaxpaged {num_pages} pages of {preset.page_size}, "
          f"dense baseline {dense_batch} rows of {preset.max_model_len}", flush=True)

    runs: dict[str, list[Run]] = {}
    checks: dict[str, object] = {}
    engine = make_engine(preset, model_config, params, tokenizer, num_pages=num_pages)
    dense = DenseBaseline(model_config, engine.runner.params, max_model_len=preset.max_model_len,
                          batch_size=dense_batch, page_size=preset.page_size,
                          max_prefill_tokens=preset.max_num_batched_tokens, eos_token_id=tokenizer.eos_token_id)
    dense_warmed = set()

    def timed_pair(name, requests, jax_engine, dense_baseline, capacity):
        """jaxpaged then the dense baseline on the same requests, each after a warm-up call."""
        max_prompt = max(len(p) for p, _ in requests)
        max_seq = max(len(p) + s.max_tokens for p, s in requests)
        key = (id(dense_baseline), max_prompt, max_seq)
        if key not in dense_warmed:
            dense_baseline.warmup(max_prompt, max_seq)
            dense_warmed.add(key)
        total = sum(s.max_tokens for _, s in requests)
        run_jaxpaged(jax_engine, warmup_requests(requests), system="warmup", workload=name, capacity_tokens=capacity)
        jax_engine.reset_prefix_cache()
        with tqdm(total=total, desc=f"{name} jaxpaged", unit="tok", leave=False) as bar:
            paged_run, paged_tokens = run_jaxpaged(jax_engine, requests, system="jaxpaged", workload=name,
                                                   capacity_tokens=capacity, bar=bar)
        run_dense(dense_baseline, warmup_requests(requests), system="warmup", workload=name, capacity_tokens=capacity)
        with tqdm(total=total, desc=f"{name} dense", unit="tok", leave=False) as bar:
            dense_run, dense_tokens = run_dense(dense_baseline, requests, system="dense-baseline", workload=name,
                                                capacity_tokens=capacity, bar=bar)
        return paged_run, paged_tokens, dense_run, dense_tokens

    def done(name):
        print(f"\n{name}:\n" + table([summarize(r) for r in runs[name]]), flush=True)

    if "w1" in workloads:
        w1 = workload_w1(**preset.w1)
        if args.no_dense:
            run_jaxpaged(engine, warmup_requests(w1), system="warmup", workload="W1", capacity_tokens=budget)
            engine.reset_prefix_cache()
            with tqdm(total=sum(s.max_tokens for _, s in w1), desc="W1 jaxpaged", unit="tok", leave=False) as bar:
                paged_run, paged_tokens = run_jaxpaged(engine, w1, system="jaxpaged", workload="W1",
                                                       capacity_tokens=budget, bar=bar)
            runs["W1"] = [paged_run]
        else:
            paged_run, paged_tokens, dense_run, _ = timed_pair("W1", w1, engine, dense, budget)
            runs["W1"] = [paged_run, dense_run]
        if not args.no_sync_peer:
            # The same engine design stepping synchronously: what the overlap of host and device buys.
            sync_engine = make_engine(preset, model_config, params, tokenizer, num_pages=num_pages,
                                      async_scheduling=False)
            run_jaxpaged(sync_engine, warmup_requests(w1), system="warmup", workload="W1", capacity_tokens=budget)
            sync_engine.reset_prefix_cache()
            with tqdm(total=sum(s.max_tokens for _, s in w1), desc="W1 jaxpaged sync", unit="tok", leave=False) as bar:
                sync_run, _ = run_jaxpaged(sync_engine, w1, system="jaxpaged-sync", workload="W1",
                                           capacity_tokens=budget, bar=bar)
            runs["W1"].insert(1, sync_run)
            del sync_engine
        if preset.hf_peer and not args.no_hf:
            hf = load_hf_model(args.hf_threads)
            run_hf(hf, warmup_requests(w1), batch_size=dense_batch, workload="W1", capacity_tokens=budget)
            with tqdm(total=sum(s.max_tokens for _, s in w1), desc="W1 hf", unit="tok", leave=False) as bar:
                runs["W1"].append(run_hf(hf, w1, batch_size=dense_batch, workload="W1", capacity_tokens=budget,
                                         bar=bar))
            del hf
        done("W1")

    if "w2" in workloads:
        w2_shared = workload_w2(**preset.w2, shared=True)
        w2_distinct = workload_w2(**preset.w2, shared=False)
        paged_on, tokens_on, dense_run, dense_tokens = timed_pair("W2", w2_shared, engine, dense, budget)
        paged_on.system = "jaxpaged (prefix cache on)"
        # The baseline's pool is no longer needed: free it before a second jaxpaged pool is made
        # (on a GPU each pool takes a large share of the memory).
        dense = None
        dense_warmed.clear()
        off_engine = make_engine(preset, model_config, params, tokenizer, num_pages=num_pages, prefix_caching=False)
        run_jaxpaged(off_engine, warmup_requests(w2_shared), system="warmup", workload="W2", capacity_tokens=budget)
        paged_off, tokens_off = run_jaxpaged(off_engine, w2_shared, system="jaxpaged (prefix cache off)",
                                             workload="W2", capacity_tokens=budget)
        paged_miss_off, _ = run_jaxpaged(off_engine, w2_distinct, system="jaxpaged (cache off, 0% hits)",
                                         workload="W2-distinct", capacity_tokens=budget)
        del off_engine
        run_jaxpaged(engine, warmup_requests(w2_distinct), system="warmup", workload="W2", capacity_tokens=budget)
        engine.reset_prefix_cache()
        paged_miss, _ = run_jaxpaged(engine, w2_distinct, system="jaxpaged (cache on, 0% hits)",
                                     workload="W2-distinct", capacity_tokens=budget)
        runs["W2"] = [paged_on, paged_off, paged_miss, paged_miss_off, dense_run]
        checks["W2 greedy outputs equal, cache on vs off"] = tokens_on == tokens_off
        checks["W2 greedy outputs equal, jaxpaged vs dense"] = tokens_on == dense_tokens
        done("W2")

    if "w3" in workloads:
        w3 = workload_w3(**preset.w3)
        small_budget = preset.w3["kv_budget_tokens"]
        small_engine = make_engine(preset, model_config, params, tokenizer, num_pages=small_budget // preset.page_size)
        small_dense = DenseBaseline(model_config, engine.runner.params, max_model_len=preset.max_model_len,
                                    batch_size=batch_size_for_budget(small_budget, preset.max_model_len),
                                    page_size=preset.page_size, max_prefill_tokens=preset.max_num_batched_tokens,
                                    eos_token_id=tokenizer.eos_token_id)
        paged_run, paged_tokens, dense_run, dense_tokens = timed_pair("W3", w3, small_engine, small_dense, small_budget)
        del small_engine, small_dense
        reference_run, reference_tokens = run_jaxpaged(engine, w3, system="jaxpaged (unconstrained pool)",
                                                       workload="W3", capacity_tokens=budget)
        runs["W3"] = [paged_run, dense_run, reference_run]
        checks["W3 greedy outputs equal to an unconstrained run"] = paged_tokens == reference_tokens
        checks["W3 greedy outputs equal, jaxpaged vs dense"] = paged_tokens == dense_tokens
        checks["W3 preemptions happened"] = paged_run.extra["preemptions"] > 0
        done("W3")

    from jaxpaged.device.kv_cache import kv_cache_bytes_per_page

    if "w3swap" in workloads:
        w3 = workload_w3(**preset.w3)
        small_pages = preset.w3["kv_budget_tokens"] // preset.page_size
        bytes_per_page = kv_cache_bytes_per_page(model_config, preset.page_size)
        w3_runs, w3_tokens = [], []
        for mode in ("recompute", "swap"):
            swap_args = dict(swap_space_bytes=4 * small_pages * bytes_per_page) if mode == "swap" else {}
            small_engine = make_engine(preset, model_config, params, tokenizer, num_pages=small_pages,
                                       preemption_mode=mode, **swap_args)
            run_jaxpaged(small_engine, warmup_requests(w3), system="warmup", workload="W3", capacity_tokens=0)
            small_engine.reset_prefix_cache()
            run, tokens = run_jaxpaged(small_engine, w3, system=f"jaxpaged (preempt by {mode})",
                                       workload="W3-swap", capacity_tokens=preset.w3["kv_budget_tokens"])
            w3_runs.append(run)
            w3_tokens.append(tokens)
            del small_engine
        engine.reset_prefix_cache()
        _, reference_tokens = run_jaxpaged(engine, w3, system="reference", workload="W3", capacity_tokens=budget)
        runs["W3-swap"] = w3_runs
        checks["W3-swap greedy outputs equal: recompute, swap, unconstrained"] = (
            w3_tokens[0] == w3_tokens[1] == reference_tokens)
        checks["W3-swap swaps happened, 0 tokens recomputed"] = (
            w3_runs[1].extra["swaps_out"] > 0 and w3_runs[1].extra["recomputed_tokens"] == 0)
        done("W3-swap")

    if "w2host" in workloads:
        if preset.w2_host is None:
            raise SystemExit(f"preset {preset.name} defines no W2-host workload; use --preset cpu")
        w2h_args = dict(preset.w2_host)
        small_budget = w2h_args.pop("kv_budget_tokens")
        w2h = workload_w2_host(**w2h_args)
        small_pages = small_budget // preset.page_size
        bytes_per_page = kv_cache_bytes_per_page(model_config, preset.page_size)
        host_runs, host_tokens = [], []
        for tier in (False, True):
            tier_args = dict(host_cache_bytes=4 * small_pages * bytes_per_page) if tier else {}
            small_engine = make_engine(preset, model_config, params, tokenizer, num_pages=small_pages, **tier_args)
            run_jaxpaged(small_engine, warmup_requests(w2h), system="warmup", workload="W2", capacity_tokens=0)
            small_engine.reset_prefix_cache()
            run, tokens = run_jaxpaged(small_engine, w2h, system=f"jaxpaged (host tier {'on' if tier else 'off'})",
                                       workload="W2-host", capacity_tokens=small_budget)
            host_runs.append(run)
            host_tokens.append(tokens)
            del small_engine
        runs["W2-host"] = host_runs
        checks["W2-host greedy outputs equal, host tier on vs off"] = host_tokens[0] == host_tokens[1]
        checks["W2-host host-tier hits happened"] = host_runs[1].extra["prefix_hit_tokens_host"] > 0
        done("W2-host")

    stem = args.name or f"throughput_{preset.name}"
    summaries = {name: [summarize(r) for r in rs] for name, rs in runs.items()}
    for name, rs in runs.items():
        plot_runs(rs, os.path.join(args.out, f"{stem}_{name.lower()}.png"),
                  f"{name}, preset {preset.name}: output throughput and KV utilisation")
    result = {
        "benchmark": "bench_throughput",
        "preset": dataclasses.asdict(preset),
        "environment": environment(),
        "model": {k: getattr(model_config, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                        "head_dim", "vocab_size", "dtype")},
        "kv_budget_tokens": budget,
        "jaxpaged_num_pages": num_pages,
        "dense_batch_size": dense_batch,
        "results": summaries,
        "checks": checks,
        "hf_torch_threads": args.hf_threads,
        "load_average_at_start": load_at_start,  # (1, 5, 15 min): other work sharing this machine
        "total_benchmark_s": round(time.perf_counter() - started, 1),
        # CPU seconds this process used (all threads): on a shared machine, a better guide than
        # the wall time to how long the run takes on an idle one.
        "process_cpu_s": round(time.process_time(), 1),
    }
    path = os.path.join(args.out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print_report(result)
    print(f"\nwrote {path} and the plots beside it ({result['total_benchmark_s']} s in all)")
    return result


def load_hf_model(num_threads: int | None = None):
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.loading import default_model_path

    path = default_model_path()  # the bundled SmolLM2 GGUF, the file jaxpaged loads
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


TABLE_COLUMNS = [
    ("workload", "workload"), ("system", "system"), ("out tok/s", "output_tok_s"), ("total tok/s", "total_tok_s"),
    ("TTFT p50", "ttft_median_s"), ("TTFT p99", "ttft_p99_s"), ("TPOT p50", "tpot_median_s"),
    ("TPOT p99", "tpot_p99_s"), ("KV waste %", "kv_waste_pct"), ("peak seqs", "peak_running"),
    ("preempt", "preemptions"), ("recomp tok", "recomputed_tokens"), ("swaps", "swaps_out"),
    ("host MB", "host_mb"), ("hit rate", "prefix_hit_rate"), ("host hit tok", "prefix_hit_tokens_host"),
    ("compiles", "num_compiles_timed"), ("host %", "host_pct"), ("sched %", "sched_pct"),
    ("prep %", "prep_pct"), ("post %", "post_pct"), ("device %", "device_pct"),
]


def table(summaries: list[dict]) -> str:
    rows = []
    for s in summaries:
        row = dict(s)
        if "host_bytes_moved" in s:
            row["host_mb"] = s["host_bytes_moved"] / 1e6
        if s.get("host_share"):
            row["host_pct"] = 100 * s["host_share_total"]
            row["sched_pct"] = 100 * s["host_share"]["schedule"]
            row["prep_pct"] = 100 * s["host_share"]["prepare"]
            row["post_pct"] = 100 * s["host_share"]["postprocess"]
            row["device_pct"] = 100 * s["device_share"]
        rows.append(row)
    return format_table(rows, TABLE_COLUMNS)


def print_report(result: dict) -> None:
    env = result["environment"]
    print(f"\n{env['device']}  jax {env['jax_version']}  commit {env['git_commit']}  {env['date_utc']}")
    print(table([s for summaries in result["results"].values() for s in summaries]))
    for name, ok in result["checks"].items():
        print(f"check: {name}: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
