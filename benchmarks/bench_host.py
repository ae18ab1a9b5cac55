"""Host cost per decode step: everything the host does between two device steps.

One asynchronous engine step without the device: Scheduler.schedule() -> prepare_step_input and
pack_step_input (with the previous step's tokens still placeholders; the runner's decode buckets) -> Scheduler.advance -> Scheduler.commit of the
previous step -> OutputProcessor.process (detokenizing with the bundled tokenizer, RequestOutputs).
256 running sequences of ~4000 tokens, page_size 16, prefix caching on, no stop strings. Under async
stepping this is the time the host needs to keep up with the device (target < 1 ms).

Two modes, as the two real callers step the engine, each measured in its own runs:

  offline    `LLM.generate`: engine.step(only_finished=True). No RequestOutput until a request
             finishes, and a request without stop strings detokenizes once, then. That deferred
             decode is paid here too: after the timed steps every request's text is decoded as
             at its finish (with its one RequestOutput), and that time / steps is added to each
             step ("deferred" column).
  streaming  the server and `LLM.generate_stream`: engine.step(). Every step detokenizes each new
             token and builds a RequestOutput (text, token ids, deltas) for every request.

Every mode also builds the step's sampler rows (RowSpecs -> SamplingArrays, as sample/step_sampler.py)
("rows" column). A mode suffixed `_lp20_pen` runs every request with logprobs=20 and penalties
(presence, frequency, repetition): its rows add the PenaltyArrays, and its output phase turns the
sampler's logprobs arrays (256 x 20, from numpy as they come back) into {id: Logprob} dicts.
Not covered: the device transfers. Prints one table and writes benchmarks/results/host_step_cpu.json.

    python -m benchmarks.bench_host [--steps 200] [--repeats 3] [--modes offline,streaming,streaming_lp20_pen]
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

import numpy as np

from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.models.loading import default_model_path
from jaxpaged.engine.output_processor import OutputProcessor, _catch_up
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence
from jaxpaged.device.step_input import BlockTableRows, default_buckets, default_decode_buckets, pack_step_input, prepare_step_input
from jaxpaged.models.tokenizer import Tokenizer
from jaxpaged.sample.sampler import make_sampling_arrays
from jaxpaged.sample.rows import row_spec
from jaxpaged.sample.penalties import make_penalty_arrays
from jaxpaged.sample.logprobs import HostLogprobs

NUM_SEQS = 256
PAGE_SIZE = 16
PROMPT_TOKENS = (3990, 4010)
MAX_MODEL_LEN = 4096 + 512
MAX_NUM_BATCHED_TOKENS = 8192


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


def one_run(num_steps: int, seed: int, tokenizer, mode: str) -> dict[str, float]:
    rng = random.Random(seed)
    num_pages = 1 + NUM_SEQS * -(-(PROMPT_TOKENS[1] + 64 + num_steps) // PAGE_SIZE)  # 64: decoded during prefill
    bm = BlockManager(num_pages, PAGE_SIZE)
    sched = Scheduler(bm, max_num_seqs=NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                      max_model_len=MAX_MODEL_LEN)
    processor = OutputProcessor(tokenizer)
    features = mode.endswith("_lp20_pen")
    mode_base = mode.split("_")[0]
    extra = dict(logprobs=20, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1) if features else {}
    params = SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True, **extra)
    np_rng = np.random.default_rng(seed)
    lp_arrays = {"chosen": np_rng.normal(size=NUM_SEQS).astype(np.float32),
                 "rank": np_rng.integers(1, 50, NUM_SEQS).astype(np.int32),
                 "top_values": np_rng.normal(size=(NUM_SEQS, 20)).astype(np.float32),
                 "top_ids": np_rng.integers(100, 40000, (NUM_SEQS, 20)).astype(np.int32)}
    for i in range(NUM_SEQS):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(*PROMPT_TOKENS))]
        seq = Sequence(prompt, params, eos_token_id=0)
        sched.add(seq)
        processor.add_request(str(i), None, seq, params, seed=0)
    prepare_args = dict(page_size=PAGE_SIZE, num_pages=num_pages, pages_per_seq=-(-MAX_MODEL_LEN // PAGE_SIZE),
                        max_num_seqs=NUM_SEQS, buckets=default_buckets(MAX_NUM_BATCHED_TOKENS),
                        decode_buckets=default_decode_buckets(NUM_SEQS),  # as ModelRunner.prepare
                        block_table_rows=BlockTableRows(2 * NUM_SEQS, -(-MAX_MODEL_LEN // PAGE_SIZE)))

    def rows_of(out):
        rows, num_rows = [], 0
        for samples in out.samples:
            rows.append(num_rows if samples else None)
            num_rows += samples
        return rows, num_rows

    # Prefill in chunks (synchronously) until every sequence decodes one token per step.
    while True:
        out = sched.schedule()
        rows, num_rows = rows_of(out)
        sched.advance(out, rows)
        sched.commit(out, [rng.randrange(100, 40000) for _ in range(num_rows)])
        if out.num_batched_tokens == NUM_SEQS and len(out.seqs) == NUM_SEQS:
            break
    sampled = [rng.randrange(100, 40000) for _ in range(NUM_SEQS)]

    phases = {"schedule": [], "prepare": [], "rows": [], "advance+commit": [], "output": []}
    step_ms, step_cpu_ms = [], []
    in_flight = None
    offline = mode_base == "offline"
    gc.collect()
    gc.disable()  # measure the code, not the collector's pauses
    try:
        for _ in range(num_steps):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            pack_step_input(prepare_step_input(out, **prepare_args))  # as ModelRunner.execute: one packed array
            t2 = time.perf_counter()
            specs = [row_spec(i, params, 0, 0, seq, len(seq.token_ids) - seq.num_prompt_tokens)
                     for i, seq in enumerate(out.seqs)]
            make_sampling_arrays(specs, NUM_SEQS)
            if features:  # slots: one per sequence, as TokenSlots gives them
                make_penalty_arrays([(i, params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
                                     for i in range(len(out.seqs))], NUM_SEQS)
            t2r = time.perf_counter()
            rows, _ = rows_of(out)
            sched.advance(out, rows)
            update = sched.commit(in_flight, sampled) if in_flight is not None else None
            in_flight = out
            t3 = time.perf_counter()
            if update is not None:
                logprobs = HostLogprobs.read(lp_arrays) if features else None
                outputs, _ = processor.process(update.appended, update.rows, logprobs, only_finished=offline)
                assert len(outputs) == (0 if offline else NUM_SEQS)
            t4 = time.perf_counter()
            c1 = time.thread_time()
            assert len(out.seqs) == NUM_SEQS
            for name, ms in zip(phases, (t1 - t0, t2 - t1, t2r - t2, t3 - t2r, t4 - t3)):
                phases[name].append(ms * 1e3)
            step_ms.append((t4 - t0) * 1e3)
            step_cpu_ms.append((c1 - c0) * 1e3)
        # Offline, a request pays at its finish for decoding its whole text once, and for its one
        # RequestOutput: both are done here for every request and spread over the timed steps.
        undecoded = sum(len(s.seq.output_token_ids) - s.num_decoded for r in processor.requests.values() for s in r.samples)
        assert undecoded > 0 if offline else undecoded == 0, undecoded  # streaming decoded every token already
        t0 = time.perf_counter()
        if offline:
            for request in processor.requests.values():
                for sample in request.samples:
                    _catch_up(sample)
                processor.make_output(request)
        deferred_ms = (time.perf_counter() - t0) * 1e3 / num_steps
    finally:
        gc.enable()
    step_ms = [ms + deferred_ms for ms in step_ms]
    step_cpu_ms = [ms + deferred_ms for ms in step_cpu_ms]
    return {
        "mode": mode,
        "deferred_decode_ms_per_step": deferred_ms,
        "step_median_ms": statistics.median(step_ms),
        "step_p99_ms": percentile(step_ms, 0.99),
        # CPU time of this thread: what the step costs without other processes taking the core away.
        "step_cpu_median_ms": statistics.median(step_cpu_ms),
        "step_cpu_p99_ms": percentile(step_cpu_ms, 0.99),
        **{f"{name}_median_ms": statistics.median(values) for name, values in phases.items()},
        "context_len_end": statistics.mean(len(seq.token_ids) for seq in sched.running),
        "num_preemptions": sched.num_preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="independent runs; the best median is quoted")
    parser.add_argument("--modes", default="offline,streaming", help="comma-separated: offline, streaming")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "host_step_cpu.json"))
    args = parser.parse_args()

    tokenizer = Tokenizer.from_gguf(default_model_path())
    modes = args.modes.split(",")
    # Interleaved (offline, streaming, offline, ...) so that both modes see the same machine load.
    runs = [one_run(args.steps, seed, tokenizer, mode) for seed in range(args.repeats) for mode in modes]
    machine = {
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "num_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }
    print(f"host step, {NUM_SEQS} decoding sequences of ~4000 tokens, page_size {PAGE_SIZE}, "
          f"{args.steps} steps x {args.repeats} runs (median ms per step)")
    print(f"machine: {machine['cpu']} ({machine['num_cpus']} cpus), {machine['platform']}, Python {machine['python']}")
    print(f"{'run':>4} {'mode':>18} {'step':>8} {'p99':>8} {'schedule':>9} {'prepare':>8} {'rows':>6} {'adv+commit':>11} "
          f"{'output':>8} {'deferred':>9} {'cpu':>8} {'cpu p99':>8}")
    for idx, run in enumerate(runs):
        print(f"{idx:>4} {run['mode']:>18} {run['step_median_ms']:>8.3f} {run['step_p99_ms']:>8.3f} "
              f"{run['schedule_median_ms']:>9.3f} {run['prepare_median_ms']:>8.3f} {run['rows_median_ms']:>6.3f} "
              f"{run['advance+commit_median_ms']:>11.3f} {run['output_median_ms']:>8.3f} "
              f"{run['deferred_decode_ms_per_step']:>9.4f} {run['step_cpu_median_ms']:>8.3f} {run['step_cpu_p99_ms']:>8.3f}")
    print(f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    summary = {}
    for mode in modes:
        mode_runs = [r for r in runs if r["mode"] == mode]
        best = min(mode_runs, key=lambda r: r["step_median_ms"])
        summary[mode] = {
            "best_step_median_ms": best["step_median_ms"],
            "median_step_median_ms": statistics.median(r["step_median_ms"] for r in mode_runs),
            "best_step_p99_ms": best["step_p99_ms"],
            "best_step_cpu_median_ms": min(r["step_cpu_median_ms"] for r in mode_runs),
        }
        print(f"{mode}: best median {best['step_median_ms']:.3f} ms/step wall, median of runs "
              f"{summary[mode]['median_step_median_ms']:.3f}, {summary[mode]['best_step_cpu_median_ms']:.3f} "
              f"ms/step cpu (target 1 ms); worst/best {max(r['step_median_ms'] for r in mode_runs) / best['step_median_ms']:.2f}x")

    result = {
        "benchmark": "bench_host",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": machine,
        "config": {"num_seqs": NUM_SEQS, "page_size": PAGE_SIZE, "prompt_tokens": "%d..%d" % PROMPT_TOKENS,
                   "max_model_len": MAX_MODEL_LEN, "steps": args.steps, "repeats": args.repeats,
                   "prefix_caching": True, "gc_disabled": True,
                   "covers": "schedule + prepare_step_input + sampler rows + advance + commit + output processing",
                   "modes": {"offline": "engine.step(only_finished=True) as LLM.generate; deferred decode at finish "
                                        "amortized into each step",
                             "streaming": "engine.step() as the server: a RequestOutput per request per step",
                             "*_lp20_pen": "every request logprobs=20 + presence/frequency/repetition penalties"}},
        "modes": summary,
        "load_average_1m": os.getloadavg()[0],
        "target_ms": 1.0,
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
