"""scripts/gpu_check.sh on a machine without a GPU: it stops at once unless asked for a dry run, the
dry run writes its JSON and table, and the summary quotes what the closing note needs (step scratch
vs pool, K1 as a fraction of copy bandwidth, W1 against the dense baseline)."""

import importlib.util
import json
import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")


def _load_driver():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script sets its own
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300)


def test_without_a_gpu_it_stops_at_once_and_says_why(tmp_path):
    result = _run("--out", str(tmp_path))
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and "--dry-run" in result.stderr
    assert "JAX 0." in result.stdout  # the versions are printed first
    assert not list(tmp_path.iterdir())  # nothing written


def test_dry_run_writes_every_stage_and_a_summary(tmp_path):
    result = _run("--dry-run", "--skip", "kernels", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "gpu_check summary" in result.stdout
    (summary_path,) = tmp_path.glob("gpu_check-*-dry-run.json")
    summary = json.loads(summary_path.read_text())
    env = summary["environment"]
    assert env["backend"] == "cpu" and env["jax_version"] and len(env["commit"]) in (40, 7)
    pytest_stage = summary["stages"]["pytest"]
    assert pytest_stage["status"] == "ok"
    counts = json.loads(open(pytest_stage["json"]).read())["counts"]
    assert counts["skipped"] >= 5 and counts["passed"] == counts["failed"] == counts["error"] == 0
    assert summary["stages"]["throughput"]["status"].startswith("skipped")
    assert "kernels" not in summary["stages"]


def test_summary_quotes_scratch_k1_fraction_and_w1_ratio(tmp_path):
    gpu_check = _load_driver()
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_donation" time="3.0">'
        '<properties><property name="step_temp_bytes" value="104857600"/>'
        '<property name="pool_bytes" value="4294967296"/></properties></testcase>'
        '<testcase classname="tests.test_gpu" name="test_parity" time="9.0"><failure message="x"/></testcase>'
        "</testsuite></testsuites>")
    tests = gpu_check.junit_to_json(str(junit))
    assert tests["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    k1 = dict(workload="K1", batch=64, context=4096, num_heads=32, num_kv_heads=8, page_size=16)
    kernels = dict(limits=dict(copy_bytes_per_s=3.0e12, matmul_flop_per_s=7.9e14), rows=[
        dict(k1, impl="ours decode_attention", gb_per_s=2100.0, fraction_of_copy_bw=0.7),
        dict(k1, impl="dense jax.nn.dot_product_attention", gb_per_s=900.0, fraction_of_copy_bw=0.3),
        dict(workload="K2", impl="ours paged_attention (ragged)", batch_name="prefill 1x2048", page_size=16,
             tflop_per_s=300.0, fraction_of_matmul_rate=0.38),
    ])
    w1 = [dict(system="jaxpaged", output_tok_s=12000.0, num_compiles_timed=0),
          dict(system="dense-baseline", output_tok_s=4000.0, num_compiles_timed=0)]
    paths = {}
    for name, content in (("pytest", tests), ("kernels", kernels), ("throughput", {"results": {"W1": w1}})):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(content))
    env = dict(device="NVIDIA H100 80GB HBM3", backend="gpu", num_devices=1, jax_version="0.10.2",
               jaxlib_version="0.10.2", cuda={"cuda_runtime": 12080}, commit="abc")
    stages = {name: dict(status="ok", seconds=1.0, json=str(path)) for name, path in paths.items()}
    rows, figures = gpu_check.summarize(env, stages)
    table = dict(rows)
    assert table["compiled largest step scratch vs KV pool"] == "100.0 MiB vs 4.00 GiB (2.4%)"
    assert table["K1 decode B=64 ctx=4096 32/8 ps=16"] == "2100 GB/s = 70% of copy bw (dense 30%)"
    assert table["W1 output tok/s, jaxpaged vs dense baseline"] == "12000 vs 4000 (3.00x)"
    assert figures["w1"]["ratio"] == pytest.approx(3.0) and figures["copy_gb_per_s"] == pytest.approx(3000)


@pytest.mark.slow
def test_full_dry_run_with_the_kernel_benchmark(tmp_path):
    result = _run("--dry-run", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (summary_path,) = tmp_path.glob("gpu_check-*-dry-run.json")
    summary = json.loads(summary_path.read_text())
    assert summary["stages"]["kernels"]["status"] == "ok"
    assert summary["figures"]["k1"] and summary["figures"]["copy_gb_per_s"] > 0
