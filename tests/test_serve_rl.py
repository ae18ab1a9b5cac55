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
    step = llm.engine.step

    def slow_step():  # >= 30 ms a step on any machine: a 40-token stream lasts >= 1.2 s, so each test's
        time.sleep(0.03)  # /pause or /abort_requests reaches it mid-stream however fast the engine is
        return step()

    llm.engine.step = slow_step
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
    status, body = post(served, "/abort_requests", json={"request_ids": 7})
    assert status == 400 and "request_ids" in str(body)
    status, body = post(served, "/pause", params={"mode": "later"})
    assert status == 400 and "mode" in body["error"]["message"]


class Chosen:
    """A stream named by the client (vLLM's id: the X-Request-Id header or the body's request_id):
    a completion, or a chat completion when `chat`. Records its tokens and finish reason."""

    def __init__(self, client, prompt, max_tokens, *, request_id=None, header_id=None, chat=False):
        self.num_tokens, self.finish_reason, self.error, self.id = 0, None, None, None
        kwargs = dict(model=MODEL, max_tokens=max_tokens, stream=True, temperature=0.0,
                      extra_body={"ignore_eos": True, **({"request_id": request_id} if request_id else {})},
                      extra_headers={"X-Request-Id": header_id} if header_id else None)
        # Tokens counted by their logprobs entries: a chunk goes out for every token when they are asked for
        create = ((lambda: client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                          logprobs=True, **kwargs))
                  if chat else (lambda: client.completions.create(prompt=prompt, logprobs=0, **kwargs)))
        self.thread = threading.Thread(target=self._run, args=(create, chat))
        self.thread.start()

    def _run(self, create, chat):
        try:
            for chunk in create():
                self.id = chunk.id
                for choice in chunk.choices:
                    if choice.logprobs is not None:
                        self.num_tokens += len(choice.logprobs.content if chat else choice.logprobs.tokens)
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except Exception as err:  # surfaced by the test
            self.error = err

    def wait_for_tokens(self, n, timeout=120):
        deadline = time.monotonic() + timeout
        while self.num_tokens < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), (self.error, self.num_tokens)
            time.sleep(0.01)


def test_abort_requests_ends_the_chosen_streams_and_frees_their_pages_while_another_streams(served, client):
    bridge = served["bridge"]
    engine = served["llm"].engine  # its step takes >= 30 ms: 80 tokens last >= 2.4 s, all three are mid-stream
    # Prompts differ in their first page, so no page is shared through the prefix cache.
    first = Chosen(client, "alpha one", 80, request_id="first")  # vLLM's external id: cmpl-first-0
    second = Chosen(client, "bravo two", 80, header_id="second", chat=True)  # chatcmpl-second (the header)
    third = Chosen(client, "charlie three", 80, request_id="third")
    for stream in (first, second, third):
        stream.wait_for_tokens(2)

    def pages():  # on the engine thread, between two steps: used pages, and each running request's own
        return bridge.run_on_engine(lambda b: (b.engine.stats()["num_used_pages"],
                                               [len(set(seq.block_table)) for seq in b.engine.scheduler.running])
                                    ).result(60)

    used, own = pages()
    assert len(own) == 3 and used == sum(own)
    status, body = post(served, "/abort_requests", json={"request_ids": ["cmpl-first-0", "chatcmpl-second",
                                                                         "cmpl-nobody"]})
    assert status == 200 and body == {"status": "aborted", "aborted": 3}  # vLLM counts the ids sent
    used, own = pages()
    assert len(own) == 1 and used == own[0]  # the two aborted requests' pages are free
    first.thread.join(60)
    second.thread.join(60)
    assert (first.error, first.finish_reason, first.id) == (None, "abort", "cmpl-first")
    assert (second.error, second.finish_reason, second.id) == (None, "abort", "chatcmpl-second")
    assert first.num_tokens < 80 and second.num_tokens < 80
    at_abort = third.num_tokens
    third.thread.join(120)
    assert third.error is None and third.finish_reason == "length" and third.num_tokens == 80 > at_abort
    assert engine.num_unfinished_requests == 0 and get(served, "/is_paused") == {"is_paused": False}


def test_abort_requests_by_response_id_ends_every_prompt_of_a_completion(served, client):
    chunks, done = [], threading.Event()

    def run():
        for chunk in client.completions.create(model=MODEL, prompt=["delta four", "echo five"], max_tokens=80,
                                               stream=True, temperature=0.0,
                                               extra_body={"ignore_eos": True, "request_id": "pair"}):
            chunks.append(chunk)
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while not chunks:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    assert post(served, "/abort_requests", json={"request_ids": "cmpl-pair"}) == (
        200, {"status": "aborted", "aborted": 1})
    thread.join(60)
    assert done.is_set()
    reasons = {choice.index: choice.finish_reason for chunk in chunks for choice in chunk.choices
               if choice.finish_reason}
    assert reasons == {0: "abort", 1: "abort"} and served["llm"].engine.num_unfinished_requests == 0


def test_endpoints_need_dev_mode(served, monkeypatch):
    from jaxpaged.entrypoints.serve.app import build_app

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    app = build_app(served["bridge"], None, served_model_name=MODEL)
    with TestClient(app) as test_client:
        assert test_client.get("/is_paused").status_code == 404
        assert test_client.post("/pause").status_code == 404
