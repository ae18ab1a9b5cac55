"""Beam search: pages held with sharing against k private copies, copy-on-write copies, time.

    PYTHONPATH=$PWD python benchmarks/bench_beam.py [--beam-width 4] [--max-tokens 64] [--json out.json]

Runs one beam search per chat prompt on the bundled SmolLM2, stepping the engine by hand to read
the pool after every step. "private" is what the same live beams would hold without sharing:
the sum of their block-table lengths.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxpaged import LLM
from jaxpaged.engine.beam_search import BeamSearchParams

QUESTIONS = ["What is the capital of France?", "Give me a name for a pet turtle.", "Write a haiku about the sea."]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    llm = LLM(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256, warmup=False)
    engine = llm.engine
    rows = []
    for q in QUESTIONS:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        llm.beam_search([ids], BeamSearchParams(args.beam_width, max_tokens=4))  # compile the buckets it uses
        engine.reset_prefix_cache()
        copies0 = engine.block_manager.num_cow_copies
        engine.add_beam_request(ids, BeamSearchParams(args.beam_width, max_tokens=args.max_tokens))
        peak_used = peak_private = steps = 0
        t0 = time.perf_counter()
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
            steps += 1
            used = engine.block_manager.stats()["num_used_pages"]
            private = sum(len(s.block_table) for s in engine.scheduler.running)
            peak_used, peak_private = max(peak_used, used), max(peak_private, private)
        elapsed = time.perf_counter() - t0
        best = outputs[-1].beams[0]
        rows.append(dict(prompt=q, steps=steps, seconds=round(elapsed, 2), peak_pages=peak_used,
                         peak_pages_unshared=peak_private, cow_copies=engine.block_manager.num_cow_copies - copies0,
                         best_len=len(best.token_ids), best_reason=best.finish_reason))
    print(f"beam_width={args.beam_width} max_tokens={args.max_tokens} page_size={llm.config.page_size}")
    print(f"{'prompt':34} {'steps':>5} {'s':>6} {'pages':>5} {'unshared':>8} {'copies':>6} {'best':>10}")
    for r in rows:
        print(f"{r['prompt'][:34]:34} {r['steps']:5d} {r['seconds']:6.2f} {r['peak_pages']:5d} "
              f"{r['peak_pages_unshared']:8d} {r['cow_copies']:6d} {r['best_len']:4d} {r['best_reason']:>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
