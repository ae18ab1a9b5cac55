"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one run.

    python -m benchmarks.bench_spec_decode [--k 5] [--max-tokens 128] [--repeats 3] [--batches 1,4,16] \
        [--json benchmarks/results/spec_decode_cpu.json] [--plot benchmarks/results/spec_decode_cpu.png]

Copy-heavy workload on the bundled SmolLM2 (greedy, each answer ends at EOS or max_tokens): 4
"rewrite this code with one change" prompts and 4 summaries that quote a notice, whose answers copy
the input. Batch 1 runs the 8 prompts one at a time; batch B runs them B at a time (cycled to fill
the batch). Per batch: output tokens/s of the plain engine (asynchronous stepping, its default), of
the speculative one with its defaults (disable_by_batch_size: proposals off above batch 1 on the
CPU) and, above batch 1, of one speculating at every batch size ("forced"); acceptance rate and mean
new tokens per verification of the engine that speculated; whether every output is token-identical
to plain (it must be: greedy). Best of --repeats, engine order rotating each repeat; the 1-minute
load average before and after each row is recorded (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxpaged import LLM, SamplingParams

SNIPPETS = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / len(values)\n",
    "def find(items, target):\n    for index, item in enumerate(items):\n        if item == target:\n"
    "            return index\n    return -1\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def add(self, amount):\n"
    "        self.count += amount\n        return self.count\n",
    "def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n    return message\n",
]
ASK = "Rewrite this Python code, adding a docstring to it. Repeat the code exactly otherwise.\n\n"
# Summaries that quote the input: the answer copies sentences of the passage.
PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Children under twelve must be "
    "accompanied by an adult. Books may be borrowed for three weeks and renewed once online.",
    "To reset the router, hold the small button on the back for ten seconds until the light blinks orange. "
    "Then wait two minutes for the light to turn green before connecting again.",
    "The meeting is moved from Tuesday to Thursday at three o'clock. Please bring the quarterly report and the "
    "list of open issues. Lunch will be served in the main hall after the meeting.",
    "Water the tomato plants every morning before the sun is high. Remove the small shoots that grow between "
    "the stem and the branches. Pick the fruit when it is red and slightly soft.",
]
SUMMARIZE = "Summarize this notice for a colleague, quoting its important sentences word for word.\n\n"


def copy_prompts(tokenizer) -> list[list[int]]:
    """The copy-heavy workload's prompts, token ids: code rewrites, then quoting summaries."""
    texts = [ASK + s for s in SNIPPETS] + [SUMMARIZE + s for s in PASSAGES]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
             for t in texts]
    return [tokenizer.encode(c, add_special_tokens=False) for c in chats]


