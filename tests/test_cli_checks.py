"""`python -m jaxpaged.generate` refuses what it can before loading the model (issue 30 item 2), and
what `--stream --json` prints (item 4; the single-prompt header is in test_cli_output.py).

At b8feddf `--beam-width 0` failed after 22 s, `--stream --beam-width 2` after 25 s and `--num-pages 3`
after 44 s: each only once the model was loaded and compiled. Here the loader is replaced by one that
fails the test, so a check that still ran after loading would show up as that failure.
"""

import json
import subprocess
import sys
import time

import pytest

import jaxpaged.entrypoints.llm
from jaxpaged import SamplingParams
from jaxpaged.entrypoints.cli import main
from test_cli_output import cli, tiny  # noqa: F401 (fixtures)


def _never_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the flags were checked")


@pytest.fixture
def no_load(monkeypatch):
    monkeypatch.setattr(jaxpaged.entrypoints.llm, "LLM", _never_load)


@pytest.mark.parametrize("argv, message", [
    (["--beam-width", "0"], "beam_width=0 must be >= 1"),
    (["--stream", "--beam-width", "2"], "--stream does not apply to beam search"),
    (["--beam-width", "2", "--temperature", "0.7"], "--temperature does not apply to beam search"),
    (["--length-penalty", "0.5"], "--length-penalty applies only to beam search"),
    (["--num-pages", "3"], "the pool holds only 2 pages"),  # the chat prompt + 64 tokens need 7 pages of 16
    (["--num-pages", "1"], "num_pages=1 must be >= 2"),
    (["--max-tokens", "8", "--max-model-len", "20"], "max_model_len=20 leaves no room"),  # a 31-token chat prompt
    (["--max-model-len", "100000"], "exceeds the model's context of 8192"),
    (["--beam-width", "17"], "max_num_seqs=16"),  # the CPU default
    (["--preemption-mode", "recompute", "--swap-space", "1"], "used only with preemption_mode='swap'"),
    (["--no-chat", "--system", "Be brief."], "--system is a chat message"),
    (["--process-id", "1"], "need --coordinator-address"),
    (["--top-p", "0"], "top_p"),
    (["--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_bad_flags_are_one_error_line_before_loading(no_load, capsys, argv, message):
    assert main(["--prompt", "What is the capital of France?", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert "model=None" not in err  # a CLI user has no model=None to pass


def test_bad_flags_exit_in_seconds_in_a_subprocess():
    """As a user sees it: the whole run, interpreter start and jax import included, takes a few
    seconds (loading and compiling SmolLM2 took 22-44 s at b8feddf on this machine)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.generate", "--prompt", "hi", "--num-pages", "3",
                           "--max-tokens", "64"], capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "the pool holds only 2 pages" in proc.stderr
    assert "load + compile" not in proc.stderr and elapsed < 20, elapsed  # the loader never ran


# ------------------------------------------------------------------ item 4: --stream

# `tiny` and `cli` (main over the tiny model, logging restored): test_cli_output.py


def test_stream_json_prints_json_lines_as_they_come(cli, tiny, capsys):
    argv = ["--no-chat", "--stream", "--json", "--prompt", "Hello there", "--prompt", "Tell me more",
            "--max-tokens", "4", "--ignore-eos"]
    assert cli(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = tiny.generate(["Hello there", "Tell me more"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for prompt, out in zip(["Hello there", "Tell me more"], want):
        deltas = [r for r in records if r["prompt"] == prompt and "delta_token_ids" in r]
        finals = [r for r in records if r["prompt"] == prompt and "finish_reason" in r]
        assert len(deltas) >= 2  # tokens as they came, not one object at the end
        assert sum((r["delta_token_ids"] for r in deltas), []) == out.outputs[0].token_ids
        assert "".join(r["delta_text"] for r in deltas) == out.outputs[0].text
        assert len(finals) == 1 and finals[0]["token_ids"] == out.outputs[0].token_ids
        assert finals[0]["finish_reason"] == "length"
        assert records.index(finals[0]) > max(records.index(r) for r in deltas)  # last, once
