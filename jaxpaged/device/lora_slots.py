"""The adapters resident on the device: `max_loras` slots of stacked, rank-padded LoRA factors.

    stacks[module]["a"]: [num_layers, num_slots, in,  max_lora_rank]      num_slots = max_loras + 1
    stacks[module]["b"]: [num_layers, num_slots, max_lora_rank, out]      b already times the scaling

    per_layer (the runner's one-buffer-per-layer layout, device/layer_params.py): a tuple over layers of
    {module: {"a": [num_slots, in, R], "b": [num_slots, R, out]}}, so each unrolled layer reads its own
    buffers (a slice of a stacked leaf would be read, or copied, as the whole stack)

    slot:      0        1           2          ...  max_loras
    holds:     base     adapter 7   adapter 3       (LRU: the slot used longest ago is reused first)
               (zeros)

Slot 0 stays zero: a token of the base model adds an exact 0 (models/lora.py). Loading an adapter
writes one slot through one jitted function whose slot index is traced, so the stacks keep their
shapes and no step or write ever recompiles. The write makes new arrays (no donation): a step still in
flight reads the stacks it was given. Which adapters a step needs is the engine's business
(engine/adapters.py); this class only maps adapter ids to slots.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.peft_adapter import AdapterWeights


class LoRASlots:
    def __init__(self, dims: dict[str, tuple[int, int]], *, num_layers: int, max_loras: int, max_lora_rank: int,
                 dtype, placement, abstract=None, per_layer: bool = False):
        # abstract: a function ShapeDtypeStruct -> ShapeDtypeStruct placing it (a compile-only runner's
        # stacks, e.g. on a virtual H100: jaxpaged/static_profile/); None: real zeros on `placement`
        self.dims, self.num_layers = dims, num_layers
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.num_slots = max_loras + 1
        self.dtype = jnp.dtype(dtype)
        zeros = ((lambda *shape: abstract(jax.ShapeDtypeStruct(shape, self.dtype))) if abstract is not None else
                 (lambda *shape: jnp.zeros(shape, self.dtype, device=placement)))
        r, s = max_lora_rank, self.num_slots
        self.per_layer = per_layer
        if per_layer:
            self.stacks = tuple({m: {"a": zeros(s, i, r), "b": zeros(s, r, o)} for m, (i, o) in dims.items()}
                                for _ in range(num_layers))
        else:
            self.stacks = {m: {"a": zeros(num_layers, s, i, r), "b": zeros(num_layers, s, r, o)}
                           for m, (i, o) in dims.items()}
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # lora id -> slot, LRU first
        self.version_of: dict[int, int] = {}  # lora id -> the version of its weights in its slot
        self.num_write_compiles = 0  # traces of the slot write (one, at warm-up)
        self.num_loads = 0  # adapters written into a slot
        self._write = jax.jit(self._write_fn)

    def _write_fn(self, stacks, slot, new):
        self.num_write_compiles += 1  # runs only while tracing
        if self.per_layer:  # new's leaves are [num_layers, ...]: layer l's part into layer l's buffers
            return tuple(jax.tree.map(lambda stack, leaf: stack.at[slot].set(leaf[layer].astype(stack.dtype)),
                                      stacks[layer], new) for layer in range(self.num_layers))
        return jax.tree.map(lambda stack, leaf: stack.at[:, slot].set(leaf.astype(stack.dtype)), stacks, new)

    def padded(self, weights: AdapterWeights | None) -> dict:
        """`weights` as one slot's host arrays, every module, zero-padded to max_lora_rank (None: zeros)."""
        out = {}
        for m, (i, o) in self.dims.items():
            a = np.zeros((self.num_layers, i, self.max_lora_rank), np.float32)
            b = np.zeros((self.num_layers, self.max_lora_rank, o), np.float32)
            if weights is not None and m in weights.modules:
                wa, wb = weights.modules[m]
                a[:, :, : wa.shape[2]], b[:, : wb.shape[1], :] = wa, wb
            out[m] = {"a": a, "b": b}
        return out

    def write(self, slot: int, weights: AdapterWeights | None) -> None:
        """Copies `weights` (None: zeros) into `slot` of every stack."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"{slot=} must be in [1, {self.num_slots}): slot 0 is the base model")
        self.stacks = self._write(self.stacks, np.int32(slot), self.padded(weights))

    def assign(self, lora_ids: Sequence[int], version: Callable[[int], int],
               weights: Callable[[int], AdapterWeights]) -> np.ndarray:
        """The slot of each of `lora_ids` (0: the base model), loading `weights(lora_id)` for those not
        resident at their current `version(lora_id)`. Slots of adapters this call does not name are reused
        least recently used first; more distinct adapters than max_loras is a bug of the caller."""
        wanted = set(lora_ids) - {0}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters but there are max_loras={self.max_loras} slots; "
                               "the scheduler must cap the adapters a step mixes")
        for lora_id in sorted(wanted):
            current = version(lora_id)
            slot = self.slot_of.get(lora_id)
            if slot is None:
                slot, stale = self._free_slot(wanted), True
            else:
                stale = self.version_of[lora_id] != current  # replaced in place (add_lora again: an RL sync)
            if stale:
                self.write(slot, weights(lora_id))
                self.num_loads += 1
            self.slot_of[lora_id], self.version_of[lora_id] = slot, current
            self.slot_of.move_to_end(lora_id)
        return np.fromiter((0 if i == 0 else self.slot_of[i] for i in lora_ids), np.int32, len(lora_ids))

    def _free_slot(self, wanted: set[int]) -> int:
        """An unused slot, else the slot of the least recently used adapter not in `wanted` (evicted)."""
        used = set(self.slot_of.values())
        free = [s for s in range(1, self.num_slots) if s not in used]
        if free:
            return free[0]
        victim = next(i for i in self.slot_of if i not in wanted)
        self.version_of.pop(victim)
        return self.slot_of.pop(victim)

    def evict(self, lora_id: int) -> None:
        """Forgets `lora_id`'s slot (its contents are never read again; the slot is free)."""
        self.slot_of.pop(lora_id, None)
        self.version_of.pop(lora_id, None)

    def warmup(self) -> None:
        """Compiles the slot write (writes zeros into slot 1, which holds no adapter yet)."""
        if self.max_loras and not self.slot_of:
            jax.block_until_ready(self._write(self.stacks, np.int32(1), self.padded(None)))

    def num_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self.stacks))
