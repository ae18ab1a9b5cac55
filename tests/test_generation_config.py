"""vLLM's `generation_config` engine argument: a model's generation_config.json gives the default
sampling parameters of `LLM.generate` without SamplingParams and of every field a server request
leaves out (the request's own values win). Oracle for what is read: transformers' GenerationConfig
`to_diff_dict()` filtered to vLLM's keys, which is vLLM 0.32's `get_diff_sampling_param`."""

import json
import os

import pytest
from tiny_checkpoint import write_tiny_checkpoint

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loading import GENERATION_CONFIG_KEYS, generation_defaults
from serve_fixtures import running_server

# Greedy, so outputs are comparable; the penalty and the 5-token cap change what comes out.
FILE_KEYS = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.3, "max_new_tokens": 5,
             "do_sample": True}
DEFAULTS = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.3, "max_tokens": 5}
TEXT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "Name a color."}]
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, page_size=4, num_pages=96, warmup=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = write_tiny_checkpoint(str(tmp_path_factory.mktemp("generation_config")))
    path = os.path.join(directory, "generation_config.json")
    with open(path) as f:
        config = json.load(f)  # what save_pretrained wrote: special token ids only
    with open(path, "w") as f:
        json.dump({**config, **FILE_KEYS}, f)
    return directory


def test_the_defaults_are_the_keys_vllm_reads(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    diff = transformers.GenerationConfig.from_pretrained(checkpoint).to_diff_dict()
    vllm_reads = {GENERATION_CONFIG_KEYS[k]: v for k, v in diff.items() if k in GENERATION_CONFIG_KEYS and v is not None}
    assert generation_defaults(checkpoint) == vllm_reads == DEFAULTS
    assert generation_defaults(checkpoint, "vllm") == {}
    assert generation_defaults(None) == {}  # the bundled GGUF carries no generation config
    assert generation_defaults(None, checkpoint) == DEFAULTS  # a directory holding one
    with pytest.raises(FileNotFoundError, match="no generation_config.json there"):
        generation_defaults(checkpoint, str(tmp_path))


def test_override_generation_config_applies_on_top_in_every_mode(checkpoint, caplog):
    override = {"temperature": 0.25, "max_new_tokens": 9}
    assert generation_defaults(checkpoint, "auto", override) == {**DEFAULTS, "temperature": 0.25, "max_tokens": 9}
    assert generation_defaults(checkpoint, "vllm", override) == {"temperature": 0.25, "max_tokens": 9}
    assert generation_defaults(None, "auto", {"top_p": 0.5}) == {"top_p": 0.5}  # the GGUF has no file
    with caplog.at_level("WARNING"):  # a key no sampling default comes from is named, not dropped silently
        assert generation_defaults(None, "vllm", {"temprature": 0.5}) == {}
    assert "temprature" in caplog.text


def test_invalid_defaults_are_refused_before_loading(checkpoint, tmp_path):
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"top_p": 1.5}, f)
    with pytest.raises(ValueError, match="generation_config='vllm'"):
        LLM(checkpoint, generation_config=str(tmp_path), **ENGINE)


@pytest.fixture(scope="module")
def served(checkpoint):
    llm = LLM(checkpoint, **ENGINE)
    plain = LLM(checkpoint, generation_config="vllm", override_generation_config={"max_new_tokens": 7}, **ENGINE)
    chat = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    expected = {
        "defaults": llm.get_default_sampling_params(),
        "plain_defaults": plain.get_default_sampling_params(),
        "generate": llm.generate(TEXT)[0].outputs[0],
        "explicit": llm.generate(TEXT, SamplingParams(**DEFAULTS))[0].outputs[0],
        "chat": llm.generate(chat, SamplingParams(**DEFAULTS))[0].outputs[0],
        "chat_own": llm.generate(chat, SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0],
    }
    with running_server(llm.engine, served_model_name="tiny") as (base, _):
        yield dict(base=base, expected=expected)


def test_generate_without_params_takes_the_models_defaults(served):
    expected = served["expected"]
    params = expected["defaults"]
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == \
        (0.0, 0.9, 20, 1.3, 5)
    assert expected["generate"].token_ids == expected["explicit"].token_ids
    assert 1 <= len(expected["generate"].token_ids) <= 5
    # generation_config="vllm": SamplingParams' own defaults, but for the override's max_new_tokens
    plain = expected["plain_defaults"]
    assert (plain.temperature, plain.repetition_penalty, plain.max_tokens) == (1.0, 1.0, 7)


def test_the_server_fills_what_a_request_leaves_out_and_the_request_wins(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key="none", max_retries=0, timeout=120)
    expected = served["expected"]
    # No sampling fields: the model's temperature 0, top-k/p, penalty and 5-token cap.
    resp = client.chat.completions.create(model="tiny", messages=CHAT)
    assert resp.choices[0].message.content == expected["chat"].text
    assert resp.usage.completion_tokens == len(expected["chat"].token_ids) <= 5
    # The request's own values win: no penalty, 3 tokens.
    resp = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0.0, max_tokens=3, top_p=1.0,
                                          extra_body={"top_k": -1, "repetition_penalty": 1.0})
    assert resp.choices[0].message.content == expected["chat_own"].text
    # Completions: OpenAI's max_tokens default (16) is the request's value; the penalty is the model's.
    resp = client.completions.create(model="tiny", prompt=TEXT, max_tokens=5)
    assert resp.choices[0].text == expected["explicit"].text


def test_the_cli_flag_reaches_the_engine_config(checkpoint):
    from jaxpaged.config import EngineConfig
    from jaxpaged.entrypoints.cli import build_parser, engine_args

    assert EngineConfig(**engine_args(build_parser().parse_args([]))).generation_config == "auto"
    for value in ("vllm", checkpoint):
        args = build_parser().parse_args(["--generation-config", value])
        assert EngineConfig(**engine_args(args)).generation_config == value
    args = build_parser().parse_args(["--override-generation-config", '{"temperature": 0.5}'])
    assert EngineConfig(**engine_args(args)).override_generation_config == {"temperature": 0.5}


def test_a_data_parallel_engine_gives_its_replicas_defaults():
    # build_engine sets the defaults on each replica; the data-parallel engine reports the first's.
    import tp_fixtures
    from jaxpaged.engine.data_parallel import DataParallelEngine

    params = tp_fixtures.tiny_params()
    replicas = [tp_fixtures.make_engine(params, warmup=False) for _ in range(2)]
    for replica in replicas:
        replica.generation_defaults = dict(DEFAULTS)
    params = LLM.from_engine(DataParallelEngine(replicas)).get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 20, 5)
