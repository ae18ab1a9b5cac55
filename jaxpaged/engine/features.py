"""The one interface optional features of the step implement.

The step itself (engine.py) knows no feature. It holds a list of `StepFeature`s and calls each hook,
in list order, at its point of the step:

    before_schedule(scheduler)   -> outputs   requests a feature ends before planning (a grammar that
                                              failed to compile); grammars that compiled join the queue
    scheduler.schedule()
    after_schedule(out)                       proposals taken whole or removed; page moves noted;
                                              beams preempted after reporting forget their report
    ── StepRunner.run (device/step_runner.py) ──
    before_execute(out)          -> dict      the draft model proposes; extra StepInput arguments
                                              (several logits rows per verified sequence)
    after_execute(step, input, prev, result)  -> result   the step program's result, with what the
                                              feature reads split off (routed expert ids); the draft
                                              model mirrors the step
    sample_args(out)             -> dict      what the sampler needs of the feature (its rows, a mask)
    after_sample(step, logits)                device work on the logits (speculative verification)
    ── back in the engine ──
    commits_at_once(step)        -> bool      the next step needs this one's tokens on the host first
    ── RequestLifecycle.commit (engine/lifecycle.py), when the step's tokens land ──
    before_commit(step)                       read back what the feature dispatched; roll back
    amend_update(step, update)                tokens the feature appended, sequences it finished
    after_commit(step)           -> outputs   outputs the feature completes (beam searches)

    warmup(runner, sampler), stats()          start-up compiles; counters for `LLMEngine.stats`

Every hook does nothing here: a feature overrides the ones it needs. Per-step state a feature
carries from dispatch to commit goes in `step.pending[feature.name]`. Host only: no jax.
"""

from __future__ import annotations


class StepFeature:
    name = "feature"  # the key of its per-step state in StepResult.pending

    def before_schedule(self, scheduler) -> list:
        return []

    def after_schedule(self, out) -> None:
        pass

    def before_execute(self, out) -> dict:
        return {}

    def after_execute(self, step, step_input, prev_tokens, result):
        return result

    def sample_args(self, out) -> dict:
        return {}

    def after_sample(self, step, logits) -> None:
        pass

    def commits_at_once(self, step) -> bool:
        return False

    def before_commit(self, step) -> None:
        pass

    def amend_update(self, step, update) -> None:
        pass

    def after_commit(self, step) -> list:
        return []

    def warmup(self, runner, sampler) -> None:
        pass

    def stats(self) -> dict:
        return {}
