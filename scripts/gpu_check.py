"""The driver behind `scripts/gpu_check.sh`: environment, `pytest -m gpu`, K1/K2, W1, one summary.

Each stage runs as its own process (a crash or a time-out in one does not stop the others; each
gets the whole GPU memory to itself), its output goes to the console and to `<out>/gpu_check-*.log`,
and its results to JSON under `--out`. The summary, `<out>/gpu_check-<date>.json`, names the device,
the JAX version and the commit, and quotes:

  * the compiled step's scratch memory against the KV pool (from the gpu test that measures it);
  * K1: our decode kernel's bandwidth as a fraction of the measured device copy bandwidth;
  * W1: jaxpaged's output tok/s against the dense-cache baseline's.

Exit status: 0 when every stage that ran passed, 1 otherwise, 2 when there is no GPU (without
`--dry-run`).
"""

import argparse
import datetime
import glob
import json
import os
import platform
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results")
STAGES = ("pytest", "kernels", "throughput")
# Wall-clock limit per stage in seconds: 8.5 minutes in all, under the 9 minutes an H100 run must take
# (not yet measured on one: the first GPU session should adjust them to what it sees).
STAGE_LIMITS_S = {"pytest": 200, "kernels": 80, "throughput": 230}


# ---------------------------------------------------------------------------------------------
# Environment


