"""Host side of logprobs and penalties: device slots of token state, and `{id: Logprob}` dicts.

    TokenSlots      which sequence owns which row of the device TokenState (device/token_state.py);
                    a row is written once when its sequence first samples (or resumes after a
                    preemption), then only the jitted sampler updates it
    TokenDecoder    decoded_token of an id (`tokenizer.decode([id])`, cached per id)
    step_logprobs   the sampler's per-row arrays, read back once per step, as numpy
    logprobs_entry  one position's {token_id: Logprob}: the chosen / prompt token, then the top k
    PromptTargets   which tokens of a step need prompt logprobs, and where their dicts go
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpaged.device.token_state import TokenState, host_slot_rows, init_slot, zeros_token_state
from jaxpaged.engine.outputs import Logprob
from jaxpaged.planner.sequence import Sequence, SequenceStatus


class TokenSlots:
    """Rows of the device TokenState, one per running sequence that uses penalties or biases.

    A slot is freed as soon as its sequence stops running (finished, aborted, preempted): the
    device applies steps in dispatch order, so a row reused by another sequence is rewritten by
    `init_slot` before any later step reads it, whatever earlier step still writes the old one.
    A preempted sequence gets a fresh slot built from its landed tokens when it samples again.
    """

    def __init__(self, num_slots: int, vocab_size: int, place=None):
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self._place = place  # tensor parallelism: replicate over the mesh, as the logits are
        self._state: TokenState | None = None  # allocated on first use (or at warm-up)
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, tuple[int, Sequence]] = {}  # seq_id -> (slot, seq)

    @property
    def state(self) -> TokenState:
        if self._state is None:
            state = zeros_token_state(self.num_slots, self.vocab_size)
            self._state = state if self._place is None else self._place(state)
        return self._state

    @state.setter
    def state(self, value: TokenState) -> None:
        self._state = value

    def release_stopped(self) -> None:
        """Frees the slots of sequences no longer running (called before each step's rows are built)."""
        for seq_id, (slot, seq) in list(self._owner.items()):
            if seq.status is not SequenceStatus.RUNNING:
                del self._owner[seq_id]
                self._free.append(slot)

    def slot_of(self, seq: Sequence) -> int:
        """`seq`'s slot, initialised from its prompt and landed outputs if it has none yet."""
        owned = self._owner.get(seq.seq_id)
        if owned is not None:
            return owned[0]
        slot = self.new_slot(seq)
        self._owner[seq.seq_id] = (slot, seq)
        return slot

    def new_slot(self, seq: Sequence) -> int:
        """A slot initialised for `seq`'s tokens, not yet owned (n > 1 fan-out: `assign` it to a child)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} token-state slots are in use; this is a bug (one per "
                               "running sequence is enough)")
        slot = self._free.pop()
        params = seq.sampling_params
        rows = host_slot_rows(self.vocab_size, seq.prompt_token_ids, seq.output_token_ids, params.logit_bias,
                              params.allowed_token_ids)
        self.state = init_slot(self.state, np.int32(slot), *rows)
        return slot

    def assign(self, seq: Sequence, slot: int) -> None:
        self._owner[seq.seq_id] = (slot, seq)


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
    """sampler_ext.token_logprobs' arrays on the host, as Python lists (one conversion per step)."""

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
