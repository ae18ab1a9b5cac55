"""Side by side: the CPU decode step under two or more engine settings, interleaved in one process.

    python -m benchmarks.peers.cpu_step_ab '{}' '{"per_layer_weights": true}' [--rounds 12]
        # writes benchmarks/results/cpu_step_ab.json, prints one table
    python -m benchmarks.peers.cpu_step_ab '{"quantization": "gguf"}' \
        '{"quantization": "gguf", "env": {"JAXPAGED_CPU_KERNELS": "0"}}'   # the CPU kernel vs XLA's path

A setting's "env" (environment variables) is set while its engine is built, then restored.

On a shared 2-core machine a profile run minutes after another sees different load. Here every
setting builds its own engine (warm-up off: only the decode program of `--batch` sequences compiles),
then the rounds alternate between them (3 steps each per round), so load hits every setting alike.
Each step is timed in wall time and in process CPU time (all threads): CPU time counts work, not
waiting for a core, so it stays comparable when the machine is busy. The step input is the profile's
(`profile_cpu_decode.decode_step_input`: batch sequences at `context` tokens each). Internals used,
read-only: `llm.engine.runner` (`execute`, `per_layer_weights`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.common import environment, environment_variables, format_table
from benchmarks.peers.profile_cpu_decode import decode_step_input


def interleave(runs: list[dict], rounds: int, steps: int = 3) -> None:
    """Each round, `steps` timed steps of every run in turn: run["runner"].execute(run["input"]) timed
    in wall and process CPU seconds, appended to run["wall"] and run["cpu"]."""
    for _ in range(rounds):
        for run in runs:
            for _ in range(steps):
                t, c = time.perf_counter(), time.process_time()
                run["runner"].execute(run["input"]).block_until_ready()
                run.setdefault("wall", []).append(time.perf_counter() - t)
                run.setdefault("cpu", []).append(time.process_time() - c)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="+", help="JSON of LLM keyword arguments per setting")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "cpu_step_ab.json"))
    args = parser.parse_args()
    from jaxpaged import LLM

    runs = []
    for text in args.settings:
        engine_args = json.loads(text)
        env = engine_args.pop("env", {})
        t = time.perf_counter()
        with environment_variables(env):
            llm = LLM(enable_prefix_caching=False, warmup=False, **engine_args)
        engine_args = dict(engine_args, **({"env": env} if env else {}))
        runner = llm.engine.runner  # internal, read-only
        step_input = decode_step_input(runner, args.batch, args.context)
        runner.execute(step_input).block_until_ready()  # compiles (or loads from the persistent cache)
        runs.append({"engine_args": engine_args, "per_layer_weights": runner.per_layer_weights,
                     "matmul_kernels": ",".join(sorted(getattr(runner, "matmul_kernels", ()))) or "-",
                     "build_and_first_step_s": time.perf_counter() - t, "runner": runner, "input": step_input,
                     "wall": [], "cpu": []})
    load_start = os.getloadavg()
    interleave(runs, args.rounds)
    rows = [{"setting": json.dumps(r["engine_args"]), "per_layer_weights": r["per_layer_weights"],
             "matmul_kernels": r["matmul_kernels"],
             "wall_best_ms": min(r["wall"]) * 1e3, "wall_median_ms": statistics.median(r["wall"]) * 1e3,
             "cpu_best_ms": min(r["cpu"]) * 1e3, "cpu_median_ms": statistics.median(r["cpu"]) * 1e3,
             "build_and_first_step_s": r["build_and_first_step_s"]} for r in runs]
    report = {"benchmark": "cpu_step_ab", "environment": environment(),
              "loadavg": {"start": load_start, "end": os.getloadavg()},
              "workload": {"batch": args.batch, "context": args.context, "rounds": args.rounds, "steps_per_round": 3},
              "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"load {load_start[0]:.1f} -> {report['loadavg']['end'][0]:.1f}")
    print(format_table(rows, [(f"decode step, batch {args.batch}, context {args.context}", "setting"),
                              ("wall best ms", "wall_best_ms"), ("wall median", "wall_median_ms"),
                              ("CPU best ms", "cpu_best_ms"), ("CPU median", "cpu_median_ms"),
                              ("build s", "build_and_first_step_s")]))


if __name__ == "__main__":
    main()
