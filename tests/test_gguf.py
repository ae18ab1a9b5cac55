"""GGUF -> Hugging Face state dict: names, layout, the Q/K un-permutation, and the real model.

The oracle for the real model is Hugging Face's own GGUF loader (`from_pretrained(dir,
gguf_file=...)`): the same quantized weights, read by code that shares nothing with ours.
"""

import os

import numpy as np
import pytest

from jaxpaged.models import gguf as jgguf
from jaxpaged.models.loading import DEFAULT_MODEL_FILE, default_model_path

PROMPT_IDS = [19556, 905, 28, 260, 3575, 282, 4649, 314]  # "Hello world, the capital of France is"


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows, written out by rows.

    Within each head, row j (< head_dim/2) goes to 2j and row j + head_dim/2 goes to 2j + 1.
    """
    head_dim = weight.shape[0] // num_heads
    out = np.empty_like(weight)
    for head in range(num_heads):
        base = head * head_dim
        for j in range(head_dim // 2):
            out[base + 2 * j] = weight[base + j]
            out[base + 2 * j + 1] = weight[base + head_dim // 2 + j]
    return out


def test_unpermute_one_head_by_hand():
    # One head of head_dim 8, rows numbered by their Hugging Face index; GGUF stores 0 4 1 5 2 6 3 7.
    gguf_rows = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.float32)
    np.testing.assert_array_equal(jgguf.unpermute_qk_rows(gguf_rows, num_heads=1), np.arange(8))


@pytest.mark.parametrize("num_heads,head_dim", [(1, 4), (3, 8), (9, 64)])
def test_unpermute_inverts_llamacpp_permute(num_heads, head_dim):
    rng = np.random.default_rng(num_heads)
    weight = rng.standard_normal((num_heads * head_dim, 5)).astype(np.float32)
    permuted = llamacpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(jgguf.unpermute_qk_rows(permuted, num_heads), weight)
    bias = weight[:, 0].copy()  # a bias (1-D) goes through the same row order
    np.testing.assert_array_equal(jgguf.unpermute_qk_rows(llamacpp_permute(bias, num_heads), num_heads), bias)


def test_unpermute_rejects_odd_split():
    with pytest.raises(ValueError, match="num_heads=4"):
        jgguf.unpermute_qk_rows(np.zeros((6, 2)), num_heads=4)


def test_tensor_names():
    assert jgguf.gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert jgguf.gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert jgguf.gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert jgguf.gguf_to_hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert jgguf.gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert jgguf.gguf_to_hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert jgguf.gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ssm_in.weight"):
        jgguf.gguf_to_hf_name("blk.0.ssm_in.weight")


def test_config_rejects_other_architectures():
    with pytest.raises(ValueError, match="'mamba' is not supported"):
        jgguf.gguf_to_hf_config({"general.architecture": "mamba"}, tie_word_embeddings=True)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        jgguf.open_gguf(tmp_path / "nope.gguf")


# ---- a tiny GGUF written here the way llama.cpp's converter writes one -------------------------

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
_HF_TO_GGUF = {hf: gg for gg, hf in jgguf._LAYER_NAMES.items()}


def write_tiny_gguf(path, state_dict, *, tie: bool, quantize_ffn: bool, merges: bool = False):
    """A llama GGUF from a Hugging Face state dict: renamed, Q/K rows permuted, FFN optionally Q8_0;
    `merges`: a BPE merge list too, so that an engine can build its tokenizer.

    Also carries metadata of every value type, to exercise the header parser.
    """
    import gguf
    from gguf.quants import quantize

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", TINY["num_hidden_layers"])
    writer.add_uint32("llama.context_length", 256)
    writer.add_uint32("llama.embedding_length", TINY["hidden_size"])
    writer.add_uint32("llama.feed_forward_length", TINY["intermediate_size"])
    writer.add_uint32("llama.attention.head_count", TINY["num_attention_heads"])
    writer.add_uint32("llama.attention.head_count_kv", TINY["num_key_value_heads"])
    writer.add_uint32("llama.rope.dimension_count", TINY["head_dim"])
    writer.add_float32("llama.rope.freq_base", 5000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    tokens = [f"t{i}" for i in range(TINY["vocab_size"])]
    if merges:  # one merge, "t" + "1" = "t1" (token 1), whose parts take ids 3 and 4
        tokens[3:5] = ["t", "1"]
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if merges:
        writer.add_array("tokenizer.ggml.merges", ["t 1"])
    for kind, value in [("uint8", 7), ("int8", -7), ("uint16", 700), ("int16", -700), ("int32", -70000),
                        ("uint64", 2**40), ("int64", -(2**40)), ("float64", 0.125), ("bool", True)]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_array("test.ints", [3, 1, 4])
    writer.add_array("test.floats", [0.5, -1.5])
    writer.add_string("test.unicode", "héllo 😀")

    num_heads, num_kv_heads = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    for name, value in state_dict.items():
        if name == "lm_head.weight" and tie:
            continue
        if name in jgguf._GLOBAL_NAMES.values():
            gguf_name = {hf: gg for gg, hf in jgguf._GLOBAL_NAMES.items()}[name]
        else:
            parts = name.split(".")  # model.layers.0.self_attn.q_proj.weight, model.layers.0.input_layernorm.weight
            gguf_name = f"blk.{parts[2]}.{_HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"
        if name.endswith("q_proj.weight"):
            value = llamacpp_permute(value, num_heads)
        elif name.endswith("k_proj.weight"):
            value = llamacpp_permute(value, num_kv_heads)
        if quantize_ffn and ".mlp." in name:
            writer.add_tensor(gguf_name, quantize(value, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_hf_state_dict(tie: bool):
    torch = pytest.importorskip("torch")
    import transformers

    torch.manual_seed(1)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config)
    return {k: torch.randn_like(v).numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_tiny_gguf_gives_back_the_hf_state_dict(tmp_path, tie):
    state_dict = tiny_hf_state_dict(tie)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, state_dict, tie=tie, quantize_ffn=False)
    config, loaded, _ = jgguf.load_gguf(path)
    assert config.tie_word_embeddings is tie
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert (config.hidden_size, config.intermediate_size, config.head_dim, config.vocab_size) == (64, 96, 16, 64)
    assert (config.max_position_embeddings, config.bos_token_id, config.eos_token_id) == (256, 1, 2)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    expected = {k: v for k, v in state_dict.items() if not (tie and k == "lm_head.weight")}
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_tiny_gguf_quantized_tensors_and_header(tmp_path):
    """Q8_0 tensors dequantize as gguf's own round trip does; metadata equals gguf.GGUFReader's."""
    import gguf
    from gguf.quants import dequantize, quantize

    state_dict = tiny_hf_state_dict(tie=True)
    path = tmp_path / "tiny_q8.gguf"
    write_tiny_gguf(path, state_dict, tie=True, quantize_ffn=True)
    _, loaded, metadata = jgguf.load_gguf(path)
    q8 = gguf.GGMLQuantizationType.Q8_0
    name = "model.layers.1.mlp.down_proj.weight"
    expected = dequantize(quantize(state_dict[name], q8), q8)
    np.testing.assert_array_equal(loaded[name], expected)
    assert not np.array_equal(loaded[name], state_dict[name])  # it really was quantized
    np.testing.assert_allclose(loaded[name], state_dict[name], atol=0.05)

    reference = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert metadata.keys() == fields.keys()
    for key, value in fields.items():
        assert metadata[key] == pytest.approx(value) if isinstance(value, float) else metadata[key] == value, key
    assert metadata["test.unicode"] == "héllo 😀" and metadata["test.int64"] == -(2**40)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        jgguf.open_gguf(path)


# ---- the real bundled model (~50 s on a quiet 2-core machine, most of it HF's own GGUF loader) ------


@pytest.fixture(scope="module")
def ours():
    config, state_dict, _ = jgguf.load_gguf(default_model_path())
    return config, state_dict


@pytest.fixture(scope="module")
def hf_gguf_model():
    """Hugging Face's model from the same file, float32. `from_pretrained(gguf_file=)` needs
    `accelerate`; without it, the same HF GGUF parsing (`load_gguf_checkpoint`) fills the model."""
    torch = pytest.importorskip("torch")
    import transformers

    path = default_model_path()
    try:
        import accelerate  # noqa: F401

        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32
        )
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        parsed = load_gguf_checkpoint(path, return_tensors=True)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**parsed["config"]))
        model.load_state_dict(parsed["tensors"], strict=False)
        model.tie_weights()
    return model.eval()


def test_real_config_matches_hf(ours, hf_gguf_model):
    config, _ = ours
    hf = hf_gguf_model.config
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                 "bos_token_id", "eos_token_id"):
        assert getattr(config, name) == getattr(hf, name), name
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.num_hidden_layers == 30 and config.num_key_value_heads == 3 and config.tie_word_embeddings
    theta = lambda c: (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", None))
    assert theta(config) == theta(hf) == 100000.0


def test_real_state_dict_matches_hf(ours, hf_gguf_model):
    """Every tensor equal to Hugging Face's (catches names, transposes and the Q/K row order)."""
    _, state_dict = ours
    hf_state = {k: v.detach().numpy() for k, v in hf_gguf_model.state_dict().items()}
    assert set(state_dict) == set(hf_state) - {"lm_head.weight"}  # tied: HF's lm_head is the embedding
    for name, value in state_dict.items():
        assert value.dtype == np.float32 and value.shape == hf_state[name].shape, name
        np.testing.assert_allclose(value, hf_state[name], rtol=0, atol=1e-6, err_msg=name)


