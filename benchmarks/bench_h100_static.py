"""The H100 static profile: the engine's step programs compiled for an H100 on this CPU, and read.

    python -m benchmarks.bench_h100_static            # the matrix below, ~20-30 min on 2 cores
    python -m benchmarks.bench_h100_static --quick    # decode at batch 256, context 1024; the one-row bucket; one H200 row
    python -m benchmarks.bench_h100_static --families # Mixtral-8x7B (16 layers), Gemma-2-9B, gpt-oss-20b decode steps only
    python -m benchmarks.bench_h100_static --batch-invariant  # decode with batch_invariant's GPU attention beside the default
    python -m benchmarks.bench_h100_static --quantized  # Qwen3-8B decode, bf16 / FP8 channel / FP8 block / W4A16 weights
    python -m benchmarks.bench_h100_static --lora     # a decode step with 4 rank-16 LoRA adapters, and without
    python -m benchmarks.bench_h100_static --hybrid   # a Qwen3-Next-80B-A3B slice (3 Gated DeltaNet : 1 full) decode step

Needs the toolchain once: `scripts/install_h100_toolchain.sh` (the CUDA PJRT plugin and ptxas in
their own folder; the system python is unchanged). The compiling runs in a child process
(jaxpaged/static_profile/target.py). For each case (model shapes with abstract bf16 weights, attention
backend, KV dtype, batch, context) it reports launches, copies, HBM bytes against the ideal, the
bytes floor, FLOPs, temp memory and each Pallas kernel's registers / spills / occupancy
(jaxpaged/static_profile/step_profile.py), and per chip (H100, H200) the bytes floor, the launch-aware
floor and the NVLink floor (jaxpaged/static_profile/floors.py). The matrix adds the smallest bucket
(max_num_seqs=1, every KV dtype, a one-sequence verification step), H200-compiled rows, and tensor
parallel steps (TP 2/4/8 over 1x1xN virtual H100s, Llama-3-8B and -70B, figures per device). Beside it, NVIDIA aiconfigurator's prediction of vLLM's decode
step for the same batch and context (offline tables; `pip install --target .aic aiconfigurator-core`).

EVERY FIGURE IS AN ESTIMATE read from the compiled program or a prediction; nothing ran on a GPU.
JSON: benchmarks/results/h100_static[_quick].json; plot: h100_static.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, h100_child_rows

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
AIC_DIR = os.path.join(os.path.dirname(RESULTS_DIR), os.pardir, ".aic")
H100_BYTES = 84_942_979_072  # device_memory_size of jaxpaged/static_profile/h100_sxm.txtpb
H200_BYTES = 141_000_000_000  # device_memory_size of jaxpaged/static_profile/h200_sxm.txtpb
AIC_MODELS = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "llama3-8b": "meta-llama/Meta-Llama-3-8B"}


def family_cases() -> list[dict]:
    """Decode steps of the other model families: MoE (Mixtral-8x7B at 16 of its 32 layers, which fit an
    H100) at batch 1 (2 of 8 experts needed) and 64 (all of them), Gemma 2 (local/global layers), and
    gpt-oss-20b (sinks, window 128 / full layers, top-4 of 32 experts) at batch 64."""
    mixtral = lambda b: dict(model="mixtral-8x7b", backend="pallas", kv_cache_dtype="auto", num_seqs=b, context=2048,
                             num_layers=16)
    return [mixtral(1), mixtral(64),
            dict(model="gemma2-9b", backend="pallas", kv_cache_dtype="auto", num_seqs=64, context=2048),
            dict(model="gpt-oss-20b", backend="pallas", kv_cache_dtype="auto", num_seqs=64, context=2048)]


def hybrid_cases() -> list[dict]:
    """A Qwen3-Next-80B-A3B decode step on a slice of 4 of its 48 layers (3 Gated DeltaNet, then 1 gated full
    attention: the model's pattern), batch 64, context 2048: the ideal counts each sequence's recurrent state
    read and written once beside the weights and the full-attention layer's live K/V."""
    return [dict(model="qwen3-next-80b-a3b", backend="pallas", kv_cache_dtype="auto", num_seqs=64, context=2048,
                 num_layers=4)]


def smallest_bucket_cases() -> list[dict]:
    """max_num_seqs=1 (the one-row bucket) for each KV dtype and backend, and a verification step of one
    sequence (k=3: 4 rows), Qwen3-0.6B, context 1024."""
    one = dict(model="qwen3-0.6b", backend="pallas", kv_cache_dtype="auto", num_seqs=1, context=1024, max_num_seqs=1)
    return ([one, dict(one, backend="mosaic")] + [dict(one, kv_cache_dtype=kv) for kv in ("int8", "float8_e4m3fn")]
            + [dict(one, num_tokens=4, num_logits=4, max_num_seqs=4)])


def tp_cases() -> list[dict]:
    """Tensor parallel decode steps over 2/4/8 virtual H100s, Llama-3-8B (32 layers) and Llama-3-70B (80
    layers: the layer loop is a scan under a mesh, so the whole model compiles in seconds), batch 64,
    context 2048; figures per device."""
    return [dict(model=m, backend="pallas", kv_cache_dtype="auto", num_seqs=64, context=2048, tp=tp)
            for m in ("llama3-8b", "llama3-70b") for tp in (2, 4, 8)]


def h200_cases() -> list[dict]:
    """The quick rows and the one-row bucket compiled for the H200 (h200_sxm.txtpb)."""
    return [dict(c, chip="h200") for c in quick_cases() + smallest_bucket_cases()[:1]]


def quantized_cases() -> list[dict]:
    """Qwen3-8B decode steps (context 2048) with bf16 weights, with FP8 ones (per channel, 128x128 blocks;
    W8A8) and with packed 4-bit ones (W4A16: ops/w4a16_matmul.py), batch 1 and 64: bytes against the ideal,
    which counts the weights as the step holds them."""
    one = lambda w, b: dict(model="qwen3-8b", backend="pallas", kv_cache_dtype="auto", num_seqs=b, context=2048,
                            weights=w)
    return [one(w, b) for w in ("auto", "fp8-channel", "fp8-block", "w4a16") for b in (1, 64)]


def quick_cases() -> list[dict]:
    return [dict(model="qwen3-0.6b", backend=b, kv_cache_dtype="auto", num_seqs=256, context=1024)
            for b in ("pallas", "mosaic")]


def lora_cases() -> list[dict]:
    """A decode step with 4 LoRA adapters of rank 16 on every projection, beside the same step without,
    Qwen3-0.6B, batch 64, context 1024."""
    base = dict(model="qwen3-0.6b", backend="pallas", kv_cache_dtype="auto", num_seqs=64, context=1024)
    return [base, dict(base, num_loras=4, lora_rank=16)]


def cases(quick: bool, families: bool = False, quantized: bool = False, lora: bool = False,
          hybrid: bool = False) -> list[dict]:
    if hybrid:
        return hybrid_cases()
    if lora:
        return lora_cases()
    if families:
        return family_cases()
    if quantized:
        return quantized_cases()
    c = quick_cases()
    decode = lambda model, backend, kv, b, ctx: dict(model=model, backend=backend, kv_cache_dtype=kv, num_seqs=b,
                                                     context=ctx)
    if quick:
        return c + smallest_bucket_cases()[:1] + h200_cases()[:1]
    c += smallest_bucket_cases() + h200_cases() + tp_cases()
    c += [decode("qwen3-0.6b", "pallas", "auto", b, ctx) for b in (1, 16, 64, 256) for ctx in (256, 1024, 4096)
          if (b, ctx) != (256, 1024)]
    c += [decode("qwen3-0.6b", "mosaic", "auto", 64, 1024)]
    c += [decode("qwen3-0.6b", "pallas", kv, 256, 1024) for kv in ("int8", "float8_e4m3fn")]
    c += [decode("llama3-8b", backend, "auto", 64, 2048) for backend in ("pallas", "mosaic")]
    # A W1-like mixed step: 8192 tokens, 16 sequences of 512 new tokens over 512 cached ones.
    c += [dict(model="qwen3-0.6b", backend=backend, kv_cache_dtype="auto", num_seqs=16, context=1024, num_tokens=8192)
          for backend in ("pallas", "mosaic")]
    return c + family_cases()


def batch_invariant_cases() -> list[dict]:
    """Qwen3-0.6B decode steps, context 1024, batch 1 / 64 / 256: the default (the Pallas decode kernel,
    its splits planned from the batch) beside the attention batch_invariant=True would run on a GPU (the
    Pallas ragged kernel in every step, device/batch_invariant.py). The GEMMs are XLA's in both: what a
    GPU mode still lacks, so this is the attention's share of its cost only."""
    return [dict(model="qwen3-0.6b", backend="pallas", kv_cache_dtype="auto", num_seqs=b, context=1024,
                 invariant_attention=inv) for b in (1, 64, 256) for inv in (False, True)]


def spec_decode_cases(k: int) -> list[dict]:
    """Speculative decoding: each decode step beside the verification step of k proposals per sequence
    (1 + k tokens each, logits at all of them), Qwen3-0.6B, pallas, context 1024."""
    c = []
    for b in (1, 16, 64):
        base = dict(model="qwen3-0.6b", backend="pallas", kv_cache_dtype="auto", num_seqs=b, context=1024)
        c += [base, dict(base, num_tokens=b * (1 + k), num_logits=b * (1 + k))]
    return c


def spec_decode_table(rows: list[dict], k: int, lengths=(1.5, 2.0, 2.5, 3.0)) -> list[dict]:
    """HBM bytes per emitted token: a decode step's per sequence against a verification step's per
    sequence / L, L = mean tokens a verification emits (accepted + 1; the CPU benchmark measures it).
    Both add the sampler's or verifier's read of the float32 logits rows (a separate program)."""
    out = []
    for b in sorted({r["num_seqs"] for r in rows}):
        decode = next(r for r in rows if r["num_seqs"] == b and not r.get("num_logits") and "error" not in r)
        verify = next(r for r in rows if r["num_seqs"] == b and r.get("num_logits") and "error" not in r)
        vocab_bytes = 4 * 151_936  # Qwen3's vocabulary, float32 logits
        decode_bytes = decode["hbm_bytes"] + b * vocab_bytes
        verify_bytes = verify["hbm_bytes"] + verify["num_logits"] * vocab_bytes
        out.append(dict(num_seqs=b, k=k, decode_step_bytes=decode_bytes, verify_step_bytes=verify_bytes,
                        verify_to_decode=round(verify_bytes / decode_bytes, 3),
                        decode_bytes_per_token=decode_bytes // b,
                        verify_bytes_per_token={str(L): int(verify_bytes / (b * L)) for L in lengths},
                        decode_floor_ms=decode["floor_ms"], verify_floor_ms=verify["floor_ms"],
                        verify_compute_floor_ms=verify["compute_floor_ms"]))
    return out


def child(args) -> None:
    from jaxpaged.static_profile.step_profile import StepCase, profile

    rows = []
    specs = (spec_decode_cases(args.k) if args.spec_decode else batch_invariant_cases() if args.batch_invariant
             else cases(args.quick, args.families, args.quantized, args.lora, args.hybrid))
    for spec in specs:
        case = StepCase(**spec)
        try:
            row = profile(case)
        except Exception as err:  # report the case, keep going: one failure must not hide the rest
            row = {**spec, "error": f"{type(err).__name__}: {str(err)[:400]}"}
        rows.append(row)
        print(_row_line(row), flush=True)
    with open(args.child_out, "w") as f:
        json.dump(rows, f)


def _row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<12} {r['backend']:<6} {r['kv_cache_dtype']:<6} b={r['num_seqs']:<4} ctx={r['context']:<5} ERROR {r['error']}"
    kind = "decode" if not r["num_tokens"] else f"mixed {r['num_tokens']}"
    spill = max((k["spill_store_bytes"] for k in r.get("kernels", [])), default=0)
    f = r["floors"]
    weights = "" if r.get("weights", "auto") == "auto" else f" w={r['weights']}"
    return (f"{r['model']:<12} {r['chip']}{'' if r['tp'] == 1 else ' tp' + str(r['tp'])}{weights} {r['backend']:<6} "
            f"{r['kv_cache_dtype']:<6} {kind:<10} b={r['num_seqs']:<4} max_seqs={r['max_num_seqs'] or '-':<4} "
            f"ctx={r['context']:<5} L={r['num_layers']:<3} launches={r['launches']:<5} copies={r['copies']:<4} "
            f"copyGB={r['copy_bytes'] / 1e9:6.2f} x_ideal={r['bytes_to_ideal']:5.2f} "
            f"h100 bytes/launch-aware/ideal ms={f['h100']['bytes_floor_ms']:.3f}/{f['h100']['launch_floor_ms']:.3f}/"
            f"{f['h100']['ideal_floor_ms']:.3f} h200={f['h200']['bytes_floor_ms']:.3f}/{f['h200']['launch_floor_ms']:.3f}/"
            f"{f['h200']['ideal_floor_ms']:.3f} nvlink_ms={f['h100']['nvlink_floor_ms']:.3f} "
            f"graphs={r['command_buffers']['graphs']}/{r['command_buffers']['ops_in_graphs']} "
            f"matmul_flops_x={r.get('matmul_flops_to_useful')} spills={spill} compile_s={r['compile_s']}")


