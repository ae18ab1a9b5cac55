"""Side by side: one of bench_vs_vllm's workloads under two or more jaxpaged settings, interleaved in
one process (no vLLM needed).

    python -m benchmarks.peers.workload_ab '{"quantization": "gguf"}' \
        '{"quantization": "gguf", "env": {"JAXPAGED_CPU_KERNELS": "gguf_matmul,paged_attention"}}' \
        --workload w2-cache-off [--calls 3]      # the ragged attention kernel on, then off
        # writes benchmarks/results/workload_ab_<workload>.json, prints one table

Each setting builds its own engine with bench_vs_vllm's phase arguments for the workload (prefix
caching on for w2-cache-on, the small KV pool for w3-preempt; a setting's "env" is set while its
engine is built, then restored, as in cpu_step_ab). After one untimed call each, the timed calls
alternate between the settings, in reversed order every other round, so load hits each alike. Best
and median wall per setting, and whether every setting's greedy ids equal the first setting's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.bench_vs_vllm import phases, run_jaxpaged
from benchmarks.common import environment, environment_variables, format_table
from benchmarks.peers.peer_workloads import compare_greedy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("settings", nargs="+", help="JSON of LLM keyword arguments per setting (+ optional env)")
    parser.add_argument("--workload", default="w2-cache-off",
                        choices=["chat-greedy", "w1-greedy", "w1-t0.6", "w2-cache-off", "w2-cache-on", "w3-preempt"])
    parser.add_argument("--calls", type=int, default=3, help="timed calls per setting")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from jaxpaged import LLM

    phase = next(p for p in phases("vllm (2 compute threads)")
                 if args.workload in {w.name for w in p.make_workloads(_NameOnlyTokenizer())})
    runs = []
    for text in args.settings:
        engine_args = json.loads(text)
        env = engine_args.pop("env", {})
        with environment_variables(env):
            llm = LLM(**{**phase.jaxpaged_args, **engine_args})
        workload = next(w for w in phase.make_workloads(llm.tokenizer) if w.name == args.workload)
        run_jaxpaged(llm, workload, 0)  # untimed: compiles, or loads from the persistent cache
        runs.append({"setting": json.dumps(dict(engine_args, **({"env": env} if env else {}))), "llm": llm,
                     "workload": workload, "calls": []})
    load_start = os.getloadavg()
    for call in range(1, args.calls + 1):
        for run in (runs if call % 2 else runs[::-1]):
            run["calls"].append(run_jaxpaged(run["llm"], run["workload"], call))
            print(f"[workload_ab] {args.workload} call {call} {run['setting']}: {run['calls'][-1]['wall_s']:.2f} s",
                  flush=True)
    first = runs[0]
    rows = []
    for run in runs:
        walls = [c["wall_s"] for c in run["calls"]]
        greedy = None
        if run["workload"].compare_tokens:
            matches = [compare_greedy(c["token_ids"], f["token_ids"]) for c, f in zip(run["calls"], first["calls"])]
            greedy = f"{sum(m['matching_tokens'] for m in matches)}/{sum(m['total_tokens'] for m in matches)}"
        out_tokens = sum(len(ids) for ids in run["calls"][0]["token_ids"])
        rows.append({"setting": run["setting"], "wall_best_s": min(walls), "wall_median_s": statistics.median(walls),
                     "walls_s": walls, "out_tok_per_s": out_tokens / min(walls),
                     "greedy_ids_vs_first": greedy, "compiles": sum(c["num_compiles"] for c in run["calls"])})
    report = {"benchmark": "workload_ab", "environment": environment(), "workload": args.workload,
              "loadavg": {"start": load_start, "end": os.getloadavg()}, "calls": args.calls, "rows": rows}
    out = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                                   f"workload_ab_{args.workload}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"load {load_start[0]:.1f} -> {report['loadavg']['end'][0]:.1f}")
    print(format_table(rows, [(args.workload, "setting"), ("best s", "wall_best_s"), ("median s", "wall_median_s"),
                              ("out tok/s", "out_tok_per_s"), ("greedy ids vs first", "greedy_ids_vs_first"),
                              ("compiles", "compiles")]))


class _NameOnlyTokenizer:
    """Enough of a tokenizer for the workload names of a phase (the chat workload encodes its prompts)."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return messages[0]["content"]

    def encode(self, text, add_special_tokens=False):
        return [0]


if __name__ == "__main__":
    main()
