"""Hugging Face state dict -> the parameter tree of `jaxpaged.models.llama.CausalLM`, for every family.

Names and layout are HF's `nn.Linear` ones (`(out, in)`); Phi-3's fused qkv/gate_up tensors are
split first (`models/phi3.py`), MXFP4 experts dequantized (`models/mxfp4.py`), routed experts are read
by `models/moe.py`.
"""

from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from jaxpaged.models.config import ModelConfig
from jaxpaged.models.gguf_blocks import BlockCodes, keeps_embedding, panel_leaves, stacked_leaves
from jaxpaged.models.hf_quant import Fp8Matrix, fp8_leaves
from jaxpaged.models.moe import moe_params_from_hf
from jaxpaged.models.mxfp4 import dequantize_experts
from jaxpaged.models.phi3 import unfuse_phi3
from jaxpaged.models.qwen3_next import params_from_hf as qwen3_next_params


# Tensors that exist only in quantized checkpoints (block-FP8's scales, GPTQ / AWQ codes): their
# weights are not the model's values, and jaxpaged implements none of these formats.
_QUANTIZED_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", ".qweight", ".qzeros", ".scales", ".g_idx")


def _refuse_quantized(state_dict: Mapping) -> None:
    for name in state_dict:
        if isinstance(name, str) and name.endswith(_QUANTIZED_SUFFIXES):
            raise ValueError(f"the checkpoint holds {name!r}, a tensor of a quantized format (FP8 scales, GPTQ or "
                             "AWQ codes) jaxpaged does not implement: its weights would load as garbage; use the "
                             "model's unquantized checkpoint, or a .gguf of it")


