"""Host planner cost per decode step: one Scheduler.schedule() + Scheduler.update() with the block
manager's bookkeeping, 256 running sequences of ~1000 tokens, page_size 16, prefix caching on.

No device work: this is the time the host adds to every engine step (target: < 0.3 ms on CPU).
Prints one table and writes benchmarks/results/bench_host_cpu.json.

    python benchmarks/bench_host.py [--steps 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

from jaxpaged.block_manager import BlockManager
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import Scheduler
from jaxpaged.sequence import Sequence

NUM_SEQS = 256
PAGE_SIZE = 16
MAX_MODEL_LEN = 4096


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_run(num_steps: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    num_pages = 1 + NUM_SEQS * -(-(1010 + 64 + num_steps) // PAGE_SIZE)  # 64: tokens decoded during prefill
    bm = BlockManager(num_pages, PAGE_SIZE)
    sched = Scheduler(bm, max_num_seqs=NUM_SEQS, max_num_batched_tokens=8192, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    for _ in range(NUM_SEQS):
        prompt = [rng.randrange(1, 50000) for _ in range(rng.randrange(990, 1011))]
        sched.add(Sequence(prompt, params, eos_token_id=0))
    # Prefill in chunks until every sequence decodes one token per step.
    while True:
        out = sched.schedule()
        sched.update(out, [1] * len(out.seqs))
        if out.num_batched_tokens == NUM_SEQS and len(out.seqs) == NUM_SEQS:
            break
    sampled = [rng.randrange(1, 50000) for _ in range(NUM_SEQS)]

    schedule_ms, update_ms, step_ms, step_cpu_ms = [], [], [], []
    gc.collect()
    gc.disable()  # measure the code, not the collector's pauses
    try:
        for _ in range(num_steps):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            sched.update(out, sampled)
            t2 = time.perf_counter()
            c1 = time.thread_time()
            assert len(out.seqs) == NUM_SEQS
            schedule_ms.append((t1 - t0) * 1e3)
            update_ms.append((t2 - t1) * 1e3)
            step_ms.append((t2 - t0) * 1e3)
            step_cpu_ms.append((c1 - c0) * 1e3)
    finally:
        gc.enable()
    return {
        "step_median_ms": statistics.median(step_ms),
        "step_p99_ms": percentile(step_ms, 0.99),
        # CPU time of this thread: what the step costs without other processes taking the core away.
        "step_cpu_median_ms": statistics.median(step_cpu_ms),
        "step_cpu_p99_ms": percentile(step_cpu_ms, 0.99),
        "schedule_median_ms": statistics.median(schedule_ms),
        "update_median_ms": statistics.median(update_ms),
        "context_len_end": statistics.mean(len(seq.token_ids) for seq in sched.running),
        "num_preemptions": sched.num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="independent runs; the best median is quoted")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_host_cpu.json"))
    args = parser.parse_args()

    runs = [one_run(args.steps, seed) for seed in range(args.repeats)]
    best = min(runs, key=lambda r: r["step_median_ms"])
    machine = {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(f"host planner, {NUM_SEQS} decoding sequences of ~1000 tokens, page_size {PAGE_SIZE}, "
          f"{args.steps} steps x {args.repeats} runs")
    print(f"machine: {machine['cpu']} ({machine['num_cpus']} cpus), {machine['platform']}, Python {machine['python']}")
    print(f"{'run':>4} {'step median ms':>15} {'step p99 ms':>12} {'schedule ms':>12} {'update ms':>10} "
          f"{'cpu median ms':>14} {'cpu p99 ms':>11}")
    for idx, run in enumerate(runs):
        print(f"{idx:>4} {run['step_median_ms']:>15.3f} {run['step_p99_ms']:>12.3f} "
              f"{run['schedule_median_ms']:>12.3f} {run['update_median_ms']:>10.3f} "
              f"{run['step_cpu_median_ms']:>14.3f} {run['step_cpu_p99_ms']:>11.3f}")
    spread = max(r["step_median_ms"] for r in runs) / best["step_median_ms"]
    print(f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"best median {best['step_median_ms']:.3f} ms/step wall, "
          f"{min(r['step_cpu_median_ms'] for r in runs):.3f} ms/step cpu (target 0.3 ms); "
          f"worst/best median across runs {spread:.2f}x (shared machine: noise)")

    result = {
        "benchmark": "bench_host",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine,
        "config": {"num_seqs": NUM_SEQS, "page_size": PAGE_SIZE, "prompt_tokens": "990..1010",
                   "steps": args.steps, "repeats": args.repeats, "prefix_caching": True, "gc_disabled": True},
        "best_step_median_ms": best["step_median_ms"],
        "best_step_p99_ms": best["step_p99_ms"],
        "best_step_cpu_median_ms": min(r["step_cpu_median_ms"] for r in runs),
        "load_average_1m": os.getloadavg()[0],
        "target_ms": 0.3,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
