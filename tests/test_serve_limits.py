"""Bounds on what one request may cost (issue 53 item 3): the per-request deadline
(`--request-timeout`) aborts a request and frees its pages; tiny random model, a real server on
127.0.0.1 in a thread."""

import threading
import time

import httpx
import pytest

from serve_fixtures import running_server
from test_llm_inputs import tiny_llm

openai = pytest.importorskip("openai")
MODEL = "tiny"


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm(max_model_len=256, num_pages=128)
    from jaxpaged import SamplingParams  # compile the steps a lone request takes before the clock matters
    llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=230, ignore_eos=True))
    engine = llm.engine
    step = engine.step

    def slow_step():  # >= 10 ms a step: 230 tokens outlast the 1 s deadline on any machine, idle or loaded
        time.sleep(0.01)
        return step()

    engine.step = slow_step
    with running_server(engine, served_model_name=MODEL, request_timeout_s=1.0) as (base, bridge):
        yield base, bridge, engine


def test_a_request_past_its_deadline_is_aborted_and_frees_its_pages(served):
    base, bridge, engine = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = bridge.num_timed_out
    started = time.monotonic()
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=230, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    elapsed = time.monotonic() - started
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["abort"] and chunks[-1].usage.completion_tokens < 230
    assert elapsed < 30 and bridge.num_timed_out == before + 1
    whole = client.completions.create(model=MODEL, prompt="Hi", max_tokens=230, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "abort"  # a whole response is cut at its deadline too
    # A short request finishes normally; nothing is held afterwards.
    short = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0.0)
    assert short.choices[0].finish_reason in ("length", "stop")
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats()["num_used_pages"] == 0 and bridge.num_in_flight == 0


