"""What a new user of the server hit at b8feddf (issue 30 items 1, 3 and 7), on a tiny random model.

One real server (uvicorn on 127.0.0.1, driven by the `openai` client and raw HTTP) over a tiny
random model with SmolLM2's tokenizer: nothing here needs what the model says, only what the server
sends. Expected outputs come from the same engine through `LLM`, before the server takes it over.
"""

import contextlib
import io
import json
import logging
import re
import threading

import httpx
import pytest

import jaxpaged.entrypoints.llm
from jaxpaged import SamplingParams
from jaxpaged.entrypoints.cli import main as cli_main
from test_llm_inputs import tiny_llm
from serve_fixtures import running_server

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny/random"  # a served name with "/", as a hub id is
PROMPT = "Once upon a time"
SEEDS = [-2, 2**40, 2**63 - 1, 2**64 - 2, -(2**63)]  # refused by the server at b8feddf (-1 is vLLM's "no seed")
NEVER = "\x07\x07 no model writes this"  # a stop string the output never starts


def _sampled(seed):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)


def _cli_token_ids(llm, seed: int) -> list[int]:
    """`python -m jaxpaged.generate --seed SEED --json` (in-process, over `llm`): the token ids."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        mp.setattr(jaxpaged.entrypoints.llm, "LLM", lambda *a, **k: llm)
        mp.setattr(logging.getLogger(), "handlers", [])
        assert cli_main(["--no-chat", "--prompt", PROMPT, "--max-tokens", "6", "--temperature", "1",
                         "--ignore-eos", "--seed", str(seed), "--json"]) == 0
    return json.loads(out.getvalue().splitlines()[0])["token_ids"]


@pytest.fixture(scope="module")
def served():
    llm = tiny_llm()
    expected = {seed: llm.generate(PROMPT, _sampled(seed))[0].outputs[0] for seed in SEEDS + [0, 2**32]}
    cli = {seed: _cli_token_ids(llm, seed) for seed in (-2, 2**40)}  # before the server takes the engine
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    with running_server(llm.engine, served_model_name=MODEL) as (base, bridge):
        yield dict(llm=llm, base=base, expected=expected, cli=cli, bridge=bridge, greedy=greedy)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused", max_retries=0, timeout=60)


# ------------------------------------------------------------------ item 1: one seed rule on every path

def test_64_bit_seeds_draw_alike_through_the_api_the_cli_and_the_server(served, client):
    expected = served["expected"]
    assert expected[0].token_ids != expected[2**32].token_ids  # 64 bits count: not folded modulo 2**32
    assert expected[-2].token_ids == expected[2**64 - 2].token_ids  # the same seed, modulo 2**64
    assert len({tuple(expected[s].token_ids) for s in SEEDS}) == len(SEEDS) - 1
    for seed in SEEDS:
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == expected[seed].text, seed
    for seed, token_ids in served["cli"].items():  # the CLI's --seed, on the same engine
        assert token_ids == expected[seed].token_ids, seed
    # -1 is vLLM's "no seed" on every path: accepted, and drawn from the engine's stream.
    assert SamplingParams(seed=-1).seed is None
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=-1,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 6


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_seeds_beyond_64_bits_are_refused_alike(client, seed):
    with pytest.raises(ValueError, match=r"seed=.* must be an int in \[-9223372036854775808, 18446744073709551615\]"):
        SamplingParams(seed=seed)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, seed=seed)
    assert info.value.body["param"] == "seed" and "64-bit" in info.value.body["message"]


# ------------------------------------------------------------------ item 3: models, deltas, stop strings

def test_models_retrieve_names_the_served_model(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == 404  # vLLM's: the HTTP status


def _sse_chunks(base, path, body) -> list[dict]:
    with httpx.stream("POST", base + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


def test_no_stream_chunk_has_an_empty_delta(served):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0,
            "stop": [NEVER], "stream": True}
    chunks = _sse_chunks(served["base"], "/v1/chat/completions", body)
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert len(choices) >= 3 and all(c["delta"] for c in choices), [c["delta"] for c in choices]
    assert choices[-1]["finish_reason"] == "length"
    completion = _sse_chunks(served["base"], "/v1/completions",
                             {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [NEVER],
                              "stream": True})
    texts = [c for chunk in completion for c in chunk["choices"]]
    assert all(c["text"] or c["finish_reason"] for c in texts)


def test_stream_holds_back_only_what_could_start_a_stop_string():
    """With a stop string the output never starts, every snapshot shows all the text so far (at
    b8feddf the last len(stop) - 1 characters were always held back, cutting words mid-way)."""
    llm = tiny_llm()
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    stopped = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[NEVER])
    want = [o.outputs[0].text for o in llm.stream(PROMPT, plain)]
    got = [o.outputs[0].text for o in llm.stream(PROMPT, stopped)]
    assert got == want and len(got) >= 3


@pytest.mark.parametrize("text, stops, held", [
    ("The ca", ["cat!"], 2), ("The cap", ["cat!"], 0), ("The capital", ["cat!"], 0),
    ("a b", [" b c", "xx"], 2), ("abc", ["c"], 0), ("x\n", ["\n\n", "\nUser:"], 1), ("", ["ab"], 0),
])
def test_stop_prefix_len_is_the_longest_end_that_may_grow_into_a_stop(text, stops, held):
    from jaxpaged.planner.request import stop_prefix_len

    assert stop_prefix_len(text, stops) == held


# ------------------------------------------------------------------ item 7: queueing in /metrics

def test_metrics_report_waiting_requests_and_queue_time(served, client):
    """The tiny engine runs 4 sequences at a time: of 8 concurrent requests, some queue."""
    def one(i):
        client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    text = httpx.get(served["base"] + "/metrics", timeout=10).text
    count = float(re.search(r"^jaxpaged_request_queue_time_seconds_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^jaxpaged_request_queue_time_seconds_sum (\S+)$", text, re.M).group(1))
    assert count >= 8 and total > 0
    assert re.search(r"^jaxpaged_requests_waiting \S+$", text, re.M)
    assert "vllm:num_requests_waiting" in text  # the HELP line names vLLM's metric of the same meaning


def test_server_sizes_its_batch_from_the_kv_pool(monkeypatch):
    """At b8feddf the server took the engine's max_num_seqs=16 whatever its pool held, and 32
    concurrent streams waited up to 28 s. Now: as many sequences as the pool holds at max_model_len."""
    import jax

    import jaxpaged.engine.build as build
    from jaxpaged.config import EngineConfig
    from jaxpaged.models.config import ModelConfig
    from jaxpaged.models.llama import init_params
    from jaxpaged.models.loading import default_model_path
    from jaxpaged.models.tokenizer import Tokenizer

    model_config = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True)
    parts = (model_config, init_params(model_config, jax.random.key(0)), Tokenizer.from_gguf(default_model_path()))
    monkeypatch.setattr(build, "load_model", lambda model, dtype, quantization=None, **_: parts)
    small = dict(page_size=4, max_model_len=64, warmup=False, attention_backend="reference")
    # 16 pages of 4 tokens per sequence of max_model_len: a pool of 1 + 20 * 16 pages holds 20.
    engine = build.build_engine(None, EngineConfig(num_pages=321, **small), max_num_seqs_from_pool=True)
    assert engine.config.max_num_seqs == 20
    # Never below the platform default (16 on the CPU): a pool of 6 sequences still batches 16.
    assert build.build_engine(None, EngineConfig(num_pages=97, **small),
                              max_num_seqs_from_pool=True).config.max_num_seqs == 16
    # No pool size given: the whole CPU KV budget (here shrunk to 500 pages' worth), then the batch.
    monkeypatch.setattr(build, "CPU_KV_BUDGET_BYTES", 500 * engine.kv_bytes_per_page)
    engine = build.build_engine(None, EngineConfig(**small), max_num_seqs_from_pool=True)
    assert engine.stats()["num_pages"] == 499 and engine.config.max_num_seqs == 499 // 16
    # An explicit max_num_seqs wins, and the Python API keeps its defaults.
    assert build.build_engine(None, EngineConfig(num_pages=321, max_num_seqs=2, **small),
                              max_num_seqs_from_pool=True).config.max_num_seqs == 2
    assert build.build_engine(None, EngineConfig(num_pages=321, **small)).config.max_num_seqs == 16


def test_start_logs_one_configuration_line_and_no_absl_or_jax_info(served, capsys):
    from jaxpaged.entrypoints.serve.cli import configure_logging, startup_line

    root = logging.getLogger()
    saved = root.level, root.handlers[:], logging.getLogger("jaxpaged").level
    root.handlers = []
    try:
        configure_logging("info")
        for name in ("absl", "jax._src.xla_bridge", "orbax"):  # the 12 INFO lines of a start at b8feddf
            logging.getLogger(name).info("noise from %s", name)
        engine = served["llm"].engine
        logging.getLogger("jaxpaged.serve").info(startup_line(engine, MODEL, "http://127.0.0.1:8000/v1"))
    finally:
        root.setLevel(saved[0])
        root.handlers = saved[1]
        logging.getLogger("jaxpaged").setLevel(saved[2])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    config = engine.config
    kv_gib = engine.stats()["num_pages"] * engine.kv_bytes_per_page / 2**30
    for part in (f"serving {MODEL} at http://127.0.0.1:8000/v1", f"{engine.stats()['num_pages']} KV pages of 4 tokens",
                 f"({kv_gib:.2f} GiB, kv_cache_dtype=auto)", f"max_num_seqs={config.max_num_seqs}",
                 f"max_model_len={config.max_model_len}", f"backend={config.attention_backend}",
                 f"dtype={config.dtype}"):
        assert part in lines[0], (part, lines[0])


def test_stop_reason_and_vllms_output_text_fields(served, client):
    """vLLM's `stop_reason` in every choice, and its `include_stop_str_in_output` /
    `skip_special_tokens` request fields (the engine's SamplingParams semantics)."""
    greedy = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.0)
    free = client.completions.create(**greedy, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    assert text == served["greedy"].text
    stop = text.strip()[:2]
    cut = text.index(stop)
    assert free.choices[0].stop_reason is None
    out = client.completions.create(**greedy, stop=[stop], extra_body={"ignore_eos": True})
    assert (out.choices[0].text, out.choices[0].finish_reason, out.choices[0].stop_reason) == (text[:cut], "stop", stop)
    out = client.completions.create(**greedy, stop=[stop], extra_body={"ignore_eos": True,
                                                                       "include_stop_str_in_output": True})
    assert out.choices[0].text == text[: cut + len(stop)] and out.choices[0].stop_reason == stop
    # A stop token: its id is the stop_reason and its text is left out (unless asked for), streamed alike.
    tokenizer = served["llm"].get_tokenizer()
    stop_id = served["greedy"].token_ids[1]
    for stream in (False, True):
        resp = client.completions.create(**greedy, stream=stream, extra_body={"stop_token_ids": [stop_id]})
        chunks = list(resp) if stream else [resp]
        last = chunks[-1].choices[0]
        assert last.finish_reason == "stop" and last.stop_reason == stop_id
        first = served["greedy"].token_ids.index(stop_id)
        assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(served["greedy"].token_ids[:first])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}], max_tokens=3, temperature=0.0,
        extra_body={"skip_special_tokens": False, "ignore_eos": True})
    assert chat.choices[0].stop_reason is None and chat.choices[0].finish_reason == "length"
    # Streamed chat carries stop_reason too: a stop token's id, then a stop string.
    chat_args = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0)
    whole = client.chat.completions.create(**chat_args, extra_body={"ignore_eos": True, "return_token_ids": True})
    chat_ids, chat_text = whole.choices[0].token_ids, whole.choices[0].message.content
    assert len(chat_text) >= 2
    for extra, want in (({"stop_token_ids": [chat_ids[1]]}, chat_ids[1]), ({"stop": [chat_text[:2]]}, chat_text[:2])):
        chunks = list(client.chat.completions.create(**chat_args, stream=True, extra_body={"ignore_eos": True, **extra}))
        finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
        assert len(finals) == 1 and finals[0].finish_reason == "stop" and finals[0].stop_reason == want


