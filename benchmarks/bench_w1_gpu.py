"""W1 end to end on a GPU: jaxpaged, the dense-cache baseline and Hugging Face's continuous batching, same weights.

Three steps, each its own process (JAX and torch each take the GPU's memory for themselves), all
writing into one JSON file (`--out`), read, updated and rewritten after every system:

    weights  torch draws random Qwen3-0.6B-shaped weights (seed 0, bf16) and saves them as a
             Hugging Face safetensors directory (`--dir`); nothing is downloaded
    jax      jaxpaged's engine (its own defaults for this machine: max_num_seqs, backend, ...) and
             the dense-cache baseline (jaxpaged/baseline), the same KV budget, load those weights
             (models/hf_weights.params_from_hf) and serve BENCHMARKS.md's W1, each after a warm-up call
    hf       transformers' continuous batching (`init_continuous_batching` / its context manager:
             paged attention over torch's SDPA, CUDA graphs where it chooses them) on the same
             weights and requests, after two warm-up requests in the same session

W1: 256 requests, prompt and output lengths uniform in [100, 1024], temperature 0.6, ignore_eos,
max_model_len 4096 (benchmarks/workloads.py). Output tok/s = output tokens / wall seconds of the
timed call. `--dry-run`: a tiny model, 4 requests of a few tokens, on the CPU; its figures mean nothing.

    python -m benchmarks.bench_w1_gpu weights --dir /tmp/w1_model
    python -m benchmarks.bench_w1_gpu jax --dir /tmp/w1_model --out $OUT/w1.json
    python -m benchmarks.bench_w1_gpu hf  --dir /tmp/w1_model --out $OUT/w1.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workloads import PRESETS, QWEN3_0_6B_SHAPES, SilentTokenizer, workload_w1

DRY_SHAPES = dict(vocab_size=10240, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
                  max_position_embeddings=256, dtype="float32")
# The dry run: four short requests through an engine of two sequences and one 16-token bucket (few
# programs to compile), the dense baseline two rows of 64.
DRY_PRESET = dataclasses.replace(PRESETS["cpu"], max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                                 kv_budget_tokens=2 * 64, w1=dict(num_seqs=4, min_len=4, max_len=12, temperature=0.6))


def shapes(dry_run: bool) -> dict:
    return DRY_SHAPES if dry_run else QWEN3_0_6B_SHAPES


def preset(dry_run: bool):
    return DRY_PRESET if dry_run else PRESETS["h100"]  # the h100 preset is W1 exactly, for any GPU


def update_json(path: str, **fields) -> dict:
    """Reads `path` (if any), sets `fields`, rewrites it atomically; returns the whole record."""
    record = {}
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
    record.update(fields)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
    return record


# ----------------------------------------------------------------------------- weights


def hf_config(dry_run: bool):
    from transformers import Qwen3Config

    s = shapes(dry_run)
    return Qwen3Config(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"], rms_norm_eps=s["rms_norm_eps"], tie_word_embeddings=s["tie_word_embeddings"],
        max_position_embeddings=s["max_position_embeddings"], rope_theta=s["rope_theta"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None)


def make_weights(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # HF's own initialisation, drawn on the GPU
        model = AutoModelForCausalLM.from_config(hf_config(args.dry_run), dtype=torch.float32)
    model.to(torch.bfloat16 if not args.dry_run else torch.float32).save_pretrained(args.dir)
    print(f"random weights saved to {args.dir} in {time.perf_counter() - start:.1f} s")
    update_json(args.out, weights=dict(dir=args.dir, seed=0, seconds=round(time.perf_counter() - start, 1),
                                       shapes=shapes(args.dry_run)))


# ----------------------------------------------------------------------------- jaxpaged and the dense baseline


def compile_concurrently(runner, max_workers: int = 8) -> dict:
    """Compiles every step program `runner.warmup` will run (token buckets, decode buckets, prompt
    logprobs) at once: lowered here one by one, compiled in threads (XLA compiles outside the GIL).
    jit's call path then finds each program compiled, so the engine's own warm-up only runs them."""
    import concurrent.futures

    import numpy as np

    inputs = [runner.dummy_step_input(b) for b in runner.buckets]
    inputs += [runner.dummy_step_input(b, decode_only=True) for b in runner.decode_buckets]
    inputs += [dataclasses.replace(runner.dummy_step_input(b), prompt_logprob_targets=np.full(b, -1, np.int32))
               for b in runner.buckets]
    start = time.perf_counter()
    lowered = [runner.trace_step(step_input).lower() for step_input in inputs]
    lower_s = time.perf_counter() - start
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        list(pool.map(lambda program: program.compile(), lowered))
    return dict(programs=len(lowered), lower_s=round(lower_s, 1), compile_s=round(time.perf_counter() - start - lower_s, 1))


def run_jax(args) -> None:
    import jax

    from benchmarks.bench_throughput import gpu_kv_budget_tokens
    from benchmarks.common import environment
    from jaxpaged.baseline.dense_kv import DenseBaseline, batch_size_for_budget
    from jaxpaged.baseline.drivers import run_dense, run_jaxpaged, warmup_requests
    from jaxpaged.baseline.measure import CompileCounter, summarize
    from jaxpaged.config import EngineConfig
    from jaxpaged.device.backends import attention_fn
    from jaxpaged.engine.engine import LLMEngine
    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.hf_weights import params_from_hf
    from jaxpaged.models.loading import load_safetensors_dir

    p = preset(args.dry_run)
    model_config = ModelConfig(**shapes(args.dry_run))
    start = time.perf_counter()
    params = jax.device_put(params_from_hf(model_config, load_safetensors_dir(args.dir)))
    load_s = time.perf_counter() - start
    budget = p.kv_budget_tokens or gpu_kv_budget_tokens(model_config, params)
    num_pages = budget // p.page_size
    dense_batch = batch_size_for_budget(budget, p.max_model_len)
    on_gpu = jax.default_backend() == "gpu"
    # The engine's own choices for this machine (EngineConfig defaults), W1's sizes where it fixes them.
    config = EngineConfig(page_size=p.page_size, num_pages=num_pages, max_num_seqs=p.max_num_seqs,
                          max_num_batched_tokens=p.max_num_batched_tokens, max_model_len=p.max_model_len,
                          dtype=model_config.dtype, warmup=not args.dry_run).resolved(on_gpu=on_gpu, model_max_len=model_config.max_position_embeddings)
    update_json(args.out, environment=environment(), dry_run=args.dry_run, kv_budget_tokens=budget,
                jaxpaged_num_pages=num_pages, dense_batch_size=dense_batch,
                attention_backend=config.attention_backend, weights_load_s=round(load_s, 1))
    w1 = workload_w1(**p.w1)
    capacity = budget

    start = time.perf_counter()
    engine = LLMEngine(model_config, params, SilentTokenizer(), dataclasses.replace(config, warmup=False),
                       num_pages=num_pages, attention_fn=attention_fn(config.attention_backend))
    precompiled = None
    if config.warmup:  # the engine's warm-up, its step programs compiled concurrently first
        precompiled = compile_concurrently(engine.runner)
        with CompileCounter() as lowerings:
            engine.warmup()
        precompiled["lowerings_in_engine_warmup"] = lowerings.count  # the sampler's; the steps' were done
        print(f"W1 jaxpaged: {precompiled}", flush=True)
    run_jaxpaged(engine, warmup_requests(w1), system="warmup", workload="W1", capacity_tokens=capacity)
    engine.reset_prefix_cache()
    warm_s = time.perf_counter() - start
    run, _ = run_jaxpaged(engine, w1, system="jaxpaged", workload="W1", capacity_tokens=capacity)
    summary = update_json(args.out, jaxpaged=dict(summarize(run), warmup_s=round(warm_s, 1), precompiled=precompiled))["jaxpaged"]
    print(f"W1 jaxpaged: {summary['output_tok_s']:.0f} output tok/s ({run.wall_s:.1f} s; warm-up {warm_s:.0f} s)",
          flush=True)
    served = engine.runner.params
    del engine

    start = time.perf_counter()
    dense = DenseBaseline(model_config, served, max_model_len=p.max_model_len, batch_size=dense_batch,
                          page_size=p.page_size, max_prefill_tokens=p.max_num_batched_tokens, eos_token_id=None)
    if not args.dry_run:  # the dry run checks the code path, not compile-free timing
        dense.warmup(max(len(q) for q, _ in w1), max(len(q) + s.max_tokens for q, s in w1))
    run_dense(dense, warmup_requests(w1), system="warmup", workload="W1", capacity_tokens=capacity)
    warm_s = time.perf_counter() - start
    run, _ = run_dense(dense, w1, system="dense-baseline", workload="W1", capacity_tokens=capacity)
    summary = update_json(args.out, dense=dict(summarize(run), warmup_s=round(warm_s, 1)))["dense"]
    print(f"W1 dense baseline: {summary['output_tok_s']:.0f} output tok/s ({run.wall_s:.1f} s)", flush=True)


# ----------------------------------------------------------------------------- Hugging Face continuous batching


def run_hf(args) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    p = preset(args.dry_run)
    w1 = workload_w1(**p.w1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                                 attn_implementation="sdpa").to(device).eval()
    # ignore_eos: eos -1 disables it (transformers' continuous batching); W1 samples at temperature 0.6.
    generation = GenerationConfig(do_sample=True, temperature=p.w1["temperature"], top_k=0, top_p=1.0,
                                  eos_token_id=-1, max_new_tokens=max(s.max_tokens for _, s in w1))

    def serve(manager, requests) -> tuple[int, float]:
        """Adds every request, waits for all; (output tokens, wall seconds)."""
        start = time.perf_counter()
        ids = {manager.add_request(list(q), max_new_tokens=s.max_tokens) for q, s in requests}
        done, tokens = set(), 0
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
                continue
            if result.is_finished() and result.request_id not in done:
                if result.error:
                    raise RuntimeError(f"transformers' continuous batching: {result.error}")
                done.add(result.request_id)
                tokens += len(result.generated_tokens)
        return tokens, time.perf_counter() - start

    sizes = {}
    if args.dry_run:  # a small paged cache: sized from free memory, on the CPU it takes long to allocate
        from transformers import ContinuousBatchingConfig

        sizes = dict(continuous_batching_config=ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64))
    start = time.perf_counter()
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=generation, warmup=not args.dry_run, **sizes) as manager:
        serve(manager, [(q, dataclasses.replace(s, max_tokens=min(s.max_tokens, 4))) for q, s in w1[:2]])
        warm_s = time.perf_counter() - start
        attn_implementation = model.config._attn_implementation  # the paged one the manager switched to
        tokens, wall = serve(manager, w1)
    wanted = sum(s.max_tokens for _, s in w1)
    if tokens != wanted:
        raise RuntimeError(f"transformers generated {tokens} tokens where W1 asks for {wanted}")
    update_json(args.out, hf_continuous_batching=dict(
        system="hf-transformers continuous batching", transformers_version=transformers.__version__,
        torch_version=torch.__version__, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        attn_implementation=attn_implementation, output_tokens=tokens, wall_s=round(wall, 3),
        output_tok_s=tokens / wall, warmup_s=round(warm_s, 1)))
    print(f"W1 transformers continuous batching: {tokens / wall:.0f} output tok/s ({wall:.1f} s)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("weights", "jax", "hf"))
    parser.add_argument("--dir", required=True, help="the Hugging Face directory of the random weights")
    parser.add_argument("--out", required=True, help="the JSON file every step updates")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model and 4 short requests, any device")
    args = parser.parse_args(argv)
    {"weights": make_weights, "jax": run_jax, "hf": run_hf}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
