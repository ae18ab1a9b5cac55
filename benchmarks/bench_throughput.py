"""Throughput of jaxpaged against the dense-cache baseline (and, on the CPU, Hugging Face), W1-W3.

    python -m benchmarks.bench_throughput --preset cpu     # bundled SmolLM2-135M, ~5 min on 2 cores
    python -m benchmarks.bench_throughput --preset h100    # Qwen3-0.6B shapes, random bf16 weights
    python -m benchmarks.bench_throughput --preset cpu --workloads w1 --no-hf --no-dense \
        --name throughput_cpu_w1_sync_vs_async            # W1 only: async vs synchronous stepping

Every system runs the same requests in one process, each after its own warm-up (all buckets
compiled, then one small untimed call), under the same KV memory budget. Workloads (BENCHMARKS.md):

    W1  offline throughput: random prompts and output lengths, temperature 0.6, ignore_eos; jaxpaged
        also with synchronous stepping (`jaxpaged-sync`), to show what overlapping host and device buys
    W2  shared prefix: prefix caching on / off, and a run whose prompts share nothing (0% hits)
    W3  memory pressure: a pool too small for the batch; greedy outputs must equal an unconstrained run

Prints one table and writes `benchmarks/results/throughput_<preset>.json` and one PNG per workload
(output throughput and KV utilisation over time, every system).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm.auto import tqdm

from benchmarks.common import (
    PHASES,
    CompileCounter,
    RequestTimes,
    Run,
    StepSample,
    environment,
    format_table,
    plot_runs,
    summarize,
)
from benchmarks.dense_baseline import DenseBaseline, batch_size_for_budget
from jaxpaged.sampling_params import SamplingParams

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

Request = tuple[list[int], SamplingParams]


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_budget_tokens: int | None  # None: from free device memory (jaxpaged's own rule)
    w1: dict  # num_seqs, min_len, max_len (prompt and output lengths), temperature
    w2: dict  # num_seqs, prefix_len, suffix_min, suffix_max, output_len
    w3: dict  # num_seqs, prompt range, output range, kv_budget_tokens
    hf_peer: bool


PRESETS = {
    # The bundled SmolLM2-135M on 2 CPU cores: W1 scaled down as BENCHMARKS.md suggests. The KV
    # budget holds 8 rows of max_model_len for the dense design, while jaxpaged fits every sequence.
    "cpu": Preset(
        name="cpu", page_size=16, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
        kv_budget_tokens=8 * 256,
        w1=dict(num_seqs=16, min_len=16, max_len=64, temperature=0.6),
        w2=dict(num_seqs=8, prefix_len=192, suffix_min=4, suffix_max=16, output_len=16),
        w3=dict(num_seqs=6, prompt_min=16, prompt_max=48, output_min=24, output_max=64, kv_budget_tokens=256),
        hf_peer=True,
    ),
    # BENCHMARKS.md W1 exactly: 256 sequences, lengths in [100, 1024], max_model_len 4096.
    "h100": Preset(
        name="h100", page_size=16, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
        kv_budget_tokens=None,
        w1=dict(num_seqs=256, min_len=100, max_len=1024, temperature=0.6),
        w2=dict(num_seqs=128, prefix_len=1024, suffix_min=16, suffix_max=64, output_len=128),
        w3=dict(num_seqs=64, prompt_min=100, prompt_max=512, output_min=256, output_max=512,
                kv_budget_tokens=16 * 1024),
        hf_peer=False,
    ),
}

QWEN3_0_6B_SHAPES = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
    head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
    max_position_embeddings=40960, dtype="bfloat16",
)


# ----------------------------------------------------------------------------- workloads


def workload_w1(num_seqs: int, min_len: int, max_len: int, temperature: float) -> list[Request]:
    """BENCHMARKS.md W1 (nano-vllm's bench): random.seed(0), prompt ids in [0, 10000), ignore_eos."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_len, max_len))] for _ in range(num_seqs)]
    return [
        (p, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=random.randint(min_len, max_len),
                           seed=i))
        for i, p in enumerate(prompts)
    ]


