"""The OpenAI-compatible server, started for real (uvicorn on a free 127.0.0.1 port, in a thread) and
driven by the `openai` client and raw HTTP.

One server for the module, over the bundled SmolLM2 with an API key set. The expected outputs come
from `LLM.generate` on the same engine, computed before the server's engine thread takes it over.
"""

import asyncio
import re
import time

import httpx
import pytest

from jaxpaged import LLM, SamplingParams
from serve_fixtures import running_server

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
SMALL = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)
QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello."]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=12, n=2, logprobs=True)
STOPPED = SamplingParams(temperature=0.0, max_tokens=24, stop=[" is"])


def _chat_prompt(llm, question):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def served():
    llm = LLM(**SMALL)
    chats = [_chat_prompt(llm, q) for q in QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    expected = {
        "greedy": [o.outputs[0] for o in llm.generate(chats, greedy)],
        "sampled": llm.generate(chats[0], SAMPLED)[0].outputs,
        "stopped": llm.generate(chats[0], STOPPED)[0].outputs[0],
        "plain": llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8))[0],
    }
    with running_server(llm.engine, served_model_name=MODEL, api_key=API_KEY, max_waiting_requests=80, max_body_bytes=64 * 1024) as (base, bridge):
        yield dict(llm=llm, base=base, bridge=bridge, expected=expected, chats=chats)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _metrics(base) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(jaxpaged_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _wait_idle(served, timeout=20.0) -> dict[str, float]:
    """Metrics once no page is held and no request in flight (bounded in time)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = _metrics(served["base"])
        if metrics["jaxpaged_kv_pages_used"] == 0 and served["bridge"].num_in_flight == 0:
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(f"pages still held after {timeout} s: {metrics['jaxpaged_kv_pages_used']}")
        time.sleep(0.05)


# ------------------------------------------------------------------------ 1. same answers as the Python API

def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(served["base"] + "/health").json() == {"status": "ok"}


def test_chat_greedy_matches_llm_generate_streaming_and_not(served, client):
    # Two of the four questions (the load test below checks all four, streaming).
    for question, want in list(zip(QUESTIONS, served["expected"]["greedy"]))[:2]:
        messages = [{"role": "user", "content": question}]
        resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
        choice = resp.choices[0]
        assert choice.message.content == want.text and choice.finish_reason == want.finish_reason
        assert resp.usage.completion_tokens == len(want.token_ids)

        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                                     stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            want.finish_reason]
        # usage arrives once, in the last chunk, which has no choices
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_greedy_matches_llm_generate_and_counts_usage(served, client):
    want = served["expected"]["plain"]
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert resp.choices[0].text == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)
    # Token ids as the prompt give the same answer; streaming gives the same text in pieces.
    by_ids = client.completions.create(model=MODEL, prompt=want.prompt_token_ids, temperature=0, max_tokens=8)
    assert by_ids.choices[0].text == want.outputs[0].text
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True) if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == want.outputs[0].text


def test_n_seed_logprobs_and_stop_behave_as_in_the_python_api(served, client):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    want = served["expected"]["sampled"]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.8, top_p=0.9, seed=1234,
                                          max_tokens=12, n=2, logprobs=True)
    got = sorted(resp.choices, key=lambda c: c.index)
    assert [c.message.content for c in got] == [w.text for w in want]
    assert want[0].text != want[1].text  # the two samples really differ
    for c, w in zip(got, want):
        assert [t.logprob for t in c.logprobs.content] == pytest.approx([d[t].logprob for d, t in zip(w.logprobs, w.token_ids)], abs=1e-5)
        assert all(t.logprob <= 0 for t in c.logprobs.content)
    assert resp.usage.completion_tokens == sum(len(w.token_ids) for w in want)

    stopped = served["expected"]["stopped"]
    assert stopped.finish_reason == "stop"  # the stop string occurs in the greedy answer
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, stop=[" is"])
    assert resp.choices[0].message.content == stopped.text and resp.choices[0].finish_reason == "stop"
    assert " is" not in resp.choices[0].message.content


def test_cache_salt_keeps_tenants_apart(served, client):
    # The same long prompt twice: a second request hits the prefix cache, a differently salted one does not.
    prompt = "Tell me a story about a lighthouse keeper. " * 8
    hits = []
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        before = _metrics(served["base"])["jaxpaged_prefix_cache_hit_tokens_total"]
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"cache_salt": salt})
        hits.append(_metrics(served["base"])["jaxpaged_prefix_cache_hit_tokens_total"] - before)
    assert hits[0] == 0 and hits[1] > 0 and hits[2] == 0


# ------------------------------------------------------------------------ 2. load: 64 streams, 16 walk away

@pytest.mark.slow  # 17 s on a lightly loaded machine, 47 s at load average 10
def test_64_concurrent_streams_with_a_quarter_disconnecting(served):
    base, expected = served["base"], served["expected"]["greedy"]
    num_clients, budget_s = 64, 240

    async def one(i, aclient):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if i % 4 == 3:  # walks away after two chunks of a long answer
            stream = await aclient.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                           max_tokens=200, stream=True,
                                                           extra_body={"ignore_eos": True})
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.close()
            return None
        stream = await aclient.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                       max_tokens=16, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run():
        aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=budget_s)
        async with aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(i, aclient) for i in range(num_clients))), budget_s)

    results = asyncio.run(run())
    for i, result in enumerate(results):
        if i % 4 != 3:
            want = expected[i % len(QUESTIONS)]
            assert result == (want.text, want.finish_reason), f"client {i}"

    metrics = _wait_idle(served)
    stats = served["llm"].engine.stats()  # the engine thread is idle: reading stats is safe
    assert stats["num_used_pages"] == 0 and not served["llm"].engine.has_unfinished_requests()
    assert metrics["jaxpaged_kv_pages_free"] == stats["num_free_pages"] == stats["num_pages"]
    assert metrics["jaxpaged_kv_page_allocations_total"] == stats["num_page_allocations"] > 0
    assert metrics["jaxpaged_kv_used_bytes"] == 0 and metrics["jaxpaged_requests_running"] == 0
    assert metrics['jaxpaged_kv_page_ref_count_bucket{le="+Inf"}'] == 0
    assert metrics["jaxpaged_time_to_first_token_seconds_count"] >= 48
    # ...and the server still answers.
    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    want = expected[0]
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           temperature=0, max_tokens=16)
    assert again.choices[0].message.content == want.text


# ------------------------------------------------------------------------ 3. malformed and hostile requests

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

HOSTILE = [
    # (name, path, headers, body (dict -> JSON, bytes as is), status, param)
    ("bad json", "/v1/chat/completions", AUTH, b'{"model": "x", "messages": [', 400, None),
    ("not utf-8", "/v1/completions", AUTH, b"\xff\xfe not json", 400, None),  # found by the soak (serve_soak)
    ("missing messages", "/v1/chat/completions", AUTH, {"model": MODEL}, 400, "messages"),
    ("max_tokens wrong type", "/v1/chat/completions", AUTH, {**CHAT, "max_tokens": "lots"}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", AUTH, {"model": MODEL, "prompt": "a", "temperature": -1}, 400,
     "temperature"),
    ("huge n", "/v1/chat/completions", AUTH, {**CHAT, "n": 100000}, 400, "n"),
    ("zero max_tokens", "/v1/chat/completions", AUTH, {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("unknown model", "/v1/chat/completions", AUTH, {**CHAT, "model": "gpt-9"}, 404, "model"),
    ("no auth", "/v1/chat/completions", {}, CHAT, 401, None),
    ("wrong auth", "/v1/completions", {"Authorization": "Bearer nope"}, {"model": MODEL, "prompt": "a"}, 401, None),
    ("oversized body", "/v1/completions", AUTH, {"model": MODEL, "prompt": "x" * 100_000}, 413, None),
    ("prompt past max_model_len", "/v1/completions", AUTH, {"model": MODEL, "prompt": list(range(100, 700))}, 400,
     "prompt"),
    ("token id outside vocab", "/v1/completions", AUTH, {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("no such route", "/v1/nothing", AUTH, {"model": MODEL}, 404, None),
    ("wrong method", "/health", AUTH, {}, 405, None),
]


def test_a_non_streaming_request_is_aborted_when_its_client_goes(served):
    # A running request has an output every step: the disconnect check must not wait for a quiet spell.
    body = {**CHAT, "max_tokens": 450, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served["base"] + "/v1/chat/completions", headers=AUTH, json=body, timeout=httpx.Timeout(3.0))
    _wait_idle(served, timeout=8.0)  # 450 tokens would take far longer than this


def test_max_tokens_past_max_model_len_is_trimmed_as_vllm_does(served):
    # vLLM's get_max_tokens: min(max_tokens, max_model_len - prompt); only the prompt itself can be too long.
    prompt = list(range(100, 100 + SMALL["max_model_len"] - 3))
    resp = httpx.post(served["base"] + "/v1/completions", headers=AUTH, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 10**9, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length" and resp.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("name,path,headers,body,status,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_request_gets_documented_error_and_server_keeps_serving(served, name, path, headers, body,
                                                                        status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(served["base"] + path, headers={"Content-Type": "application/json", **headers}, timeout=30,
                      **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == status  # vLLM's: the HTTP status
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(served["base"] + "/v1/completions", headers=AUTH, timeout=60,
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert _wait_idle(served)["jaxpaged_kv_pages_used"] == 0
