"""The model's shape and numerics, in one frozen dataclass that checks itself.

`ModelConfig.from_hf` reads a Hugging Face `PretrainedConfig` of the decoder-only families that
`jaxpaged.models.llama` implements (the list and each family's fields: `models/hf_config.py`).
"""

import dataclasses
from typing import Any

from jaxpaged.config import FP8_ACTIVATIONS, GGUF_ACTIVATIONS
from jaxpaged.models.hf_config import config_from_hf
from jaxpaged.models.rope_scaling import LongRope, RopeScaling, Yarn


_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LongRope | Yarn | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2; Llama/Qwen3 if configured)
    o_proj_bias: bool = False  # bias on the output projection (Llama/Qwen3 `attention_bias=True`)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # of weights, activations and the KV pages; logits are always float32
    # GGUF codes served as panels (EngineConfig.gguf_activations): their x in float32, or quantized to
    # Q8_1 blocks with integer sums ("q8_1", GGUF's own arithmetic: ops/gguf_panels.py).
    gguf_activations: str = "float32"
    # FP8 weights of a quantized checkpoint (EngineConfig.fp8_activations; ops/fp8_matmul.py): "float"
    # multiplies them dequantized by float activations (W8A16), "fp8" quantizes the activations too (W8A8).
    fp8_activations: str = "float"
    # Sliding window (Mistral, Phi-3, Gemma 2/3): a token at position p attends keys p-window+1..p.
    # `layer_types` names each layer "sliding_attention" or "full_attention"; None: every layer
    # is sliding when `sliding_window` is set, else full.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # Gemma 3: the RoPE base of sliding layers
    # Gemma 2/3 numerics.
    norm_plus_one: bool = False  # RMSNorm multiplies by (1 + weight)
    sandwich_norms: bool = False  # extra norms after attention and around the MLP
    scale_embedding: bool = False  # embeddings times sqrt(hidden_size)
    # or "gelu_tanh" (Gemma's gelu_pytorch_tanh), or "swigluoai" (gpt-oss experts, vLLM's name: gate clamped
    # above at 7, up to [-7, 7], (up + 1) * gate * sigmoid(1.702 gate); models/moe.py)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default head_dim)
    attn_soft_cap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_soft_cap: float | None = None  # output logits likewise
    # Mixture of experts (Mixtral, Qwen3-MoE); num_experts 0 is a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    moe_bias: bool = False  # gpt-oss: a bias on the router's logits and on every expert projection
    # gpt-oss: one learned logit per query head joins each softmax's denominator (a key with value 0).
    attention_sinks: bool = False
    # Qwen3-Next (models/qwen3_next.py): layer_types may name "linear_attention" layers (Gated DeltaNet,
    # a recurrent state per sequence: planner/state_pool.py); full attention layers gate their output
    # (sigmoid of a second half of q_proj) and rotate only the first partial_rotary_factor of head_dim.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones, gated by sigmoid

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        num_heads, num_kv_heads, head_dim, dtype = self.num_heads, self.num_kv_heads, self.head_dim, self.dtype
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads=} must be divisible by {num_kv_heads=}")
        if head_dim % 2:
            raise ValueError(f"{head_dim=} must be even: RoPE rotates pairs of dimensions")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} and rope_theta={self.rope_theta} must be positive")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations={self.gguf_activations!r} must be one of {GGUF_ACTIVATIONS}")
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8_activations={self.fp8_activations!r} must be one of {FP8_ACTIVATIONS}")
        if dtype not in _DTYPES:
            raise ValueError(f"{dtype=} is not supported; use one of {_DTYPES}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")
        if self.layer_types is not None:
            kinds = {"sliding_attention", "full_attention", "linear_attention"}
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= kinds:
                raise ValueError(
                    f"layer_types={self.layer_types} must name each of the {self.num_layers} layers "
                    "'sliding_attention', 'full_attention' or 'linear_attention'"
                )
            if self.is_hybrid and min(self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                                      self.linear_value_head_dim, self.linear_conv_kernel_dim - 1) <= 0:
                raise ValueError("linear_attention layers need positive linear_num_key_heads, linear_num_value_heads, "
                                 "linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim >= 2")
            if self.is_hybrid and self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be divisible by "
                                 f"linear_num_key_heads={self.linear_num_key_heads}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None; set it")
        if self.hidden_act not in ("silu", "gelu_tanh", "swigluoai"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; use 'silu', 'gelu_tanh' or 'swigluoai'")
        if (self.hidden_act == "swigluoai" or self.moe_bias) and not self.num_experts:
            raise ValueError(f"hidden_act={self.hidden_act!r} and moe_bias={self.moe_bias} are for MoE experts "
                             "(gpt-oss); set num_experts")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"num_experts={self.num_experts} needs 0 < num_experts_per_tok={self.num_experts_per_tok} "
                    f"<= num_experts and moe_intermediate_size={self.moe_intermediate_size} > 0"
                )

    def for_max_model_len(self, max_model_len: int) -> "ModelConfig":
        """LongRoPE: the long factors when `max_model_len` passes the original context (else unchanged)."""
        scaling = self.rope_scaling
        if not isinstance(scaling, LongRope):
            return self
        use_long = max_model_len > scaling.original_max_position_embeddings
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(scaling, use_long=use_long))

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention (Qwen3-Next): each sequence also holds a recurrent state."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V in the page pool (every layer but the linear-attention ones)."""
        if self.layer_types is None:
            return self.num_layers
        return sum(t != "linear_attention" for t in self.layer_types)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens (None: global attention)."""
        types = self.layer_types or ("sliding_attention" if self.sliding_window else "full_attention",) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    @property
    def all_layers_local(self) -> bool:
        """Every layer attends within `sliding_window`: KV older than the window is never read."""
        return all(w is not None for w in self.layer_windows)

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: str | None = None) -> "ModelConfig":
        """Reads a Hugging Face config (object or dict) of a family listed in `models/hf_config.py`.

        `dtype=None` picks float32 on CPU and bfloat16 on accelerators. A field jaxpaged does not
        implement is refused with a ValueError naming it.
        """
        return config_from_hf(cls, hf_config, dtype)
