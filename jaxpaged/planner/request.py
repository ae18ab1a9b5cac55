"""A request's lifecycle rules, in one place: its parameters, its seeds, and every stop rule.

    SamplingParams            what the request asks for (validated here, once)
    seed_for                  the seed of sample j of a request
    check_prompt_fits         a prompt must leave room for one generated token
    banned_token_ids          the min_tokens ban: stop tokens masked while fewer than min_tokens are out
    token_stop_reason         token-level stops at commit: "length" (max_tokens / max_model_len), "stop"
                              (eos unless ignore_eos, stop_token_ids), once min_tokens are out
    stop_string_match         string-level stops: a stop string ending in newly added text, where to cut
    stop_prefix_len           what a stream holds back: the end of the text that may start a stop string
    placeholder_token_id/row  the stand-in for a token sampled on the device, not yet read back

The scheduler calls `token_stop_reason` once per token at commit; the output processor calls
`stop_string_match` on the text that token added; the sampler rows take `banned_token_ids`. Pure Python
(no jax).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import no_type_check

from jaxpaged.planner.structured_params import StructuredOutputsParams


# no_type_check: __post_init__ validates every field with a ValueError that says what to do; the
# tests' run-time type checker (jaxtyping + beartype) would replace those with bare TypeErrors.
# Mutable, as vLLM's (RL code sets `params.max_tokens = ...` between calls): the engine takes a
# validated copy of it at add_request, so a change afterwards never reaches a running request.
@no_type_check
@dataclasses.dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 = off
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 = off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token); 0 = off
    seed: int | None = None  # per-request seed, any 64-bit int (SEED_MIN..SEED_MAX); None (or -1, as vLLM) = random
    max_tokens: int | None = 16  # generate at most this many tokens ("length"); None = up to max_model_len
    min_tokens: int = 0  # eos / stop_token_ids do not stop before this many tokens
    stop: str | list[str] | tuple[str, ...] | None = ()  # stop strings (the engine checks text); a tuple, None = ()
    stop_token_ids: list[int] | tuple[int, ...] | None = ()  # token ids that stop ("stop"); a tuple, None = ()
    ignore_eos: bool = False  # keep generating past the model's eos token
    n: int = 1  # number of samples of the same prompt (forks share the prompt's pages)
    # Log-probabilities (vLLM): k in 0..MAX_LOGPROBS = the chosen token plus the k most likely, per
    # generated token; None = none. True is 1 (as in vLLM, where a bool is an int), False None.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token (teacher-forced); None = none
    # Penalties and biases (vLLM / OpenAI semantics), applied on the device:
    presence_penalty: float = 0.0  # subtracted once from every token already generated; in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens; in [-2, 2]
    repetition_penalty: float = 1.0  # HF: logits of prompt or generated tokens / p (> 0) or * p (<= 0); > 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (finite, or -inf: banned)
    allowed_token_ids: list[int] | tuple[int, ...] | None = None  # only these may be drawn; None = all
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema / regex / choice / grammar
    # Output text (vLLM's fields):
    include_stop_str_in_output: bool = False  # keep the stop string, or the stop token's text, in `text`
    skip_special_tokens: bool = True  # leave special tokens (eos, chat markers) out of `text`
    # Spaces between special tokens in `text`: vLLM's fast tokenizers ignore it, and so does jaxpaged.
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, `text` stays "" (no stop strings)
    extra_args: dict | None = None  # for custom sampling code (vLLM's): carried, never read by the engine

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
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's "no seed"
            object.__setattr__(self, "seed", None)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed={self.seed!r} must be an int in [{SEED_MIN}, {SEED_MAX}] (any signed or unsigned "
                             "64-bit integer) or None")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # True = 1 (vLLM: a bool is an int); False = none
                object.__setattr__(self, name, 1 if value else None)
            elif value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r} must be None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2]; 0 turns it off")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0; 1 turns it off")
        if self.logit_bias is not None:  # any finite bias, or -inf to ban a token (vLLM takes any float)
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_token_id(k) and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and (math.isfinite(v) or v == -math.inf) for k, v in self.logit_bias.items()):
                raise ValueError(f"logit_bias={self.logit_bias!r} must map token ids (ints >= 0) to finite biases "
                                 "(or -inf to ban a token)")
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids or not all(
                    map(_is_token_id, self.allowed_token_ids)):
                raise ValueError(f"allowed_token_ids={self.allowed_token_ids!r} must be a non-empty list of "
                                 "token ids (ints >= 0), or None for all")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))

        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if not self.detokenize and stop:
            raise ValueError("stop strings need the text: detokenize=False gives token ids only; "
                             "use stop_token_ids, or detokenize=True")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args={self.extra_args!r} must be a dict or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs={self.structured_outputs!r} must be a StructuredOutputsParams "
                "(from jaxpaged import StructuredOutputsParams) or None"
            )

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`)."""
        return copy.deepcopy(self)

    @property
    def needs_token_state(self) -> bool:
        """Whether sampling needs the per-sequence token counts and bias row kept on the device."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.allowed_token_ids is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MAX_LOGPROBS = 20  # the most log-probabilities per token a request may ask for (vLLM's default cap)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# A request's seed is any integer a 64-bit client can send, signed or unsigned (OpenAI's and vLLM's
# seeds are 64-bit): a seed and its value modulo 2**64 are the same seed (-1 is 2**64 - 1). The
# sampler's PRNG key takes 32 bits, so `seed_for` folds the 64 into them: seeds below 2**32 are kept
# as they are, larger ones are mixed (splitmix64's finalizer), not truncated, so 2**32 + s and s
# draw differently. The engine draws the seeds of requests without one in [0, SEED_MASK].
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
SEED_MASK = 2**31 - 1
_MASK64 = 2**64 - 1


def _fold_seed(seed: int) -> int:
    """A 64-bit seed as the sampler's 32-bit one (identity below 2**32)."""
    z = seed & _MASK64
    if z < 2**32:
        return z
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def seed_for(seed: int, sample_idx: int) -> int:
    """The sampler's 32-bit seed of a request's sample `sample_idx`; sample 0 uses the request's own."""
    seed = _fold_seed(seed)
    return seed if sample_idx == 0 else (seed * 1_000_003 + sample_idx * 7_919) & SEED_MASK


