"""Penalties: the per-sequence token state on the device that penalties, logit bias and
allowed_token_ids read, and which sequence owns which of its rows.

    TokenState (device, donated through every step that uses it), one row per slot:
      counts      int32 [slots, V]   occurrences of each id among the sequence's generated tokens
      prompt_mask bool  [slots, V]   ids that occur in its prompt (repetition_penalty only)
      bias        f32   [slots, V]   logit_bias, and -inf outside allowed_token_ids

A slot is given to a sequence the first time it samples (`init_slot`, one host->device row write)
and rebuilt from the host's tokens if it is preempted and resumes; the sampler then adds each row's
drawn token to its counts inside the jitted step (`add_tokens`), so no token comes back to the host
for this. Rows without a slot pass slot -1: they read zeros and write nothing. `TokenSlots` (host)
holds the state and knows which sequence owns which slot.

Penalties, in vLLM's order, on logits x of a row (c = counts, m = prompt_mask | c > 0):
    x += bias                                                   (logit_bias; -inf outside allowed ids)
    x = where(m, where(x > 0, x / repetition, x * repetition), x)    (HF RepetitionPenaltyLogitsProcessor)
    x -= frequency * c + presence * (c > 0)                     (OpenAI: generated tokens only)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxpaged.planner.sequence import Sequence, SequenceStatus

HostOrDevice = Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenState:
    counts: Int[Array, "slots vocab_size"]
    prompt_mask: Bool[Array, "slots vocab_size"]
    bias: Float[Array, "slots vocab_size"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyArrays:
    """Per output row (padded like SamplingArrays; padding rows: slot -1, no penalty)."""

    slot: Int[HostOrDevice, "num_rows"]  # int32, the row's TokenState slot, -1 = none
    presence: Float[HostOrDevice, "num_rows"]  # float32
    frequency: Float[HostOrDevice, "num_rows"]  # float32
    repetition: Float[HostOrDevice, "num_rows"]  # float32, 1 = off


def zeros_token_state(num_slots: int, vocab_size: int) -> TokenState:
    return TokenState(
        counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((num_slots, vocab_size), jnp.bool_),
        bias=jnp.zeros((num_slots, vocab_size), jnp.float32),
    )


def make_penalty_arrays(rows: list[tuple[int, float, float, float]], num_rows: int) -> PenaltyArrays:
    """rows: (slot, presence, frequency, repetition) per output row, in sampler-row order."""
    rows = rows + [(-1, 0.0, 0.0, 1.0)] * (num_rows - len(rows))
    slot, presence, frequency, repetition = zip(*rows)
    return PenaltyArrays(
        slot=np.array(slot, np.int32), presence=np.array(presence, np.float32),
        frequency=np.array(frequency, np.float32), repetition=np.array(repetition, np.float32),
    )


def host_slot_rows(vocab_size: int, prompt_token_ids, output_token_ids, logit_bias, allowed_token_ids):
    """The (counts, prompt_mask, bias) numpy rows of a sequence, as `init_slot` writes them."""
    counts = np.bincount(np.asarray([t for t in output_token_ids if t >= 0], np.int64), minlength=vocab_size)
    prompt_mask = np.zeros(vocab_size, np.bool_)
    prompt_mask[np.asarray(prompt_token_ids, np.int64)] = True
    bias = np.zeros(vocab_size, np.float32)
    if allowed_token_ids is not None:
        bias[:] = -np.inf
        bias[np.asarray(allowed_token_ids, np.int64)] = 0.0
    for token_id, value in (logit_bias or {}).items():
        bias[token_id] += value
    return counts[:vocab_size].astype(np.int32), prompt_mask, bias


@functools.partial(jax.jit, donate_argnums=(0,))  # one compile: the rows have fixed shapes
def init_slot(state: TokenState, slot, counts, prompt_mask, bias) -> TokenState:
    return TokenState(
        counts=state.counts.at[slot].set(counts),
        prompt_mask=state.prompt_mask.at[slot].set(prompt_mask),
        bias=state.bias.at[slot].set(bias),
    )


def apply_penalties(
    x: Float[Array, "num_rows vocab_size"], state: TokenState, pen: PenaltyArrays
) -> Float[Array, "num_rows vocab_size"]:
    """x with the rows' bias and penalties applied (module docstring); rows with slot -1 unchanged."""
    has_slot = (pen.slot >= 0)[:, None]
    slot = jnp.maximum(pen.slot, 0)
    counts = jnp.where(has_slot, state.counts[slot], 0)
    seen = jnp.where(has_slot, state.prompt_mask[slot], False) | (counts > 0)
    x = x + jnp.where(has_slot, state.bias[slot], 0.0)
    repetition = pen.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / repetition, x * repetition), x)
    return x - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0)


def add_tokens(state: TokenState, slot: Int[Array, "num_rows"], tokens: Int[Array, "num_rows"]) -> TokenState:
    """counts[slot[r], tokens[r]] += 1 for rows with a slot (slot -1 points past the slots: dropped)."""
    rows = jnp.where(slot >= 0, slot, state.counts.shape[0])
    return dataclasses.replace(state, counts=state.counts.at[rows, tokens].add(1, mode="drop"))


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
