"""data_parallel_size=2 through every entry point a user has, on forced host devices.

The story: a tiny random Llama checkpoint on disk is served by one engine and by two replicas. The
replicas must give the same greedy tokens through `LLM.generate`, `LLM.stream`, `LLM.beam_search`
and `LLM.stats`; the CLI (`python -m jaxpaged.generate --data-parallel-size 2`) and the server
(`python -m jaxpaged.serve --data-parallel-size 2`, driven by the openai client) run as a user runs
them, in their own processes on 4 forced host devices. At b8feddf every one of these crashed
(`'DataParallelEngine' object has no attribute 'processor'`).
"""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from jaxpaged import LLM, BeamSearchParams, SamplingParams
from jaxpaged.engine.data_parallel import DataParallelEngine
from jaxpaged.engine.protocol import EngineClient
from tiny_checkpoint import write_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
              warmup=False)  # the CLI and the server below warm up, as users run them
FLAGS = ["--max-model-len", "96", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--page-size", "8"]
PROMPTS = ["hello there", "abc", "the quick brown fox", "x", "12345678", "dp"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")))


BEAMS = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)


def _beams(results):
    return [[(b.token_ids, round(b.score, 5)) for b in r.beams] for r in results]


@pytest.fixture(scope="module")
def one_engine(checkpoint):
    """What one engine gives: greedy tokens of PROMPTS, their texts, beams of the first three."""
    llm = LLM(checkpoint, **ENGINE)
    outs = llm.generate(PROMPTS, GREEDY)
    return {"tokens": [o.outputs[0].token_ids for o in outs], "texts": [o.outputs[0].text for o in outs],
            "beams": _beams(llm.beam_search(PROMPTS[:3], BEAMS))}


@pytest.fixture(scope="module")
def expected(one_engine):
    return one_engine["tokens"]


def _env4():
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")


def test_llm_generate_stream_beam_search_and_stats_on_two_replicas(checkpoint, expected, one_engine):
    llm = LLM(checkpoint, data_parallel_size=2, tensor_parallel_size=2, **ENGINE)
    assert isinstance(llm.engine, DataParallelEngine) and isinstance(llm.engine, EngineClient)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected

    streamed: dict[str, list[int]] = {}
    for out in llm.stream(PROMPTS, GREEDY):
        streamed.setdefault(out.prompt, []).extend(out.outputs[0].delta_token_ids)
    assert [streamed[p] for p in PROMPTS] == expected

    assert _beams(llm.beam_search(PROMPTS[:3], BEAMS)) == one_engine["beams"]  # each search on one replica

    stats = llm.stats()
    assert stats["num_requests"] == 0 and stats["num_used_pages"] == 0
    assert len(stats["replicas"]) == 2 and all(r["num_generated_tokens"] > 0 for r in stats["replicas"])
    assert stats["num_generated_tokens"] == sum(r["num_generated_tokens"] for r in stats["replicas"])
    assert llm.params is llm.engine.engines[0].params


def test_cli_with_two_replicas(checkpoint, expected):
    args = [sys.executable, "-m", "jaxpaged.generate", "--model", checkpoint, "--no-chat", "--json",
            "--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--data-parallel-size", "2", *FLAGS]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    proc = subprocess.run(args, cwd=ROOT, env=_env4(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["token_ids"] for r in records] == expected


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_with_two_replicas(checkpoint, one_engine):
    openai = pytest.importorskip("openai")
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.serve", "--model", checkpoint, "--port", str(port), "--log-level", "warning",
         "--data-parallel-size", "2", *FLAGS],
        cwd=ROOT, env=_env4(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.communicate()[1][-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        for prompt, want in zip(PROMPTS[:3], one_engine["texts"]):
            resp = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert resp.choices[0].finish_reason == "length" and resp.choices[0].text == want
        chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason is not None
        metrics = httpx.get(f"{base}/metrics").text
        assert "jaxpaged_kv_pages_total" in metrics and "jaxpaged_requests_running 0.0" in metrics
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_batch_invariant_replicas_give_the_same_bits(checkpoint):
    """batch_invariant=True: one seeded request gives the same tokens and logprobs bit for bit on
    either replica, beside other requests or alone (the replicas are two CPU devices of one process)."""
    llm = LLM(checkpoint, data_parallel_size=2, batch_invariant=True, logprobs_mode="processed_logprobs", **ENGINE)
    assert isinstance(llm.engine, DataParallelEngine)
    sampled = SamplingParams(temperature=0.7, max_tokens=8, seed=11, logprobs=0, ignore_eos=True)

    def chosen(output):
        sample = output.outputs[0]
        return sample.token_ids, [entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)]

    # Least-loaded routing: the first copy goes to replica 0, the second to replica 1.
    both = llm.generate([PROMPTS[2], PROMPTS[2]] + PROMPTS[3:5], sampled)
    alone = llm.generate([PROMPTS[2]], sampled)[0]
    assert chosen(both[0]) == chosen(both[1]) == chosen(alone)
