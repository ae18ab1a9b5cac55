"""Runs offline workloads through real vLLM; executed by the vLLM venv's python, never imported.

Imports only the standard library and vllm, so it runs in the venv that setup_vllm.sh built.
`benchmarks/peers/vllm_peer.py` drives it in either mode:

File mode: all runs of a request file, each warmed up once and timed best of N.

    .peers/vllm-venv/bin/python benchmarks/peers/vllm_offline.py REQUEST.json RESULT.json

    REQUEST.json: {"model": DIR,                   # the converted HF directory (setup_vllm.sh)
                   "engine_args": {...},           # extra vllm.LLM(...) keyword arguments
                   "runs": [{"name": "w1-greedy",
                             "prompts": [[ids...], ...],   # token ids, fed as TokensPrompt
                             "params": [{"temperature": 0.0, "max_tokens": 48,
                                         "ignore_eos": false, "seed": null}, ...],
                             "repeats": 3}]}
    RESULT.json:  {"vllm_version", "engine": {what vLLM resolved}, "load_s",
                   "runs": {name: {"wall_s": [per repeat], "best_wall_s", "loadavg_before": [per repeat],
                                   "num_prompt_tokens", "num_output_tokens", "output_tok_s", "total_tok_s",
                                   "token_ids": [[ids...] per request, last repeat]}}}

Worker mode: one engine kept alive so that a benchmark can alternate it with jaxpaged repeat by repeat.

    vllm_offline.py --worker MODEL_DIR ENGINE_ARGS_JSON REPLY_FD

    Replies go to file descriptor REPLY_FD as one JSON object per line (stdout belongs to vLLM's
    logs): first {"ready": true, "vllm_version", "engine", "load_s"}; then, for each stdin line
    {"prompts": [...], "params": [...]}, one {"wall_s", "loadavg_before", "token_ids",
    "num_cached_tokens", "num_preemptions"}; on an error
    {"error": "..."}. An empty line or end of input stops the worker.

Invariant in both modes: a timed call generates exactly the requests it was given, with the given
params; nothing is cached between calls except what vLLM itself caches (prefix caching is off when
the caller passes enable_prefix_caching=False, as bench_vs_vllm does).
"""

import json
import os
import sys
import time
import traceback


def _sampling_params(vllm, spec: dict):
    # Only the fields both engines read the same way; anything else is a request-file bug.
    allowed = {"temperature", "max_tokens", "ignore_eos", "seed"}
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"unsupported sampling fields {sorted(unknown)}; allowed: {sorted(allowed)}")
    return vllm.SamplingParams(
        temperature=float(spec.get("temperature", 0.0)),
        max_tokens=int(spec["max_tokens"]),
        ignore_eos=bool(spec.get("ignore_eos", False)),
        seed=spec.get("seed"),
        detokenize=False,  # the engines are compared on token ids; text is not needed
    )


def _load(model: str, engine_args: dict):
    """(vllm module, LLM, what the engine resolved, seconds to build it)."""
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(model=model, enforce_eager=True, **{"dtype": "float32", **engine_args})  # float32 unless asked
    load_s = time.perf_counter() - t0
    try:  # internal config, read only to report beside the figures
        cfg = llm.llm_engine.vllm_config
        engine = {
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_model_len": cfg.model_config.max_model_len,
            "block_size": cfg.cache_config.block_size,
            "num_blocks": cfg.cache_config.num_gpu_blocks,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "dtype": str(cfg.model_config.dtype),
            "enforce_eager": cfg.model_config.enforce_eager,
        }
    except AttributeError as e:
        engine = {"unavailable": repr(e)}
    engine["omp_threads"] = os.environ.get("OMP_NUM_THREADS")
    engine["ld_preload"] = os.environ.get("LD_PRELOAD")
    return vllm, llm, engine, load_s


def _timed_generate(vllm, llm, prompts: list, params: list) -> dict:
    """One timed generate call: wall seconds, the load average just before, the output ids."""
    from vllm.inputs import TokensPrompt

    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params; give one per prompt")
    token_prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
    sampling = [_sampling_params(vllm, s) for s in params]
    preemptions_before = _num_preemptions(llm)
    loadavg = list(os.getloadavg())
    start = time.perf_counter()
    outputs = llm.generate(token_prompts, sampling, use_tqdm=False)
    wall = time.perf_counter() - start
    preemptions = _num_preemptions(llm)
    # vLLM returns outputs in prompt order; each request has one sample (n=1).
    return {"wall_s": wall, "loadavg_before": loadavg, "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "num_cached_tokens": [o.num_cached_tokens or 0 for o in outputs],
            "num_preemptions": None if preemptions is None else preemptions - preemptions_before}


def _num_preemptions(llm) -> int | None:
    """vLLM's `vllm:num_preemptions` counter so far; None when its stats are off (LLM's default:
    pass disable_log_stats=False in engine_args to have it)."""
    try:
        metrics = llm.get_metrics()
    except (AssertionError, AttributeError, RuntimeError):
        return None
    counts = [m.value for m in metrics if m.name == "vllm:num_preemptions"]
    return int(sum(counts)) if counts else None


def run_file(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    for run in request["runs"]:
        if run.get("repeats", 1) < 1:
            raise ValueError(f"run {run['name']!r}: repeats={run['repeats']} must be >= 1")
    vllm, llm, engine, load_s = _load(request["model"], request.get("engine_args", {}))
    results = {}
    for run in request["runs"]:
        _timed_generate(vllm, llm, run["prompts"], run["params"])  # warm-up, not reported
        timed = [_timed_generate(vllm, llm, run["prompts"], run["params"]) for _ in range(run.get("repeats", 1))]
        best = min(t["wall_s"] for t in timed)
        num_out = sum(len(ids) for ids in timed[-1]["token_ids"])
        num_prompt = sum(len(p) for p in run["prompts"])
        results[run["name"]] = {
            "wall_s": [t["wall_s"] for t in timed], "best_wall_s": best,
            "loadavg_before": [t["loadavg_before"] for t in timed],
            "num_prompt_tokens": num_prompt, "num_output_tokens": num_out,
            "output_tok_s": num_out / best, "total_tok_s": (num_out + num_prompt) / best,
            "token_ids": timed[-1]["token_ids"],
        }
        print(f"[vllm_offline] {run['name']}: best {best:.3f} s of {len(timed)}, {num_out / best:.1f} out tok/s",
              flush=True)
    with open(result_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "engine": engine, "load_s": load_s, "runs": results}, f)


def run_worker(model: str, engine_args_json: str, reply_fd: int) -> None:
    reply = os.fdopen(reply_fd, "w", buffering=1)

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    try:
        vllm, llm, engine, load_s = _load(model, json.loads(engine_args_json))
    except Exception:
        send({"error": traceback.format_exc()})
        raise
    send({"ready": True, "vllm_version": vllm.__version__, "engine": engine, "load_s": load_s})
    for line in sys.stdin:
        if not line.strip():
            break
        try:
            command = json.loads(line)
            send(_timed_generate(vllm, llm, command["prompts"], command["params"]))
        except Exception:  # noqa: BLE001 - any failure goes back to the caller, who raises it
            send({"error": traceback.format_exc()})
    reply.close()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        run_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) == 3:
        run_file(sys.argv[1], sys.argv[2])
    else:
        sys.exit("usage (with the vLLM venv's python): vllm_offline.py REQUEST.json RESULT.json\n"
                 "                                 or vllm_offline.py --worker MODEL_DIR ENGINE_ARGS_JSON REPLY_FD")