def vllm_predictions(rows: list[dict]) -> dict[str, float]:
    """aiconfigurator's vLLM decode-step latency (ms) per (model, batch, context), where it runs offline."""
    wanted = sorted({(r["model"], r["num_seqs"], r["context"]) for r in rows
                     if not r.get("num_tokens") and r["model"] in AIC_MODELS})  # the models it has tables for
    code = ("import json, sys\nfrom aiconfigurator_core.sdk.engine import EngineHandle\nout, handles = {}, {}\n"
            "for model, b, ctx in json.loads(sys.argv[1]):\n"
            "    try:\n"
            "        h = handles.setdefault(model, EngineHandle.compile(model, 'h100_sxm', 'vllm'))\n"
            "        out[f'{model}|{b}|{ctx}'] = h.decode_step_latency(b, ctx, 2)\n"
            "    except Exception as err:\n"
            "        out[f'{model}|{b}|{ctx}'] = f'{type(err).__name__}: {err}'[:200]\n"
            "print(json.dumps(out))\n")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(AIC_DIR), HF_HUB_OFFLINE="1")
    query = [(AIC_MODELS[m], b, ctx) for m, b, ctx in wanted]
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(query)], env=env, capture_output=True,
                              text=True, timeout=600)
        raw = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return {}
    names = {v: k for k, v in AIC_MODELS.items()}
    return {f"{names[key.split('|')[0]]}|{key.split('|', 1)[1]}": value for key, value in raw.items()}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ok = [r for r in rows if "error" not in r and r["fits_h100"] and r["model"] == "qwen3-0.6b" and r["backend"] == "pallas"
          and r["chip"] == "h100" and r["tp"] == 1 and not r.get("max_num_seqs")
          and r["kv_cache_dtype"] == "auto" and not r["num_tokens"]]
    for b in sorted({r["num_seqs"] for r in ok}):
        pts = sorted((r["context"], r["bytes_to_ideal"], r["launches"]) for r in ok if r["num_seqs"] == b)
        left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {b}")
        right.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"batch {b}")
    left.set(xscale="log", xlabel="context (tokens)", ylabel="HBM bytes / ideal", title="decode step, Qwen3-0.6B, pallas")
    right.set(xscale="log", xlabel="context (tokens)", ylabel="launches per step", title="launches (incl. copies)")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("H100 static profile: estimates from the compiled program (no GPU measurement)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="decode at batch 256, context 1024 only")
    parser.add_argument("--families", action="store_true", help="the Mixtral, Gemma 2 and gpt-oss decode steps only")
    parser.add_argument("--quantized", action="store_true",
                        help="Qwen3-8B decode steps with bf16 and FP8 (per channel, block) weights, batch 1 and 64")
    parser.add_argument("--lora", action="store_true", help="a decode step with 4 rank-16 LoRA adapters, and without")
    parser.add_argument("--hybrid", action="store_true",
                        help="a Qwen3-Next-80B-A3B 4-layer slice decode step (recurrent states in the ideal)")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--spec-decode", action="store_true",
                        help="speculative decoding: decode vs verification steps (k proposals), bytes per token")
    parser.add_argument("--k", type=int, default=3, help="with --spec-decode: proposals per sequence")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="decode steps with batch_invariant's GPU attention (ragged in every step) beside the default")
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_out:
        child(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.spec_decode:
        return spec_decode_main(args)
    if args.batch_invariant:
        return batch_invariant_main(args)
    name = ("h100_static_quick" if args.quick else "h100_static_families" if args.families else
            "h100_static_quantized" if args.quantized else "h100_static_lora" if args.lora else
            "h100_static_hybrid" if args.hybrid else "h100_static")
    rows = h100_child_rows("benchmarks.bench_h100_static",
                           [*(["--quick"] if args.quick else []), *(["--families"] if args.families else []),
                            *(["--quantized"] if args.quantized else []), *(["--lora"] if args.lora else []),
                            *(["--hybrid"] if args.hybrid else [])],
                           args.out, name)
    predictions = vllm_predictions(rows)
    for r in rows:
        # The prediction is of one H100's decode step (aiconfigurator's h100_sxm tables).
        decode = not r.get("num_tokens") and r.get("chip", "h100") == "h100" and r.get("tp", 1) == 1
        r["vllm_predicted_ms"] = predictions.get(f"{r['model']}|{r['num_seqs']}|{r['context']}") if decode else None
        # A case whose live KV alone exceeds the H100's 80 GB cannot run there (e.g. Qwen3-0.6B, 256 x 4096:
        # 120 GB); XLA then rematerialises and copies, so its figures describe nothing real.
        r["fits_h100"] = "error" in r or r["ideal_bytes"] < H100_BYTES  # weights + live KV + the step's I/O (per device)
        r["fits_h200"] = "error" in r or r["ideal_bytes"] < H200_BYTES
    from jaxpaged.static_profile.floors import PER_LAUNCH_S

    result = {"environment": environment(), "label": "ESTIMATES from the compiled program (H100, or H200 where "
              "chip says so; tp > 1: per device); floors for both chips from each program: bytes / HBM bandwidth, "
              f"launch-aware = + launches x {PER_LAUNCH_S * 1e6:.1f} us (PER_LAUNCH_S, an uncalibrated estimate), "
              "NVLink 450 GB/s one way; vLLM column: aiconfigurator-core prediction. Nothing here ran on a GPU.",
              "per_launch_s": PER_LAUNCH_S, "rows": rows}
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if not (args.quick or args.families or args.quantized or args.lora or args.hybrid):
        plot(rows, os.path.join(args.out, "h100_static.png"))
    print("\n(estimates; vLLM = aiconfigurator prediction)")
    for r in rows:
        print(_row_line(r), f"vllm_pred_ms={r['vllm_predicted_ms']}", "" if r["fits_h100"] else
              "(over an H100's 80 GB: not real there)" if r["fits_h200"] else "(over 80 and 141 GB: not real)")
    return 0


def batch_invariant_main(args) -> int:
    rows = h100_child_rows("benchmarks.bench_h100_static", ["--batch-invariant"], args.out, "h100_static_batch_invariant")
    keys = ("num_seqs", "invariant_attention", "launches", "bytes_to_ideal", "hbm_bytes", "ideal_bytes", "floor_ms",
            "launch_floor_ms")
    table = [{k: r.get(k) for k in keys} | ({"error": r["error"]} if "error" in r else {}) for r in rows]
    result = {"environment": environment(), "label": "ESTIMATES from the compiled H100 programs; nothing ran on a GPU. "
              "invariant_attention: the Pallas ragged kernel in every step (batch_invariant's GPU attention); the "
              "GEMMs are XLA's in both rows (not batch-invariant: batch_invariant stays refused on GPUs)",
              "table": table, "rows": rows}
    with open(os.path.join(args.out, "h100_static_batch_invariant.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n(estimates) Qwen3-0.6B decode, context 1024: default vs batch_invariant's attention")
    for t in table:
        print(t)
    return 0


def spec_decode_main(args) -> int:
    rows = h100_child_rows("benchmarks.bench_h100_static", ["--spec-decode", "--k", str(args.k)], args.out,
                           "h100_spec_decode")
    table = spec_decode_table(rows, args.k)
    result = {"environment": environment(), "label": "ESTIMATES from the compiled H100 programs (HBM bytes of the "
              "step, plus the float32 logits the sampler / verifier reads); nothing ran on a GPU", "table": table,
              "rows": rows}
    with open(os.path.join(args.out, "h100_spec_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n(estimates) HBM bytes per emitted token, Qwen3-0.6B bf16, context 1024, k =", args.k)
    for t in table:
        print(f"b={t['num_seqs']:<3} decode {t['decode_bytes_per_token'] / 1e6:8.2f} MB/token  verify step = "
              f"{t['verify_to_decode']:.2f}x a decode step; per token at L accepted+1: "
              + "  ".join(f"L={L}: {v / 1e6:.2f} MB" for L, v in t["verify_bytes_per_token"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