def test_vllms_request_fields_are_served_or_refused_never_dropped(served, client):
    tokenizer = served["llm"].get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    greedy = dict(model=MODEL, max_tokens=3, temperature=0.0)
    out = client.completions.create(**greedy, prompt=ids, extra_body={"truncate_prompt_tokens": 2,
                                                                      "return_token_ids": True,
                                                                      "request_id": "abc"})
    assert out.id == "cmpl-abc" and out.usage.prompt_tokens == 2
    choice = out.choices[0].model_dump()
    assert choice["prompt_token_ids"] == ids[-2:] and len(choice["token_ids"]) == 3
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    # Chat: the template's variables, no generation prompt, continuing the assistant's message.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    open_text = rendered[: rendered.rindex("Hello there") + len("Hello there")]
    chat = client.chat.completions.create(**greedy, messages=messages, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True})
    assert chat.model_dump()["prompt_token_ids"] == tokenizer.encode(open_text, add_special_tokens=False)
    assert len(chat.choices[0].model_dump()["token_ids"]) == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**greedy, messages=messages, extra_body={"continue_final_message": True})
    assert info.value.body["param"] == "continue_final_message"
    for field, value in (("bad_words", ["x"]), ("use_beam_search", True), ("prompt_logprobs", 1), ("priority", 2),
                         ("chat_template", "{{ 1 }}"), ("echo", True),
                         ("chat_template_kwargs", {"chat_template": "{{ 1 }}"})):  # no way around the refusal
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**greedy, messages=messages[:1], extra_body={field: value})
        assert info.value.body["param"] == field, field
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**greedy, prompt=PROMPT, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert info.value.body["param"] == "stream_options"


