"""Hugging Face config -> `ModelConfig`, one family at a time; what a family cannot run is refused by name.

    model_type     HF class                  what it adds to the Llama block
    llama          LlamaForCausalLM          (Llama 2/3, SmolLM2; llama3 RoPE scaling)
    mistral        MistralForCausalLM        sliding_window on every layer
    qwen2, qwen3   Qwen2/Qwen3ForCausalLM    q/k/v bias (Qwen2), q/k RMSNorm (Qwen3)
    phi3           Phi3ForCausalLM           fused qkv_proj / gate_up_proj checkpoints (models/phi3.py)
    mixtral        MixtralForCausalLM        routed experts, top-k renormalised (models/moe.py)
    qwen3_moe      Qwen3MoeForCausalLM       routed experts, q/k norm, norm_topk_prob as configured
    gemma2         Gemma2ForCausalLM         alternating local/global layers, soft-capping, (1+w) norms,
                                             sandwich norms, sqrt(D) embedding scale, gelu-tanh
    gemma3_text    Gemma3ForCausalLM         Gemma 2 minus soft-capping plus q/k norm, 5 local : 1 global,
                                             a separate RoPE base on local layers
    gpt_oss        GptOssForCausalLM         per-head attention sinks, alternating sliding / full layers,
                                             q/k/v/o bias, routed experts with router and expert biases and
                                             the clamped SwiGLU (models/moe.py), YaRN RoPE; MXFP4 expert
                                             weights dequantized at load (models/mxfp4.py)
    qwen3_next     Qwen3NextForCausalLM      Gated DeltaNet linear-attention layers (models/qwen3_next.py) between
                                             gated full-attention layers (partial RoPE, (1+w) q/k norms), MoE
                                             with a sigmoid-gated shared expert, (1+w) norms
"""

import math
from collections.abc import Mapping
from typing import Any

import jax

from jaxpaged.models.hf_quant import check_quantization_config
from jaxpaged.models.rope_scaling import LongRope, RopeScaling, Yarn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text",
                         "gpt_oss", "qwen3_next")
_GEMMA = ("gemma2", "gemma3_text")


