"""Logprobs, device and host: the sampler's per-row arrays, and the `{id: Logprob}` dicts made of them.

    device (inside the jitted sampler / model step)
      token_logprobs         per row: the chosen id's logprob and 1-based rank, the top NUM_TOP_LOGPROBS
      with_every_token       the logits rows a step keeps: each sequence's last token, then (prompt
                             logprobs) every token of the step
      split_prompt_logprobs  those logits split back: the sequences' rows, and token_logprobs of every
                             token at its next prompt token
    host (after the step's arrays are read back)
      HostLogprobs           token_logprobs' arrays as Python lists, read once per step; `entry` gives
                             one position's {token_id: Logprob}: the chosen / prompt token, then the top k
      TokenDecoder           decoded_token of an id (`tokenizer.decode([id])`, cached per id)
      prompt_targets         which tokens of a step need prompt logprobs (PromptChunk: where their dicts go)
      Logprob                vLLM's Logprob (engine/outputs.py re-exports it)

The device rows of token state that penalties read, and which sequence owns which, are penalties.py's.

Importing this module never imports jax: engine/outputs.py re-exports `Logprob`, and `import jaxpaged`
stays jax-free (tests/test_layout.py). The three device functions import jax when they are traced;
their shapes are in their docstrings, since jaxtyping's annotations would import jax here.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

NUM_TOP_LOGPROBS = 20  # = planner.request.MAX_LOGPROBS: the width every row's top logprobs are taken at


class Logprob(NamedTuple):
    """vLLM's Logprob: one token's log-probability, its 1-based rank in the distribution (1 = most
    likely), and its text alone (`tokenizer.decode([token_id])`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def token_logprobs(logprobs, token_ids) -> dict:
    """The chosen ids' logprobs and 1-based ranks, and each row's top NUM_TOP_LOGPROBS.

    logprobs: float32 [rows, vocab_size]; token_ids: int32 [rows]. Returns "chosen" f32 [rows],
    "rank" int32 [rows], "top_values" f32 [rows, 20], "top_ids" int32 [rows, 20].
    """
    import jax
    import jax.numpy as jnp

    chosen = jnp.take_along_axis(logprobs, token_ids[:, None], axis=1)
    rank = 1 + jnp.sum(logprobs > chosen, axis=1).astype(jnp.int32)
    top_values, top_ids = jax.lax.top_k(logprobs, min(NUM_TOP_LOGPROBS, logprobs.shape[1]))
    return {"chosen": chosen[:, 0], "rank": rank, "top_values": top_values, "top_ids": top_ids.astype(jnp.int32)}


def with_every_token(logits_indices, targets):
    """The model's logits rows: each sequence's last token, then (prompt logprobs) every token.

    logits_indices: int32 [num_seqs]; targets: int32 [num_tokens] or None.
    """
    import jax.numpy as jnp

    if targets is None:
        return logits_indices
    return jnp.concatenate([logits_indices, jnp.arange(targets.shape[0], dtype=jnp.int32)])


def split_prompt_logprobs(logits, num_seqs: int, targets):
    """logits (no targets), or (the sequences' logits, token_logprobs of every token at its target).

    logits: [num_seqs + num_tokens, vocab_size] with targets, int32 [num_tokens] (-1: none), else [num_seqs, vocab_size].
    """
    import jax
    import jax.numpy as jnp

    if targets is None:
        return logits
    per_token = jax.nn.log_softmax(logits[num_seqs:], axis=1)
    return logits[:num_seqs], token_logprobs(per_token, jnp.maximum(targets, 0))


class TokenDecoder:
    """decoded_token for Logprob: each id decoded alone once, then cached."""

    def __init__(self, tokenizer):
        self._decode = getattr(tokenizer, "decode", None)
        self._cache: dict[int, str | None] = {}

    def __call__(self, token_id: int) -> str | None:
        text = self._cache.get(token_id)
        if text is None and token_id not in self._cache:
            # Special tokens show as themselves ("<|im_end|>"), as vLLM's decoded_token does.
            text = self._decode([token_id], skip_special_tokens=False) if self._decode is not None else None
            self._cache[token_id] = text
        return text


@dataclasses.dataclass(slots=True)
class HostLogprobs:
    """token_logprobs' arrays on the host, as Python lists (one conversion per step)."""

    chosen: list[float]
    rank: list[int]
    top_values: list[list[float]]
    top_ids: list[list[int]]

    @classmethod
    def read(cls, arrays: dict) -> HostLogprobs:
        return cls(*(np.asarray(arrays[k]).tolist() for k in ("chosen", "rank", "top_values", "top_ids")))

    def entry(self, row: int, token_id: int, k: int, decode: TokenDecoder) -> dict[int, Logprob]:
        """{token_id: Logprob} of row `row`: `token_id` first, then the row's top k (rank = position)."""
        out = {token_id: Logprob(self.chosen[row], self.rank[row], decode(token_id))}
        values, ids = self.top_values[row], self.top_ids[row]
        for i in range(k):
            top_id = ids[i]
            if top_id not in out:
                out[top_id] = Logprob(values[i], i + 1, decode(top_id))
        return out


@dataclasses.dataclass(slots=True)
class PromptChunk:
    """Prompt tokens of one request computed in a step: flat tokens [flat_start, flat_start + count)
    give the dicts of prompt positions first_position + 1 ..."""

    request: object  # output_processor.RequestState
    flat_start: int
    first_position: int
    count: int


def prompt_targets(out, owner, num_tokens: int) -> tuple[np.ndarray | None, list[PromptChunk]]:
    """Per flat token of the step, the next prompt token where a request asks for prompt logprobs
    (-1 elsewhere), and the chunks to fill at commit; (None, []) when no scheduled request asks."""
    targets, chunks, flat = None, [], 0
    for seq, num_new in zip(out.seqs, out.num_new_tokens):
        start = seq.num_computed_tokens
        owned = owner.get(seq.seq_id)
        if owned is not None and owned[0].params.prompt_logprobs is not None:
            last = min(start + num_new, seq.num_prompt_tokens - 1)  # positions < last predict a prompt token
            if last > start:
                if targets is None:
                    targets = np.full(num_tokens, -1, np.int32)
                targets[flat : flat + last - start] = seq.prompt_token_ids[start + 1 : last + 1]
                chunks.append(PromptChunk(owned[0], flat, start, last - start))
        flat += num_new
    return targets, chunks