def params_from_hf(config: ModelConfig, state_dict: Mapping[str, np.ndarray | BlockCodes]) -> dict:
    """Converts a Hugging Face state dict (names and (out, in) layout of `nn.Linear`) to params.

    Layers are stacked along a leading `num_layers` axis, as `nn.scan` expects. Arrays are cast to
    `config.dtype` and stay on the host (numpy); `jax.device_put` them, or hand them to
    `ModelRunner`, which does. Raises KeyError naming any missing tensor.
    """
    c = config
    dtype = jnp.dtype(c.dtype)
    _refuse_quantized(state_dict)
    state_dict = unfuse_phi3(c, state_dict)
    state_dict = dequantize_experts(state_dict)  # gpt-oss's MXFP4 experts (models/mxfp4.py)

    def tensor(name: str) -> np.ndarray:
        if name not in state_dict:
            raise KeyError(f"{name!r} is missing from the state dict; is the checkpoint a {c} model?")
        value = state_dict[name]
        if isinstance(value, (BlockCodes, Fp8Matrix)):
            return value.dequantize()
        return np.asarray(value, dtype=np.float32)

    if c.is_hybrid:  # Qwen3-Next: its own tree, layers of two kinds (models/qwen3_next.py)
        return qwen3_next_params(c, tensor, lambda name: name in state_dict)

    def stacked(suffix: str, convert: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        layers = [convert(tensor(f"model.layers.{i}.{suffix}")) for i in range(c.num_layers)]
        return np.stack(layers).astype(dtype)

    def linear(name: str, suffix: str, convert: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
        """{name: stacked float weight}, or its codes' three leaves when every layer kept it as
        GGUF blocks (quantization="gguf": models/gguf_blocks.py; integer formats of a quantized Hugging
        Face checkpoint: models/hf_quant.py), or its FP8 leaves when every layer is an FP8 weight it keeps."""
        layers = [state_dict.get(f"model.layers.{i}.{suffix}") for i in range(c.num_layers)]
        if all(isinstance(w, BlockCodes) for w in layers):
            return stacked_leaves(name, layers)
        if (all(isinstance(w, Fp8Matrix) and w.block == layers[0].block for w in layers)
                and len({w.input_scale is None for w in layers}) == 1):
            return fp8_leaves(name, layers)
        return {name: stacked(suffix, convert)}

    dim, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    attn = {
        # (N*H, D) -> (D, N, H): rows of the HF weight are output features, head-major.
        **linear("q_proj", "self_attn.q_proj.weight", lambda w: w.T.reshape(dim, n, h)),
        **linear("k_proj", "self_attn.k_proj.weight", lambda w: w.T.reshape(dim, k, h)),
        **linear("v_proj", "self_attn.v_proj.weight", lambda w: w.T.reshape(dim, k, h)),
        **linear("o_proj", "self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, dim)),  # (D, N*H)
    }
    if c.attention_bias:
        attn["q_bias"] = stacked("self_attn.q_proj.bias", lambda b: b.reshape(n, h))
        attn["k_bias"] = stacked("self_attn.k_proj.bias", lambda b: b.reshape(k, h))
        attn["v_bias"] = stacked("self_attn.v_proj.bias", lambda b: b.reshape(k, h))
    if c.o_proj_bias:
        attn["o_bias"] = stacked("self_attn.o_proj.bias", lambda b: b)
    if c.attention_sinks:
        attn["sinks"] = stacked("self_attn.sinks", lambda w: w)  # [N]
    if c.qk_norm:
        attn["q_norm"] = {"scale": stacked("self_attn.q_norm.weight", lambda w: w)}
        attn["k_norm"] = {"scale": stacked("self_attn.k_norm.weight", lambda w: w)}
    norm = lambda name: {"scale": stacked(name, lambda w: w)}
    layers = {"attn": attn, "input_norm": norm("input_layernorm.weight")}
    if c.sandwich_norms:  # Gemma: HF's post_attention_layernorm normalises the attention output
        layers["attn_out_norm"] = norm("post_attention_layernorm.weight")
        layers["post_attn_norm"] = norm("pre_feedforward_layernorm.weight")
        layers["mlp_out_norm"] = norm("post_feedforward_layernorm.weight")
    else:
        layers["post_attn_norm"] = norm("post_attention_layernorm.weight")
    if c.num_experts:
        per_layer = [
            moe_params_from_hf(
                c.num_experts, c.moe_intermediate_size, lambda suffix, i=i: tensor(f"model.layers.{i}.{suffix}"),
                lambda suffix, i=i: f"model.layers.{i}.{suffix}" in state_dict,
            )
            for i in range(c.num_layers)
        ]
        layers["moe"] = {name: np.stack([p[name] for p in per_layer]).astype(dtype) for name in per_layer[0]}
    else:
        layers["mlp"] = {
            **linear("gate_proj", "mlp.gate_proj.weight", lambda w: w.T),  # (F, D) -> (D, F)
            **linear("up_proj", "mlp.up_proj.weight", lambda w: w.T),
            **linear("down_proj", "mlp.down_proj.weight", lambda w: w.T),  # (D, F) -> (F, D)
        }
    embedding = state_dict.get("model.embed_tokens.weight")
    params = {
        # (V, D); a tied embedding kept as GGUF codes (quantization="gguf"): three leaves of LM head panels
        **(panel_leaves(embedding) if keeps_embedding(embedding, c.tie_word_embeddings)
           else {"embedding": tensor("model.embed_tokens.weight").astype(dtype)}),
        "layers": layers,
        "final_norm": {"scale": tensor("model.norm.weight").astype(dtype)},
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = tensor("lm_head.weight").T.astype(dtype)  # (V, D) -> (D, V)
    return {"params": params}


def params_from_weights(config: ModelConfig, weights) -> dict:
    """`params_from_hf` over what a trainer hands `LLM.load_weights`: a mapping or an iterable of
    (Hugging Face name, array) pairs, arrays as numpy, torch tensors (bf16 included) or jax arrays.
    ValueError naming the first missing tensor: every weight must be there."""
    state_dict = {}
    for name, array in (weights.items() if hasattr(weights, "items") else weights):
        if hasattr(array, "detach"):  # a torch tensor: to float32 numpy without importing torch here
            array = array.detach().float().cpu().numpy()
        state_dict[name] = np.asarray(array)
    try:
        return params_from_hf(config, state_dict)
    except KeyError as err:
        raise ValueError(f"load_weights needs every weight of the model: {err.args[0]}") from None
