"""The CPU's vocabulary-major tied LM head against the plain x @ E^T, in one process (issue 31).

    python -m benchmarks.peers.lm_head_ab [--batches 4 16 64] [--context 128] [--rounds 15]
        # writes benchmarks/results/cpu_lm_head_ab.json; ~3 min on 2 cores

Two engines on the bundled SmolLM2, alike except `models.llama.VOCAB_MAJOR_ROWS` when their decode
step is traced: (2, 0) takes no row count vocabulary-major (the head as before), (2, 64) is the
engine's rule. Their batch-`b` decode steps (`profile_cpu_decode.decode_step_input`, each sequence at
`context` tokens) run interleaved, three at a time, and wall and process CPU time are kept. The
logits of the two are compared too (float32 summation order only). Internal, read-only:
`llm.engine.runner` (`execute`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from benchmarks.common import environment
from benchmarks.peers.profile_cpu_decode import decode_step_input

WAYS = {"x @ E^T (before)": (2, 0), "vocabulary-major (now)": (2, 64)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "cpu_lm_head_ab.json"))
    args = parser.parse_args()
    import jaxpaged.models.llama as llama
    from jaxpaged import LLM

    engines = {}
    for name, rows in WAYS.items():
        llama.VOCAB_MAJOR_ROWS = rows  # read when the step is traced (first execute per batch below)
        engines[name] = LLM(enable_prefix_caching=False, warmup=False).engine.runner
        for batch in args.batches:
            engines[name].execute(decode_step_input(engines[name], batch, args.context)).block_until_ready()
    rows = []
    for batch in args.batches:
        runs = {name: {"input": decode_step_input(r, batch, args.context), "wall": [], "cpu": []}
                for name, r in engines.items()}
        logits = [np.asarray(engines[name].execute(runs[name]["input"])) for name in WAYS]
        load = os.getloadavg()
        for _ in range(args.rounds):
            for name, run in runs.items():
                for _ in range(3):
                    t, c = time.perf_counter(), time.process_time()
                    engines[name].execute(run["input"]).block_until_ready()
                    run["wall"].append(time.perf_counter() - t)
                    run["cpu"].append(time.process_time() - c)
        for name, run in runs.items():
            rows.append({"batch": batch, "context": args.context, "way": name,
                         "wall_best_ms": round(min(run["wall"]) * 1e3, 2),
                         "wall_median_ms": round(statistics.median(run["wall"]) * 1e3, 2),
                         "cpu_median_ms": round(statistics.median(run["cpu"]) * 1e3, 2),
                         "logits_max_abs_diff": float(np.max(np.abs(logits[0] - logits[1]))),
                         "loadavg_before": [round(x, 2) for x in load]})
            print(f"batch {batch:3d} context {args.context} {name:24s} wall best {rows[-1]['wall_best_ms']:7.2f} "
                  f"median {rows[-1]['wall_median_ms']:7.2f} ms, CPU median {rows[-1]['cpu_median_ms']:7.2f} ms "
                  f"(logits differ by <= {rows[-1]['logits_max_abs_diff']:.1e}; load {load[0]:.2f})", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "lm_head_ab", "environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
