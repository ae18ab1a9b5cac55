"""The driver behind `scripts/gpu_check.sh`: one GPU check in at most 9 minutes, every stage time-limited.

Stages, each its own process (a crash or a time-out in one does not stop the next; each gets the
GPU's memory to itself), in this order, with these wall-clock limits (STAGE_LIMITS_S):

    env      device, JAX / jaxlib / CUDA / torch / transformers versions, commit      -> env.json
    pytest   pytest -m gpu tests/test_gpu.py tests/test_gpu_path.py (kernels at real sizes against
             the reference, both backends, donation, no compilation after warm-up)   -> pytest.json
    steps    every decode bucket the engine compiles, Qwen3-0.6B shapes at contexts 256/1024/4096,
             Llama-3-8B shapes at batch 1 and 64: measured ms beside the static floor of the same
             compiled program at 4.8 TB/s (benchmarks/bench_decode_steps.py)          -> decode_steps.json
    kernels  K1: decode attention alone as a fraction of the measured copy bandwidth, beside JAX's
             own pallas.ops.gpu paged attention (benchmarks/bench_kernels.py --check) -> kernels.json
    w1       W1 end to end: jaxpaged, the dense baseline and transformers' continuous batching on
             the same random weights (benchmarks/bench_w1_gpu.py)                    -> w1.json

Every stage's JSON is rewritten as it goes, so a stage cut by its limit keeps what it measured. A
stage that ends early leaves its unused seconds to the next one (the total stays 540 s).
Then one summary table is printed last and written, with each stage's status and time, to
gpu_check.json; all output also goes to gpu_check.log. That is 8 files at most under --out.

`--dry-run` runs every stage on any machine at tiny sizes (gpu tests skipped, kernels interpreted,
tiny models): GPU measurements are null; the floors are those of the programs compiled here.
Exit status: 0 when every stage passed, 1 otherwise, 2 when there is no GPU (without --dry-run).
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "gpu")
STAGES = ("env", "pytest", "steps", "kernels", "w1")
# Wall-clock limits in seconds: 540 in all, the 9 minutes the H200 run may take (the call's own
# limit is 600 s). No jaxpaged program has been compiled on that machine yet, so compiles are
# budgeted generously; the first run's stage times say how to share them better.
STAGE_LIMITS_S = {"env": 40, "pytest": 110, "steps": 170, "kernels": 70, "w1": 150}
assert sum(STAGE_LIMITS_S.values()) <= 540
FILES = dict(env="env.json", pytest="pytest.json", steps="decode_steps.json", kernels="kernels.json", w1="w1.json",
             summary="gpu_check.json", log="gpu_check.log")


# ---------------------------------------------------------------------------------------------
# The environment, probed in a child process (the driver never opens the GPU: JAX would take
# most of its memory for the whole run)


def probe_environment(path: str) -> None:
    import jax
    import jaxlib

    env = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), num_devices=jax.device_count(),
               jax_version=jax.__version__, jaxlib_version=jaxlib.__version__, python=platform.python_version())
    cuda = {}
    try:
        from jax._src.lib import cuda_versions  # None on a CPU-only jaxlib
    except ImportError:
        cuda_versions = None
    for name in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version"):
        try:
            cuda[name.removesuffix("_get_version")] = getattr(cuda_versions, name)()
        except Exception:  # noqa: BLE001 - a probe that fails is reported as absent
            pass
    env["cuda"] = cuda
    for module in ("torch", "transformers", "flax", "numpy"):
        try:
            env[f"{module}_version"] = __import__(module).__version__
        except Exception as e:  # noqa: BLE001
            env[f"{module}_version"] = f"missing ({type(e).__name__})"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = smi.stdout.strip() if smi.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        env["nvidia_smi"] = None
    with open(path, "w") as f:
        json.dump(env, f, indent=1)


def git_commit() -> str:
    """HEAD, or $JAXPAGED_COMMIT where the tree travelled without .git or git (the device machine)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("JAXPAGED_COMMIT") or "unknown"


# ---------------------------------------------------------------------------------------------
# Running a stage