def request_params(params: SamplingParams, max_logprobs: int, extra_stop_ids: tuple[int, ...],
                   vocab_size: int) -> SamplingParams:
    """The copy of `params` a request keeps, validated again: SamplingParams is mutable (as vLLM's),
    so a caller's later change never reaches a running request, and a change since construction is
    checked like a new one. Logprobs are capped by the engine's max_logprobs; `extra_stop_ids` (a
    generation config's other end tokens) join stop_token_ids unless ignore_eos; token ids must be
    in the vocabulary."""
    params = dataclasses.replace(params)
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > max_logprobs:
            raise ValueError(f"{name}={getattr(params, name)} is more than this engine's max_logprobs="
                             f"{max_logprobs}; ask for fewer, or raise max_logprobs (at most {MAX_LOGPROBS})")
    if extra_stop_ids and not params.ignore_eos:
        params.stop_token_ids = tuple(dict.fromkeys((*params.stop_token_ids, *extra_stop_ids)))
    check_token_ids_in_vocab(params, vocab_size)  # logit_bias, allowed and stop ids
    return params


def check_token_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Raises ValueError for token ids in `params` outside a model's vocabulary [0, vocab_size)."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """Raises ValueError when a prompt leaves no room for a generated token under max_model_len."""
    if num_prompt_tokens + 1 > max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens but max_model_len={max_model_len} leaves no room for a "
            "generated token; raise max_model_len or shorten the prompt"
        )


