"""What `python -m jaxpaged.generate` prints (issue 18 items 9, 10).

In-process on a tiny random model (with SmolLM2's tokenizer) where output formatting is the
point, so no real model loads; a subprocess where the user's view of a failure is the point.
"""

import json
import logging
import os
import re
import subprocess
import sys

import pytest

import jaxpaged.entrypoints.llm
from jaxpaged import SamplingParams
from jaxpaged.entrypoints.cli import main
from test_llm_inputs import tiny_llm


@pytest.fixture(scope="module")
def tiny():
    return tiny_llm()


@pytest.fixture
def cli(tiny, monkeypatch):
    """main(argv) with `LLM(...)` giving the tiny model; logging restored afterwards."""
    monkeypatch.setattr(jaxpaged.entrypoints.llm, "LLM", lambda *args, **kwargs: tiny)
    root, ours = logging.getLogger(), logging.getLogger("jaxpaged")
    saved = root.level, root.handlers[:], ours.level, ours.handlers[:], ours.propagate
    # Like a fresh process: pytest's own handlers on the root would make basicConfig a no-op.
    root.handlers = []
    yield main
    root.setLevel(saved[0])
    root.handlers = saved[1]
    ours.setLevel(saved[2])
    ours.handlers = saved[3]
    ours.propagate = saved[4]


def test_verbose_turns_on_jaxpaged_debug_only(cli, capsys):
    assert cli(["--verbose", "--no-chat", "--prompt", "Hello there", "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert logging.getLogger("jaxpaged.engine").isEnabledFor(logging.DEBUG)
    for name in ("absl", "orbax", "jax._src.cache_key", "jax._src.compiler", "jax._src.dispatch"):
        assert not logging.getLogger(name).isEnabledFor(logging.DEBUG), f"{name} logs DEBUG under --verbose"
    assert re.search(r"step 1: .*\(seq_id, new_tokens, pages\)=\[\(\d+, \d+, \d+\)\]", err), err
    page_lines = [line for line in err.splitlines() if "pages:" in line and "used" in line]
    assert page_lines and all(re.search(r"pages: \d+/\d+ used \(\d+%\), \d+ free", line) for line in page_lines)
    assert all(len(line) < 120 for line in page_lines)


def test_logprobs_are_printed_without_json(cli, tiny, capsys):
    assert cli(["--no-chat", "--prompt", "Hello there", "--max-tokens", "4", "--ignore-eos", "--logprobs"]) == 0
    out = capsys.readouterr().out
    want = tiny.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                      logprobs=True))[0].outputs[0]
    want = [entry[t].logprob for entry, t in zip(want.logprobs, want.token_ids)]
    assert f"logprobs (sum {sum(want):.3f} over 4 tokens): " + " ".join(f"{x:.3f}" for x in want) in out


@pytest.mark.parametrize("extra", [["--prompt", "Tell me more"], ["--n", "2", "--temperature", "1", "--seed", "3"]],
                         ids=["two-prompts", "n=2"])
def test_stream_of_several_completions_prints_each_whole(cli, tiny, capsys, extra):
    argv = ["--no-chat", "--stream", "--prompt", "Hello there", "--max-tokens", "6", "--ignore-eos", *extra]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    n = 2 if "--n" in extra else 1
    params = SamplingParams(temperature=1.0 if n > 1 else 0.0, seed=3 if n > 1 else None, max_tokens=6,
                            ignore_eos=True, n=n)
    prompts = ["Hello there"] + (["Tell me more"] if n == 1 else [])
    for prompt, result in zip(prompts, tiny.generate(prompts, params)):
        for c in result.outputs:
            tag = f"[{c.index}] " if n > 1 else ""
            assert f">>> {prompt}\n{tag}{c.text}\n" in out
    assert len(out.splitlines()) < 6 * len(prompts) * n  # not one line per token


def test_single_stream_prints_the_header_then_tokens_as_they_go(cli, tiny, capsys):
    """The `>>>` header the other outputs show (missing at b8feddf: issue 30 item 4), then the text."""
    assert cli(["--no-chat", "--stream", "--prompt", "Hello there", "--max-tokens", "5", "--ignore-eos"]) == 0
    text = tiny.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].text
    assert capsys.readouterr().out == f">>> Hello there\n{text}\n"


def test_missing_model_is_one_error_line(capsys):
    assert main(["--model", "/nonexistent", "--prompt", "hi"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "/nonexistent" in err and "\n" not in err


def test_missing_prompts_file_is_reported_before_the_model_loads(capsys):
    # The model does not exist either: reading the prompts first means the file is what we hear about.
    assert main(["--model", "/nonexistent", "--prompts-file", "/no/such/prompts.txt"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "/no/such/prompts.txt" in err and "\n" not in err


def test_unreachable_hub_id_is_one_error_line_in_a_subprocess():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # as unreachable as a machine without network, but fast
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.generate", "--model", "no-such-org/no-such-model", "--prompt", "hi"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode != 0
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "no-such-org/no-such-model" in proc.stderr and "Traceback" not in proc.stderr


def test_beam_width_prints_every_beam_best_first(cli, tiny, capsys):
    from jaxpaged.engine.beam_search import BeamSearchParams

    args = ["--no-chat", "--prompt", "Hello there", "--max-tokens", "5", "--beam-width", "3", "--length-penalty", "0.5"]
    want = tiny.beam_search("Hello there", BeamSearchParams(3, max_tokens=5, length_penalty=0.5))[0].beams
    assert cli(args + ["--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [r["beam"] for r in records] == [0, 1, 2]
    assert [r["token_ids"] for r in records] == [b.token_ids for b in want]
    assert [r["score"] for r in records] == [b.score for b in want]
    assert records[0]["score"] >= records[1]["score"] >= records[2]["score"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(">>> Hello there\n[beam 0] (logprob ") and out.count("[beam ") == 3
    assert tiny.stats()["num_used_pages"] == 0


def test_beam_width_too_large_is_one_error_line(cli, capsys):
    assert cli(["--no-chat", "--prompt", "Hi", "--beam-width", "9"]) == 2  # the tiny engine: max_num_seqs 4
    err = capsys.readouterr().err
    assert err.startswith("error: beam_width=9 needs 9 sequences") and "raise max_num_seqs" in err
