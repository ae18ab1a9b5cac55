"""How one request wants its tokens chosen and when it wants to stop.

Pure Python (no jax): the scheduler reads the stop fields on the host, the sampler reads the
sampling fields when it builds its per-row arrays.
"""

from __future__ import annotations

import dataclasses
from typing import no_type_check


# no_type_check: __post_init__ validates every field with a ValueError that says what to do; the
# tests' run-time type checker (jaxtyping + beartype) would replace those with bare TypeErrors.
@no_type_check
@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 = off
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token); 0 = off
    seed: int | None = None  # per-request seed; None = the engine's random stream
    max_tokens: int | None = 16  # generate at most this many tokens ("length"); None = up to max_model_len
    min_tokens: int = 0  # eos / stop_token_ids do not stop before this many tokens
    stop: str | list[str] | tuple[str, ...] | None = ()  # stop strings (the engine checks text); a tuple, None = ()
    stop_token_ids: list[int] | tuple[int, ...] | None = ()  # token ids that stop ("stop"); a tuple, None = ()
    ignore_eos: bool = False  # keep generating past the model's eos token
    n: int = 1  # number of samples of the same prompt (forks share the prompt's pages)
    logprobs: bool = False  # also return the chosen tokens' log-probabilities

    def __post_init__(self) -> None:
        # Normalise the two list fields to tuples, so the object is hashable and immutable; None
        # (as vLLM users write it) means none.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, list, tuple)):
                raise ValueError(f"{name}={value!r} must be a list, a tuple or None")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        # Integer fields take ints only: 1.5 would be truncated somewhere, and True is not a count.
        for name in ("top_k", "min_tokens", "n") + (() if self.max_tokens is None else ("max_tokens",)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be an int")

        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(
                f"temperature={self.temperature} is negative; use 0 for greedy decoding or a value > 0 to sample"
            )
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} is invalid; use -1 (or 0) to turn top-k off, or a value >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to turn nucleus sampling off")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]; use 0.0 to turn min-p off")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r} must be an int or None")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1 (or None: up to max_model_len)")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(
                f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]; "
                "lower min_tokens or raise max_tokens"
            )
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a list of non-negative ints")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1; ask for at least one sample")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs={self.logprobs!r} must be True or False")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
