"""GGUF for the MoE families (models/gguf_families.py): a tiny random HF Mixtral / Qwen3-MoE written
as llama.cpp's converter writes it (tensor names from the `gguf` package's own tables, Q/K rows
permuted for `llama` by llama.cpp's formula, experts stacked [E, out, in]) with `gguf.GGUFWriter`,
read back by jaxpaged: logits within 1e-4 of HF float32."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxpaged.models import ModelConfig, params_from_hf
from jaxpaged.models import gguf as jgguf
from jaxpaged.models.llama import CausalLM

gguf = pytest.importorskip("gguf")
from gguf.constants import MODEL_ARCH, MODEL_TENSOR, TENSOR_NAMES  # noqa: E402

T = MODEL_TENSOR
LAYER_TENSORS = {  # HF name after "model.layers.{i}." -> llama.cpp tensor kind
    "self_attn.q_proj.weight": T.ATTN_Q, "self_attn.k_proj.weight": T.ATTN_K, "self_attn.v_proj.weight": T.ATTN_V,
    "self_attn.o_proj.weight": T.ATTN_OUT, "input_layernorm.weight": T.ATTN_NORM,
    "post_attention_layernorm.weight": T.FFN_NORM, "mlp.gate.weight": T.FFN_GATE_INP,
    "self_attn.q_norm.weight": T.ATTN_Q_NORM, "self_attn.k_norm.weight": T.ATTN_K_NORM,
}


def llamacpp_permute(weight, num_heads):
    """convert_hf_to_gguf.py LlamaModel.permute: per head, [2, half] -> [half, 2]."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_gguf(path, arch, hf_config, state_dict):
    writer = gguf.GGUFWriter(str(path), arch)
    c = hf_config
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_weights_norm(bool(c.norm_topk_prob))
    name = lambda kind, i=None: TENSOR_NAMES[kind].format(bid=i) + ".weight"
    writer.add_tensor(name(T.TOKEN_EMBD), state_dict["model.embed_tokens.weight"])
    writer.add_tensor(name(T.OUTPUT_NORM), state_dict["model.norm.weight"])
    writer.add_tensor(name(T.OUTPUT), state_dict["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for hf, kind in LAYER_TENSORS.items():
            weight = state_dict.get(f"model.layers.{i}.{hf}")
            if weight is None:
                continue
            if arch == "llama" and kind in (T.ATTN_Q, T.ATTN_K):
                weight = llamacpp_permute(weight, c.num_attention_heads if kind == T.ATTN_Q else c.num_key_value_heads)
            writer.add_tensor(name(kind, i), np.ascontiguousarray(weight))
        gate_up = state_dict[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, 2F, D]
        f = gate_up.shape[1] // 2
        writer.add_tensor(name(T.FFN_GATE_EXP, i), np.ascontiguousarray(gate_up[:, :f]))
        writer.add_tensor(name(T.FFN_UP_EXP, i), np.ascontiguousarray(gate_up[:, f:]))
        writer.add_tensor(name(T.FFN_DOWN_EXP, i), state_dict[f"model.layers.{i}.mlp.experts.down_proj"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name,arch", [("mixtral-top2", "llama"), ("qwen3moe-top1", "qwen3moe")])
def test_moe_gguf_logits_equal_hf(name, arch, tiny_hf_model, hf_logits, tmp_path):
    hf_config, _, state_dict = tiny_hf_model(name)
    assert MODEL_ARCH.QWEN3MOE  # the gguf package knows the architecture it writes
    path = tmp_path / "model.gguf"
    write_gguf(path, arch, hf_config, state_dict)
    loaded_config, loaded, _ = jgguf.load_gguf(path)
    assert loaded_config.model_type == hf_config.model_type
    config = ModelConfig.from_hf(loaded_config, dtype="float32")
    expected = ModelConfig.from_hf(hf_config, dtype="float32")
    assert np.float32(config.rms_norm_eps) == np.float32(expected.rms_norm_eps)  # GGUF keeps it as float32
    assert dataclasses.replace(config, rms_norm_eps=expected.rms_norm_eps) == expected
    assert set(loaded) == set(state_dict)
    for key, value in state_dict.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    # And the model on those weights: logits of a prompt equal HF's (one prefill, dense K/V pages).
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 12).astype(np.int32)
    kv = jax.numpy.zeros((config.num_layers, 2, config.num_kv_heads, 4, 4, config.head_dim))
    n = len(tokens)
    logits, _ = jax.jit(CausalLM(config).apply)(
        params_from_hf(config, loaded), kv, tokens, np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32),
        np.array([[0, 1, 2, 3]], np.int32), np.array([n], np.int32), np.array([0, n], np.int32),
        np.arange(n, dtype=np.int32))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(name, tokens.tolist()), atol=1e-4, rtol=1e-4)


def test_other_architectures_are_refused_by_name():
    with pytest.raises(ValueError, match="'gemma2' is not supported"):
        jgguf.gguf_to_hf_config({"general.architecture": "gemma2"}, tie_word_embeddings=True)
