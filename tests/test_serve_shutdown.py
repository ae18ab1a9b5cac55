"""Graceful shutdown (vLLM's --shutdown-timeout, jaxpaged/entrypoints/serve/shutdown.py).

A real `python -m jaxpaged.serve` subprocess on 127.0.0.1 over a tiny random checkpoint gets SIGTERM
with streams in flight (the openai client): they finish whole, new requests get 503 with
Retry-After, /health says draining, and the process exits 0. In-process: streams still running at
the deadline end with finish_reason "abort" and free their pages; a second signal ends the drain.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_fixtures import free_port
from tiny_checkpoint import write_tiny_checkpoint

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
ENGINE_FLAGS = ["--page-size", "8", "--num-pages", "96", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--max-model-len", "256"]


def _num_files(directory) -> int:
    return sum(len(files) for _, _, files in os.walk(directory))


def _wait_healthy(base: str, proc: subprocess.Popen | None, timeout_s: float) -> list:
    """Polls /health until 200; returns what it answered before: (status, JSON body, Retry-After)."""
    deadline, before = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            health = httpx.get(f"{base}/health", timeout=1)
            if health.status_code == 200:
                return before
            before.append((health.status_code, health.json(), health.headers.get("Retry-After")))
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server was not healthy within {timeout_s} s")


def _read_stream(client, max_tokens: int, first: threading.Event, result: dict) -> None:
    try:
        chunks = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=max_tokens,
                                           temperature=0.0, stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        text, finish = "", None
        for chunk in chunks:
            first.set()
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            result["last_chunk_at"] = time.monotonic()
            if chunk.usage is not None:
                result["num_tokens"] = chunk.usage.completion_tokens
        result.update(text=text, finish=finish)
    except Exception as err:  # noqa: BLE001 - reported by the test
        result.update(error=repr(err))
    finally:
        first.set()


def test_sigterm_drains_streams_in_flight_refuses_new_requests_and_exits_0(tmp_path):
    model = write_tiny_checkpoint(str(tmp_path / "tiny"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # An empty compilation cache of its own: the server writes every program it compiles there (the
    # persistent cache keeps each one, runner.enable_compilation_cache), so files that appear after
    # /health said ready are programs that serving compiled.
    cache = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.serve", "--model", model, "--served-model-name", MODEL, "--port", str(port),
         "--shutdown-timeout", "60", "--log-level", "warning", *ENGINE_FLAGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)),
        env={**env, "JAX_COMPILATION_CACHE_DIR": str(cache)})
    try:
        starting = _wait_healthy(base, proc, timeout_s=300)
        # Readiness: listening before the engine is built and warm, and saying so.
        assert starting and all(h == (503, {"status": "starting"}, "5") for h in starting), starting
        compiled_when_ready = _num_files(cache)
        assert compiled_when_ready > 0
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        max_tokens = 230
        results = [{} for _ in range(4)]
        firsts = [threading.Event() for _ in results]
        threads = [threading.Thread(target=_read_stream, args=(client, max_tokens, e, r))
                   for e, r in zip(firsts, results)]
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in firsts)  # every stream has its first chunk: in flight
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)  # the handler runs between two bytecodes of the server's main thread

        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = httpx.post(f"{base}/v1/completions", timeout=10, json={"model": MODEL, "prompt": "hi"})
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == 503 and refused.json()["error"]["type"] == "server_draining"

        for t in threads:
            t.join(180)
        for r in results:  # finished whole, not cut: the drain waited for them
            assert "error" not in r, r
            assert r["finish"] == "length" and r["num_tokens"] == max_tokens, r
        # Ready meant compiled: the streams (prefill, decode, every batch size on the way) compiled nothing.
        assert _num_files(cache) == compiled_when_ready, "the server compiled programs after /health said ready"
        assert max(r["last_chunk_at"] for r in results) > signalled  # they were still streaming
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


@pytest.fixture
def drained_server():
    """An in-process DrainingServer (shutdown_timeout 1 s) over a tiny engine that takes >= 20 ms a step, in a thread."""
    from jaxpaged.entrypoints.serve import build_server
    from jaxpaged.entrypoints.serve.shutdown import Drain, DrainingServer
    from test_llm_inputs import tiny_llm

    engine = tiny_llm(max_model_len=256, num_pages=128).engine
    step = engine.step

    def slow_step():  # >= 20 ms a step: 200 tokens outlast the 1 s drain on any machine, idle or loaded
        time.sleep(0.02)
        return step()

    engine.step = slow_step
    drain = Drain(1.0)
    app, bridge = build_server(engine, served_model_name=MODEL, drain=drain)
    bridge.start()
    port = free_port()
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"), drain=drain,
                            bridge=bridge)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(base, None, timeout_s=30)
    try:
        yield base, server, thread, engine
    finally:
        server.should_exit = True
        thread.join(10)
        bridge.shutdown()


def test_streams_running_at_the_deadline_end_with_abort_and_free_their_pages(drained_server):
    base, server, thread, engine = drained_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    results = [{} for _ in range(2)]
    firsts = [threading.Event() for _ in results]
    threads = [threading.Thread(target=_read_stream, args=(client, 200, e, r)) for e, r in zip(firsts, results)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in firsts)
    started = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)  # as the signal handler calls it
    for t in threads:
        t.join(60)
    for r in results:
        assert "error" not in r and r["finish"] == "abort", r
        assert r["num_tokens"] < 200  # what it had when the deadline came
    thread.join(30)
    assert not thread.is_alive() and server.num_aborted == 2
    assert time.monotonic() - started < 30
    assert engine.stats()["num_used_pages"] == 0 and not engine.has_unfinished_requests()


def test_a_second_signal_ends_the_drain_at_once(drained_server):
    base, server, thread, engine = drained_server
    server.drain.timeout_s = 600.0  # the first signal alone would wait ten minutes
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    result, first = {}, threading.Event()
    reader = threading.Thread(target=_read_stream, args=(client, 200, first, result))
    reader.start()
    assert first.wait(60)
    server.handle_exit(signal.SIGTERM, None)
    time.sleep(0.3)
    assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200  # metrics stay readable while draining
    server.handle_exit(signal.SIGINT, None)
    reader.join(60)
    thread.join(30)
    assert result.get("finish") == "abort", result
    assert not thread.is_alive() and engine.stats()["num_used_pages"] == 0


def test_a_model_that_cannot_load_stops_the_starting_server_with_status_2(tmp_path):
    """The server listens while the engine is built; an engine that cannot be built ends it, exit 2."""
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.serve", "--model", str(tmp_path / "nothing-here"),
                           "--port", str(port), "--log-level", "warning"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: " in proc.stderr, proc.stderr[-2000:]


def test_the_startup_gate_answers_503_until_opened():
    from fastapi.testclient import TestClient

    from jaxpaged.entrypoints.serve.startup import StartupGate

    gate = StartupGate()
    with TestClient(gate) as http:
        for path in ("/health", "/ping"):
            r = http.get(path)
            assert (r.status_code, r.json(), r.headers["Retry-After"]) == (503, {"status": "starting"}, "5")
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503 and r.headers["Retry-After"] == "5"

        async def ready(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        gate.open(ready)
        assert http.get("/health").status_code == 200 and http.post("/v1/completions").text == "ok"


def test_shutdown_timeout_must_not_be_negative():
    from jaxpaged.entrypoints.serve.cli import main
    from jaxpaged.entrypoints.serve.shutdown import Drain

    with pytest.raises(ValueError, match="shutdown_timeout"):
        Drain(-1.0)
    with pytest.raises(SystemExit, match="--shutdown-timeout"):
        main(["--shutdown-timeout", "-2"])