def check_prompt_token_ids(prompt_token_ids, vocab_size: int, max_model_len: int) -> None:
    """ValueError for a prompt no engine of this model can serve: empty, ids outside the vocabulary,
    or too long for max_model_len."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt is empty; give at least one token or a non-empty string")
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) or hasattr(t, "__index__")) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}; "
            "encode the text with this model's tokenizer"
        )
    check_prompt_fits(len(prompt_token_ids), max_model_len)


def check_fits_pool(max_num_tokens: int, page_size: int, num_usable_pages: int) -> None:
    """The longest a request may grow to must fit the whole pool, so that it can always finish alone."""
    num_pages_needed = -(-max_num_tokens // page_size)
    if num_pages_needed > num_usable_pages:
        raise ValueError(
            f"request may grow to {max_num_tokens} tokens = {num_pages_needed} pages of {page_size} tokens, but "
            f"the pool holds only {num_usable_pages} pages; give the KV cache more pages, lower max_tokens "
            "or shorten the prompt"
        )


def banned_token_ids(stop_token_set: frozenset[int], num_output_tokens: int, min_tokens: int) -> tuple[int, ...]:
    """Token ids the sampler masks for a sequence that has `num_output_tokens` outputs (landed or not).

    Under min_tokens the stop tokens are masked in the logits (as vLLM and HF do), so the sequence
    draws its most likely non-stop token instead of a stop that commit would ignore. The token
    drawn now is output number num_output_tokens + 1: it may stop once that reaches min_tokens.
    """
    return tuple(sorted(stop_token_set)) if num_output_tokens < min_tokens else ()


def token_stop_reason(token_idx: int, token_id: int, num_output_tokens: int, max_num_tokens: int,
                      stop_token_set: frozenset[int], min_tokens: int) -> str | None:
    """Why the token just committed at `token_idx` of token_ids ends its sequence, or None.

    `num_output_tokens` counts it. "stop": a stop token (eos unless ignore_eos, stop_token_ids) once
    min_tokens outputs are out, even as the last token allowed (vLLM's check_stop order);
    "length": it is the max_num_tokens-th token (prompt + max_tokens, capped by max_model_len).
    """
    if token_id in stop_token_set and num_output_tokens >= min_tokens:
        return "stop"
    if token_idx + 1 >= max_num_tokens:
        return "length"
    return None


def stop_string_match(text: str, num_new_chars: int, params: SamplingParams,
                      num_output_tokens: int) -> tuple[str, int] | None:
    """String-level stop, as vLLM's detokenizer: the stop string completing earliest in the last
    `num_new_chars` characters (ties: the first in `params.stop`) and where the text is cut (before
    it, or after it with include_stop_str_in_output), or None. Under min_tokens only text after
    the min_tokens-th token counts: its token and those before it never stop (a string begun there
    may end in a later token), so call this with the characters the token after it added."""
    if num_output_tokens <= params.min_tokens:
        return None
    found = find_stop(text, num_new_chars, params.stop)
    if found is None:
        return None
    start, stop = found
    return stop, start + len(stop) if params.include_stop_str_in_output else start


def find_stop(text: str, num_new_chars: int, stops) -> tuple[int, str] | None:
    """(start, stop string) of the stop string that ends earliest within the last `num_new_chars`
    characters (ties: the first in `stops`), or None.

        text:  ... a b c d | e f g        num_new_chars = 3, stop "cde": search from len - 3 - 3 + 1
                    ^ a hit must start here or later, so that it ends in the new characters

    """
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if idx >= 0 and (best is None or idx + len(stop) < best[0] + len(best[1])):
            best = (idx, stop)
    return best


def stop_prefix_len(text: str, stops) -> int:
    """Characters a stream holds back: the longest end of `text` that could still grow into a stop
    string (a proper prefix of one), so no more than that. With stop "cat!":

        "The ca"   -> 2 ("ca" may become "cat!")       "The cap" -> 0 (nothing can)

    """
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def placeholder_token_id(row: int) -> int:
    """The stand-in for a token sampled on device into sampler row `row` (>= 0), not yet read back."""
    return -1 - row


def placeholder_row(token_id):
    """Inverse of `placeholder_token_id` (an int, or a numpy array of placeholders)."""
    return -1 - token_id
