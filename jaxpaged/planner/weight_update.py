"""What the planner does when the model's weights change under running requests (`update_params`).

    in_flight="keep"       running sequences keep their K/V (computed under the old weights) and
                           continue under the new ones; nothing here but re-salting (below)
    in_flight="recompute"  every unfinished sequence drops its K/V (device and swapped host pages)
                           and is queued again as PREEMPTED: readmitted, it recomputes all its tokens
                           (prompt + committed outputs) under the new weights, exactly the scheduler's
                           preempt-by-recompute path
    in_flight="abort"      the engine finishes them (Scheduler.abort); nothing here

In every mode, each sequence that will (re)compute K/V under the new weights (every one without
pages: waiting, and preempted by recompute) takes the new weight epoch into its prefix-cache salt
and forgets its page hashes: it can only hit pages computed under the new weights, and the pages it
registers are never served to a sequence of another epoch (planner/prefix_cache.py). A running
sequence kept under "keep", and a swapped one, keeps its old salt: its mixed-weights pages are
registered under the old epoch, where no new admission looks.

Pure Python (no jax).
"""

from __future__ import annotations

from jaxpaged.planner.prefix_cache import versioned_salt
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import SequenceStatus

IN_FLIGHT_MODES = ("keep", "recompute", "abort")


def check_in_flight(in_flight: str) -> None:
    if in_flight not in IN_FLIGHT_MODES:
        raise ValueError(f"in_flight={in_flight!r}; use one of {IN_FLIGHT_MODES}")


def discard_kv(scheduler: Scheduler) -> int:
    """Every unfinished sequence gives up its K/V and waits to be recomputed from its tokens.

    Running ones go back to the front of `waiting` in arrival order (the invariant: running +
    waiting sorted by arrival); swapped ones drop their host pages. A sequence whose token is still
    on the device is readmitted once it lands (the scheduler waits for placeholders). Pages written
    by the step in flight are freed now and reused only by later steps, ordered after it on the
    device. Returns the number of computed tokens thrown away."""
    block_manager = scheduler.block_manager
    num_dropped = 0
    for seq in reversed(scheduler.running):
        block_manager.free(seq)
        scheduler.waiting.appendleft(seq)
    scheduler.running = []
    for seq in scheduler.waiting:
        block_manager.free(seq)  # a swapped sequence's host pages; nothing for the others
        num_dropped += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        if seq.status is not SequenceStatus.WAITING:
            seq.status = SequenceStatus.PREEMPTED
    scheduler.num_recomputed_tokens += num_dropped
    return num_dropped


def resalt_waiting(scheduler: Scheduler, weight_epoch: int) -> None:
    """Waiting sequences without K/V (those waiting for a grammar too) take `weight_epoch` into their
    salt and hash their pages anew."""
    for seq in [*scheduler.waiting, *scheduler.waiting_for_grammar.values()]:
        if seq.status is SequenceStatus.SWAPPED:  # keeps its K/V (and so its epoch) until swapped in
            continue
        seq.cache_salt = versioned_salt(seq.cache_salt, weight_epoch)
        seq.page_hashes = []
