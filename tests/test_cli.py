"""`python -m jaxpaged.generate` as a user runs it: a subprocess, JSON lines out."""

import json
import subprocess
import sys

import pytest


def _run(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "jaxpaged.generate", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_answers_paris_as_json(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a large river in Africa."}) + "\n")
    proc = _run(
        "--prompt", "What is the capital of France?", "--prompts-file", str(prompts), "--max-tokens", "20",
        "--json", "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["prompt"] for r in records] == ["What is the capital of France?", "Name a large river in Africa."]
    assert "Paris" in records[0]["text"]
    assert all(0 < len(r["token_ids"]) <= 20 and r["finish_reason"] in ("stop", "length") for r in records)
    assert "tok/s" in proc.stderr  # the summary line


def test_cli_bad_argument_exits_with_message():
    proc = _run("--prompt", "hi", "--top-p", "0", "--max-model-len", "256", timeout=300)
    assert proc.returncode == 2
    assert "top_p" in proc.stderr


@pytest.mark.slow
def test_cli_demo_runs_with_no_arguments():
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
