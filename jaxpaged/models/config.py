"""The model's shape and numerics, in one frozen dataclass that checks itself.

`ModelConfig.from_hf` reads a Hugging Face `PretrainedConfig` of the decoder-only families that
`jaxpaged.models.llama` implements: Llama (Llama 2/3, SmolLM2, Mistral without a sliding window),
Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm on each head of q and k).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

_DTYPES = ("float32", "bfloat16", "float16")
_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type: "llama3"` in Hugging Face configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor={self.factor} must be positive")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope scaling needs 0 < low_freq_factor={self.low_freq_factor} "
                f"< high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"original_max_position_embeddings={self.original_max_position_embeddings} must be positive"
            )


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
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2; Llama/Qwen3 if configured)
    o_proj_bias: bool = False  # bias on the output projection (Llama/Qwen3 `attention_bias=True`)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # of weights, activations and the KV pages; logits are always float32

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
        if dtype not in _DTYPES:
            raise ValueError(f"{dtype=} is not supported; use one of {_DTYPES}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: str | None = None) -> "ModelConfig":
        """Reads a Hugging Face Llama/Mistral/Qwen2/Qwen3 config (object or dict).

        `dtype=None` picks float32 on CPU and bfloat16 on accelerators.
        """
        get = hf_config.get if isinstance(hf_config, Mapping) else lambda k, d=None: getattr(hf_config, k, d)
        model_type = get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; jaxpaged implements {_ARCHITECTURES}"
            )
        if get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported; only bias-free MLPs are implemented")
        if model_type == "mistral" and get("sliding_window") is not None:
            raise ValueError(
                f"sliding_window={get('sliding_window')} is not supported; "
                "use a Mistral checkpoint without sliding-window attention"
            )
        if model_type in ("qwen2", "qwen3") and get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported; set it to False")
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={get('hidden_act')!r} is not supported; only silu is")

        rope_theta, rope_scaling = _read_rope(get)
        num_heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // num_heads
        bias = bool(get("attention_bias", False))
        if dtype is None:
            dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an output bias; the others use one flag for both.
            attention_bias=True if model_type == "qwen2" else bias,
            o_proj_bias=False if model_type == "qwen2" else bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=get("max_position_embeddings", 2048),
            dtype=dtype,
        )


def _read_rope(get) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 folds theta and scaling into `rope_parameters`; older configs have
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(get("rope_parameters") or {})
    params.update(get("rope_scaling") or {})
    theta = float(params.get("rope_theta", get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; only 'default' and 'llama3' RoPE are"
        )
    scaling = RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    return theta, scaling
