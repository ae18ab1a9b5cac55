"""Structured outputs and tool calling through the OpenAI-compatible server (a real uvicorn server
on 127.0.0.1, the `openai` client), over the tiny random checkpoint: every token the model writes
is chosen by the grammar mask, so each check below is the constraint's doing, not the model's."""

import json
import time
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from jaxpaged import LLM
from jaxpaged.entrypoints.serve.tools import parse_tool_calls, render_messages
from tiny_checkpoint import write_tiny_checkpoint
from serve_fixtures import running_server

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}}


class Person(BaseModel):
    name: Literal["Ann", "Bob"]
    age: int = Field(ge=0, le=99)
    member: bool


def _long_context_checkpoint(directory) -> str:
    """The tiny checkpoint with a 2048-token context: byte-level prompts with a tool list are long."""
    path = write_tiny_checkpoint(directory)
    config = json.load(open(f"{path}/config.json"))
    json.dump({**config, "max_position_embeddings": 2048}, open(f"{path}/config.json", "w"))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = LLM(_long_context_checkpoint(str(tmp_path_factory.mktemp("tiny"))), max_model_len=1536, max_num_seqs=4,
              max_num_batched_tokens=256, warmup=False)
    with running_server(llm.engine, served_model_name="tiny") as (base, bridge):
        yield dict(llm=llm, base=base, bridge=bridge,
                   client=openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120))


def _idle(served):
    for _ in range(100):
        engine = served["llm"].engine
        if served["bridge"].num_in_flight == 0 and engine.block_manager.stats()["num_used_pages"] == 0:
            assert len(engine.structured) == 0
            return
        time.sleep(0.05)
    pytest.fail("pages or matchers still held")


def test_parse_with_a_pydantic_model(served):
    for temperature in (0.0, 1.0):
        completion = served["client"].chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "Who?"}], response_format=Person,
            temperature=temperature, max_tokens=80, seed=3)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice.message.content


def test_json_object_regex_and_choice(served):
    client = served["client"]
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}],
                                          response_format={"type": "json_object"}, max_tokens=200, temperature=0,
                                          extra_body={"structured_outputs": None})
    if resp.choices[0].finish_reason == "stop":  # a random model may write an object past 200 tokens
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:
        assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content.startswith("{")
    done = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0.9, seed=1,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert done.choices[0].finish_reason == "stop" and len(done.choices[0].text) == 6
    picked = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}], max_tokens=9,
                                            extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert picked.choices[0].message.content in ("red", "blue")
    _idle(served)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_calls_that_validate(served, stream):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME],
              tool_choice="required", max_tokens=200, temperature=1.0, seed=5)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    if stream:
        chunks, finish = [], None
        for chunk in served["client"].chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                chunks += [d.model_dump(exclude_none=True) for d in choice.delta.tool_calls or ()]
                finish = choice.finish_reason or finish
        calls = _assemble(chunks)  # a header per call, then argument fragments
        assert len(chunks) >= len(calls) + 2, "arguments were not streamed as they were generated"
    else:
        choice = served["client"].chat.completions.create(**kw).choices[0]
        finish = choice.finish_reason
        assert choice.message.content is None
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert finish == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    # parallel_tool_calls=false: the grammar allows one call (the array's maxItems 1)
    single = served["client"].chat.completions.create(parallel_tool_calls=False, **{**kw, "seed": 6})
    assert single.choices[0].finish_reason == "tool_calls" and len(single.choices[0].message.tool_calls) == 1
    from jaxpaged.entrypoints.serve.protocol import ChatCompletionRequest
    from jaxpaged.entrypoints.serve.tools import structured_spec

    for parallel, bound in ((False, 1), (True, None)):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=parallel)
        assert structured_spec(body, "required").json.get("maxItems") == bound
    _idle(served)


