"""LoRA adapters on the OpenAI server, through the openai client: `model=<adapter>` on completions and
chat (greedy tokens equal to Hugging Face + PEFT's), /v1/models listing the adapters, vLLM's runtime
load / unload endpoints behind VLLM_ALLOW_RUNTIME_LORA_UPDATING, and vllm:lora_requests_info."""

import httpx
import pytest
from serve_fixtures import running_server
from tiny_checkpoint import write_tiny_checkpoint

from jaxpaged import LoRARequest
from jaxpaged.config import EngineConfig
from jaxpaged.engine.build import build_engine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
openai = pytest.importorskip("openai")
from peft_adapters import base_model, hf_greedy, write_adapters  # noqa: E402 (needs torch and peft)

ENGINE = dict(page_size=4, num_pages=128, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96,
              enable_lora=True, max_loras=2, max_lora_rank=8, warmup=False)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")))
    return ckpt, write_adapters(ckpt, tmp_path_factory)


def test_adapters_served_by_name_loaded_and_unloaded_at_runtime(setup, monkeypatch):
    ckpt, adapters = setup
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    engine = build_engine(ckpt, EngineConfig(**ENGINE))
    sql = LoRARequest("sql", 1, adapters["sql"][0])
    engine.add_lora(sql)  # as the CLI does for --lora-modules sql=PATH
    with running_server(engine, served_model_name="tiny", loras=[sql]) as (base, _bridge):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        models = client.models.list().data
        assert [m.id for m in models] == ["tiny", "sql"]
        assert models[1].model_extra["parent"] == "tiny" and models[1].model_extra["root"] == adapters["sql"][0]
        assert client.models.retrieve("sql").id == "sql"

        def complete(model: str) -> str:
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.model == model
            return out.choices[0].text

        want_sql = tokenizer.decode(hf_greedy(adapters["sql"][1], tokenizer, PROMPT, 6))
        want_base = tokenizer.decode(hf_greedy(base_model(ckpt), tokenizer, PROMPT, 6))
        assert complete("sql") == want_sql != want_base
        assert complete("tiny") == want_base
        chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0.0)
        assert chat.model == "sql" and chat.choices[0].message.content is not None

        # Runtime load: a bad path is a 400 and nothing changes; a good one serves at once.
        bad = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            complete("poet")
        ok = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": adapters["poet"][0]})
        assert ok.status_code == 200, ok.text
        again = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": adapters["poet"][0]})
        assert again.status_code == 400
        assert complete("poet") == tokenizer.decode(hf_greedy(adapters["poet"][1], tokenizer, PROMPT, 6))
        assert [m.id for m in client.models.list().data] == ["tiny", "sql", "poet"]
        metrics = httpx.get(f"{base}/metrics").text
        assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
        gone = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "poet"})
        assert gone.status_code == 200, gone.text
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "poet"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("poet")
        assert engine.list_loras() == {1}


def test_runtime_lora_routes_need_vllms_flag(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    from jaxpaged.entrypoints.serve.app import build_app
    from jaxpaged.entrypoints.serve.bridge import EngineBridge
    from jaxpaged.entrypoints.serve.lora_routes import parse_lora_modules

    def paths() -> set[str]:  # the routes an app built now has (nothing is served)
        app = build_app(object.__new__(EngineBridge), None, served_model_name="m").app
        return {path for path in app.openapi()["paths"]}

    assert "/v1/load_lora_adapter" not in paths() and "/v1/unload_lora_adapter" not in paths()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths()
    loras = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert [(r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) for r in loras] == [
        ("a", 1, "/x", None), ("b", 2, "/y", "m")]
    for bad in (["a"], ["a=/x", "a=/y"], ["{not json"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
