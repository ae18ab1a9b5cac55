"""Try the H100 instrument on a decode step shaped like jaxpaged's: layers over stacked weights,
the paged KV buffer donated and carried through the layer loop, the real Pallas (Triton) decode
kernel reading the whole buffer. Three ways of looping over layers, side by side:

    scan      jax.lax.scan over the stacked weights as `xs` (what nn.scan does)
    fori      jax.lax.fori_loop, weights indexed `w[layer]` inside the body
    unrolled  a Python loop, weights indexed by a constant layer

    python benchmarks/h100/scan_probe.py            # re-runs itself in the H100 environment
    python benchmarks/h100/scan_probe.py --layers 4 --num-seqs 16 --context 256

Shapes default to Qwen3-0.6B (hidden 1024, MLP 3072, 16 query / 8 KV heads of 128, 28 layers);
RoPE, q/k norms, the embedding and the LM head are left out: they do not change the loop pattern.
Every figure is an estimate read from the compiled program (no GPU): launches, device-to-device
copies, HBM bytes with the KV buffer counted as the live context it really reads, and the bytes
floor at 3.35 TB/s. JSON goes to benchmarks/results/h100_scan_probe.json.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.h100.target import H100, REPO_ROOT, run_in_h100_python

# Weight name -> (rows, cols) for hidden H, MLP F, query heads N, KV heads K, head dim D.
_WEIGHTS = lambda H, F, N, K, D: {"wq": (H, N * D), "wk": (H, K * D), "wv": (H, K * D), "wo": (N * D, H),
                                  "w_gate": (H, F), "w_up": (H, F), "w_down": (F, H)}


def build(args):
    """(step function, argument specs, live KV bytes read per layer, weight bytes) for these shapes."""
    import jax
    import jax.numpy as jnp

    from benchmarks.h100.target import spec
    from pallas_kernels.decode import decode_attention_from_buffer

    H, F, N, K, D, L = args.hidden, args.mlp, args.heads, args.kv_heads, 128, args.layers
    B, P = args.num_seqs, args.page_size
    pages_per_seq = args.context // P
    num_pages = B * pages_per_seq + 1  # page 0 stays free, as in the engine
    bf16 = jnp.bfloat16
    shapes = _WEIGHTS(H, F, N, K, D)
    params = {name: spec((L, *rc), bf16) for name, rc in shapes.items()}
    params |= {"norm1": spec((L, H), bf16), "norm2": spec((L, H), bf16)}
    kv = spec((L, 2, K, num_pages, P, D), bf16)
    x = spec((B, H), bf16)
    slots = spec((B,), jnp.int32)  # where each sequence's new token goes: page * P + offset
    tables = spec((B, pages_per_seq), jnp.int32)
    lens = spec((B,), jnp.int32)

    def rms(v, w):
        v32 = v.astype(jnp.float32)
        return (v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, -1, keepdims=True) + 1e-6)).astype(bf16) * w

    def layer(x, kv, layer_idx, w, tables, lens, slots):
        h = rms(x, w["norm1"])
        q, k, v = (h @ w["wq"]).reshape(B, N, D), (h @ w["wk"]).reshape(B, K, D), (h @ w["wv"]).reshape(B, K, D)
        flat = kv.reshape(L, 2, K, num_pages * P, D)  # slot view of the pages, no copy
        flat = flat.at[layer_idx, 0, :, slots].set(k).at[layer_idx, 1, :, slots].set(v)
        kv = flat.reshape(kv.shape)
        o = decode_attention_from_buffer(q, kv, tables, lens, layer_idx=layer_idx, scale=D ** -0.5, interpret=False)
        x = x + o.reshape(B, N * D) @ w["wo"]
        h = rms(x, w["norm2"])
        x = x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return x, kv

    def step(kv, params, x, tables, lens, slots):
        if args.variant == "scan":
            def body(carry, w):
                x, kv, i = carry
                x, kv = layer(x, kv, i, w, tables, lens, slots)
                return (x, kv, i + 1), None
            (x, kv, _), _ = jax.lax.scan(body, (x, kv, jnp.int32(0)), params)
        elif args.variant == "fori":
            def body(i, carry):
                return layer(*carry, i, jax.tree.map(lambda a: a[i], params), tables, lens, slots)
            x, kv = jax.lax.fori_loop(0, L, body, (x, kv))
        else:
            for i in range(L):
                x, kv = layer(x, kv, i, jax.tree.map(lambda a, i=i: a[i], params), tables, lens, slots)
        return x, kv

    live_kv_per_layer = B * args.context * K * D * 2 * 2  # K and V, bf16: what one layer must read
    weight_bytes = sum(L * r * c * 2 for r, c in shapes.values()) + 2 * L * H * 2
    return step, (kv, params, x, tables, lens, slots), live_kv_per_layer, weight_bytes


def probe(args) -> dict:
    """Compile one variant in this (H100) process and read it."""
    from benchmarks.h100.target import compile_for_h100

    step, specs, live_kv, weight_bytes = build(args)
    options = {"xla_gpu_enable_triton_gemm": False} if args.cublas else None
    with tempfile.TemporaryDirectory(prefix="h100-probe-") as tmp:  # the dump is read here, then dropped
        return _read(args, compile_for_h100(step, specs, donate_argnums=(0,), dump_dir=os.path.join(tmp, "dump"),
                                            compiler_options=options), live_kv, weight_bytes)


def _read(args, out, live_kv: int, weight_bytes: int) -> dict:
    import jax

    from benchmarks.h100 import ptxas_report
    from benchmarks.h100.hlo_accounting import BufferOverride, account, entry_param_number
    from benchmarks.h100.thunks import cross_check

    kv_param = entry_param_number(out.hlo_text, "kv")
    new_kv = args.num_seqs * args.kv_heads * 128 * 2 * 2  # this step's K and V rows, bf16
    acc = account(out.hlo_text, BufferOverride(kv_param, bytes_read=live_kv))
    kernels = ptxas_report.report(out.dump_dir)
    ideal = weight_bytes + args.layers * live_kv + new_kv * args.layers
    mem = out.compiled.memory_analysis()
    return dict(
        variant=args.variant + ("+cublas" if args.cublas else ""), lower_s=round(out.lower_seconds, 2),
        compile_s=round(out.compile_seconds, 2), launches=acc.num_launches, kernels=acc.num_kernels,
        num_copies=acc.num_copies, copy_bytes=acc.copy_bytes, hbm_bytes=acc.hbm_bytes, ideal_bytes=ideal,
        floor_ms=acc.hbm_bytes / H100.hbm_bandwidth * 1e3, ideal_ms=ideal / H100.hbm_bandwidth * 1e3,
        flops=acc.flops, by_kind=acc.by_kind(), warnings=acc.warnings, cross_check=cross_check(acc, out.dump_dir),
        temp_bytes=mem.temp_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
        copies=_copy_summary(acc), pallas=sorted({json.dumps(dict(
            name=k.kernel, registers=k.registers, spills=k.spill_store_bytes + k.spill_load_bytes,
            smem=k.static_smem + k.dynamic_smem, threads=k.threads_per_block, occupancy=round(k.occupancy, 4),
            limiter=k.limiter, features=k.features)) for k in kernels}),
        jax=jax.__version__)


def _copy_summary(acc) -> list[dict]:
    """Device-to-device copies grouped by what XLA made of them and their size, biggest total first."""
    groups: dict[tuple, int] = {}
    for launch in acc.launches:
        if launch.kind == "copy":
            key = (launch.detail, launch.bytes_read)
            groups[key] = groups.get(key, 0) + launch.count
    rows = [dict(how=how, bytes_each=n, runs=runs) for (how, n), runs in groups.items()]
    return sorted(rows, key=lambda r: -r["bytes_each"] * r["runs"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--mlp", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--variants", default="scan,fori,unrolled,scan+cublas")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child process
    p.add_argument("--cublas", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "h100_scan_probe.json"))
    args = p.parse_args()
    if args.variant:  # child: compile one variant, print its JSON
        print("RESULT " + json.dumps(probe(args)))
        return
    rows = []
    for variant in args.variants.split(","):
        name, _, backend = variant.partition("+")
        argv = [os.path.abspath(__file__), *sys.argv[1:], "--variant", name] + (["--cublas"] if backend else [])
        run = run_in_h100_python(argv, capture_output=True, text=True, check=False)
        lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            sys.exit(f"{variant} failed:\n{run.stderr[-4000:]}")
        rows.append(json.loads(lines[-1][len("RESULT "):]))
        rows[-1]["pallas"] = [json.loads(k) for k in rows[-1]["pallas"]]
    print(f"H100 SXM static profile (estimates, no GPU): {args.layers} layers, {args.num_seqs} seqs x context "
          f"{args.context}, page {args.page_size}; KV counted as the live context per layer read")
    print(f"{'variant':<13} {'launch':>6} {'kernel':>6} {'copies':>6} {'copy MB':>8} {'HBM MB':>8} {'ideal MB':>8} "
          f"{'floor ms':>8} {'x ideal':>7} {'compile s':>9}  cross-check")
    for r in rows:
        print(f"{r['variant']:<13} {r['launches']:>6} {r['kernels']:>6} {r['num_copies']:>6} {r['copy_bytes'] / 1e6:>8.1f} "
              f"{r['hbm_bytes'] / 1e6:>8.1f} {r['ideal_bytes'] / 1e6:>8.1f} {r['floor_ms']:>8.3f} "
              f"{r['hbm_bytes'] / r['ideal_bytes']:>7.2f} {r['compile_s']:>9.1f}  {'agree' if not r['cross_check'] else r['cross_check'][:3]}")
    for r in rows:
        copies = ", ".join(f"{c['runs']} x {c['bytes_each'] / 1e6:.2f} MB ({c['how']})" for c in r["copies"])
        print(f"  {r['variant']} copies: {copies or 'none'}")
    for k in map(json.loads, sorted({json.dumps(k) for r in rows for k in r["pallas"]})):
        print(f"  Pallas {k['name']}: {k['registers']} regs, {k['spills']} B spills, {k['smem']} B smem, "
              f"{k['threads']} threads, occupancy {k['occupancy']:.1%} ({k['limiter']}), {','.join(k['features']) or '-'}")
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(device="H100 SXM (deviceless compile, estimates)", commit=commit, shapes=vars(args),
                       date=datetime.datetime.now().isoformat(timespec="seconds"), rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
