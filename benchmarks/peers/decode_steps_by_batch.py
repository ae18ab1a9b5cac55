"""The codes engine's decode step at several batch sizes, for comparing two builds (issue 31).

    python -m benchmarks.peers.decode_steps_by_batch LABEL [--batches 1 4 8 16] [--engine-args '{"quantization": "gguf"}']
        # prints one line: LABEL b1: best/median ms ...; ~1.5 min on 2 cores

Two builds compare from two checkouts run in alternating processes, e.g. (the eleventh pass)
    git worktree add /tmp/old bf980eb
    for i in 1 2; do for P in /tmp/old "$PWD"; do (cd $P && PYTHONPATH=$P python -m \\
        benchmarks.peers.decode_steps_by_batch $(basename $P)); done; done
One engine (prefix caching off, warm-up off), a decode step of `batch` sequences at `--context`
tokens each (`profile_cpu_decode.decode_step_input`) per batch; each round times 3 steps of every
batch in turn. Internal, read-only: `llm.engine.runner` (`execute`).
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("label")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--engine-args", default='{"quantization": "gguf"}')
    args = parser.parse_args()
    from jaxpaged import LLM

    from benchmarks.peers.cpu_step_ab import interleave
    from benchmarks.peers.profile_cpu_decode import decode_step_input

    llm = LLM(enable_prefix_caching=False, warmup=False, **json.loads(args.engine_args))
    runner = llm.engine.runner
    inputs = {b: decode_step_input(runner, b, args.context) for b in args.batches}
    for step_input in inputs.values():
        runner.execute(step_input).block_until_ready()  # compiles
    runs = [{"runner": runner, "input": step_input} for step_input in inputs.values()]
    interleave(runs, args.rounds)  # 3 timed steps of every batch per round
    print(args.label, " ".join(f"b{b}: {min(r['wall']) * 1e3:.2f}/{statistics.median(r['wall']) * 1e3:.2f}"
                               for b, r in zip(inputs, runs)), flush=True)


if __name__ == "__main__":
    main()