def config_from_hf(cls, hf_config: Any, dtype: str | None):
    """`cls(**fields)` read from `hf_config` (`ModelConfig.from_hf` passes itself as `cls`, so this module
    needs only the RoPE scaling classes, not ModelConfig)."""
    read = hf_config.get if isinstance(hf_config, Mapping) else lambda k: getattr(hf_config, k, None)

    def get(name: str, default=None):  # a field set to null reads as absent: its default
        value = read(name)
        return default if value is None else value

    model_type = get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; jaxpaged implements {SUPPORTED_MODEL_TYPES}")
    _refuse_unsupported(model_type, get)  # first: what jaxpaged does not implement is the news
    _check_values(model_type, get)

    num_heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // num_heads
    bias = bool(get("attention_bias", False))
    num_layers = get("num_hidden_layers")
    if dtype is None:
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    rope_theta, rope_scaling, local_theta = _read_rope(get, model_type)
    fields = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(get("tie_word_embeddings", model_type in _GEMMA)),
        # Qwen2 always has q/k/v bias and never an output bias; the others use one flag for both.
        attention_bias=True if model_type == "qwen2" else bias,
        o_proj_bias=False if model_type == "qwen2" else bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_next"),
        max_position_embeddings=get("max_position_embeddings", 2048),
        dtype=dtype,
        sliding_window=get("sliding_window"),
    )
    if model_type in _GEMMA:
        fields.update(
            norm_plus_one=True, sandwich_norms=True, scale_embedding=True, hidden_act="gelu_tanh",
            query_pre_attn_scalar=float(get("query_pre_attn_scalar") or head_dim),
            attn_soft_cap=get("attn_logit_softcapping"), final_soft_cap=get("final_logit_softcapping"),
            layer_types=_gemma_layer_types(get, model_type, num_layers), local_rope_theta=local_theta,
        )
    elif get("layer_types") is not None:
        fields["layer_types"] = tuple(get("layer_types"))
    # transformers >= 5 writes `num_local_experts` for both; older Qwen3-MoE configs `num_experts`.
    num_experts = get("num_local_experts") or get("num_experts")
    if model_type == "mixtral":
        fields.update(num_experts=num_experts, num_experts_per_tok=get("num_experts_per_tok"),
                      moe_intermediate_size=get("intermediate_size"), norm_topk_prob=True)
    if model_type == "qwen3_moe":
        fields.update(num_experts=num_experts, num_experts_per_tok=get("num_experts_per_tok"),
                      moe_intermediate_size=get("moe_intermediate_size"),
                      norm_topk_prob=bool(get("norm_topk_prob", False)))
    if model_type == "gpt_oss":
        fields.update(num_experts=num_experts, num_experts_per_tok=get("num_experts_per_tok"),
                      moe_intermediate_size=get("intermediate_size"),
                      # HF: softmax over the top-k logits, which is softmax, top-k, renormalise
                      norm_topk_prob=True, moe_bias=True, attention_sinks=True, hidden_act="swigluoai",
                      layer_types=tuple(get("layer_types") or (  # GptOssConfig's default: even layers slide
                          "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers))))
    if model_type == "qwen3_next":
        fields.update(_qwen3_next_fields(get, num_layers, num_experts))
    elif fields["sliding_window"] is None:
        fields.pop("layer_types", None)  # "sliding" layers without a window are global (HF alike)
    return cls(**fields)


# A config.json comes from whoever published the model: every size is checked before anything is
# derived from it or allocated by it. The bounds are far above any released model (largest known in
# brackets) and far below what would exhaust memory on the way to a clear error.
_SIZE_BOUNDS = {  # field: (required, largest accepted)
    "vocab_size": (True, 1 << 22),  # [262,144: Gemma 3]
    "hidden_size": (True, 1 << 16),  # [16,384: Llama 3.1 405B]
    "intermediate_size": (True, 1 << 18),  # [53,248: Llama 3.1 405B]
    "num_hidden_layers": (True, 1024),  # [126: Llama 3.1 405B]
    "num_attention_heads": (True, 1024),  # [128]
    "num_key_value_heads": (False, 1024),
    "head_dim": (False, 1024),  # [256: Gemma 2 / 3]
    "max_position_embeddings": (False, 1 << 24),  # [10,485,760: Llama 4 Scout]
    "sliding_window": (False, 1 << 24),
    "num_local_experts": (False, 1 << 12),  # [384: Kimi K2]
    "num_experts": (False, 1 << 12),
    "num_experts_per_tok": (False, 1 << 12),
    "moe_intermediate_size": (False, 1 << 18),
    "sliding_window_pattern": (False, 1024),
}
_FLOATS = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "attn_logit_softcapping",
           "final_logit_softcapping")  # positive and finite when set
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "norm_topk_prob",
          "use_bidirectional_attention")


def _check_values(model_type: str, get) -> None:
    """ValueError naming the first field of the config whose value is missing, of the wrong type, out of
    bounds or inconsistent with another (what a corrupt or hostile config.json holds)."""
    for name, (required, largest) in _SIZE_BOUNDS.items():
        value = get(name)
        if value is None:
            if required:
                raise ValueError(f"the model config has no {name}; a {model_type} config needs it")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"the model config's {name}={value!r:.60} must be an integer")
        if not 1 <= value <= largest:
            raise ValueError(f"the model config's {name}={value} must lie in [1, {largest}]; the file is corrupt or "
                             "not a model jaxpaged can serve")
    for name in _FLOATS:
        value = get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ValueError(f"the model config's {name}={value!r:.60} must be a positive finite number")
    for name in _BOOLS:
        value = get(name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"the model config's {name}={value!r:.60} must be true or false")
    num_heads, hidden_size = get("num_attention_heads"), get("hidden_size")
    if get("head_dim") is None and hidden_size % num_heads:
        raise ValueError(f"the model config's hidden_size={hidden_size} is not divisible by num_attention_heads="
                         f"{num_heads} and there is no head_dim; the file is inconsistent")
    if get("head_dim") is None and (hidden_size // num_heads) % 2:
        raise ValueError(f"the model config's hidden_size={hidden_size} / num_attention_heads={num_heads} gives an odd "
                         "head_dim; RoPE rotates pairs of dimensions")
    num_kv_heads = get("num_key_value_heads") or num_heads
    if num_kv_heads > num_heads or num_heads % num_kv_heads:
        raise ValueError(f"the model config's num_key_value_heads={num_kv_heads} must divide num_attention_heads="
                         f"{num_heads}")
    num_experts = get("num_local_experts") or get("num_experts")
    if model_type in ("mixtral", "qwen3_moe"):
        if num_experts is None or get("num_experts_per_tok") is None:
            raise ValueError(f"the model config of a {model_type} needs num_local_experts (or num_experts) and "
                             "num_experts_per_tok")
        if get("num_experts_per_tok") > num_experts:
            raise ValueError(f"the model config's num_experts_per_tok={get('num_experts_per_tok')} is more than its "
                             f"{num_experts} experts")
    layer_types = get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, (list, tuple))
                                    or len(layer_types) != get("num_hidden_layers")):
        raise ValueError(f"the model config's layer_types must list one entry per layer (num_hidden_layers="
                         f"{get('num_hidden_layers')}), got {layer_types!r:.80}")
    for name in ("rope_parameters", "rope_scaling", "quantization_config"):
        value = get(name)
        if value is not None and not isinstance(value, Mapping) and not hasattr(value, "quant_method"):
            raise ValueError(f"the model config's {name}={value!r:.60} must be an object")