def _abort_counts(base: str) -> tuple[float, float, float]:
    """(request_success_total{finished_reason="abort"}, e2e latency count, TTFT count) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {"abort": 0.0, "e2e": 0.0, "ttft": 0.0}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total" and sample.labels.get("finished_reason") == "abort":
                found["abort"] += sample.value
            elif sample.name == "vllm:e2e_request_latency_seconds_count":
                found["e2e"] += sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_count":
                found["ttft"] += sample.value
    return found["abort"], found["e2e"], found["ttft"]


def test_deadline_and_disconnect_aborts_count_in_the_latency_histograms(served):
    """As vLLM declares request_success{finished_reason="abort"}: a request the server ends (deadline,
    client gone) is one finished request in the counters and the e2e histogram, and in TTFT when it had
    its first token."""
    base, bridge, engine = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    aborts, e2e, ttft = _abort_counts(base)
    cut = client.completions.create(model=MODEL, prompt="Hi", max_tokens=230, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "abort"  # at its 1 s deadline
    assert _abort_counts(base) == (aborts + 1, e2e + 1, ttft + 1)
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hi", "max_tokens": 230, "temperature": 0.0, "stream": True,
            "ignore_eos": True}) as response:
        next(line for line in response.iter_lines() if line.startswith("data: "))  # a first token, then leave
    deadline = time.monotonic() + 10
    while bridge.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _abort_counts(base) == (aborts + 2, e2e + 2, ttft + 2)


def test_request_timeout_must_not_be_negative():
    from jaxpaged.entrypoints.serve.bridge import EngineBridge

    with pytest.raises(ValueError, match="request_timeout"):
        EngineBridge(tiny_llm().engine, request_timeout_s=-1.0)


@pytest.fixture(scope="module")
def limited():
    from jaxpaged.entrypoints.serve.limits import RequestLimits

    engine = tiny_llm(max_model_len=256, num_pages=128).engine
    limits = RequestLimits(max_stop_strings=2, max_stop_string_length=8, max_structured_spec_bytes=200,
                           max_chat_template_kwargs_bytes=50)
    with running_server(engine, {"h11_max_incomplete_event_size": 8192}, served_model_name=MODEL, limits=limits,
                        max_header_count=16, max_header_bytes=8192) as (base, bridge):
        yield base, bridge, engine


BIG_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(20)}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path, body, param, flag", [
    ("/v1/completions", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop", "--max-stop-strings"),
    ("/v1/completions", {"prompt": "a", "stop": "a stop string far too long"}, "stop", "--max-stop-string-length"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"json": BIG_SCHEMA}}, "structured_outputs",
     "--max-structured-spec-bytes"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": BIG_SCHEMA}}},
     "response_format", "--max-structured-spec-bytes"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}]},
     "tools", "--max-structured-spec-bytes"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"x": "y" * 100}}, "chat_template_kwargs",
     "--max-chat-template-kwargs-bytes"),
])
def test_a_request_past_a_limit_is_a_400_before_any_work(limited, path, body, param, flag):
    base, bridge, engine = limited
    steps = engine.stats()["num_steps"]
    r = httpx.post(base + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and flag in error["message"] and error["code"] == 400
    assert bridge.num_in_flight == 0 and engine.stats()["num_steps"] == steps  # the engine never saw it
    # Within the limits the same kind of request is served.
    ok = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stop": ["x", "y"]},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_stop_string_of_exactly_the_limit_is_served_and_one_character_more_is_refused(limited):
    """--max-stop-string-length 8 here: 8 characters pass, 9 are a 400 naming `stop` (the other tests
    sent 26 against 8, so an off-by-one passed)."""
    base, _, _ = limited
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    ok = httpx.post(base + "/v1/completions", json={**body, "stop": ["x" * 8, "y"]}, timeout=60)
    assert ok.status_code == 200, ok.text
    refused = httpx.post(base + "/v1/completions", json={**body, "stop": "x" * 9}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop", refused.text
    assert "--max-stop-string-length" in refused.json()["error"]["message"]


def test_n_up_to_max_num_seqs_is_served_and_one_more_is_refused(limited):
    """n fans out to n sequences of one step: at most max_num_seqs (4 here), a 400 naming `n` past it."""
    base, _, engine = limited
    assert engine.config.max_num_seqs == 4
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": 1.0, "seed": 0}
    ok = httpx.post(base + "/v1/completions", json={**body, "n": 4}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4, ok.text
    refused = httpx.post(base + "/v1/completions", json={**body, "n": 5}, timeout=30)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "n" and refused.json()["error"]["code"] == 400


def test_headers_past_their_size_or_count_are_refused_and_the_server_keeps_serving(limited):
    """--h11-max-incomplete-event-size and --h11-max-header-count, vLLM's flags (here 8 KiB and 16
    headers): 431 in OpenAI's shape; past h11's buffer across reads, uvicorn's own 400."""
    base, bridge, engine = limited
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    big = httpx.post(base + "/v1/completions", json=body, headers={"x-big": "y" * 10_000}, timeout=30)
    assert big.status_code == 431 and big.json()["error"]["code"] == 431, big.text
    assert "--h11-max-incomplete-event-size" in big.json()["error"]["message"]
    try:  # h11 gave up buffering it: uvicorn answers 400 and closes, which may reset a client still sending
        huge = httpx.post(base + "/v1/completions", json=body, headers={"x-big": "y" * 200_000}, timeout=30)
        assert huge.status_code == 400, huge.text
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        pass  # refused before the request was read: the server keeps serving (checked below)
    many = httpx.post(base + "/v1/completions", json=body, headers={f"x-h{i}": "1" for i in range(20)}, timeout=30)
    assert many.status_code == 431 and many.json()["error"]["code"] == 431, many.text
    assert "--h11-max-header-count" in many.json()["error"]["message"]
    ok = httpx.post(base + "/v1/completions", json=body, headers={"x-some": "y" * 4_000, "x-h1": "1"}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert bridge.num_in_flight == 0


def test_exactly_max_header_count_headers_are_served_and_one_more_is_a_431(limited):
    """The boundary of --h11-max-header-count (16 here), counting every header the client itself sends
    (Host, User-Agent, Content-Length, ...), not only the ones the test adds."""
    base, bridge, engine = limited
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        def request_with(num_headers: int) -> httpx.Response:
            request = client.build_request("POST", base + "/v1/completions", json=body)
            for i in range(num_headers - len(request.headers)):  # filler up to exactly `num_headers`
                request.headers[f"x-filler-{i}"] = "1"
            assert len(request.headers.raw) == num_headers  # what goes on the wire
            return client.send(request)

        at_limit = request_with(16)
        assert at_limit.status_code == 200, at_limit.text
        past = request_with(17)
        assert past.status_code == 431, past.text
        error = past.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}  # OpenAI's error shape
        assert error["code"] == 431 and error["type"] == "invalid_request_error" and error["param"] is None
        assert "17 headers" in error["message"] and "at most 16" in error["message"]
        assert "--h11-max-header-count" in error["message"]
    assert bridge.num_in_flight == 0


def test_the_header_flags_default_to_vllms():
    from jaxpaged.entrypoints.serve.cli import build_parser

    args = build_parser().parse_args([])
    assert (args.h11_max_incomplete_event_size, args.h11_max_header_count) == (4 << 20, 256)


def test_limits_must_be_positive_ints():
    from jaxpaged.entrypoints.serve.limits import RequestLimits

    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="max_stop_strings"):
            RequestLimits(max_stop_strings=bad)


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    """Every /v1 request's Authorization header goes through hmac.compare_digest (time independent
    of how much of the key matched); right key 200, wrong ones (same length, prefix, none) 401."""
    import hmac

    from fastapi.testclient import TestClient

    import jaxpaged.entrypoints.serve.app as app_module
    from jaxpaged.entrypoints.serve import build_server

    compared, real = [], hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", compare_digest)
    app, _ = build_server(tiny_llm().engine, served_model_name=MODEL, api_key="s3cret-key")
    with TestClient(app) as http:
        assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
        for wrong in ("Bearer s3cret-kex", "Bearer s3cret", "s3cret-key", ""):
            r = http.get("/v1/models", headers={"Authorization": wrong} if wrong else {})
            assert r.status_code == 401 and r.json()["error"]["code"] == 401, wrong
    assert len(compared) == 5 and all(b == b"Bearer s3cret-key" for _, b in compared)
