"""RoPE scaling a model's config may carry (`ModelConfig.rope_scaling`): Llama 3's frequency scaling and
Phi-3's LongRoPE. Plain frozen dataclasses that check themselves; `models/hf_config.py` reads them from a
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
