"""Where one jaxpaged decode step's time goes on this CPU (issue 31, second half).

    python -m benchmarks.peers.profile_cpu_decode [--batch 16] [--context 128] [--engine-args '{"per_layer_weights": true}']
        # writes benchmarks/results/cpu_decode_profile.json, prints one table; ~5 min on 2 cores

All in one process, back to back:
  1. the machine: float32 matmul rate (a 2048^3 jnp.dot), read and copy bandwidth over 512 MB, the
     cost of dispatching a trivial jitted call;
  2. the compiled decode step (the engine's own program, decode bucket of `batch` sequences, each
     at `context` tokens): wall time, and an XLA CPU profile (jax.profiler) whose per-thunk events
     are attributed to categories through the compiled HLO's op names. Wall time is split among the
     thunks running at each instant (two threads: half each while both are busy);
  3. pieces compiled on their own with the real weights: the 210 layer matmuls from pre-sliced
     weights, the same under lax.scan over stacked weights (as the model runs them), the LM head,
     the sampler (greedy and temperature 0.6);
  4. the step as users see it: the slope of `LLM.generate` wall time over max_tokens.
Each category gets its floor: max(FLOPs / matmul rate, bytes / read bandwidth).

The trace is read by `benchmarks/peers/xla_cpu_trace.py`. Internals used, read-only (they are moving; the imports tolerate both layouts): `llm.engine.runner`
(`dummy_step_input`, `execute`, `trace_step`, `page_size`, `config`) and the sampler module
(`sample`, `make_sampling_arrays`). The public API gives `LLM`, `llm.params` and `generate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import time

import numpy as np

from benchmarks.common import environment, format_table
from benchmarks.peers.xla_cpu_trace import trace_breakdown

READ_BYTES = 512 << 20


def best_of(fn, n: int) -> tuple[float, float]:
    """(best, median) seconds of `fn()` over n calls; fn must block until its result is ready."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), statistics.median(times)


