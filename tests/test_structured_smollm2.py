"""Structured outputs on a real model (slow): the bundled SmolLM2-135M and its 49152-token BPE
vocabulary, where tokens span several characters and the mask must follow them through the
grammar. The default suite's tiny byte-level model (test_structured_outputs.py,
test_serve_structured.py) covers every feature; these add depth on a real tokenizer and chat template.
"""

import json
import os
import time

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from serve_fixtures import running_server

pytestmark = pytest.mark.slow

SCHEMAS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")))
SMALL = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


def _chat(llm, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


def _assert_idle(llm):
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.structured) == 0
    assert llm.engine.block_manager.stats()["num_used_pages"] == 0


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_schema_outputs_validate_on_a_real_tokenizer(llm, mode):
    schemas = SCHEMAS[::4] if mode == "greedy" else SCHEMAS[2::4]  # 15 + 15 of the corpus's 60 shapes
    kw = dict(temperature=0.0) if mode == "greedy" else dict(temperature=0.8, top_p=0.95, seed=11)
    prompts = [_chat(llm, "Describe a fictional item as a JSON object matching this schema: " + json.dumps(s))
               for s in schemas]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=400, structured_outputs=StructuredOutputsParams(json=s),
                                                 **kw) for s in schemas])
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    _assert_idle(llm)


def test_an_always_true_constraint_leaves_greedy_tokens_unchanged(llm):
    """The mask removes only forbidden tokens: under a regex every text matches, SmolLM2's greedy
    tokens are its unconstrained ones, multi-character BPE tokens included."""
    prompts = [_chat(llm, q) for q in ("What is the capital of France?", "Name three colors.", "Say hi in JSON.")]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    anything = StructuredOutputsParams(regex=r"(?s:.*)")
    con = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=anything))
    for f, c in zip(free, con):
        assert c.outputs[0].token_ids == f.outputs[0].token_ids, (f.outputs[0].text, c.outputs[0].text)
    _assert_idle(llm)


@pytest.fixture(scope="module")
def client(llm):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")

    with running_server(llm.engine, served_model_name="smollm2") as (base, bridge):
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 40},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                     "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
    "required": ["query"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls_parse_and_validate(client, llm, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
    question = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    for tool_choice, finish in (("required", "tool_calls"),
                                ({"type": "function", "function": {"name": "get_weather"}}, "stop")):
        # parallel_tool_calls=False: one call (a 135M model asked for "1 or more" repeats its call until max_tokens)
        kw = dict(model="smollm2", messages=question, tools=[WEATHER, SEARCH], tool_choice=tool_choice,
                  max_tokens=200, temperature=0.0, parallel_tool_calls=False)
        if stream:
            calls, got_finish = {}, None
            for chunk in client.chat.completions.create(stream=True, **kw):
                for d in chunk.choices[0].delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                    call["arguments"] += d.function.arguments or ""
                got_finish = chunk.choices[0].finish_reason or got_finish
            calls = [calls[i] for i in sorted(calls)]
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            got_finish = choice.finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        assert got_finish == finish and calls
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
        if tool_choice != "required":
            assert [c["name"] for c in calls] == ["get_weather"]
    for _ in range(100):
        if llm.engine.block_manager.stats()["num_used_pages"] == 0:
            break
        time.sleep(0.05)
    _assert_idle(llm)


def test_json_schema_response_format_parses_into_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population_millions: float = Field(ge=0, le=50)
        continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]

    parsed = client.chat.completions.parse(model="smollm2", messages=[
        {"role": "user", "content": "Give facts about Paris as JSON."}], response_format=City, max_tokens=200,
        temperature=0.0)
    city = parsed.choices[0].message.parsed
    assert parsed.choices[0].finish_reason == "stop" and isinstance(city, City), parsed.choices[0].message.content
