"""Routed experts per token (vLLM's `enable_return_routed_experts`), for rollout router replay in RL.

With the engine flag on, the step program also returns each token's top-k expert ids in every MoE
layer, [num_tokens, num_layers, top_k] int16 (models/moe.py sows them; with the flag off the step is
the default program and nothing is returned). `CompletionOutput.routed_experts` is, as in vLLM, an
array [len(prompt) + len(output) - 1, num_layers, top_k]: one row per token that was fed to the model
(the last sampled token has not been).

A sequence does not compute every one of its tokens itself: prefix-cache hits, a fork's shared
prompt and swapped-back pages were computed earlier, maybe by another sequence. So the host keeps
the rows where the K/V is kept, by KV slot, and moves them whenever pages move:

    by_slot[page_id * page_size + offset]        device pages   (written by every committed step)
    host_by_slot[host_page_id * page_size + ...] host pages     (swap, the prefix cache's host tier)

    moves, in the order the device makes them:   swap_out  device page -> host page
                                                 swap_in   host page   -> device page
                                                 copies    device page -> device page (copy-on-write)

A step dispatched as step k takes the moves planned since step k-1's dispatch; its commit applies
them, writes its own rows by slot, then gives each scheduled sequence the rows of positions
[min(recorded, start), start + n) read through its block table as it was at dispatch. Commits run in
dispatch order, so the host tables see the same history the device's pages do.

Host only (numpy).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpaged.engine.features import StepFeature

ROUTED_DTYPE = np.int16  # expert ids; every MoE model's num_experts fits (checked at start-up)


@dataclasses.dataclass
class RoutedStep:
    """What a dispatched step's commit needs: the page moves before it, and which rows go where."""

    moves: list[tuple[str, int, int]]  # ("out" | "in" | "copy", src page, dst page), in device order
    slots: np.ndarray  # int32 [num_tokens]: the step's slot mapping (padding past the pool)
    wanted: list[tuple[int, int, np.ndarray]]  # (seq_id, first position, slots of positions first..)
    ids: object = None  # the step's ids on the device, int16 [num_tokens (padded), L, k]


def routed_experts_recorder(config, model_config, num_pages: int, num_host_pages: int) -> RoutedExpertsRecorder | None:
    """The engine's recorder, or None with the flag off (the default: nothing recorded, nothing returned)."""
    if not config.enable_return_routed_experts:
        return None
    if not model_config.num_experts:
        raise ValueError("enable_return_routed_experts needs a mixture-of-experts model (Mixtral, Qwen3-MoE); "
                         "this one has a dense MLP")
    return RoutedExpertsRecorder(num_pages=num_pages, num_host_pages=num_host_pages,
                                 page_size=config.page_size, num_layers=model_config.num_layers,
                                 top_k=model_config.num_experts_per_tok, num_experts=model_config.num_experts)


class RoutedExpertsRecorder(StepFeature):
    """A feature of the step (engine/features.py): page moves noted after scheduling, the step's ids
    split off its result after execution, applied at commit."""

    name = "routed"

    def __init__(self, *, num_pages: int, num_host_pages: int, page_size: int, num_layers: int, top_k: int,
                 num_experts: int):
        if num_experts > np.iinfo(ROUTED_DTYPE).max:
            raise ValueError(f"num_experts={num_experts} does not fit int16 routed-expert ids")
        self.page_size = page_size
        row = (num_layers, top_k)
        self.by_slot = np.zeros((num_pages * page_size, *row), ROUTED_DTYPE)
        self.host_by_slot = np.zeros((num_host_pages * page_size, *row), ROUTED_DTYPE)
        self.rows: dict[int, np.ndarray] = {}  # seq_id -> [capacity, L, k]; positions < lengths valid
        self.lengths: dict[int, int] = {}
        self._moves: list[tuple[str, int, int]] = []

    def after_schedule(self, out) -> None:
        """A planned step's host transfers (issued even when it schedules nothing), in device order."""
        self._moves += [("out", *pair) for pair in out.swap_out] + [("in", *pair) for pair in out.swap_in]

    def after_execute(self, step, step_input, prev_tokens, result):
        logits, step.pending[self.name] = self.plan(step.out, step_input.slot_mapping, result)
        return logits

    def before_commit(self, step) -> None:
        self.commit(step.pending[self.name])

    def plan(self, out, slot_mapping: np.ndarray, result) -> tuple[object, RoutedStep]:
        """At dispatch, before the scheduler advances: splits the step's `result` into (what the engine
        reads as logits, RoutedStep) and notes which rows each scheduled sequence wants."""
        ps, wanted = self.page_size, []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            first = min(self.lengths.get(seq.seq_id, 0), start)
            positions = np.arange(first, start + n)
            pages = np.asarray(seq.block_table, np.int64)[positions // ps]
            wanted.append((seq.seq_id, first, pages * ps + positions % ps))
        moves, self._moves = self._moves + [("copy", *pair) for pair in out.copies], []
        logits, ids = result
        ids.copy_to_host_async()
        return logits, RoutedStep(moves, np.asarray(slot_mapping, np.int64).copy(), wanted, ids)

    def commit(self, step: RoutedStep) -> None:
        """Applies the step's page moves, then its ids (read back here: waits for the device)."""
        ps, routed = self.page_size, np.asarray(step.ids)
        for kind, src, dst in step.moves:
            source = self.host_by_slot if kind == "in" else self.by_slot
            target = self.host_by_slot if kind == "out" else self.by_slot
            target[dst * ps : (dst + 1) * ps] = source[src * ps : (src + 1) * ps]
        real = step.slots < len(self.by_slot)  # padding tokens carry a slot past the pool
        self.by_slot[step.slots[real]] = routed[: len(step.slots)][real]
        for seq_id, first, slots in step.wanted:
            end = first + len(slots)
            rows = self.rows.get(seq_id)
            if rows is None or len(rows) < end:
                grown = np.zeros((max(end, 2 * (0 if rows is None else len(rows)), 64),) + self.by_slot.shape[1:],
                                 ROUTED_DTYPE)
                if rows is not None:
                    grown[: len(rows)] = rows
                self.rows[seq_id] = rows = grown
            rows[first:end] = self.by_slot[slots]
            self.lengths[seq_id] = end

    def rows_of(self, seq_id: int, num_fed: int) -> np.ndarray:
        """[num_fed, L, k]: the rows of positions [0, num_fed) (a view; those rows never change)."""
        rows = self.rows.get(seq_id)
        if rows is None:
            return np.zeros((0,) + self.by_slot.shape[1:], ROUTED_DTYPE)
        return rows[: min(num_fed, self.lengths[seq_id])]

    def forget(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)
        self.lengths.pop(seq_id, None)
