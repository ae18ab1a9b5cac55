"""jaxpaged of one source tree on bench_vs_vllm's prefix-caching-off workloads (chat-greedy, w1-greedy,
w1-t0.6, w2-cache-off), with bench_vs_vllm's engine (`max_model_len` 1024, caching off): one JSON line.

Compares two commits on the same machine, e.g. main against a branch, alternating trees:

    git archive <main commit> | tar -x -C /tmp/main_tree
    for t in /tmp/main_tree . . /tmp/main_tree; do
      (cd $t && PYTHONPATH=$t python /path/to/benchmarks/peers/tree_side_by_side.py $t) >> side.jsonl
    done

Per workload: one warm-up call, then 3 timed `generate` calls (best reported), their process CPU
time (all threads: counts work, not waiting for a core, so it stays comparable on a busy machine),
the 1-minute load before each, compiles after warm-up, and the first timed call's token ids
(to check trees agree).
W2 draws a fresh shared prefix per call, the same in both trees.
"""

import json
import sys
import time

from benchmarks.bench_vs_vllm import MAX_MODEL_LEN, chat_workload, run_jaxpaged, w1_workloads, w2_workload
from jaxpaged import LLM


def main() -> None:
    llm = LLM(max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    result = {"tree": sys.argv[1] if len(sys.argv) > 1 else "."}
    for workload in [chat_workload(llm.tokenizer), *w1_workloads(), w2_workload("w2-cache-off")]:
        run_jaxpaged(llm, workload, 0)  # warm-up
        runs, cpu_s = [], []
        for call in (1, 2, 3):
            cpu0 = time.process_time()
            runs.append(run_jaxpaged(llm, workload, call))
            cpu_s.append(time.process_time() - cpu0)
        tokens = runs[0]["token_ids"]
        result[workload.name] = {
            "out_tok_s_best": sum(map(len, tokens)) / min(r["wall_s"] for r in runs),
            "walls_s": [r["wall_s"] for r in runs], "cpu_s": cpu_s, "loads": [r["loadavg_before"][0] for r in runs],
            "compiles_after_warmup": [r["num_compiles"] for r in runs], "tokens": sum(map(len, tokens)),
            "token_ids": tokens,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