class Log:
    """Everything the stages print, to the console and to one log file."""

    def __init__(self, path: str):
        self.file = open(path, "a")

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        self.file.write(text)
        self.file.flush()


def run_logged(cmd: list[str], log: Log, limit_s: float, env: dict) -> tuple[int | None, float]:
    """Runs `cmd` in the repository; (exit code, or None when killed at `limit_s`; wall seconds)."""
    start = time.perf_counter()
    log.write(f"$ {' '.join(cmd)}   (limit {limit_s:.0f} s)\n")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    killed = threading.Event()

    def kill():
        killed.set()
        try:
            os.killpg(proc.pid, 9)  # the stage and any process it started
        except ProcessLookupError:
            pass

    timer = threading.Timer(max(limit_s, 1.0), kill)
    timer.start()
    try:
        for line in proc.stdout:
            log.write(line)
        returncode = proc.wait()
    finally:
        timer.cancel()
    seconds = time.perf_counter() - start
    if killed.is_set():
        log.write(f"!!! killed at its limit of {limit_s:.0f} s\n")
        return None, seconds
    return returncode, seconds


def stage_commands(name: str, out: str, dry_run: bool) -> list[list[str]]:
    """The command(s) of a stage; the stage's limit covers them all, in order."""
    py, dry = sys.executable, (["--dry-run"] if dry_run else [])
    path = os.path.join(out, FILES[name])
    if name == "env":
        return [[py, os.path.abspath(__file__), "--probe-env", path]]
    if name == "pytest":
        return [[py, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "tests/test_gpu_path.py", "-q", "-rs",
                 "-p", "no:cacheprovider", "-p", "pytest_progress", "--progress-json", path]]
    if name == "steps":
        return [[py, "-m", "benchmarks.bench_decode_steps", "--out", path, *dry]]
    if name == "kernels":
        return [[py, "benchmarks/bench_kernels.py", "--check", "--workloads", "K1", "--json", path, *dry]]
    if name == "w1":
        weights = os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxpaged_w1_weights" + ("_dry" if dry_run else ""))
        return [[py, "-m", "benchmarks.bench_w1_gpu", step, "--dir", weights, "--out", path, *dry]
                for step in ("weights", "jax", "hf")]
    raise ValueError(name)


def run_stage(name: str, out: str, dry_run: bool, log: Log, env: dict, spare_s: float = 0.0) -> dict:
    """Runs stage `name` under its limit plus `spare_s` (what earlier stages left unused)."""
    limit = STAGE_LIMITS_S[name] + spare_s
    start = time.perf_counter()
    path = os.path.join(out, FILES[name])
    if os.path.exists(path):
        os.remove(path)
    status, codes = "ok", []
    for cmd in stage_commands(name, out, dry_run):
        left = limit - (time.perf_counter() - start)
        code, _ = run_logged(cmd, log, left, env)
        codes.append(code)
        if code is None:
            status = "timeout"
            break
        if code != 0:
            status = "failed"
            if name != "w1":  # W1's steps are independent enough to go on (a peer may fail alone)
                break
    if status == "ok" and not os.path.exists(path):
        status = "failed"  # exited 0 without its JSON
    return dict(stage=name, status=status, returncodes=codes, seconds=round(time.perf_counter() - start, 1),
                limit_s=round(limit, 1), json=FILES[name] if os.path.exists(path) else None)


# ---------------------------------------------------------------------------------------------
# Summary


def _load(out: str, name: str) -> dict | None:
    path = os.path.join(out, FILES[name])
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _ms(x) -> str:
    return "null" if x is None else f"{x:.4g} ms"