def workload_w2(num_seqs, prefix_len, suffix_min, suffix_max, output_len, *, shared: bool) -> list[Request]:
    """A common prefix (a few-shot prompt) with short distinct suffixes; `shared=False`: every prefix differs."""
    rng = random.Random(1)
    common = [rng.randint(0, 10000) for _ in range(prefix_len)]
    requests = []
    for _ in range(num_seqs):
        prefix = common if shared else [rng.randint(0, 10000) for _ in range(prefix_len)]
        suffix = [rng.randint(0, 10000) for _ in range(rng.randint(suffix_min, suffix_max))]
        requests.append((prefix + suffix, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)))
    return requests


def workload_w3(num_seqs, prompt_min, prompt_max, output_min, output_max, **_) -> list[Request]:
    rng = random.Random(3)
    return [
        ([rng.randint(0, 10000) for _ in range(rng.randint(prompt_min, prompt_max))],
         SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(output_min, output_max)))
        for _ in range(num_seqs)
    ]


def warmup_requests(requests: list[Request]) -> list[Request]:
    """The untimed warm-up call: the first two requests, a few tokens each."""
    return [(p, dataclasses.replace(s, max_tokens=min(s.max_tokens, 4))) for p, s in requests[:2]]


# ----------------------------------------------------------------------------- systems


class _SilentTokenizer:
    """For random-weight models: token ids only, no text (the engine's detokenizer does nothing)."""

    eos_token_id = None

    class _Detokenizer:
        def __getattr__(self, name):
            return lambda *args, **kwargs: ""

    def detokenizer(self, *args, **kwargs):
        return self._Detokenizer()

    incremental_detokenizer = detokenizer


