"""GGUF beyond dense Llama: Mixtral (llama.cpp's `llama` architecture with experts) and Qwen3-MoE
(`qwen3moe`). models/gguf.py reads the file; this module says what these two add:

    metadata                                    Hugging Face config
    {arch}.expert_count / expert_used_count     num_local_experts / num_experts_per_tok
    qwen3moe.expert_feed_forward_length         moe_intermediate_size
    qwen3moe.expert_weights_norm (absent: True) norm_topk_prob
    qwen3moe.attention.key_length               head_dim

    tensors (per layer, numpy shapes)           Hugging Face (transformers >= 5 fused experts)
    ffn_gate_inp      [E, D]                    mlp.gate.weight
    ffn_gate_exps     [E, F, D]  ┐ concatenated mlp.experts.gate_up_proj [E, 2F, D] (gate rows first)
    ffn_up_exps       [E, F, D]  ┘
    ffn_down_exps     [E, D, F]                 mlp.experts.down_proj
    attn_q_norm / attn_k_norm [H]               self_attn.q_norm / k_norm

llama.cpp permutes Q/K rows (models/gguf.py `unpermute_qk_rows`) for `llama` only; Qwen files keep
Hugging Face's order. Gemma 2/3 and Phi-3 GGUFs are not read yet (their norms are stored as 1 + w,
Phi-3's projections fused): `SUPPORTED_ARCHITECTURES` refuses them by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen3moe")
PERMUTED_QK_ARCHITECTURES = ("llama",)  # llama.cpp's converter reorders Q/K rows for these only

MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",  # fused with up below; ".weight" dropped there
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def family_config(arch: str, metadata: dict[str, Any], field) -> dict[str, Any]:
    """The Hugging Face config fields that the model type and its experts add (`field(name, default)`
    reads `{arch}.{name}`)."""
    num_experts = int(metadata.get(f"{arch}.expert_count", 0))
    if arch == "llama" and not num_experts:
        return dict(model_type="llama", architectures=["LlamaForCausalLM"])
    used = int(field("expert_used_count"))
    if arch == "llama":  # Mixtral: experts of the dense FFN's width, top-k renormalised
        return dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=num_experts,
                    num_experts_per_tok=used)
    return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_local_experts=num_experts,
                num_experts_per_tok=used, moe_intermediate_size=int(field("expert_feed_forward_length")),
                norm_topk_prob=bool(metadata.get(f"{arch}.expert_weights_norm", True)))


def fuse_experts(state_dict: dict[str, Any], num_layers: int) -> None:  # arrays, or kept BlockCodes
    """Per layer, stacked gate and up experts -> `mlp.experts.gate_up_proj`; names without `.weight`."""
    for i in range(num_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        gate = state_dict.pop(prefix + "gate_proj.weight", None)
        if gate is None:
            continue
        up = state_dict.pop(prefix + "up_proj.weight")
        state_dict[prefix + "gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2F, D]
        state_dict[prefix + "down_proj"] = state_dict.pop(prefix + "down_proj.weight")


def expected_mlp_shapes(config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Per-layer MLP tensor shapes the config implies (dense, or fused experts)."""
    hidden = config.hidden_size
    experts = config.num_local_experts
    if not experts:
        inter = config.intermediate_size
        return {prefix + "mlp.gate_proj.weight": (inter, hidden), prefix + "mlp.up_proj.weight": (inter, hidden),
                prefix + "mlp.down_proj.weight": (hidden, inter)}
    inter = config.moe_intermediate_size or config.intermediate_size
    return {prefix + "mlp.gate.weight": (experts, hidden),
            prefix + "mlp.experts.gate_up_proj": (experts, 2 * inter, hidden),
            prefix + "mlp.experts.down_proj": (experts, hidden, inter)}
