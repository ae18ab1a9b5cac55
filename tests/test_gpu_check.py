"""scripts/gpu_check.sh, the one command prepared for a lent GPU, checked here without one.

Without a GPU it stops at once and says why. `--dry-run` runs every stage at tiny sizes: its JSON has
one row per (decode bucket the engine compiles, context) with `measured_ms` null and a `floor_ms`
read from the program compiled here, W1's three systems ran, at most 8 files are written, and the
summary table comes last. A stage cut by its limit is reported as such and keeps what it wrote; the
summary quotes what the GPU figures will be (measured/floor, K1 against JAX's kernel, W1's ratios).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script sets its own
    env["PYTHON"] = sys.executable
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_without_a_gpu_it_stops_at_once_and_says_why(tmp_path):
    result = _run("--out", str(tmp_path))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "needs a CUDA GPU" in result.stderr and "--dry-run" in result.stderr
    assert "JAX 0." in result.stdout  # the versions are printed first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.json", "gpu_check.log"]  # no stage ran


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    result = _run("--dry-run", "--out", str(out))
    return out, result


def test_dry_run_passes_every_stage_and_prints_the_summary_last(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tail = result.stdout.rstrip().splitlines()
    assert "gpu_check summary" in tail[-60:] or any("gpu_check summary" in line for line in tail[-60:])
    assert tail[-1].startswith("total wall time")
    files = sorted(p.name for p in out.iterdir())
    assert files == ["decode_steps.json", "env.json", "gpu_check.json", "gpu_check.log", "kernels.json",
                     "pytest.json", "w1.json"]  # at most 8 files come back from the device machine
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["dry_run"] and summary["environment"]["backend"] == "cpu"
    assert {name: s["status"] for name, s in summary["stages"].items()} == dict.fromkeys(
        ("env", "pytest", "steps", "kernels", "w1"), "ok")
    assert sum(summary["stage_limits_s"].values()) <= 540  # 9 minutes on the device machine
    stages = [summary["stages"][name] for name in ("env", "pytest", "steps", "kernels", "w1")]
    assert all(s["seconds"] <= s["limit_s"] for s in stages)
    for before, after in zip(stages, stages[1:]):  # what a stage leaves unused goes to the next
        spare = before["limit_s"] - before["seconds"]
        assert after["limit_s"] == pytest.approx(summary["stage_limits_s"][after["stage"]] + spare, abs=0.2)
    tests = json.loads((out / "pytest.json").read_text())  # the gpu tests, all skipped on a CPU
    assert tests["finished"] and tests["counts"]["skipped"] >= 5
    assert tests["counts"]["passed"] == tests["counts"]["failed"] == tests["counts"]["error"] == 0


def test_dry_run_rows_cover_every_decode_bucket_and_context(dry_run):
    out, _ = dry_run
    steps = json.loads((out / "decode_steps.json").read_text())
    assert steps["status"] == "done" and steps["dry_run"]
    qwen, llama = steps["models"]["tiny-qwen3-like"], steps["models"]["tiny-llama-like"]
    assert qwen["decode_buckets"] == qwen["measured_buckets"] == [1, 2, 4]  # every bucket the engine compiles
    assert llama["measured_buckets"] == [1, 4]  # the buckets the engine picks for batch 1 and 3 (1, 64 on the GPU)
    rows = {(r["model"], r["bucket"], r["context"]): r for r in steps["rows"]}
    assert set(rows) == {("tiny-qwen3-like", b, c) for b in (1, 2, 4) for c in (16, 32, 64)} | {
        ("tiny-llama-like", b, c) for b in (1, 4) for c in (16, 64)}
    assert [rows[("tiny-llama-like", b, 64)]["num_seqs"] for b in (1, 4)] == [1, 3]  # live rows; the rest padding
    for row in rows.values():
        assert row["measured_ms"] is None and row["ratio"] is None  # no GPU here
        assert row["floor_ms"] > 0 and row["hbm_bytes"] > 0 and "dry run" in row["floor_label"]
        assert row["launch_floor_ms"] == pytest.approx(row["floor_ms"] + row["launches"] * 2e-3)  # 2 us a launch
    for b in (1, 2, 4):  # one program per bucket: the same launches at every context, nothing lowered again
        short, long = rows[("tiny-qwen3-like", b, 16)], rows[("tiny-qwen3-like", b, 64)]
        assert long["launches"] == short["launches"] and long["hbm_bytes"] >= short["hbm_bytes"]
        assert rows[("tiny-qwen3-like", b, 32)]["lowerings"] == long["lowerings"] == 0
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [r["measured_ms"] for r in summary["figures"]["decode_steps"]] == [None] * len(rows)


def test_dry_run_w1_ran_all_three_systems_and_k1_its_peers(dry_run):
    out, _ = dry_run
    w1 = json.loads((out / "w1.json").read_text())
    assert w1["jaxpaged"]["num_output_tokens"] == w1["dense"]["num_output_tokens"] == \
        w1["hf_continuous_batching"]["output_tokens"] > 0  # the same requests, every token generated
    assert w1["weights"]["seed"] == 0
    kernels = json.loads((out / "kernels.json").read_text())
    impls = {r["impl"] for r in kernels["rows"]}
    assert {"ours decode_attention", "dense jax.nn.dot_product_attention"} <= impls
    figures = json.loads((out / "gpu_check.json").read_text())["figures"]
    assert figures["w1_output_tok_s"] == dict.fromkeys(
        ("jaxpaged", "dense baseline", "transformers continuous batching"))  # null: measured on a GPU only
    assert figures["copy_gb_per_s"] is None


def test_a_stage_cut_by_its_limit_keeps_what_it_wrote(tmp_path, monkeypatch):
    gpu_check = _load("gpu_check", "scripts/gpu_check.py")
    partial = tmp_path / gpu_check.FILES["steps"]
    writer = f"import json, time; json.dump({{'rows': [1]}}, open({str(partial)!r}, 'w')); time.sleep(60)"
    monkeypatch.setattr(gpu_check, "stage_commands", lambda name, out, dry_run: [[sys.executable, "-c", writer]])
    monkeypatch.setitem(gpu_check.STAGE_LIMITS_S, "steps", 4)
    log = gpu_check.Log(str(tmp_path / "log"))
    stage = gpu_check.run_stage("steps", str(tmp_path), False, log, dict(os.environ))
    assert stage["status"] == "timeout" and stage["returncodes"] == [None] and 4 <= stage["seconds"] < 30
    assert json.loads(partial.read_text()) == {"rows": [1]} and stage["json"] == partial.name
    assert "killed at its limit of 4 s" in (tmp_path / "log").read_text()


def test_the_commit_comes_from_the_environment_where_git_cannot_tell(monkeypatch):
    gpu_check = _load("gpu_check", "scripts/gpu_check.py")
    monkeypatch.setenv("JAXPAGED_COMMIT", "f" * 40)
    monkeypatch.setattr(gpu_check, "REPO", "/")  # no repository there: the tree travelled without .git
    assert gpu_check.git_commit() == "f" * 40


def test_summary_quotes_measured_over_floor_k1_fractions_and_w1_ratios(tmp_path, monkeypatch):
    gpu_check = _load("gpu_check", "scripts/gpu_check.py")
    write = lambda name, record: (tmp_path / gpu_check.FILES[name]).write_text(json.dumps(record))  # noqa: E731
    write("env", dict(device="NVIDIA H200", backend="gpu", num_devices=1, jax_version="0.11.2",
                      jaxlib_version="0.11.2", cuda={"cuda_runtime": 13000}, python="3.12.3"))
    write("pytest", dict(finished=False, counts=dict(passed=3, failed=1, error=0, skipped=0), tests=[
        dict(name="tests/test_gpu.py::test_donation", outcome="passed", properties=dict(
            step_temp_bytes=104857600, pool_bytes=4294967296)),
        dict(name="tests/test_gpu.py::test_parity", outcome="failed", properties={})]))
    write("steps", dict(models={"qwen3-0.6b": dict(decode_buckets=[2, 4], max_num_seqs=4, attention_backend="pallas",
                                                   num_pages=100)},
                        rows=[dict(model="qwen3-0.6b", bucket=4, context=1024, measured_ms=1.5, floor_ms=0.5, ratio=3.0)]))
    k1 = dict(workload="K1", batch=64, context=4096, num_heads=16, num_kv_heads=8, page_size=16)
    write("kernels", dict(limits=dict(copy_bytes_per_s=4.3e12), rows=[
        dict(k1, impl="ours decode_attention", fraction_of_copy_bw=0.7),
        dict(k1, impl="jax ops.gpu.paged_attention", fraction_of_copy_bw=0.35),
        dict(k1, impl="mosaic decode_attention", fraction_of_copy_bw=None, error="ValueError: no lowering")]))
    write("w1", dict(jaxpaged=dict(output_tok_s=12000.0), dense=dict(output_tok_s=4000.0),
                     hf_continuous_batching=dict(output_tok_s=6000.0)))
    stages = {n: dict(status="ok", seconds=1.0, limit_s=gpu_check.STAGE_LIMITS_S[n]) for n in gpu_check.STAGES}
    monkeypatch.setattr(gpu_check, "git_commit", lambda: "abc")
    rows, figures = gpu_check.summarize(str(tmp_path), stages, dry_run=False)
    table = dict(rows)
    assert table["pytest -m gpu"] == "3 passed, 1 failed, 0 errors, 0 skipped (cut short)"
    assert table["  failed"] == "tests/test_gpu.py::test_parity"
    assert table["compiled largest step scratch vs KV pool"] == "100.0 MiB vs 4.00 GiB (2.4%)"
    assert table["qwen3-0.6b bucket 4 ctx 1024"] == "measured 1.5 ms, floor 0.5 ms, measured/floor 3.00x"
    assert table["K1 B=64 ctx=4096 16/8 of copy bw"] == (
        "ours decode_attention 70%, jax ops.gpu.paged_attention 35%, mosaic decode_attention FAILED")
    assert table["measured copy bandwidth (read + write)"] == "4300 GB/s"
    assert table["W1 output tok/s, jaxpaged"] == "12000"
    assert table["W1 output tok/s, dense baseline"] == "4000 (jaxpaged 3.00x)"
    assert table["W1 output tok/s, transformers continuous batching"] == "6000 (jaxpaged 2.00x)"
    assert figures["w1_output_tok_s"]["jaxpaged"] == 12000.0 and figures["copy_gb_per_s"] == pytest.approx(4300)


def test_progress_plugin_writes_outcomes_as_tests_finish(tmp_path):
    (tmp_path / "test_story.py").write_text(
        "import pytest\n"
        "def test_ok(record_property):\n    record_property('pool_bytes', 7)\n"
        "def test_bad():\n    assert 1 == 2\n"
        "@pytest.mark.skip(reason='no GPU')\ndef test_skipped():\n    pass\n")
    progress = tmp_path / "progress.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "scripts"))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_progress",
                    "--progress-json", str(progress), "-o", "addopts=", str(tmp_path / "test_story.py")],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    record = json.loads(progress.read_text())
    assert record["finished"] and record["exitstatus"] == 1
    assert record["counts"] == dict(passed=1, failed=1, error=0, skipped=1)
    by_name = {t["name"].split("::")[-1]: t for t in record["tests"]}
    assert by_name["test_ok"]["properties"] == {"pool_bytes": 7}
    assert "assert 1 == 2" in by_name["test_bad"]["message"]


def test_the_wheel_list_is_what_the_fetch_script_reads():
    lines = [line.strip() for line in open(os.path.join(REPO, "scripts", "gpu_wheels.txt"))
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines and all("==" in line for line in lines)  # exact versions: the machine has no registry
    assert "beartype" in {line.split("==")[0] for line in lines}  # pyproject's pytest addopts need it
    header = open(SCRIPT).read()
    assert ('run(command="JAXPAGED_COMMIT=<git rev-parse HEAD> bash scripts/gpu_check.sh --out $OUT", '
            'carry=[".whl"], timeout_s=600)') in header