def run(llm: LLM, batches: list[list[list[int]]], max_tokens: int) -> tuple[list[list[int]], float, float]:
    """Generates each batch in turn; returns every output's tokens, the wall time and the process's CPU time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    c0, t0 = time.process_time(), time.perf_counter()
    tokens = []
    for prompts in batches:
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def spec_counts(llm: LLM) -> np.ndarray:
    stats = llm.stats()
    return np.array([stats[f"num_spec_{name}"] for name in ("draft_tokens", "accepted_tokens", "emitted_tokens", "verified")])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=5)  # 5 beat 3 on this workload (DESIGN.md)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    common = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = LLM(**common)
    spec = LLM(**common, speculative_config=spec_config)
    # The same, speculating at every batch size: what disable_by_batch_size's CPU default (1) avoids.
    forced = LLM(**common, speculative_config={**spec_config, "disable_by_batch_size": 1 << 20})
    ids = copy_prompts(plain.tokenizer)
    for llm in (plain, spec, forced):
        run(llm, [ids[:1]], 8)  # first-call costs out of the timings
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [ids[i % len(ids)] for i in range(max(batch, len(ids)))]
        batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        # At batch 1 the default engine speculates: "forced" would be the same engine again.
        engines = {"plain": plain, "spec": spec, **({"forced": forced} if batch > 1 else {})}
        speculating = forced if batch > 1 else spec
        load_before, counts = round(os.getloadavg()[0], 1), spec_counts(speculating)
        # Best of --repeats, the order rotating: the machine is shared, one run's time is mostly load.
        times: dict = {name: [] for name in engines}
        cpu_times: dict = {name: [] for name in engines}
        outs = {}
        for rep in range(args.repeats):
            names = list(engines)
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                outs[name], seconds, cpu_seconds = run(engines[name], batches, args.max_tokens)
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
        drafts, accepted, emitted, verified = (spec_counts(speculating) - counts) // args.repeats
        num_tokens = sum(len(t) for t in outs["plain"])
        best = {name: min(ts) for name, ts in times.items()}
        best_cpu = {name: min(ts) for name, ts in cpu_times.items()}
        row = dict(
            batch=batch, k=args.k, num_prompts=len(prompts), num_output_tokens=num_tokens,
            load_average_1min=[load_before, round(os.getloadavg()[0], 1)],  # before and after the row
            seconds_all={name: [round(t, 2) for t in ts] for name, ts in times.items()},
            **{f"{name}_tok_s": round(num_tokens / s, 1) for name, s in best.items()},
            **{f"{name}_speedup": round(best["plain"] / s, 2) for name, s in best.items() if name != "plain"},
            # The same from the process's CPU seconds (XLA:CPU steps run single-threaded here): less
            # sensitive to the other processes on the machine than wall time.
            cpu_seconds_all={name: [round(t, 2) for t in ts] for name, ts in cpu_times.items()},
            **{f"{name}_cpu_speedup": round(best_cpu["plain"] / s, 2) for name, s in best_cpu.items() if name != "plain"},
            acceptance_rate=round(int(accepted) / max(1, int(drafts)), 3),  # of the engine that speculated
            mean_accepted_length=round(int(emitted) / max(1, int(verified)), 2),
            verifications_per_output_token=round(int(verified) / max(1, num_tokens), 3),
            identical=all(outs[name] == outs["plain"] for name in engines),
        )
        rows.append(row)
        print(row, flush=True)
    print(f"{'batch':>5} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>7} {'forced':>7} {'speedup':>7} "
          f"{'cpu':>5} {'accept':>6} {'len':>5} {'load':>9} identical")
    for r in rows:
        print(f"{r['batch']:5d} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:11.1f} {r['spec_speedup']:7.2f} "
              f"{r.get('forced_tok_s', r['spec_tok_s']):7.1f} {r.get('forced_speedup', r['spec_speedup']):7.2f} "
              f"{r['spec_cpu_speedup']:5.2f} {r['acceptance_rate']:6.3f} {r['mean_accepted_length']:5.2f} "
              f"{'-'.join(map(str, r['load_average_1min'])):>9} {r['identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(workload="copy-heavy: 4 code rewrites + 4 quoting summaries, greedy, stop at EOS",
                           command="python -m benchmarks.bench_spec_decode " + " ".join(
                               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                           max_tokens=args.max_tokens,
                           note="shared 2-core machine: absolute tok/s are contended (load_average_1min per row)",
                           speculative_config=spec_config, rows=rows), f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = range(len(rows))
        ax.bar([x - 0.27 for x in xs], [r["plain_tok_s"] for r in rows], 0.27, label="plain")
        ax.bar(list(xs), [r["spec_tok_s"] for r in rows], 0.27, label=f"ngram k={args.k} (default disable_by_batch_size)")
        ax.bar([x + 0.27 for x in xs], [r.get("forced_tok_s", r["spec_tok_s"]) for r in rows], 0.27,
               label=f"ngram k={args.k}, every batch")
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['spec_speedup']:.2f}x", (x, r["spec_tok_s"]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [f"batch {r['batch']}\nload {r['load_average_1min'][0]}" for r in rows])
        ax.set_ylabel("output tokens / s")
        ax.set_title("SmolLM2-135M, shared 2-core CPU, best of %d" % args.repeats)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