def summarize(out: str, stages: dict[str, dict], dry_run: bool) -> tuple[list[tuple[str, str]], dict]:
    """The table's rows and the figures behind them, from the stages' JSON files under `out`."""
    env = _load(out, "env") or {}
    rows = [
        ("device", f"{env.get('device', '?')} ({env.get('backend', '?')}, {env.get('num_devices', '?')} device(s))"),
        ("JAX / jaxlib / CUDA", f"{env.get('jax_version')} / {env.get('jaxlib_version')} / {env.get('cuda') or 'n/a'}"),
        ("torch / transformers / Python", f"{env.get('torch_version')} / {env.get('transformers_version')} / "
                                          f"{env.get('python')}"),
        ("commit", git_commit()),
    ]
    if dry_run:
        rows.append(("dry run", "tiny sizes on this machine: measured figures null, floors of programs compiled here"))
    figures: dict = {}
    for name in STAGES:
        s = stages.get(name)
        rows.append((f"stage {name}", "not run" if s is None else f"{s['status']} ({s['seconds']} s of {s['limit_s']} s)"))

    tests = _load(out, "pytest")
    if tests:
        c = tests["counts"]
        rows.append(("pytest -m gpu", f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
                                      f"{c['skipped']} skipped{'' if tests['finished'] else ' (cut short)'}"))
        for t in tests["tests"]:
            if t["outcome"] in ("failed", "error"):
                rows.append((f"  {t['outcome']}", t["name"]))
            props = t["properties"]
            if "step_temp_bytes" in props and "pool_bytes" in props:
                temp, pool = int(props["step_temp_bytes"]), int(props["pool_bytes"])
                figures["step_temp_bytes"], figures["pool_bytes"] = temp, pool
                rows.append(("compiled largest step scratch vs KV pool",
                             f"{temp / 2**20:.1f} MiB vs {pool / 2**30:.2f} GiB ({temp / pool:.1%})"))

    steps = _load(out, "steps")
    if steps:
        figures["decode_steps"] = [{k: r.get(k) for k in ("model", "bucket", "context", "measured_ms", "floor_ms",
                                                           "ratio")} for r in steps["rows"]]
        for model, m in steps["models"].items():
            rows.append((f"{model} decode buckets", f"{m['decode_buckets']} (max_num_seqs {m['max_num_seqs']}, "
                                                     f"backend {m['attention_backend']}, {m['num_pages']} pages)"))
        for r in steps["rows"]:
            ratio = "null" if r["ratio"] is None else f"{r['ratio']:.2f}x"
            rows.append((f"{r['model']} bucket {r['bucket']} ctx {r['context']}",
                         f"measured {_ms(r['measured_ms'])}, floor {_ms(r['floor_ms'])}, measured/floor {ratio}"))

    kernels = _load(out, "kernels")
    if kernels:
        copy_bw = kernels["limits"]["copy_bytes_per_s"]
        figures["copy_gb_per_s"] = None if dry_run else copy_bw / 1e9
        rows.append(("measured copy bandwidth (read + write)", "null" if dry_run else f"{copy_bw / 1e9:.0f} GB/s"))
        k1 = [r for r in kernels["rows"] if r["workload"] == "K1"]
        figures["k1"] = []
        for r in (r for r in k1 if r["impl"] == "ours decode_attention"):
            same = [p for p in k1 if (p["batch"], p["context"], p["num_heads"], p["page_size"])
                    == (r["batch"], r["context"], r["num_heads"], r["page_size"])]
            fractions = {p["impl"]: None if dry_run else p["fraction_of_copy_bw"] for p in same}
            failed = [p["impl"] for p in same if p.get("error")]
            figures["k1"].append(dict(batch=r["batch"], context=r["context"], heads=f"{r['num_heads']}/{r['num_kv_heads']}",
                                      page_size=r["page_size"], fraction_of_copy_bw=fractions))
            text = ", ".join(f"{impl} {'FAILED' if impl in failed else 'null' if f is None else format(f, '.0%')}"
                             for impl, f in fractions.items())
            rows.append((f"K1 B={r['batch']} ctx={r['context']} {r['num_heads']}/{r['num_kv_heads']} of copy bw", text))

    w1 = _load(out, "w1")
    if w1:
        systems = {"jaxpaged": w1.get("jaxpaged"), "dense baseline": w1.get("dense"),
                   "transformers continuous batching": w1.get("hf_continuous_batching")}
        tok_s = {name: (None if s is None or dry_run else s["output_tok_s"]) for name, s in systems.items()}
        figures["w1_output_tok_s"] = tok_s
        ours = tok_s["jaxpaged"]
        for name, value in tok_s.items():
            ran = systems[name] is not None
            text = ("not run" if not ran else "null" if value is None else
                    f"{value:.0f}" + ("" if name == "jaxpaged" or not ours else f" (jaxpaged {ours / value:.2f}x)"))
            rows.append((f"W1 output tok/s, {name}", text))
    return rows, figures