def test_real_logits_through_hf_torch_model(ours, hf_gguf_model):
    """Our state dict in HF's own LlamaForCausalLM gives the gguf_file= model's logits."""
    torch = pytest.importorskip("torch")
    import transformers

    config, state_dict = ours
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state_dict.items()}, strict=False)
    model.tie_weights()
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        ours_logits = model(ids).logits[0].numpy()
        hf_logits = hf_gguf_model(ids).logits[0].numpy()
    np.testing.assert_allclose(ours_logits, hf_logits, rtol=0, atol=1e-3)


def test_real_prefill_logits_flax_vs_hf(ours, hf_gguf_model):
    """The whole path: GGUF -> state dict -> params_from_hf -> jaxpaged's Flax model, one prefill."""
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp

    from jaxpaged.ops.attention import reference_paged_attention
    from jaxpaged.models import ModelConfig, params_from_hf
    from jaxpaged.models.llama import CausalLM

    hf_config, state_dict = ours
    config = ModelConfig.from_hf(hf_config, dtype="float32")
    params = params_from_hf(config, state_dict)
    page_size, num_tokens = 4, len(PROMPT_IDS)
    block_table = [3, 1]  # logical page 0 -> physical 3, 1 -> 1 (page 0 is padding)
    num_pages = 5
    slots = [block_table[t // page_size] * page_size + t % page_size for t in range(num_tokens)]
    kv_pages = jnp.zeros((config.num_layers, 2, config.num_kv_heads, num_pages, page_size, config.head_dim))
    logits, _ = CausalLM(config, attention_fn=reference_paged_attention).apply(
        params,
        kv_pages,
        jnp.asarray(PROMPT_IDS, jnp.int32),
        jnp.arange(num_tokens, dtype=jnp.int32),
        jnp.asarray(slots, jnp.int32),
        jnp.asarray([block_table], jnp.int32),
        jnp.asarray([num_tokens], jnp.int32),
        jnp.asarray([0, num_tokens], jnp.int32),
        jnp.asarray([num_tokens - 1], jnp.int32),
    )
    with torch.no_grad():
        expected = hf_gguf_model(torch.tensor([PROMPT_IDS])).logits[0, -1].numpy()
    np.testing.assert_allclose(np.asarray(logits[0]), expected, rtol=0, atol=1e-3)
    assert int(np.argmax(logits[0])) == int(np.argmax(expected))
