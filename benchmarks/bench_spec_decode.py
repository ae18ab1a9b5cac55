"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one run.

    PYTHONPATH=$PWD python benchmarks/bench_spec_decode.py [--k 3] [--max-tokens 128] \
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
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    common = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = LLM(**common)
    spec = LLM(**common, speculative_config=spec_config)
    tok = plain.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": ASK + s}], add_generation_prompt=True)
             for s in SNIPPETS]
    ids = [tok.encode(c, add_special_tokens=False) for c in chats]
    run(plain, ids[:1], 8), run(spec, ids[:1], 8)  # first-call costs out of the timings
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [ids[i % len(ids)] for i in range(batch)]
        before = spec.stats()
        plain_out, plain_s = run(plain, prompts, args.max_tokens)
        spec_out, spec_s = run(spec, prompts, args.max_tokens)
        after = spec.stats()
        drafts = after["num_spec_draft_tokens"] - before["num_spec_draft_tokens"]
        accepted = after["num_spec_accepted_tokens"] - before["num_spec_accepted_tokens"]
        emitted = after["num_spec_emitted_tokens"] - before["num_spec_emitted_tokens"]
        verified = after["num_spec_verified"] - before["num_spec_verified"]
        num_tokens = batch * args.max_tokens
        rows.append(dict(
            batch=batch, k=args.k, load_average_1min=round(os.getloadavg()[0], 1),
            spec_steps=verified > 0,  # False: disable_by_batch_size turned proposals off at this batch
            plain_tok_s=round(num_tokens / plain_s, 1), spec_tok_s=round(num_tokens / spec_s, 1),
            speedup=round(plain_s / spec_s, 2), acceptance_rate=round(accepted / max(1, drafts), 3),
            mean_accepted_length=round(emitted / max(1, verified), 2), identical=plain_out == spec_out,
        ))
        print(rows[-1], flush=True)
    print(f"{'batch':>5} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>7} {'accept':>6} {'len':>5} identical")
    for r in rows:
        print(f"{r['batch']:5d} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:11.1f} {r['speedup']:7.2f} "
              f"{r['acceptance_rate']:6.3f} {r['mean_accepted_length']:5.2f} {r['identical']}")
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
        ax.bar([x - 0.2 for x in xs], [r["plain_tok_s"] for r in rows], 0.4, label="plain")
        ax.bar([x + 0.2 for x in xs], [r["spec_tok_s"] for r in rows], 0.4, label=f"ngram k={args.k}")
        ax.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
        ax.set_ylabel("output tokens / s")
        ax.set_title("SmolLM2-135M on CPU, copy-heavy prompts")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
