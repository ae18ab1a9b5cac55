"""What an RL loop drives between rollouts, under vLLM's names: pausing generation, and weight updates
staged in chunks (`LLM.pause_generation`, `start_weight_update` ... `finish_weight_update`).

    pause_generation(mode=)      the gate closes: no call steps the engine until resume_generation
        "abort"  every request finishes now, finish_reason "abort" (its call returns that output)
        "wait"   requests already in the engine run to their end first (their calls return)
        "keep"   requests stay where they are, K/V kept; they continue after resume_generation
    start_weight_update()        opens a staged update
    update_weights(request)      {"update_info": {"params": tree}} (jaxpaged's parameter tree),
                                 {"update_info": {"weights": {hf_name: array} or [(name, array)]}}
                                 (Hugging Face names, chunks merged) or {"update_info": {"leaves":
                                 {tree path: array}}} (chunks merged; what a jax_transfer pull of kind
                                 "params" stages, entrypoints/weight_transfer.py); nothing is applied yet
    finish_weight_update(weight_version=)   applies what was staged between two steps (update_params,
                                 in_flight="keep"): kept requests continue under the new weights

The gate is a condition variable the LLM's calls wait on before each step; a call whose requests
all finished while paused (abort, wait) returns without waiting for resume.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r}: use one of {PAUSE_MODES} (abort: end requests now, wait: let them "
                         "finish, keep: freeze them until resume_generation)")


class GenerationGate:
    """Whether the LLM's calls may step the engine."""

    def __init__(self):
        self._condition = threading.Condition()
        self.paused = False

    def close(self) -> None:
        with self._condition:
            self.paused = True

    def open(self) -> None:
        with self._condition:
            self.paused = False
            self._condition.notify_all()

    def notify(self) -> None:
        """Wakes waiting calls to look at their outputs (a draining pause stepped for them)."""
        with self._condition:
            self._condition.notify_all()

    def wait(self, done: Callable[[], bool]) -> None:
        """Returns once the gate is open, or `done()` (the caller has outputs to hand out, or nothing left)."""
        with self._condition:
            self._condition.wait_for(lambda: not self.paused or done())


class StagedWeights:
    """One weight update staged in chunks: start, update (any number), finish."""

    def __init__(self):
        self.active = False
        self.params = None  # a whole jaxpaged tree, or None
        self.weights: dict = {}  # Hugging Face name -> array, merged over chunks
        self.leaves: dict = {}  # jaxpaged tree path (jax.tree_util.keystr) -> array, merged over chunks

    def start(self) -> None:
        if self.active:
            raise ValueError("a weight update is already started; call finish_weight_update() before starting another")
        self.active, self.params, self.weights, self.leaves = True, None, {}, {}

    def add(self, request) -> None:
        if not self.active:
            raise ValueError("no weight update is started; call start_weight_update() first")
        info = request.get("update_info") if isinstance(request, Mapping) else getattr(request, "update_info", None)
        if not isinstance(info, Mapping) or not ({"params", "weights", "leaves"} & info.keys()):
            raise ValueError("update_weights takes {'update_info': {'params': tree}} (jaxpaged's parameter tree), "
                             "{'update_info': {'weights': {name: array} or [(name, array), ...]}} (Hugging Face "
                             "names) or a jax_transfer offer (entrypoints/weight_transfer.py)")
        kinds = [k for k in ("params", "weights", "leaves") if k in info]
        mixed = [k for k, staged in (("params", self.params is not None), ("weights", bool(self.weights)),
                                     ("leaves", bool(self.leaves))) if staged and k not in kinds]
        if len(kinds) > 1 or mixed:
            raise ValueError(f"this update mixes {sorted(set(kinds + mixed))}; send one kind per update: a 'params' "
                             "tree, Hugging Face 'weights' chunks, or jaxpaged tree-path chunks")
        if "params" in info:
            self.params = info["params"]
        for key, merged in (("weights", self.weights), ("leaves", self.leaves)):
            if key in info:
                chunk = info[key]
                merged.update(chunk.items() if isinstance(chunk, Mapping) else chunk)

    def finish(self) -> tuple[str, object]:
        """("params", tree), ("weights", {name: array}) or ("leaves", {path: array}); the update is closed
        either way."""
        if not self.active:
            raise ValueError("no weight update is started; call start_weight_update() first")
        params, weights, leaves = self.params, self.weights, self.leaves
        self.active, self.params, self.weights, self.leaves = False, None, {}, {}
        if params is not None:
            return "params", params
        if weights:
            return "weights", weights
        if leaves:
            return "leaves", leaves
        raise ValueError("finish_weight_update() with nothing staged; call update_weights(...) first")
