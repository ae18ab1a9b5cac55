"""The server's logprobs, echo, prompt lists, penalties and logit_bias, through the `openai` client
against a real server (127.0.0.1) over a tiny random checkpoint; expectations come from the Python
API on the same engine, computed before the server's engine thread takes it over."""


import httpx
import pytest
from tiny_checkpoint import write_tiny_checkpoint

from jaxpaged import LLM, SamplingParams
from serve_fixtures import running_server

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
TEXT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "Name a color."}]
BIAS_ID = 70


def chosen(c):
    return [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = LLM(write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny"))), max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, page_size=4, num_pages=96, warmup=False)
    chat = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    expected = {
        "prompt_logprobs": llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs,
        "chat": llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=5, logprobs=5))[0].outputs[0],
        "texts": [llm.generate(t, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].text
                  for t in (TEXT, "Hello", "abc")],
        "penalized": llm.generate(TEXT, SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=1.5,
                                                       frequency_penalty=0.5, repetition_penalty=1.2))[0].outputs[0],
        "ids": llm.tokenizer.encode(TEXT),
    }
    with running_server(llm.engine, served_model_name=MODEL) as (base, bridge):
        yield dict(llm=llm, base=base, expected=expected)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_request_returns_the_python_apis_prompt_logprobs(served, client, max_tokens):
    want = served["expected"]["prompt_logprobs"]
    ids = served["expected"]["ids"]
    resp = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=max_tokens,
                                     temperature=0.0)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith(TEXT) and len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([want[i][ids[i]].logprob for i in range(1, len(ids))],
                                                            abs=1e-6)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert resp.usage.completion_tokens == max_tokens


def test_chat_logprobs_with_top_logprobs_parse_whole_and_streamed(served, client):
    want = served["expected"]["chat"]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.0, max_tokens=5, logprobs=True,
                                          top_logprobs=5)
    content = resp.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx(chosen(want), abs=1e-6)
    for t, entry in zip(content, want.logprobs):
        assert len(t.top_logprobs) == 5
        assert [x.logprob for x in t.top_logprobs] == sorted([x.logprob for x in t.top_logprobs], reverse=True)
        ranked = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= 5)
        assert [x.logprob for x in t.top_logprobs] == pytest.approx([v for _, v in ranked], abs=1e-6)
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.0, max_tokens=5,
                                                logprobs=True, top_logprobs=5, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [t.logprob for t in streamed] == pytest.approx(chosen(want), abs=1e-6)
    assert all(len(t.top_logprobs) == 5 for t in streamed)


def test_prompt_lists_give_one_choice_per_prompt(served, client):
    llm = served["llm"]
    texts = [TEXT, "Hello", "abc"]
    resp = client.completions.create(model=MODEL, prompt=texts, max_tokens=4, temperature=0.0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == served["expected"]["texts"]
    token_lists = [llm.tokenizer.encode(t) for t in texts[:2]]
    resp = client.completions.create(model=MODEL, prompt=token_lists, max_tokens=4, temperature=0.0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [served["expected"]["texts"][0]] * 2 + [served["expected"]["texts"][1]] * 2


def test_penalties_and_logit_bias_are_honoured(served, client):
    want = served["expected"]["penalized"]
    resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=8, temperature=0.0, presence_penalty=1.5,
                                     frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2})
    assert resp.choices[0].text == want.text
    resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0.0, logprobs=0,
                                     logit_bias={str(BIAS_ID): 100})
    token = served["llm"].tokenizer.decode([BIAS_ID])
    assert resp.choices[0].logprobs.tokens == [token] * 4


@pytest.mark.parametrize("body, field", [
    (dict(prompt=TEXT, best_of=2), "best_of"), (dict(prompt=TEXT, suffix="x"), "suffix"),
    (dict(prompt=TEXT, logprobs=21), "logprobs"), (dict(prompt=TEXT, max_tokens=0), "max_tokens"),
    (dict(prompt=TEXT, logit_bias={"999999": 1}), None), (dict(prompt=TEXT, logit_bias={"5": 101}), "logit_bias"),
])
def test_unsupported_or_bad_fields_are_400s_naming_the_field(served, body, field):
    r = httpx.post(served["base"] + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field is None or error["param"] == field or field in error["message"]
    if field is None:
        assert "logit_bias" in error["message"]
    r = httpx.post(served["base"] + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": CHAT, "functions": [{"name": "f"}]})  # tools replaced it
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions"
    r = httpx.post(served["base"] + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200  # still serving
