"""The cost of batch_invariant=True: rollout throughput beside the default engine, in one run.

    python -m benchmarks.bench_batch_invariant [--max-tokens 64] [--repeats 3] [--batches 1,16] \
        [--json benchmarks/results/batch_invariant_cpu.json]

The bundled SmolLM2-135M-Instruct (float32, CPU kernels), a GRPO-like rollout: B sequences (B/4 chat
prompts, n=4 samples each; B=1: one prompt, n=1), temperature 1, seeded, chosen-token logprobs
(`logprobs=0`, what an RL trainer reads), ignore_eos so every engine generates the same number of
tokens. Output tokens/s of each engine, best of --repeats, the engine order alternating each repeat;
the ratio invariant / default is the figure (target >= 0.85). The 1-minute load average is recorded
(the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.common import environment, format_table
from jaxpaged import LLM, SamplingParams

QUESTIONS = ["Name a color you like and say why.", "Write one sentence about the sea.",
             "What is a good name for a cat?", "Describe your ideal breakfast."]


def rollout(llm: LLM, prompts: list[str], n: int, max_tokens: int) -> tuple[int, float]:
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=0, logprobs=0, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for o in outputs for c in o.outputs), elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engines = {name: LLM(max_model_len=256, max_num_seqs=max(batches), warmup=False, batch_invariant=flag)
               for name, flag in (("default", False), ("batch_invariant", True))}
    chats = [engines["default"].get_tokenizer().apply_chat_template([{"role": "user", "content": q}],
                                                                    add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    rows = []
    for batch in batches:
        prompts, n = (chats[:1], 1) if batch == 1 else ((chats * batch)[: batch // 4], 4)
        for llm in engines.values():  # compiles this batch's buckets: not timed
            rollout(llm, prompts, n, args.max_tokens)
        best = {name: 0.0 for name in engines}
        load = [os.getloadavg()[0]]
        for r in range(args.repeats):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                tokens, seconds = rollout(engines[name], prompts, n, args.max_tokens)
                best[name] = max(best[name], tokens / seconds)
        load.append(os.getloadavg()[0])
        rows.append({"batch": batch, "default_tok_s": round(best["default"], 1),
                     "invariant_tok_s": round(best["batch_invariant"], 1),
                     "ratio": round(best["batch_invariant"] / best["default"], 3), "load_1min": load})
    print(format_table(rows, [("batch", "batch"), ("default tok/s", "default_tok_s"),
                              ("batch_invariant tok/s", "invariant_tok_s"), ("ratio", "ratio"),
                              ("load (before, after)", "load_1min")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "max_tokens": args.max_tokens, "repeats": args.repeats,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