def cuda_versions() -> dict:
    """CUDA runtime/driver/cuDNN versions as jaxlib reports them, else nvidia-smi's driver line."""
    versions = {}
    try:
        from jax._src.lib import cuda_versions as cuda  # None on a CPU-only jaxlib
    except ImportError:
        cuda = None
    if cuda is not None:
        for name in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version"):
            try:
                versions[name.removesuffix("_get_version")] = getattr(cuda, name)()
            except Exception:  # noqa: BLE001 - a missing or failing probe is reported as absent
                pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            versions["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return versions


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return dict(
        device=device.device_kind,
        backend=jax.default_backend(),
        num_devices=jax.device_count(),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        cuda=cuda_versions(),
        python=platform.python_version(),
        commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


# ---------------------------------------------------------------------------------------------
# Stages


def run_logged(cmd: list[str], log_path: str, limit_s: float) -> tuple[int | None, float]:
    """Runs `cmd` in the repository, teeing its output to the console and `log_path`.

    Returns (exit code, or None if it ran past `limit_s` and was killed; wall seconds).
    """
    start = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(limit_s, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            returncode = proc.wait()
        finally:
            timer.cancel()
    seconds = time.perf_counter() - start
    timed_out = returncode < 0 and seconds >= limit_s
    return (None if timed_out else returncode), seconds


def junit_to_json(xml_path: str) -> dict:
    """pytest's junit XML -> {counts, tests: [{name, outcome, seconds, properties}]}."""
    tests = []
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append(dict(name=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
                          seconds=float(case.get("time", 0.0)), properties=properties))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return dict(counts=counts, tests=tests)


def newest(pattern: str, since: float) -> str | None:
    paths = [p for p in glob.glob(pattern) if os.path.getmtime(p) >= since]
    return max(paths, key=os.path.getmtime) if paths else None


def stage_pytest(out: str, log: str, stamp: str) -> dict:
    xml_path = os.path.join(out, f"pytest_gpu-{stamp}.xml")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-rs", "-p", "no:cacheprovider",
           "-o", "junit_family=xunit1", f"--junitxml={xml_path}"]
    returncode, seconds = run_logged(cmd, log, STAGE_LIMITS_S["pytest"])
    result = dict(stage="pytest", returncode=returncode, seconds=round(seconds, 1))
    if os.path.exists(xml_path):
        result.update(junit_to_json(xml_path))
        os.remove(xml_path)
    # Exit code 5 = no test collected, i.e. every test deselected: a broken marker, not a pass.
    result["status"] = "timeout" if returncode is None else "ok" if returncode == 0 else "failed"
    path = os.path.join(out, f"pytest_gpu-{stamp}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    result["json"] = path
    return result


def stage_kernels(out: str, log: str, dry_run: bool) -> dict:
    start = time.time()
    cmd = [sys.executable, "benchmarks/bench_kernels.py", "--dry-run" if dry_run else "--quick", "--out", out]
    returncode, seconds = run_logged(cmd, log, STAGE_LIMITS_S["kernels"])
    path = newest(os.path.join(out, "kernels-*.json"), start)
    status = "timeout" if returncode is None else "ok" if returncode == 0 and path else "failed"
    return dict(stage="kernels", status=status, returncode=returncode, seconds=round(seconds, 1), json=path)


def stage_throughput(out: str, log: str) -> dict:
    start = time.time()
    cmd = [sys.executable, "-m", "benchmarks.bench_throughput", "--preset", "h100", "--workloads", "w1", "--out", out]
    returncode, seconds = run_logged(cmd, log, STAGE_LIMITS_S["throughput"])
    path = newest(os.path.join(out, "throughput_h100.json"), start)
    status = "timeout" if returncode is None else "ok" if returncode == 0 and path else "failed"
    return dict(stage="throughput", status=status, returncode=returncode, seconds=round(seconds, 1), json=path)


# ---------------------------------------------------------------------------------------------
# Summary


def _load(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


_PEER_LABELS = {
    "ours paged_attention (ragged)": "our ragged kernel",
    "jax ops.gpu.paged_attention": "JAX's ops.gpu.paged_attention",
    "dense jax.nn.dot_product_attention": "dense",
}


def summarize(env: dict, stages: dict[str, dict]) -> tuple[list[tuple[str, str]], dict]:
    """The summary table's rows and the figures behind them, from each stage's JSON."""
    rows = [
        ("device", f"{env['device']} ({env['backend']}, {env['num_devices']} device(s))"),
        ("JAX / jaxlib / CUDA", f"{env['jax_version']} / {env['jaxlib_version']} / {env['cuda'] or 'n/a'}"),
        ("commit", env["commit"]),
    ]
    figures: dict = {}
    for name in STAGES:
        stage = stages.get(name)
        rows.append((f"stage {name}", "not run" if stage is None else f"{stage['status']} ({stage.get('seconds', 0)} s)"))

    tests = _load(stages.get("pytest", {}).get("json"))
    if tests and "counts" in tests:
        c = tests["counts"]
        rows.append(("pytest -m gpu", f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"))
        for test in tests["tests"]:
            props = test["properties"]
            if "step_temp_bytes" in props and "pool_bytes" in props:
                temp, pool = int(props["step_temp_bytes"]), int(props["pool_bytes"])
                figures["step_temp_bytes"], figures["pool_bytes"] = temp, pool
                rows.append(("compiled largest step scratch vs KV pool",
                             f"{temp / 2**20:.1f} MiB vs {pool / 2**30:.2f} GiB ({temp / pool:.1%})"))

    kernels = _load(stages.get("kernels", {}).get("json"))
    if kernels:
        copy_bw = kernels["limits"]["copy_bytes_per_s"]
        figures["copy_gb_per_s"] = copy_bw / 1e9
        rows.append(("measured copy bandwidth (read + write)", f"{copy_bw / 1e9:.0f} GB/s"))
        k1 = [r for r in kernels["rows"] if r["workload"] == "K1"]
        ours = [r for r in k1 if r["impl"] == "ours decode_attention"]
        figures["k1"] = [dict(batch=r["batch"], context=r["context"], heads=f"{r['num_heads']}/{r['num_kv_heads']}",
                              page_size=r["page_size"], fraction_of_copy_bw=r["fraction_of_copy_bw"]) for r in ours]
        for r in sorted(ours, key=lambda r: (r["batch"], r["context"])):
            peers = {p["impl"]: p for p in k1 if (p["batch"], p["context"], p["num_heads"], p["page_size"])
                     == (r["batch"], r["context"], r["num_heads"], r["page_size"])}
            others = ", ".join(f"{_PEER_LABELS.get(name, name)} {p['fraction_of_copy_bw']:.0%}"
                               for name, p in peers.items() if p is not r)
            rows.append((f"K1 decode B={r['batch']} ctx={r['context']} {r['num_heads']}/{r['num_kv_heads']} ps={r['page_size']}",
                         f"{r['gb_per_s']:.0f} GB/s = {r['fraction_of_copy_bw']:.0%} of copy bw ({others})"))
        for r in (r for r in kernels["rows"] if r["workload"] == "K2" and r["impl"].startswith("ours")):
            rows.append((f"K2 ragged {r['batch_name']} ps={r['page_size']}",
                         f"{r['tflop_per_s']:.1f} TFLOP/s = {r['fraction_of_matmul_rate']:.0%} of bf16 matmul"))

    throughput = _load(stages.get("throughput", {}).get("json"))
    if throughput:
        runs = {r["system"]: r for r in throughput["results"].get("W1", [])}
        paged, dense = runs.get("jaxpaged"), runs.get("dense-baseline")
        if paged and dense:
            ratio = paged["output_tok_s"] / dense["output_tok_s"]
            figures["w1"] = dict(jaxpaged_output_tok_s=paged["output_tok_s"], dense_output_tok_s=dense["output_tok_s"],
                                 ratio=ratio, compiles_timed=[paged["num_compiles_timed"], dense["num_compiles_timed"]])
            rows.append(("W1 output tok/s, jaxpaged vs dense baseline",
                         f"{paged['output_tok_s']:.0f} vs {dense['output_tok_s']:.0f} ({ratio:.2f}x)"))
            rows.append(("W1 compilations while timed (jaxpaged, dense)",
                         f"{paged['num_compiles_timed']}, {dense['num_compiles_timed']}"))
    return rows, figures


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print("\n" + "=" * (width + 50))
    print("gpu_check summary")
    print("=" * (width + 50))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="directory for every JSON (default benchmarks/results/)")
    parser.add_argument("--dry-run", action="store_true",
                        help="any machine: gpu tests skip, kernels interpreted at tiny sizes, no throughput run")
    parser.add_argument("--skip", default="", help=f"comma-separated stages to leave out, of {','.join(STAGES)}")
    args = parser.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(STAGES):
        parser.error(f"--skip {sorted(args.skip - set(STAGES))}: stages are {', '.join(STAGES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = environment()
    print(f"device {env['device']} | backend {env['backend']} | JAX {env['jax_version']} (jaxlib "
          f"{env['jaxlib_version']}) | CUDA {env['cuda'] or 'n/a'} | Python {env['python']} | commit {env['commit']}")
    if env["backend"] != "gpu" and not args.dry_run:
        print(f"gpu_check needs a CUDA GPU, but JAX's backend here is {env['backend']!r}: install jax[cuda12] on a "
              "GPU machine, or pass --dry-run to check the script itself.", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    log = os.path.join(args.out, f"gpu_check-{stamp}.log")
    started = time.perf_counter()

    stages: dict[str, dict] = {}
    if "pytest" not in args.skip:
        stages["pytest"] = stage_pytest(args.out, log, stamp)
    if "kernels" not in args.skip:
        stages["kernels"] = stage_kernels(args.out, log, args.dry_run)
    if "throughput" not in args.skip:
        stages["throughput"] = (dict(stage="throughput", status="skipped (dry run: needs a GPU)", seconds=0)
                                if args.dry_run else stage_throughput(args.out, log))

    rows, figures = summarize(env, stages)
    total_s = round(time.perf_counter() - started, 1)
    rows.append(("total wall time", f"{total_s} s"))
    print_table(rows)
    summary = dict(environment=env, dry_run=args.dry_run, stages=stages, figures=figures, table=rows, total_s=total_s)
    path = os.path.join(args.out, f"gpu_check-{stamp}{'-dry-run' if args.dry_run else ''}.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {path}")
    failed = [name for name, s in stages.items() if s["status"] not in ("ok",) and not s["status"].startswith("skipped")]
    if failed:
        print(f"stages that did not pass: {', '.join(failed)} (see {log})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