def test_named_tool_choice_and_a_replayed_tool_conversation(served):
    client = served["client"]
    named = {"type": "function", "function": {"name": "get_time"}}
    first = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}],
                                           tools=[WEATHER, TIME], tool_choice=named, max_tokens=40, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    # A named tool_choice finishes "stop" (OpenAI's and vLLM's behaviour), not "tool_calls".
    assert first.choices[0].finish_reason == "stop" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    chunks, finish = [], None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "time?"}],
                                                tools=[WEATHER, TIME], tool_choice=named, max_tokens=40,
                                                temperature=0, stream=True):
        chunks += [d.model_dump(exclude_none=True) for d in chunk.choices[0].delta.tool_calls or ()]
        finish = chunk.choices[0].finish_reason or finish
    streamed = _assemble(chunks)
    assert finish == "stop" and streamed == [{"name": "get_time", "arguments": call.function.arguments}]
    assert len(chunks) > 2, "arguments were not streamed as they were generated"
    # An agent replays the conversation: the assistant turn with content null + tool_calls, the tool's answer.
    messages = [{"role": "user", "content": "time?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=5,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("length", "stop")
    prompt = render_messages(served["llm"].engine.tokenizer, messages, [TIME], "auto")
    assert "<tools>" in prompt and '"name": "get_time"' in prompt and "<tool_response>\n12:00" in prompt
    _idle(served)


def test_auto_parses_hermes_tool_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "auto", None)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    assert parse_tool_calls("no calls here", "auto", None) == ("no calls here", [])
    two = text + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>'
    assert len(parse_tool_calls(two, "auto", None)[1]) == 2 and len(parse_tool_calls(two, "auto", None, False)[1]) == 1
    assert parse_tool_calls(two, "auto", None)[0] == "Let me check."  # the content stops at the FIRST call
    assert parse_tool_calls("<tool_call>{broken", "auto", None) == ("<tool_call>{broken", [])


def _feed_by_characters(mode, name, text):
    """ToolCallStream fed every prefix of text, as a stream of one-character tokens would feed it."""
    from jaxpaged.entrypoints.serve.tool_stream import ToolCallStream

    stream, content, chunks = ToolCallStream(mode, name), "", []
    for end in range(1, len(text) + 1):
        new_content, deltas = stream.feed(text[:end])
        content += new_content
        chunks += deltas
    return content, chunks


def _assemble(chunks):
    """OpenAI's client-side assembly: each call's first chunk has id, type and name; the rest only
    argument fragments, appended."""
    calls = {}
    for d in chunks:
        if d["index"] not in calls:
            assert {"id", "type"} <= d.keys() and d["type"] == "function" and d["function"]["name"], d
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
        else:
            assert d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"}, d
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("mode, name, text, content, want", [
    ("named", "get_time", '{"zone": -3}', "", [("get_time", {"zone": -3})]),
    ("required", None, '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, '
                       '{"name": "get_time", "arguments": {"zone": 4}}]', "",
     [("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"zone": 4})]),
    ("auto", None, 'Let me <check>.\n<tool_call>\n{"arguments": {"s": "a}\\"{"}, "name": "f"}\n</tool_call>\n'
                   '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', "Let me <check>.",
     [("f", {"s": 'a}"{'}), ("g", {})]),
    ("auto", None, "no calls, a < sign", "no calls, a < sign", []),
])
def test_tool_calls_stream_as_openai_streams_them(mode, name, text, content, want):
    """Header first (id, type, name), then arguments fragments as the characters arrive; arguments
    written before the name (auto) wait for it; a `<` that does not open a block is content."""
    got_content, chunks = _feed_by_characters(mode, name, text)
    calls = _assemble(chunks)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want
    if want:
        assert len(chunks) >= len(want) + 2, "arguments were not streamed in fragments"


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_inputs_are_400_and_the_server_keeps_serving(served, body, param):
    r = httpx.post(served["base"] + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    _idle(served)
    ok = served["client"].chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_schemas_are_validated_on_a_worker_thread_once_never_on_the_engine_thread_or_the_event_loop(served,
                                                                                                      monkeypatch):
    """llguidance's validation of a large schema takes ~0.1 s: on the engine thread it would stall every
    stream, on the event loop every handler. The server validates on a worker thread, and the engine
    thread's submit does not validate it again; an invalid schema is still a 400 naming the field."""
    import asyncio
    import threading

    import llguidance

    calls = []
    real = llguidance.LLMatcher.validate_grammar

    def recording(grammar, tokenizer):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        calls.append("event loop" if on_loop else threading.current_thread().name)
        return real(grammar, tokenizer)

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", staticmethod(recording))
    schema = {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 7}},
              "required": ["k"]}
    r = served["client"].chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        response_format={"type": "json_schema", "json_schema": {"name": "k", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["k"] in range(8)
    assert len(calls) == 1, calls  # once: submit on the engine thread skipped it
    assert calls[0] not in ("jaxpaged-engine", "event loop"), calls
    bad = httpx.post(served["base"] + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "structured_outputs": {"json": {"type": "foo"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs", bad.text
    assert len(calls) == 2 and calls[1] not in ("jaxpaged-engine", "event loop"), calls
    _idle(served)
