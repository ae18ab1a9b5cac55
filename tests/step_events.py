"""Which engine step is dispatched and read back when, observed from outside the step (it has no test hook)."""

from jaxpaged.device.step_runner import StepResult


def record_events(engine, monkeypatch) -> list[tuple[str, int]]:
    """("dispatch", n) when step n is dispatched, ("readback", n) when its sampled tokens are read back,
    observed by wrapping the step runner and StepResult.read_tokens (the step has no test hook)."""
    events = []
    dispatch = engine.step_runner.run

    def recording_run(*args):
        step = dispatch(*args)
        if step is not None:
            events.append(("dispatch", step.idx))
        return step

    read = StepResult.read_tokens

    def recording_read(step):
        if step.tokens is not None:
            events.append(("readback", step.idx))
        return read(step)

    monkeypatch.setattr(engine.step_runner, "run", recording_run)
    monkeypatch.setattr(StepResult, "read_tokens", recording_read)
    return events
