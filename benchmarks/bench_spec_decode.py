"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one run.

    PYTHONPATH=$PWD python benchmarks/bench_spec_decode.py [--k 3] [--max-tokens 96] [--repeats 3] \
        [--json benchmarks/results/spec_decode_cpu.json] [--plot benchmarks/results/spec_decode_cpu.png]

Copy-heavy workload on the bundled SmolLM2 (greedy): "rewrite this code with one change" prompts,
whose answers quote the input. For batch 1, 4 and 16 it reports output tokens/s of the plain engine
(asynchronous stepping, its default) and of the speculative one, the acceptance rate, the mean new
tokens per verification, and whether the outputs are token-identical (they must be: greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import time

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


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=96)
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
    tok = plain.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": ASK + s}], add_generation_prompt=True)
             for s in SNIPPETS]
    ids = [tok.encode(c, add_special_tokens=False) for c in chats]
    run(plain, ids[:1], 8), run(spec, ids[:1], 8), run(forced, ids[:1], 8)  # first-call costs out of the timings
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [ids[i % len(ids)] for i in range(batch)]
        before, spec_verified = forced.stats(), spec.stats()["num_spec_verified"]
        # Best of --repeats, the order rotating: the machine is shared, one run's time is mostly load.
        engines = {"plain": plain, "spec": spec, "forced": forced}
        times: dict = {name: [] for name in engines}
        outs = {}
        for rep in range(args.repeats):
            order = list(engines)[rep % 3:] + list(engines)[: rep % 3]
            for name in order:
                outs[name], seconds = run(engines[name], prompts, args.max_tokens)
                times[name].append(seconds)
        plain_out, spec_out = outs["plain"], outs["spec"]
        plain_times, spec_times = times["plain"], times["spec"]
        plain_s, spec_s, forced_s = (min(times[name]) for name in engines)
        after = forced.stats()
        drafts = after["num_spec_draft_tokens"] - before["num_spec_draft_tokens"]
        accepted = after["num_spec_accepted_tokens"] - before["num_spec_accepted_tokens"]
        emitted = after["num_spec_emitted_tokens"] - before["num_spec_emitted_tokens"]
        verified = after["num_spec_verified"] - before["num_spec_verified"]
        drafts, accepted, emitted, verified = (x // args.repeats for x in (drafts, accepted, emitted, verified))
        num_tokens = batch * args.max_tokens
        rows.append(dict(
            batch=batch, k=args.k, load_average_1min=round(os.getloadavg()[0], 1),
            # False: disable_by_batch_size (default) turned proposals off at this batch
            spec_steps=spec.stats()["num_spec_verified"] > spec_verified,
            plain_tok_s=round(num_tokens / plain_s, 1), spec_tok_s=round(num_tokens / spec_s, 1),
            seconds_all={name: [round(t, 2) for t in ts] for name, ts in times.items()},
            speedup=round(plain_s / spec_s, 2), forced_tok_s=round(num_tokens / forced_s, 1),
            forced_speedup=round(plain_s / forced_s, 2), forced_identical=outs["forced"] == plain_out,
            acceptance_rate=round(accepted / max(1, drafts), 3),  # acceptance figures: the forced engine's
            mean_accepted_length=round(emitted / max(1, verified), 2), identical=plain_out == spec_out,
        ))
        print(rows[-1], flush=True)
    print(f"{'batch':>5} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>7} {'forced':>7} {'speedup':>7} "
          f"{'accept':>6} {'len':>5} identical")
    for r in rows:
        print(f"{r['batch']:5d} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:11.1f} {r['speedup']:7.2f} "
              f"{r['forced_tok_s']:7.1f} {r['forced_speedup']:7.2f} {r['acceptance_rate']:6.3f} "
              f"{r['mean_accepted_length']:5.2f} {r['identical'] and r['forced_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(workload="rewrite-code (copy-heavy), greedy", max_tokens=args.max_tokens,
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
        ax.bar([x + 0.27 for x in xs], [r["forced_tok_s"] for r in rows], 0.27, label=f"ngram k={args.k}, every batch")
        ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
        ax.set_ylabel("output tokens / s")
        ax.set_title("SmolLM2-135M, shared 2-core CPU (contended), best of %d" % args.repeats)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