def test_tokenize_detokenize_version_and_ping_as_vllm(served):
    base, tokenizer = served["base"], served["llm"].get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    body = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(base + "/tokenize", json={"messages": messages, "return_token_strs": True}, timeout=30).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False) and len(chat["token_strs"]) == chat["count"]
    assert httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30).json() == \
        {"prompt": tokenizer.decode(ids)}
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(base + "/tokenize", json={"prompt": "x", "messages": messages}, timeout=30).status_code == 400
    assert httpx.get(base + "/version", timeout=30).json()["version"]
    assert httpx.get(base + "/ping", timeout=30).status_code == httpx.post(base + "/ping", timeout=30).status_code == 200


def test_vllms_metric_names_are_served(served, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0.0)
    text = httpx.get(served["base"] + "/metrics", timeout=30).text
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert re.search(rf"^{re.escape(name + labels)} \S+$", text, re.M), name
    generated = float(re.search(rf"^vllm:generation_tokens_total{re.escape(labels)} (\S+)$", text, re.M).group(1))
    assert generated == float(re.search(r"^jaxpaged_generation_tokens_total (\S+)$", text, re.M).group(1)) >= 2
    assert re.search(r'^vllm:request_success_total\{.*finished_reason="length".*\} [1-9]', text, re.M)


