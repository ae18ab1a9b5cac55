"""The engine bridge's admission control, over a stand-in engine that never finishes (no model).

Capacity is max_num_seqs + max_waiting_requests = 1 + 1: the third request in flight gets HTTP 503 with
an OpenAI error body, and an abort gives its slot back once the engine thread has processed it.
"""

import asyncio
import threading
import time
import types

import pytest
from starlette.testclient import TestClient

from jaxpaged.planner.request import SamplingParams
from jaxpaged.entrypoints.serve.bridge import EngineBridge, ServerOverloaded
from jaxpaged.entrypoints.serve.metrics import ServerMetrics
from jaxpaged.entrypoints.serve.app import build_app


class NeverFinishingEngine:
    """The public engine API the bridge uses; requests stay in flight until aborted."""

    def __init__(self):
        self.config = types.SimpleNamespace(max_num_seqs=1, max_model_len=64)
        self.tokenizer = None
        self.generation_defaults = {}  # no generation_config: the protocol's defaults
        self.requests: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    def add_request(self, prompt_token_ids, params, *, prompt=None, request_id=None, cache_salt=None):
        if max(prompt_token_ids) >= 100:
            raise ValueError("token id outside the vocabulary [0, 100)")
        self.requests[request_id] = prompt_token_ids
        return request_id

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.01)
        return []


def _wait(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_full_queue_answers_503_and_an_abort_frees_a_slot():
    engine = NeverFinishingEngine()
    bridge = EngineBridge(engine, max_waiting_requests=1)
    app = build_app(bridge, ServerMetrics(page_size=16, bytes_per_page=1), served_model_name="m")
    bridge.start()
    try:
        async def fill():
            streams = [bridge.submit([1, 2, 3], SamplingParams(max_tokens=4)) for _ in range(2)]
            for stream in streams:
                await stream.accepted()
            with pytest.raises(ServerOverloaded, match="retry later"):
                bridge.submit([1], SamplingParams())
            return streams

        streams = asyncio.run(fill())
        assert bridge.num_in_flight == 2 and len(engine.requests) == 2

        with TestClient(app) as http:
            resp = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert resp.status_code == 503
            assert resp.json()["error"]["type"] == "server_overloaded" and resp.json()["error"]["code"] == 503
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

            # A client that goes away frees its slot; a prompt the engine refuses gets 400 and holds none.
            streams[0].close()  # the client of request 0 went away
            _wait(lambda: bridge.num_in_flight == 1)
            assert engine.aborted == [streams[0].request_id]
            resp = http.post("/v1/completions", json={"prompt": [1, 500], "max_tokens": 2})
            assert resp.status_code == 400 and "vocabulary" in resp.json()["error"]["message"]
            assert bridge.num_in_flight == 1  # the refused request gave its slot back
    finally:
        bridge.shutdown()


def test_cli_defaults_serve_the_bundled_model_locally_and_take_the_engine_flags():
    from jaxpaged.entrypoints.cli import engine_args
    from jaxpaged.entrypoints.serve.cli import build_parser, served_name

    args = build_parser().parse_args([])
    assert (args.model, args.host, args.port, args.api_key) == (None, "127.0.0.1", 8000, None)
    assert served_name(args.model) == "SmolLM2-135M-Instruct"
    args = build_parser().parse_args(["--model", "/models/tiny.gguf", "--max-num-seqs", "4", "--no-prefix-caching",
                                      "--page-size", "32"])
    assert served_name(args.model) == "tiny"
    kwargs = engine_args(args)
    assert kwargs["max_num_seqs"] == 4 and kwargs["page_size"] == 32 and kwargs["enable_prefix_caching"] is False


def test_a_drain_ends_the_requests_a_pause_held_back():
    # /pause holds new requests unadded; a SIGTERM drain that then runs out of time must end them
    # too (finish_reason "abort", their slot given back), or their clients would wait forever.
    engine = NeverFinishingEngine()
    bridge = EngineBridge(engine, max_waiting_requests=1)
    bridge.start()

    async def scenario():
        await asyncio.to_thread(lambda: bridge.run_on_engine(lambda b: setattr(b, "paused", True)).result(5))
        stream = bridge.submit([1, 2, 3], SamplingParams(max_tokens=4))
        await asyncio.to_thread(_wait, lambda: len(bridge.held) == 1)
        aborted = await asyncio.to_thread(bridge.drain, time.monotonic(), threading.Event())
        await asyncio.wait_for(stream.accepted(), 5)
        return aborted, await asyncio.wait_for(stream.__anext__(), 5)

    try:
        aborted, output = asyncio.run(scenario())
    finally:
        bridge.shutdown()
    assert aborted == 1 and [c.finish_reason for c in output.outputs] == ["abort"]
    assert bridge.held == [] and bridge.num_in_flight == 0 and engine.requests == {}
