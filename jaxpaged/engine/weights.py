"""The engine's weights over time: updates with requests in flight, versions, sleep and wake-up.

    update_params(params, version=, in_flight=)   between two steps (the caller holds the engine)
        validate + place the new weights (runner: same tree and shapes; resharded leaf by leaf)
        "keep"       running requests continue on their K/V computed under the old weights
        "recompute"  their K/V are dropped and recomputed from their tokens under the new weights
        "abort"      they finish with finish_reason "abort" (final outputs come out of the next step())
        then: weight epoch + 1 (prefix-cache salt of everything computed from now on), prefix cache
        reset, every sample's next token starts a run of the new `version`

A step already dispatched (asynchronous scheduling) ran under the old weights: its tokens land
with the old version. The compiled step is reused (the weights are an argument, same shapes).

    sleep(level)   only with no request in the engine; level 1: KV pool freed, weights to host;
                   level 2: KV pool and weights freed
    wake_up()      KV pool back (zeros), weights back (level 1); after level 2 update_params must
                   have brought weights (before or after wake_up) before anything is generated
While asleep, add_request raises (nothing is queued): call wake_up() first.
"""

from __future__ import annotations

from jaxpaged.device.sleep import SLEEP_LEVELS, sleep_runner, wake_runner
from jaxpaged.models.gguf_blocks import REFUSED_UPDATE, has_kept_weights
from jaxpaged.planner.weight_update import check_in_flight, discard_kv, resalt_waiting


def check_version(version) -> None:
    """A weight version is a label: an int (jaxpaged's) or a str (vLLM's weight_version), or None."""
    if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
        raise ValueError(f"version={version!r}; pass an int or a str (or None for the next version)")


def next_version(version: int | str) -> int | str:
    """The version `update_params(version=None)` gives: an int's next, or a str label kept (vLLM's rule: no
    new label given, the label stays)."""
    return version + 1 if isinstance(version, int) else version


class WeightLifecycle:
    """Which weights the engine runs (user version, internal epoch), their updates, sleep and wake-up."""

    def __init__(self, runner, scheduler, processor, *, keeps_gguf_codes: bool, draft_runner=None,
                 beam_searches=None):
        self.runner, self.draft_runner = runner, draft_runner  # the draft's weights stay on the host asleep
        self.scheduler, self.processor = scheduler, processor
        self.beam_searches = beam_searches  # truthy while beam searches run (they refuse recompute/abort)
        # quantization="gguf": only trees of GGUF codes may replace these weights (kept across sleep).
        self.keeps_gguf_codes = keeps_gguf_codes
        self.version = 0  # the label users give (`update_params(version=)`); recorded per token
        self.epoch = 0  # bumped on every update: the prefix cache's salt (versions may repeat)
        self.sleep_level = 0  # 0: awake
        self.has_params = True  # False after sleep(level=2) until update_params
        self.aborted_outputs: list = []  # final RequestOutputs of in_flight="abort", for the next step()

    def check_awake(self) -> None:
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (sleep(level={self.sleep_level})); call wake_up() first")
        if not self.has_params:
            raise RuntimeError("the engine has no weights since sleep(level=2); call update_params(params) first")

    def take_aborted_outputs(self) -> list:
        outputs, self.aborted_outputs = self.aborted_outputs, []
        return outputs

    def update_params(self, params, *, version: int | str | None, in_flight: str) -> None:
        """Applies new weights between two steps (aborted requests' final outputs: aborted_outputs)."""
        check_in_flight(in_flight)
        check_version(version)
        if in_flight != "keep" and self.beam_searches:
            raise ValueError(f"in_flight={in_flight!r} with beam searches running; use in_flight='keep' "
                             "or finish the searches first")
        if self.keeps_gguf_codes and not has_kept_weights(params):
            raise ValueError(REFUSED_UPDATE)  # float weights for an engine serving GGUF codes (models/gguf_blocks.py)
        self.runner.update_params(params)  # ValueError on a wrong tree/shape/dtype: nothing changed
        self.version = next_version(self.version) if version is None else version
        self.epoch += 1
        self.has_params = True
        if self.sleep_level:  # the weights are on the device now; wake_up restores only the KV pool
            self.runner.params_on_host = False
        scheduler = self.scheduler
        if in_flight == "abort":
            self.abort_running()
        elif in_flight == "recompute":
            discard_kv(scheduler)
        resalt_waiting(scheduler, self.epoch)
        scheduler.block_manager.reset_prefix_cache()
        self.processor.start_weight_version(self.version)

    def abort_running(self) -> int:
        """Finishes every request with finish_reason "abort" (their final outputs come out of the next
        step(): aborted_outputs); returns how many."""
        for request in self.processor.requests.values():
            for sample in request.samples:
                self.scheduler.abort(sample.seq.seq_id)
        finished = self.processor.finish_all("abort")
        self.aborted_outputs += finished
        return len(finished)

    def set_version(self, version: int | str) -> None:
        """Labels the current weights `version` (vLLM's update_weight_version): tokens sampled from now on carry it."""
        check_version(version)
        if version is None:
            raise ValueError("version=None; pass the label (an int or a str)")
        self.version = version
        self.processor.start_weight_version(version)

    def sleep(self, level: int) -> None:
        """Call with no request in the engine (the caller checks: their K/V live in the pool freed here)."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level={level!r}; use 1 (weights kept in host memory) or 2 (weights dropped)")
        if self.sleep_level:
            raise ValueError(f"the engine already sleeps at level {self.sleep_level}; call wake_up() first")
        self.scheduler.block_manager.reset_prefix_cache()  # the pool's contents are gone
        sleep_runner(self.runner, level)
        if self.draft_runner is not None:  # the draft model's weights stay on the host: update_params brings only the target's
            sleep_runner(self.draft_runner, 1)
        self.sleep_level = level
        if level == 2:
            self.has_params = False

    def wake_up(self) -> None:
        if not self.sleep_level:
            return  # awake already: nothing to restore
        wake_runner(self.runner)
        if self.draft_runner is not None:
            wake_runner(self.draft_runner)
        self.sleep_level = 0


def reset_prefix_cache(engines, reset_running_requests: bool) -> bool:
    """vLLM's reset_prefix_cache on one engine or every data-parallel replica: forgets every cached
    page; with reset_running_requests, running requests also give up their K/V and are recomputed
    from their tokens (same weights: same outputs). Refused, before any engine changes, while beam
    searches run."""
    if reset_running_requests and any(engine.beams for engine in engines):
        raise ValueError("reset_running_requests=True with beam searches running; finish them first "
                         "or reset only the cache (reset_running_requests=False)")
    for engine in engines:
        if reset_running_requests:
            discard_kv(engine.scheduler)
        engine.block_manager.reset_prefix_cache()
    return True