def live_tokens(running, page_size: int) -> int:
    """Tokens with K/V in the pages of the running sequences, each shared page counted once."""
    held: dict[int, int] = {}  # page id -> tokens it holds
    for seq in running:
        computed = seq.num_computed_tokens
        for i, page_id in enumerate(seq.block_table[: -(-computed // page_size)]):
            held[page_id] = max(held.get(page_id, 0), min(page_size, computed - i * page_size))
    return sum(held.values())


def run_jaxpaged(engine, requests: list[Request], *, system: str, workload: str, capacity_tokens: int,
                 bar: tqdm | None = None) -> tuple[Run, list[list[int]]]:
    """Drives `engine` step by step over `requests` (all arriving at t=0), sampling its state after each step."""
    scheduler, block_manager = engine.scheduler, engine.block_manager
    page_size = block_manager.page_size
    last_schedule = {}
    schedule = scheduler.schedule

    def recording_schedule():  # keeps the step's plan, to tell prefill steps from decode steps
        out = schedule()
        last_schedule["out"] = out
        return out

    stats0, sched0, compiles0 = block_manager.stats(), scheduler.stats(), engine.runner.num_compiles
    scheduler.schedule = recording_schedule
    steps: list[StepSample] = []
    try:
        with CompileCounter() as compiles:
            t0 = time.perf_counter()
            ids = [engine.add_request(p, s) for p, s in requests]
            times = {i: RequestTimes() for i in ids}
            tokens: dict[str, list[int]] = {}
            overhead = 0.0  # seconds spent here recording, left out of the wall time
            while engine.has_unfinished_requests():
                before = dict(engine.timings)
                outputs = engine.step()
                t_step = time.perf_counter()
                now = t_step - t0 - overhead
                num_out = 0
                for out in outputs:
                    rt, n = times[out.request_id], len(out.outputs[0].token_ids)
                    num_out += n - rt.num_output_tokens
                    if rt.first_token is None and n:
                        rt.first_token = now
                    rt.num_output_tokens = n
                    if out.finished:
                        rt.finish = now
                        tokens[out.request_id] = list(out.outputs[0].token_ids)
                plan = last_schedule["out"]
                running = scheduler.running
                steps.append(StepSample(
                    t=now, kind="decode" if max(plan.num_new_tokens, default=1) == 1 else "prefill",
                    num_output_tokens=num_out, num_computed_tokens=plan.num_batched_tokens, num_running=len(running),
                    num_live_tokens=live_tokens(running, page_size),
                    num_allocated_tokens=block_manager.stats()["num_used_pages"] * page_size,
                    phases={p: engine.timings[p] - before[p] for p in PHASES},
                ))
                if bar is not None:
                    bar.update(num_out)
                overhead += time.perf_counter() - t_step
            wall = time.perf_counter() - t0 - overhead
    finally:
        del scheduler.schedule  # back to the class's method
    stats, sched = block_manager.stats(), scheduler.stats()
    queries = stats["prefix_query_tokens"] - stats0["prefix_query_tokens"]
    hits = stats["prefix_hit_tokens"] - stats0["prefix_hit_tokens"]
    run = Run(
        system=system, workload=workload, wall_s=wall, num_prompt_tokens=sum(len(p) for p, _ in requests),
        steps=steps, requests=[times[i] for i in ids], kv_capacity_tokens=capacity_tokens,
        num_compiles=compiles.count,
        extra={
            "num_step_compiles_timed": engine.runner.num_compiles - compiles0,
            "preemptions": sched["num_preemptions"] - sched0["num_preemptions"],
            "recomputed_tokens": sched["num_recomputed_tokens"] - sched0["num_recomputed_tokens"],
            "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "prefix_hit_tokens": hits,
        },
    )
    return run, [tokens[i] for i in ids]


def run_dense(baseline: DenseBaseline, requests: list[Request], *, system: str, workload: str,
              capacity_tokens: int, bar: tqdm | None = None) -> tuple[Run, list[list[int]]]:
    steps: list[StepSample] = []
    state = {"timings": dict(baseline.timings)}

    def on_step(step):
        now = time.perf_counter() - t0
        before, state["timings"] = state["timings"], dict(baseline.timings)
        steps.append(StepSample(
            t=now, kind=step.kind, num_output_tokens=step.num_output_tokens, num_computed_tokens=step.num_tokens,
            num_running=step.num_running, num_live_tokens=step.num_live_tokens,
            num_allocated_tokens=step.num_reserved_tokens,
            phases={p: baseline.timings[p] - before[p] for p in PHASES},
        ))
        if bar is not None:
            bar.update(step.num_output_tokens)

    compiles0 = baseline.num_compiles
    with CompileCounter() as compiles:
        t0 = time.perf_counter()
        outputs = baseline.generate([p for p, _ in requests], [s for _, s in requests], on_step=on_step)
        wall = time.perf_counter() - t0
    times = [RequestTimes(len(o.token_ids), o.first_token_time - t0, o.finish_time - t0) for o in outputs]
    run = Run(
        system=system, workload=workload, wall_s=wall, num_prompt_tokens=sum(len(p) for p, _ in requests),
        steps=steps, requests=times, kv_capacity_tokens=capacity_tokens, num_compiles=compiles.count,
        extra={"num_step_compiles_timed": baseline.num_compiles - compiles0, "preemptions": 0,
               "recomputed_tokens": 0, "prefix_hit_rate": 0.0, "batch_size": baseline.batch_size},
    )
    return run, [o.token_ids for o in outputs]


def run_hf(model, requests: list[Request], *, batch_size: int, workload: str, capacity_tokens: int,
           bar: tqdm | None = None) -> Run:
    """Hugging Face `generate`, static batches of `batch_size` left-padded prompts, as a user would call it.

    Each batch generates as many tokens as its longest request asks for; a request keeps its own
    `max_tokens` (the rest is computed and thrown away). Per-step times come from a streamer.
    """
    import torch
    from transformers.generation.streamers import BaseStreamer

    steps: list[StepSample] = []
    times = [RequestTimes() for _ in requests]

    class StepClock(BaseStreamer):
        def __init__(self, batch: list[int], padded_len: int):
            self.batch, self.padded_len, self.num_puts = batch, padded_len, 0

        def put(self, value):
            self.num_puts += 1
            if self.num_puts == 1:  # the prompt itself
                return
            now = time.perf_counter() - t0
            step_idx = self.num_puts - 2  # tokens generated before this one
            num_out = 0
            live = 0
            for i in self.batch:
                wanted = requests[i][1].max_tokens
                if step_idx < wanted:
                    num_out += 1
                    times[i].num_output_tokens += 1
                    if times[i].first_token is None:
                        times[i].first_token = now
                    if step_idx == wanted - 1:
                        times[i].finish = now
                    else:
                        live += len(requests[i][0]) + step_idx + 1
            steps.append(StepSample(
                t=now, kind="prefill" if step_idx == 0 else "decode", num_output_tokens=num_out,
                num_computed_tokens=len(self.batch) * (self.padded_len if step_idx == 0 else 1),
                num_running=sum(1 for i in self.batch if step_idx < requests[i][1].max_tokens - 1),
                num_live_tokens=live, num_allocated_tokens=len(self.batch) * (self.padded_len + step_idx + 1),
                phases={},
            ))
            if bar is not None:
                bar.update(num_out)

        def end(self):
            pass

    with torch.inference_mode():
        t0 = time.perf_counter()
        for start in range(0, len(requests), batch_size):
            batch = list(range(start, min(start + batch_size, len(requests))))
            padded_len = max(len(requests[i][0]) for i in batch)
            input_ids = torch.zeros((len(batch), padded_len), dtype=torch.long)
            mask = torch.zeros((len(batch), padded_len), dtype=torch.long)
            for row, i in enumerate(batch):  # left padding
                prompt = requests[i][0]
                input_ids[row, padded_len - len(prompt):] = torch.tensor(prompt)
                mask[row, padded_len - len(prompt):] = 1
            new_tokens = max(requests[i][1].max_tokens for i in batch)
            temperature = requests[batch[0]][1].temperature
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
                dict(do_sample=False)
            model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=0, streamer=StepClock(batch, padded_len), **sampling)
        wall = time.perf_counter() - t0
    return Run(
        system="hf-transformers", workload=workload, wall_s=wall,
        num_prompt_tokens=sum(len(p) for p, _ in requests), steps=steps, requests=times,
        kv_capacity_tokens=capacity_tokens, extra={"batch_size": batch_size},
    )


# ----------------------------------------------------------------------------- building the systems


def load_cpu_model():
    from jaxpaged.models.weights import load_model

    model_config, params, tokenizer = load_model(None, dtype="float32")
    return model_config, params, tokenizer


def load_h100_model():
    import jax

    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.llama import init_params

    model_config = ModelConfig(**QWEN3_0_6B_SHAPES)
    params = init_params(model_config, jax.random.key(0))  # random bf16, on the device
    return model_config, params, _SilentTokenizer()


def make_engine(preset: Preset, model_config, params, tokenizer, *, num_pages: int, prefix_caching: bool = True,
                async_scheduling: bool = True, kv_cache_dtype: str = "auto"):
    from jaxpaged.engine import LLMEngine
    from jaxpaged.engine_config import EngineConfig

    on_gpu = preset.name != "cpu"
    config = EngineConfig(
        page_size=preset.page_size, num_pages=num_pages, max_num_seqs=preset.max_num_seqs,
        max_num_batched_tokens=preset.max_num_batched_tokens, max_model_len=preset.max_model_len,
        enable_prefix_caching=prefix_caching, dtype=model_config.dtype,
        attention_backend="pallas" if on_gpu else "reference", async_scheduling=async_scheduling,
        kv_cache_dtype=kv_cache_dtype,
    ).resolved(on_gpu=on_gpu, model_max_len=model_config.max_position_embeddings)
    if on_gpu:
        import pallas_kernels

        # The engine's own GPU backend: whole-buffer kernels, the decode kernel in decode-only steps.
        attention_fn = pallas_kernels.pallas_backend(interpret=False)
    else:
        from jaxpaged.attention import reference_paged_attention

        attention_fn = reference_paged_attention
    return LLMEngine(model_config, params, tokenizer, config, num_pages=num_pages, attention_fn=attention_fn)


def gpu_kv_budget_tokens(model_config, params, fraction: float = 0.4) -> int:
    """A share of the device memory left after the weights (jaxpaged's rule, at half its default
    fraction: two pools of this size, jaxpaged's and the baseline's, live at once)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    token_bytes = model_config.num_layers * 2 * model_config.num_kv_heads * model_config.head_dim * 2
    return int(free * fraction) // token_bytes


# ----------------------------------------------------------------------------- main


def check_device(preset: Preset) -> None:
    import jax

    backend = jax.default_backend()
    if preset.name != "cpu" and backend != "gpu":
        raise SystemExit(
            f"--preset {preset.name} needs a CUDA GPU, but JAX's backend here is {backend!r} "
            f"(devices: {jax.devices()}); run it on an H100 with jax[cuda12] installed, or use --preset cpu"
        )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--workloads", default="w1,w2,w3", help="comma-separated subset of w1,w2,w3")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer on the CPU preset")
    parser.add_argument("--no-dense", action="store_true", help="W1: skip the dense-cache baseline")
    parser.add_argument("--no-sync-peer", action="store_true",
                        help="W1: skip jaxpaged with synchronous stepping (async_scheduling=False)")
    parser.add_argument("--name", default=None, help="JSON and plot file name stem (default throughput_<preset>)")
    parser.add_argument("--out", default=RESULTS_DIR, help="directory for the JSON and the plots")
    parser.add_argument("--hf-threads", type=int, default=None,
                        help="torch threads for the Hugging Face peer (default: torch's). On a CPU shared with "
                             "other work use 1: OpenMP threads that spin-wait for a descheduled peer made torch "
                             "6x slower per step here with 2 threads")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    check_device(preset)
    workloads = [w.strip().lower() for w in args.workloads.split(",") if w.strip()]
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]

    model_config, params, tokenizer = load_cpu_model() if preset.name == "cpu" else load_h100_model()
    budget = preset.kv_budget_tokens or gpu_kv_budget_tokens(model_config, params)
    num_pages = budget // preset.page_size  # the same bytes as the dense cache (page 0 included)
    dense_batch = batch_size_for_budget(budget, preset.max_model_len)
    print(f"KV budget {budget} tokens: jaxpaged {num_pages} pages of {preset.page_size}, "
          f"dense baseline {dense_batch} rows of {preset.max_model_len}", flush=True)

    runs: dict[str, list[Run]] = {}
    checks: dict[str, object] = {}
    engine = make_engine(preset, model_config, params, tokenizer, num_pages=num_pages)
    dense = DenseBaseline(model_config, engine.runner.params, max_model_len=preset.max_model_len,
                          batch_size=dense_batch, page_size=preset.page_size,
                          max_prefill_tokens=preset.max_num_batched_tokens, eos_token_id=tokenizer.eos_token_id)
    dense_warmed = set()

    def timed_pair(name, requests, jax_engine, dense_baseline, capacity):
        """jaxpaged then the dense baseline on the same requests, each after a warm-up call."""
        max_prompt = max(len(p) for p, _ in requests)
        max_seq = max(len(p) + s.max_tokens for p, s in requests)
        key = (id(dense_baseline), max_prompt, max_seq)
        if key not in dense_warmed:
            dense_baseline.warmup(max_prompt, max_seq)
            dense_warmed.add(key)
        total = sum(s.max_tokens for _, s in requests)
        run_jaxpaged(jax_engine, warmup_requests(requests), system="warmup", workload=name, capacity_tokens=capacity)
        jax_engine.reset_prefix_cache()
        with tqdm(total=total, desc=f"{name} jaxpaged", unit="tok", leave=False) as bar:
            paged_run, paged_tokens = run_jaxpaged(jax_engine, requests, system="jaxpaged", workload=name,
                                                   capacity_tokens=capacity, bar=bar)
        run_dense(dense_baseline, warmup_requests(requests), system="warmup", workload=name, capacity_tokens=capacity)
        with tqdm(total=total, desc=f"{name} dense", unit="tok", leave=False) as bar:
            dense_run, dense_tokens = run_dense(dense_baseline, requests, system="dense-baseline", workload=name,
                                                capacity_tokens=capacity, bar=bar)
        return paged_run, paged_tokens, dense_run, dense_tokens

    def done(name):
        print(f"\n{name}:\n" + table([summarize(r) for r in runs[name]]), flush=True)

    if "w1" in workloads:
        w1 = workload_w1(**preset.w1)
        if args.no_dense:
            run_jaxpaged(engine, warmup_requests(w1), system="warmup", workload="W1", capacity_tokens=budget)
            engine.reset_prefix_cache()
            with tqdm(total=sum(s.max_tokens for _, s in w1), desc="W1 jaxpaged", unit="tok", leave=False) as bar:
                paged_run, paged_tokens = run_jaxpaged(engine, w1, system="jaxpaged", workload="W1",
                                                       capacity_tokens=budget, bar=bar)
            runs["W1"] = [paged_run]
        else:
            paged_run, paged_tokens, dense_run, _ = timed_pair("W1", w1, engine, dense, budget)
            runs["W1"] = [paged_run, dense_run]
        if not args.no_sync_peer:
            # The same engine design stepping synchronously: what the overlap of host and device buys.
            sync_engine = make_engine(preset, model_config, params, tokenizer, num_pages=num_pages,
                                      async_scheduling=False)
            run_jaxpaged(sync_engine, warmup_requests(w1), system="warmup", workload="W1", capacity_tokens=budget)
            sync_engine.reset_prefix_cache()
            with tqdm(total=sum(s.max_tokens for _, s in w1), desc="W1 jaxpaged sync", unit="tok", leave=False) as bar:
                sync_run, _ = run_jaxpaged(sync_engine, w1, system="jaxpaged-sync", workload="W1",
                                           capacity_tokens=budget, bar=bar)
            runs["W1"].insert(1, sync_run)
            del sync_engine
        if preset.hf_peer and not args.no_hf:
            hf = load_hf_model(args.hf_threads)
            run_hf(hf, warmup_requests(w1), batch_size=dense_batch, workload="W1", capacity_tokens=budget)
            with tqdm(total=sum(s.max_tokens for _, s in w1), desc="W1 hf", unit="tok", leave=False) as bar:
                runs["W1"].append(run_hf(hf, w1, batch_size=dense_batch, workload="W1", capacity_tokens=budget,
                                         bar=bar))
            del hf
        done("W1")

    if "w2" in workloads:
        w2_shared = workload_w2(**preset.w2, shared=True)
        w2_distinct = workload_w2(**preset.w2, shared=False)
        paged_on, tokens_on, dense_run, dense_tokens = timed_pair("W2", w2_shared, engine, dense, budget)
        paged_on.system = "jaxpaged (prefix cache on)"
        # The baseline's pool is no longer needed: free it before a second jaxpaged pool is made
        # (on a GPU each pool takes a large share of the memory).
        dense = None
        dense_warmed.clear()
        off_engine = make_engine(preset, model_config, params, tokenizer, num_pages=num_pages, prefix_caching=False)
        run_jaxpaged(off_engine, warmup_requests(w2_shared), system="warmup", workload="W2", capacity_tokens=budget)
        paged_off, tokens_off = run_jaxpaged(off_engine, w2_shared, system="jaxpaged (prefix cache off)",
                                             workload="W2", capacity_tokens=budget)
        paged_miss_off, _ = run_jaxpaged(off_engine, w2_distinct, system="jaxpaged (cache off, 0% hits)",
                                         workload="W2-distinct", capacity_tokens=budget)
        del off_engine
        run_jaxpaged(engine, warmup_requests(w2_distinct), system="warmup", workload="W2", capacity_tokens=budget)
        engine.reset_prefix_cache()
        paged_miss, _ = run_jaxpaged(engine, w2_distinct, system="jaxpaged (cache on, 0% hits)",
                                     workload="W2-distinct", capacity_tokens=budget)
        runs["W2"] = [paged_on, paged_off, paged_miss, paged_miss_off, dense_run]
        checks["W2 greedy outputs equal, cache on vs off"] = tokens_on == tokens_off
        checks["W2 greedy outputs equal, jaxpaged vs dense"] = tokens_on == dense_tokens
        done("W2")

    if "w3" in workloads:
        w3 = workload_w3(**preset.w3)
        small_budget = preset.w3["kv_budget_tokens"]
        small_engine = make_engine(preset, model_config, params, tokenizer, num_pages=small_budget // preset.page_size)
        small_dense = DenseBaseline(model_config, engine.runner.params, max_model_len=preset.max_model_len,
                                    batch_size=batch_size_for_budget(small_budget, preset.max_model_len),
                                    page_size=preset.page_size, max_prefill_tokens=preset.max_num_batched_tokens,
                                    eos_token_id=tokenizer.eos_token_id)
        paged_run, paged_tokens, dense_run, dense_tokens = timed_pair("W3", w3, small_engine, small_dense, small_budget)
        del small_engine, small_dense
        reference_run, reference_tokens = run_jaxpaged(engine, w3, system="jaxpaged (unconstrained pool)",
                                                       workload="W3", capacity_tokens=budget)
        runs["W3"] = [paged_run, dense_run, reference_run]
        checks["W3 greedy outputs equal to an unconstrained run"] = paged_tokens == reference_tokens
        checks["W3 greedy outputs equal, jaxpaged vs dense"] = paged_tokens == dense_tokens
        checks["W3 preemptions happened"] = paged_run.extra["preemptions"] > 0
        done("W3")

    stem = args.name or f"throughput_{preset.name}"
    summaries = {name: [summarize(r) for r in rs] for name, rs in runs.items()}
    for name, rs in runs.items():
        plot_runs(rs, os.path.join(args.out, f"{stem}_{name.lower()}.png"),
                  f"{name}, preset {preset.name}: output throughput and KV utilisation")
    result = {
        "benchmark": "bench_throughput",
        "preset": dataclasses.asdict(preset),
        "environment": environment(),
        "model": {k: getattr(model_config, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                        "head_dim", "vocab_size", "dtype")},
        "kv_budget_tokens": budget,
        "jaxpaged_num_pages": num_pages,
        "dense_batch_size": dense_batch,
        "results": summaries,
        "checks": checks,
        "hf_torch_threads": args.hf_threads,
        "load_average_at_start": load_at_start,  # (1, 5, 15 min): other work sharing this machine
        "total_benchmark_s": round(time.perf_counter() - started, 1),
        # CPU seconds this process used (all threads): on a shared machine, a better guide than
        # the wall time to how long the run takes on an idle one.
        "process_cpu_s": round(time.process_time(), 1),
    }
    path = os.path.join(args.out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print_report(result)
    print(f"\nwrote {path} and the plots beside it ({result['total_benchmark_s']} s in all)")
    return result


def load_hf_model(num_threads: int | None = None):
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.loading import default_model_path

    path = default_model_path()  # the bundled SmolLM2 GGUF, the file jaxpaged loads
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


TABLE_COLUMNS = [
    ("workload", "workload"), ("system", "system"), ("out tok/s", "output_tok_s"), ("total tok/s", "total_tok_s"),
    ("TTFT p50", "ttft_median_s"), ("TTFT p99", "ttft_p99_s"), ("TPOT p50", "tpot_median_s"),
    ("TPOT p99", "tpot_p99_s"), ("KV waste %", "kv_waste_pct"), ("peak seqs", "peak_running"),
    ("preempt", "preemptions"), ("recomp tok", "recomputed_tokens"), ("hit rate", "prefix_hit_rate"),
    ("compiles", "num_compiles_timed"), ("host %", "host_pct"), ("sched %", "sched_pct"),
    ("prep %", "prep_pct"), ("post %", "post_pct"), ("device %", "device_pct"),
]


def table(summaries: list[dict]) -> str:
    rows = []
    for s in summaries:
        row = dict(s)
        if s.get("host_share"):
            row["host_pct"] = 100 * s["host_share_total"]
            row["sched_pct"] = 100 * s["host_share"]["schedule"]
            row["prep_pct"] = 100 * s["host_share"]["prepare"]
            row["post_pct"] = 100 * s["host_share"]["postprocess"]
            row["device_pct"] = 100 * s["device_share"]
        rows.append(row)
    return format_table(rows, TABLE_COLUMNS)


def print_report(result: dict) -> None:
    env = result["environment"]
    print(f"\n{env['device']}  jax {env['jax_version']}  commit {env['git_commit']}  {env['date_utc']}")
    print(table([s for summaries in result["results"].values() for s in summaries]))
    for name, ok in result["checks"].items():
        print(f"check: {name}: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