def machine_peaks() -> dict:
    import jax
    import jax.numpy as jnp

    n = 2048
    a, b = jnp.ones((n, n), jnp.float32), jnp.ones((n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    t_dot, _ = best_of(lambda: dot(a, b).block_until_ready(), 5)
    x = jnp.ones(READ_BYTES // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    t_read, _ = best_of(lambda: total(x).block_until_ready(), 5)
    # Read + write in place: donated, so no call pays for first-touching a fresh 512 MB output.
    inc = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    y = [inc(jnp.ones(READ_BYTES // 4, jnp.float32)).block_until_ready()]

    def copy_once():
        y[0] = inc(y[0]).block_until_ready()

    copy_once()
    t_copy, _ = best_of(copy_once, 5)
    s = jnp.float32(0)
    tiny = jax.jit(lambda v: v + 1)
    tiny(s).block_until_ready()
    _, t_tiny = best_of(lambda: tiny(s).block_until_ready(), 2000)
    return {"matmul_gflop_s": 2 * n**3 / t_dot / 1e9, "read_gb_s": READ_BYTES / t_read / 1e9,
            "copy_gb_s": 2 * READ_BYTES / t_copy / 1e9, "dispatch_us": t_tiny * 1e6, "matmul_n": n}


def _import_first(*names):
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    raise ImportError(f"none of {names} imports; the module moved again: update profile_cpu_decode.py")


def decode_step_input(runner, batch: int, context: int):
    """A decode step of `batch` sequences, each holding `context` tokens (this step's included).

        sequence i owns pages 1 + i*pps ... i*pps + pps   (pps = ceil(context / page_size); page 0 = padding)
        its new token sits at position context-1: slot = block_table[i][(context-1) // p] * p + (context-1) % p
    """
    p = runner.page_size
    pps = -(-context // p)
    if 1 + batch * pps > runner.num_pages:
        raise ValueError(f"{batch=} x {context=} needs {1 + batch * pps} pages but the pool has {runner.num_pages}")
    base = runner.dummy_step_input(batch, decode_only=True)
    tables = np.zeros_like(base.block_tables)
    for i in range(batch):
        tables[i, :pps] = 1 + i * pps + np.arange(pps)
    rows = np.arange(batch)
    slots = tables[rows, (context - 1) // p] * p + (context - 1) % p
    return dataclasses.replace(
        base, token_ids=(rows + 100).astype(np.int32), positions=np.full(batch, context - 1, np.int32),
        slot_mapping=slots.astype(np.int32), block_tables=tables, seq_lens=np.full(batch, context, np.int32),
        query_start_loc=np.arange(batch + 1, dtype=np.int32), logits_indices=rows.astype(np.int32))


def pieces(params: dict, batch: int, vocab: int) -> dict:
    """Model pieces compiled alone with the real weights (float32), timed best of 5."""
    import jax
    import jax.numpy as jnp

    layers = params["params"]["layers"]
    attn, mlp = layers["attn"], layers["mlp"]
    if "q_proj" not in attn:  # quantization="gguf": block codes, no float matrices to time alone
        return {}
    num_layers, dim = attn["q_proj"].shape[:2]
    mats = {  # stacked [L, in, out] matrices, in the order a layer uses them
        "q": attn["q_proj"].reshape(num_layers, dim, -1), "k": attn["k_proj"].reshape(num_layers, dim, -1),
        "v": attn["v_proj"].reshape(num_layers, dim, -1), "o": attn["o_proj"].reshape(num_layers, -1, dim),
        "gate": mlp["gate_proj"], "up": mlp["up_proj"], "down": mlp["down_proj"],
    }

    def layer(x, w):  # x: [B, D]; the model's seven matmuls, attention replaced by q itself
        q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
        h = x + (q + jnp.tile(k + v, q.shape[1] // k.shape[1])) @ w["o"]
        return h + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]

    sliced = [{n: jnp.array(m[i]) for n, m in mats.items()} for i in range(num_layers)]  # own buffers
    def run_unrolled(x, ws):
        for w in ws:
            x = layer(x, w)
        return x

    unrolled = jax.jit(run_unrolled)
    scanned = jax.jit(lambda x, ws: jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0])
    x = jnp.ones((batch, dim), jnp.float32) * 0.01
    lm_head = jax.jit(lambda h, e: jnp.einsum("SD,VD->SV", h, e))
    tied_lm_head = getattr(importlib.import_module("jaxpaged.models.llama"), "tied_lm_head", None)
    vocab_major = jax.jit(lambda h, e: tied_lm_head(h, e, True)) if tied_lm_head else None
    emb = params["params"]["embedding"]
    for fn, args in ((unrolled, (x, sliced)), (scanned, (x, mats)), (lm_head, (x, emb))):
        fn(*args).block_until_ready()
    out = {
        "layer_matmuls_presliced_ms": best_of(lambda: unrolled(x, sliced).block_until_ready(), 5)[0] * 1e3,
        "layer_matmuls_scan_ms": best_of(lambda: scanned(x, mats).block_until_ready(), 5)[0] * 1e3,
        "lm_head_ms": best_of(lambda: lm_head(x, emb).block_until_ready(), 5)[0] * 1e3,  # x @ E^T
    }
    if vocab_major is not None:  # the engine's CPU head (models/llama.py tied_lm_head)
        vocab_major(x, emb).block_until_ready()
        out["lm_head_vocab_major_ms"] = best_of(lambda: vocab_major(x, emb).block_until_ready(), 5)[0] * 1e3
    sampler = _import_first("jaxpaged.sample.sampler", "jaxpaged.device.sampler", "jaxpaged.sampler")
    logits = jax.random.normal(jax.random.key(0), (batch, vocab), jnp.float32)
    for label, temperature in (("sampler_greedy_ms", 0.0), ("sampler_t0.6_ms", 0.6)):
        rows = [sampler.RowSpec(row_idx=i, temperature=temperature, seed=i) for i in range(batch)]
        arrays = sampler.make_sampling_arrays(rows, batch)
        jax.block_until_ready(sampler.sample(logits, arrays))
        out[label] = best_of(lambda a=arrays: jax.block_until_ready(sampler.sample(logits, a)), 10)[0] * 1e3
    return out


def weight_bytes_read(params, cfg) -> dict:
    """Bytes of the weights each matmul category reads, from the parameter tree itself: float matrices,
    or GGUF codes with their scales and minimums (quantization="gguf"), the head's too where the tree
    keeps the tied embedding as codes."""
    tree = params["params"]
    layers = tree["layers"]

    def leaves(group: dict, names: tuple) -> int:
        return sum(int(np.asarray(v).nbytes) for k, v in group.items() if k.startswith(names))

    head = ({k: v for k, v in tree.items() if k.startswith("embedding")} if cfg.tie_word_embeddings
            else {"lm_head": tree["lm_head"]})
    return {"attention projections (q, k, v, o)": leaves(layers["attn"], ("q_proj", "k_proj", "v_proj", "o_proj")),
            "MLP matmuls (gate, up, down)": leaves(layers["mlp"], ("gate_proj", "up_proj", "down_proj")),
            "LM head matmul": leaves(head, tuple(head))}


def public_decode_step_ms(llm, batch: int, context: int, short: int = 4, long: int = 36) -> dict:
    """The decode step as `generate` users pay it (host, sampler, dispatch included): the slope of wall
    time between max_tokens=short and max_tokens=long, best of 2 each, same prompts."""
    from jaxpaged import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 10000, context - long).tolist() for _ in range(batch)]
    walls = {}
    for n in (short, long):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompts, params)
        walls[n] = best_of(lambda p=params: llm.generate(prompts, p), 2)[0]
    return {"generate_wall_s": walls, "decode_step_ms": (walls[long] - walls[short]) / (long - short) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="steps timed and traced")
    parser.add_argument("--split-attention", action="store_true",
                        help="attention's page gather, its matmuls and its softmax as three categories")
    parser.add_argument("--engine-args", default="{}", help='JSON of LLM keyword arguments, e.g. {"per_layer_weights": false}')
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "results", "cpu_decode_profile.json"))
    args = parser.parse_args()
    from jaxpaged import LLM

    loads = {"start": os.getloadavg()}
    peaks = machine_peaks()
    engine_args = json.loads(args.engine_args)
    t = time.perf_counter()
    llm = LLM(enable_prefix_caching=False, **engine_args)  # compiles every bucket (persistent XLA cache applies)
    build_s = time.perf_counter() - t
    runner = llm.engine.runner  # internal, read-only
    cfg = runner.config
    step_input = decode_step_input(runner, args.batch, args.context)
    runner.execute(step_input).block_until_ready()  # compiled at start-up; this only warms caches
    loads["step"] = os.getloadavg()
    cpu0 = time.process_time()
    step_best, step_median = best_of(lambda: runner.execute(step_input).block_until_ready(), args.steps)
    step_cpu = (time.process_time() - cpu0) / args.steps  # CPU seconds of all threads: less load-sensitive than wall
    loads["trace"] = os.getloadavg()
    d, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    trace = trace_breakdown(runner, step_input, args.steps, {d, f, kv, cfg.num_heads * cfg.head_dim},
                            split_attention=args.split_attention)
    loads["pieces"] = os.getloadavg()
    piece = pieces(llm.params, args.batch, cfg.vocab_size)
    loads["public"] = os.getloadavg()
    public = public_decode_step_ms(llm, args.batch, args.context)

    # Floors per category: FLOPs at the measured matmul rate, bytes at the measured read bandwidth.
    layer_w = {"attention projections (q, k, v, o)": cfg.num_layers * d * (2 * d + 2 * kv),
               "MLP matmuls (gate, up, down)": cfg.num_layers * 3 * d * f,
               "LM head matmul": cfg.vocab_size * d}
    chunk = 8 * runner.page_size  # the CPU attention reads keys in chunks of 8 pages
    kv_bytes = args.batch * (-(-args.context // chunk) * chunk) * kv * 2 * 4 * cfg.num_layers
    read = weight_bytes_read(llm.params, cfg)  # what the step reads: float32, or GGUF codes + scales + mins
    floors = {cat: max(2 * args.batch * w / (peaks["matmul_gflop_s"] * 1e9), read[cat] / (peaks["read_gb_s"] * 1e9)) * 1e3
              for cat, w in layer_w.items()}
    floors["attention (page gather, softmax, PV)"] = kv_bytes / (peaks["read_gb_s"] * 1e9) * 1e3
    weight_bytes = sum(read.values())
    # The target: the step's useful FLOPs (weight matmuls + QK^T and PV over the live context)
    # per second, against the plain jnp.dot rate measured above in this same run.
    step_flops = 2 * args.batch * sum(layer_w.values()) + 4 * args.batch * args.context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    peak_share = step_flops / step_best / (peaks["matmul_gflop_s"] * 1e9)
    bytes_floor_s = (weight_bytes + kv_bytes) / (peaks["read_gb_s"] * 1e9)  # every weight and live K/V read once
    compute_floor_s = step_flops / (peaks["matmul_gflop_s"] * 1e9)
    floor_share = compute_floor_s / max(bytes_floor_s, compute_floor_s)  # the best share a step can reach
    floors["whole step (weights + live KV once)"] = (weight_bytes + kv_bytes) / (peaks["read_gb_s"] * 1e9) * 1e3

    rows = [{"category": cat, "wall_ms": ms, "share": ms / trace["traced_step_ms"], "thread_ms": trace["thread_ms"].get(cat),
             "floor_ms": floors.get(cat)} for cat, ms in sorted(trace["wall_ms"].items(), key=lambda kv_: -kv_[1])]
    rows.append({"category": "outside thunks (dispatch, executor gaps, tracing)",
                 "wall_ms": trace["traced_step_ms"] - trace["busy_wall_ms"],
                 "share": (trace["traced_step_ms"] - trace["busy_wall_ms"]) / trace["traced_step_ms"]})
    rows.append({"category": "compiled step, untraced (median)", "wall_ms": step_median * 1e3, "share": None,
                 "floor_ms": floors["whole step (weights + live KV once)"]})
    rows.append({"category": "generate() per decode step (slope)", "wall_ms": public["decode_step_ms"]})
    for key in ("sampler_greedy_ms", "sampler_t0.6_ms", "layer_matmuls_presliced_ms", "layer_matmuls_scan_ms",
                "lm_head_ms", "lm_head_vocab_major_ms"):
        if key in piece:
            rows.append({"category": f"alone: {key[:-3]}", "wall_ms": piece[key]})
    report = {
        "benchmark": "profile_cpu_decode", "environment": environment(), "loadavg": loads,
        "workload": {"batch": args.batch, "context": args.context, "steps": args.steps, "dtype": cfg.dtype},
        "engine_args": engine_args, "per_layer_weights": runner.per_layer_weights, "llm_build_s": build_s,
        "machine": peaks, "step_ms": {"best": step_best * 1e3, "median": step_median * 1e3,
                                     "process_cpu_mean": step_cpu * 1e3},
        "step_gflop": step_flops / 1e9, "matmul_peak_share": peak_share, "matmul_peak_share_at_bytes_floor": floor_share,
        "trace": trace, "floors_ms": floors, "pieces_ms": piece, "public": public,
        "internals_used": ["llm.engine.runner (dummy_step_input, execute, trace_step, page_size, num_pages, config)",
                           "jaxpaged.sampler / jaxpaged.device.sampler / jaxpaged.sample.sampler (RowSpec, make_sampling_arrays, sample)"],
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"engine {engine_args or 'defaults'} (per_layer_weights={runner.per_layer_weights}): built in {build_s:.0f} s; "
          f"step best {step_best * 1e3:.1f} ms, process CPU {step_cpu * 1e3:.1f} ms/step; {step_flops / 1e9:.2f} GFLOP = "
          f"{peak_share:.0%} of the jnp.dot rate ({floor_share:.0%} at the bytes floor)")
    print(f"machine: matmul {peaks['matmul_gflop_s']:.1f} GFLOP/s (f32 {peaks['matmul_n']}^3), read "
          f"{peaks['read_gb_s']:.1f} GB/s, copy {peaks['copy_gb_s']:.1f} GB/s, dispatch {peaks['dispatch_us']:.0f} us; "
          f"load {loads['start'][0]:.1f}")
    print(format_table(rows, [(f"decode step, batch {args.batch}, context {args.context}", "category"),
                              ("wall ms", "wall_ms"), ("share", "share"), ("thread ms", "thread_ms"),
                              ("floor ms", "floor_ms")]))


if __name__ == "__main__":
    main()