def print_table(rows: list[tuple[str, str]], log: Log) -> None:
    width = max(len(k) for k, _ in rows)
    lines = ["", "=" * (width + 60), "gpu_check summary", "=" * (width + 60)]
    lines += [f"{key:<{width}}  {value}" for key, value in rows]
    log.write("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="directory for the JSON files and the log "
                                                           "(default benchmarks/results/gpu/)")
    parser.add_argument("--dry-run", action="store_true", help="any machine, tiny sizes: checks the script itself")
    parser.add_argument("--skip", default="", help=f"comma-separated stages to leave out, of {','.join(STAGES[1:])}")
    parser.add_argument("--probe-env", default=None, help=argparse.SUPPRESS)  # the env stage's child process
    args = parser.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(STAGES[1:]):
        parser.error(f"--skip {sorted(args.skip - set(STAGES[1:]))}: stages that can be skipped are {', '.join(STAGES[1:])}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe_env:
        probe_environment(args.probe_env)
        return 0
    os.makedirs(args.out, exist_ok=True)
    log = Log(os.path.join(args.out, FILES["log"]))
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "scripts"), *filter(None, [env.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",  # nothing is fetched: random weights, no tokenizer
        TQDM_DISABLE="1",
        # One persistent compilation cache for every stage: a program compiled once is read back after.
        JAX_COMPILATION_CACHE_DIR=env.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
            env.get("TMPDIR", "/tmp"), "jaxpaged_gpu_check_xla"),
    )
    started = time.perf_counter()
    stages = {"env": run_stage("env", args.out, args.dry_run, log, env)}
    probed = _load(args.out, "env") or {}
    log.write(f"device {probed.get('device')} | backend {probed.get('backend')} | JAX {probed.get('jax_version')} "
              f"(jaxlib {probed.get('jaxlib_version')}) | CUDA {probed.get('cuda') or 'n/a'} | "
              f"Python {probed.get('python')}\n")
    if probed.get("backend") != "gpu" and not args.dry_run:
        sys.stderr.write(f"gpu_check needs a CUDA GPU, but JAX's backend here is {probed.get('backend')!r}: run it on "
                         "a GPU machine with jax[cuda], or pass --dry-run to check the script itself.\n")
        return 2
    # A stage that ends early leaves its unused seconds to the next: the total stays the bound.
    spare = max(0.0, stages["env"]["limit_s"] - stages["env"]["seconds"])
    for name in STAGES[1:]:
        if name in args.skip:
            stages[name] = dict(stage=name, status="skipped", seconds=0.0, limit_s=STAGE_LIMITS_S[name], json=None)
            continue
        stages[name] = run_stage(name, args.out, args.dry_run, log, env, spare)
        spare = max(0.0, stages[name]["limit_s"] - stages[name]["seconds"])

    rows, figures = summarize(args.out, stages, args.dry_run)
    total_s = round(time.perf_counter() - started, 1)
    rows.append(("total wall time", f"{total_s} s"))
    summary = dict(environment=probed, commit=git_commit(), dry_run=args.dry_run,
                   date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   stages=stages, stage_limits_s=STAGE_LIMITS_S, figures=figures, table=rows, total_s=total_s)
    with open(os.path.join(args.out, FILES["summary"]), "w") as f:
        json.dump(summary, f, indent=1)
    print_table(rows, log)
    failed = [n for n, s in stages.items() if s["status"] not in ("ok", "skipped")]
    if failed:
        log.write(f"stages that did not pass: {', '.join(failed)} (see {FILES['log']})\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