def _refuse_unsupported(model_type: str, get) -> None:
    """ValueError naming the first config field whose value jaxpaged does not implement."""
    quantization = get("quantization_config")
    if model_type == "gpt_oss" and quantization:
        if _quant_method(quantization) != "mxfp4":  # the other methods are tested on dense families only
            raise ValueError(f"quantization_config with quant_method={_quant_method(quantization)!r} is not "
                             "supported for gpt_oss; only its released MXFP4 experts ('mxfp4') or unquantized weights")
        quantization = None  # the released checkpoints: experts dequantized at load (models/mxfp4.py)
    if quantization:  # a method models/hf_quant.py reads, or refused by name (its weights would load as garbage)
        check_quantization_config(quantization)
    act = get("hidden_activation") or get("hidden_act") if model_type in _GEMMA else get("hidden_act", "silu")
    wanted_act = "gelu_pytorch_tanh" if model_type in _GEMMA else "silu"
    if act != wanted_act:
        raise ValueError(f"hidden_act={act!r} is not supported for {model_type}; only {wanted_act} is")
    if get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported; only bias-free MLPs are implemented")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported (Qwen's max_window_layers split); set it to False")
    if model_type == "qwen3_moe":
        if get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"decoder_sparse_step={get('decoder_sparse_step')} is not supported; only 1 (every layer MoE) is"
            )
        if get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers={get('mlp_only_layers')} is not supported; only [] (every layer MoE) is")
        if get("shared_expert_intermediate_size"):
            raise ValueError("shared_expert_intermediate_size is not supported (Qwen3-MoE has no shared expert)")
    if model_type == "qwen3_next":
        if get("attention_bias", False):
            raise ValueError("attention_bias=True is not supported for qwen3_next; only bias-free projections are")
        if get("decoder_sparse_step", 1) != 1:
            raise ValueError(f"decoder_sparse_step={get('decoder_sparse_step')} is not supported; only 1 (every layer MoE) is")
        if get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers={get('mlp_only_layers')} is not supported; only [] (every layer MoE) is")
        if (get("num_experts") or get("num_local_experts")) and not get("shared_expert_intermediate_size"):
            raise ValueError("shared_expert_intermediate_size must be positive for qwen3_next (its MoE has a shared expert)")
        factor = (get("rope_parameters") or {}).get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
        if int(((get("head_dim") or get("hidden_size") // get("num_attention_heads")) * factor)) % 2:
            raise ValueError(f"partial_rotary_factor={factor} must rotate an even number of head dimensions")
    if model_type == "phi3":
        rope = get("rope_parameters")
        factor = (rope if isinstance(rope, Mapping) else {}).get("partial_rotary_factor",
                                                                 get("partial_rotary_factor", 1.0))
        if factor != 1.0:
            raise ValueError(f"partial_rotary_factor={factor} is not supported; only 1.0 (full RoPE) is")
    if model_type == "gemma3_text" and get("use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported; jaxpaged is causal only")
    if model_type == "gpt_oss":
        # vLLM's swigluoai fixes both constants too
        for name, implemented in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            if float(get(name, implemented)) != implemented:
                raise ValueError(f"{name}={get(name)} is not supported for gpt_oss; only {implemented} (the released "
                                 "models' value) is implemented")
        if not get("attention_bias", True):
            raise ValueError("attention_bias=False is not supported for gpt_oss; its checkpoints have q/k/v/o biases")


def _quant_method(quantization) -> str | None:
    if not quantization:
        return None
    return (quantization.get("quant_method") if isinstance(quantization, Mapping)
            else getattr(quantization, "quant_method", None))


def _qwen3_next_fields(get, num_layers: int, num_experts: int) -> dict:
    """Qwen3-Next's own fields: the layer pattern, the Gated DeltaNet shapes, the gated attention, the MoE."""
    layer_types = get("layer_types")
    if layer_types is None:  # HF's default: every full_attention_interval-th layer is full attention
        interval = int(get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    params = dict(get("rope_parameters") or {})
    return dict(
        layer_types=tuple(layer_types), norm_plus_one=True, attn_output_gate=True,
        partial_rotary_factor=float(params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))),
        linear_num_key_heads=get("linear_num_key_heads"), linear_num_value_heads=get("linear_num_value_heads"),
        linear_key_head_dim=get("linear_key_head_dim"), linear_value_head_dim=get("linear_value_head_dim"),
        linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
        num_experts=num_experts or 0, num_experts_per_tok=get("num_experts_per_tok") if num_experts else 0,
        moe_intermediate_size=get("moe_intermediate_size") if num_experts else 0,
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size") if num_experts else 0,
    )


def _gemma_layer_types(get, model_type: str, num_layers: int) -> tuple[str, ...]:
    if get("layer_types") is not None:
        return tuple(get("layer_types"))
    # Older config.json files: Gemma 2 alternates local/global; Gemma 3 has `sliding_window_pattern`.
    pattern = 2 if model_type == "gemma2" else int(get("sliding_window_pattern", 6))
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _read_rope(get, model_type: str):
    """(theta, scaling, local theta) from `rope_parameters` (transformers >= 5) or the older fields.

    Gemma 3 keeps one parameter set per layer type; older Gemma 3 configs have `rope_local_base_freq`.
    """
    params = dict(get("rope_parameters") or {})
    local_theta = None
    if "full_attention" in params:  # per layer type
        local = params.get("sliding_attention", {})
        _check_rope_type(local)
        local_theta = float(local.get("rope_theta", 10000.0))
        params = dict(params["full_attention"])
    elif model_type == "gemma3_text":
        local_theta = float(get("rope_local_base_freq", 10000.0))
    params.update(get("rope_scaling") or {})
    theta = float(params.get("rope_theta", get("rope_theta", 10000.0)))
    rope_type = _check_rope_type(params)
    if rope_type == "default":
        return theta, None, local_theta
    if rope_type == "yarn":
        unread = sorted(name for name in ("mscale", "mscale_all_dim") if params.get(name))
        if unread or params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"yarn rope_parameters {unread or ['partial_rotary_factor']} are not supported; only "
                             "factor, beta_fast, beta_slow, truncate, attention_factor and "
                             "original_max_position_embeddings are (and partial_rotary_factor 1.0)")
        # HF: the pretrained context defaults to max_position_embeddings (a config that names no original)
        original = int(params.get("original_max_position_embeddings") or get("original_max_position_embeddings")
                       or get("max_position_embeddings"))
        factor = float(params.get("factor") or get("max_position_embeddings") / original)
        attention = params.get("attention_factor") or (1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0)
        return theta, Yarn(factor, original, float(params.get("beta_fast") or 32.0),
                           float(params.get("beta_slow") or 1.0), bool(params.get("truncate", True)),
                           float(attention)), local_theta
    if rope_type == "longrope":
        original = int(params.get("original_max_position_embeddings") or get("original_max_position_embeddings"))
        factor = params.get("factor") or get("max_position_embeddings") / original
        attention = params.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        return theta, LongRope(tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"])),
                               original, float(attention)), local_theta
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    return theta, scaling, local_theta


def _check_rope_type(params: dict) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "longrope", "yarn"):
        raise ValueError(f"rope_type={rope_type!r} is not supported; only 'default', 'llama3', 'longrope' and 'yarn' "
                         "RoPE are")
    return rope_type
