"""RoPE scaling a model's config may carry (`ModelConfig.rope_scaling`): Llama 3's frequency scaling,
Phi-3's LongRoPE and gpt-oss's YaRN. Plain frozen dataclasses that check themselves; `models/hf_config.py` reads them from a
Hugging Face config, `models/llama.py` turns them into frequencies (`rope_inv_freq`).
"""

import dataclasses


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
class LongRope:
    """Phi-3's LongRoPE (`rope_type: "longrope"`): per-frequency divisors, short below the original
    context and long past it, and cos/sin times `attention_factor`.

    Which set a step uses is fixed per engine, as vLLM does: the long factors when the engine's
    max_model_len exceeds `original_max_position_embeddings` (`ModelConfig.for_max_model_len`).
    Hugging Face chooses per forward by the longest position in it; the two agree for every sequence
    of an engine whose max_model_len <= original (short) and for a forward past it (long).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    use_long: bool = False

    def __post_init__(self):
        if len(self.short_factor) != len(self.long_factor) or min(self.short_factor + self.long_factor) <= 0:
            raise ValueError("longrope short_factor and long_factor must be positive lists of head_dim / 2 values")


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN (`rope_type: "yarn"`, gpt-oss): each frequency blended between its original value and the value
    divided by `factor`, by a linear ramp over the dimensions between the ones that turn `beta_fast` and
    `beta_slow` times over the original context; cos/sin times `attention_factor` (0.1 ln(factor) + 1 by
    default). `truncate` (HF's, default True) rounds the ramp's ends to whole dimensions; gpt-oss sets False."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self):
        if self.factor <= 0 or self.original_max_position_embeddings <= 0 or self.attention_factor <= 0:
            raise ValueError(f"yarn factor={self.factor}, original_max_position_embeddings="
                             f"{self.original_max_position_embeddings} and attention_factor={self.attention_factor} "
                             "must be positive")
