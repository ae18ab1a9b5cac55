"""Prefix-aware routing over data-parallel replicas: prefix-cache hit rate against round-robin and
least-loaded routing on a GRPO-like workload, in one run.

    python -m benchmarks.bench_prefix_routing [--replicas 4] [--prompts 12] [--group 8] \
        [--json benchmarks/results/prefix_routing_cpu.json]

The workload: P prompts of 96 tokens (a shared instruction page, then the question), each sampled G
times as G separate requests (a GRPO group sent the way rollout workers send it), 16 tokens each;
then every one of the P * G conversations takes a second turn (its first prompt + answer + 16 new
tokens). Each routing runs the same requests on `--replicas` engine replicas, one forced host CPU
device each, over a tiny random model (the hit rate depends on routing, not on the model); the hit
rate is prefix-hit tokens over prompt tokens looked up, summed over replicas (the engines' own
counters), per turn and overall. The wall time includes each routing's compilation (the first
run's programs are compiled, later runs mostly load them from the persistent cache): not a speed
comparison.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # the replicas are host devices, fixed when jax is first imported
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import environment, format_table  # noqa: E402

PAGE_SIZE, PROMPT_LEN, ANSWER, FOLLOW_UP = 16, 96, 16, 16


def build(routing: str, replicas: int):
    import jax

    from jaxpaged.config import EngineConfig
    from jaxpaged.device.backends import attention_fn
    from jaxpaged.engine.build import engine_from_parts
    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.llama import init_params
    from jaxpaged.models.loading import default_model_path
    from jaxpaged.models.tokenizer import Tokenizer

    model = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
    config = EngineConfig(page_size=PAGE_SIZE, num_pages=512, max_num_seqs=8, max_num_batched_tokens=256,
                          max_model_len=256, warmup=False, data_parallel_size=replicas,
                          data_parallel_routing=routing).resolved(on_gpu=False, model_max_len=512)
    engine = engine_from_parts(model, init_params(model, jax.random.key(0)), Tokenizer.from_gguf(default_model_path()),
                               config, num_pages=config.num_pages, attention_fn=attention_fn("chunked"))
    return LLM.from_engine(engine)


def workload(num_prompts: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    instruction = rng.integers(300, 40000, PAGE_SIZE).tolist()  # one page every prompt shares
    return [instruction + rng.integers(300, 40000, PROMPT_LEN - PAGE_SIZE).tolist() for _ in range(num_prompts)]


def hit_counts(llm) -> tuple[int, int]:
    stats = llm.stats()
    return stats["prefix_hit_tokens"], stats["prefix_query_tokens"]


def run(routing: str, args) -> dict:
    from jaxpaged import SamplingParams

    llm = build(routing, args.replicas)
    prompts = workload(args.prompts)
    turn1 = [p for p in prompts for _ in range(args.group)]
    params = [SamplingParams(temperature=1.0, max_tokens=ANSWER, seed=i, ignore_eos=True) for i in range(len(turn1))]
    t0 = time.perf_counter()
    outputs = llm.generate(turn1, params)
    hits1, queried1 = hit_counts(llm)
    rng = np.random.default_rng(1)
    turn2 = [p + o.outputs[0].token_ids + rng.integers(300, 40000, FOLLOW_UP).tolist() for p, o in zip(turn1, outputs)]
    llm.generate(turn2, params)
    seconds = time.perf_counter() - t0
    hits, queried = hit_counts(llm)
    return {"routing": routing, "hit_rate_turn1": round(hits1 / queried1, 3),
            "hit_rate_turn2": round((hits - hits1) / (queried - queried1), 3), "hit_rate": round(hits / queried, 3),
            "prompt_tokens": queried, "seconds": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [run(routing, args) for routing in ("round_robin", "least_loaded", "prefix")]
    print(format_table(rows, [("routing", "routing"), ("hit rate turn 1", "hit_rate_turn1"),
                              ("hit rate turn 2", "hit_rate_turn2"), ("hit rate", "hit_rate"),
                              ("prompt tokens", "prompt_tokens"), ("wall s", "seconds")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "workload": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