def test_streamed_token_ids_add_up_to_the_whole_responses_even_where_text_is_held_back(served, client):
    """vLLM's return_token_ids: every token id reaches a streaming client, also those whose text the
    detokenizer holds back (part of a UTF-8 character: the tiny byte-level model writes many)."""
    args = dict(model=MODEL, max_tokens=24, temperature=0.0)
    tokenizer = served["llm"].get_tokenizer()
    partial = [t for t in range(100, 300) if "\ufffd" in tokenizer.decode([t])]  # bytes of a UTF-8 character
    assert len(partial) >= 8
    body = {"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": partial}
    whole = client.completions.create(**args, prompt=PROMPT, extra_body=body).choices[0].model_dump()
    chunks = [c.choices[0].model_dump() for c in client.completions.create(**args, prompt=PROMPT, stream=True,
                                                                            extra_body=body) if c.choices]
    assert [t for c in chunks for t in c["token_ids"] or []] == whole["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(**args, messages=messages, extra_body=body).choices[0].model_dump()
    chunks = [c.choices[0].model_dump() for c in client.chat.completions.create(**args, messages=messages,
                                                                                 stream=True, extra_body=body)
              if c.choices]
    assert [t for c in chunks for t in c.get("token_ids") or []] == whole["token_ids"]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == whole["message"]["content"]
