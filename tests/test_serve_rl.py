"""vLLM's RL endpoints on the server (VLLM_SERVER_DEV_MODE=1): /pause in each mode, /resume,
/is_paused, /abort_requests, /update_weight_version, /weight_info, and the weight version in responses.
A tiny checkpoint served on 127.0.0.1, driven by the openai client (completions, streamed on a thread,
as a rollout worker streams) and httpx for the control endpoints."""

import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient
from tiny_checkpoint import write_tiny_checkpoint

from jaxpaged import LLM
from serve_fixtures import running_server

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
PROMPT = "The weights of a policy"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = LLM(write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny"))), max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, page_size=4, num_pages=96, warmup=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_SERVER_DEV_MODE", "1")  # read when the app is built
        with running_server(llm.engine, served_model_name=MODEL) as (base, bridge):
            yield dict(llm=llm, base=base, bridge=bridge)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="none", max_retries=0, timeout=120)


def post(served, path, **kwargs):
    response = httpx.post(served["base"] + path, timeout=120, **kwargs)
    return response.status_code, response.json()


def get(served, path):
    return httpx.get(served["base"] + path, timeout=60).json()


class Stream:
    """A streamed completion on a thread: the time of each chunk and the final finish reason."""

    def __init__(self, client, max_tokens):
        self.times, self.texts, self.finish_reason, self.error = [], [], None, None
        self.thread = threading.Thread(target=self._run, args=(client, max_tokens))
        self.thread.start()

    def _run(self, client, max_tokens):
        try:
            for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True,
                                                   temperature=0.0, extra_body={"ignore_eos": True}):
                self.times.append(time.monotonic())
                for choice in chunk.choices:
                    self.texts.append(choice.text)
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except Exception as err:  # surfaced by the test
            self.error = err

    def wait_for_chunks(self, n, timeout=120):
        deadline = time.monotonic() + timeout
        while len(self.times) < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), (self.error, len(self.times))
            time.sleep(0.01)


def test_keep_freezes_then_resumes_and_versions_label_responses(served, client):
    stream = Stream(client, max_tokens=40)
    stream.wait_for_chunks(2)
    assert post(served, "/pause", params={"mode": "keep"}) == (200, {"status": "paused"})
    assert get(served, "/is_paused") == {"is_paused": True}
    frozen = len(stream.times)
    time.sleep(0.6)
    assert len(stream.times) <= frozen + 1  # at most a chunk already on its way; nothing is stepped
    assert served["llm"].engine.num_unfinished_requests == 1  # kept, not aborted
    assert post(served, "/update_weight_version", json={"new_version": "v2"}) == (
        200, {"success": True, "new_version": "v2"})
    assert get(served, "/weight_info") == {"weight_version": "v2"}
    assert post(served, "/resume") == (200, {"status": "resumed"})
    stream.thread.join(120)
    assert stream.error is None and stream.finish_reason == "length"
    assert get(served, "/is_paused") == {"is_paused": False}
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0)
    assert done.model_extra["weight_version"] == "v2"


def test_abort_ends_streams_and_holds_new_requests_until_resume(served, client):
    stream = Stream(client, max_tokens=60)
    stream.wait_for_chunks(2)
    assert post(served, "/pause", params={"mode": "abort"})[0] == 200
    stream.thread.join(60)
    assert stream.error is None and stream.finish_reason == "abort"
    assert served["llm"].engine.num_unfinished_requests == 0
    later = Stream(client, max_tokens=3)  # while paused: held, not added
    time.sleep(0.6)
    assert later.times == [] and later.thread.is_alive() and len(served["bridge"].held) == 1
    post(served, "/resume")
    later.thread.join(60)
    assert later.error is None and later.finish_reason == "length"


def test_wait_finishes_requests_first(served, client):
    stream = Stream(client, max_tokens=20)
    stream.wait_for_chunks(2)
    assert post(served, "/pause", params={"mode": "wait"})[0] == 200
    stream.thread.join(60)
    assert stream.finish_reason == "length" and get(served, "/is_paused") == {"is_paused": True}
    post(served, "/resume")


def test_abort_requests_without_pausing(served, client):
    stream = Stream(client, max_tokens=60)
    stream.wait_for_chunks(2)
    status, body = post(served, "/abort_requests", json={})
    assert status == 200 and body == {"status": "aborted", "aborted": 1}
    stream.thread.join(60)
    assert stream.finish_reason == "abort" and get(served, "/is_paused") == {"is_paused": False}
    status, body = post(served, "/abort_requests", json={"request_ids": ["cmpl-1"]})
    assert status == 400 and "request_ids" in body["error"]["message"]
    status, body = post(served, "/pause", params={"mode": "later"})
    assert status == 400 and "mode" in body["error"]["message"]


def test_endpoints_need_dev_mode(served, monkeypatch):
    from jaxpaged.entrypoints.serve.app import build_app

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    app = build_app(served["bridge"], None, served_model_name=MODEL)
    with TestClient(app) as test_client:
        assert test_client.get("/is_paused").status_code == 404
        assert test_client.post("/pause").status_code == 404
