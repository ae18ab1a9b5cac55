"""The step's one interface for optional features (engine/features.py): every hook is called at its
point of the step, in order, and the step itself names no feature."""

import ast
import inspect
import textwrap

from jaxpaged.device.step_runner import StepRunner
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.engine.features import StepFeature
from jaxpaged.engine.lifecycle import RequestLifecycle
from jaxpaged.planner.request import SamplingParams
from tp_fixtures import make_engine, tiny_params

HOOKS_OF_A_STEP = ["before_schedule", "after_schedule", "before_execute", "after_execute", "sample_args",
                   "after_sample", "commits_at_once", "before_commit", "amend_update", "after_commit"]
# Synchronous scheduling commits every step at once: no feature is asked.
HOOKS_OF_A_SYNCHRONOUS_STEP = [hook for hook in HOOKS_OF_A_STEP if hook != "commits_at_once"]


class Recording(StepFeature):
    """Records every hook call; `at_once` says whether steps must be committed in the call that dispatched them."""

    name = "recording"

    def __init__(self, at_once: bool = False):
        self.calls, self.at_once = [], at_once

    def before_schedule(self, scheduler):
        self.calls.append("before_schedule")
        return []

    def after_schedule(self, out):
        self.calls.append("after_schedule")

    def before_execute(self, out):
        self.calls.append("before_execute")
        return {}

    def after_execute(self, step, step_input, prev_tokens, result):
        self.calls.append("after_execute")
        step.pending[self.name] = step.idx  # per-step state, read back at this step's commit
        return result

    def sample_args(self, out):
        self.calls.append("sample_args")
        return {}

    def after_sample(self, step, logits):
        self.calls.append("after_sample")

    def commits_at_once(self, step):
        self.calls.append("commits_at_once")
        return self.at_once

    def before_commit(self, step):
        self.calls.append("before_commit")
        assert step.pending[self.name] == step.idx

    def amend_update(self, step, update):
        self.calls.append("amend_update")

    def after_commit(self, step):
        self.calls.append("after_commit")
        return []


def _engine_with(feature, **overrides):
    engine = make_engine(tiny_params(), **overrides)
    engine.features.append(feature)  # the list the step runner and the lifecycle iterate too
    return engine


def test_a_synchronous_step_calls_every_hook_once_in_the_order_of_the_step():
    feature = Recording()
    engine = _engine_with(feature, async_scheduling=False)
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine.step()
    assert feature.calls == HOOKS_OF_A_SYNCHRONOUS_STEP
    feature.calls.clear()
    outputs = engine.step()  # the second (last) token: the same hooks again
    assert feature.calls == HOOKS_OF_A_SYNCHRONOUS_STEP and outputs[0].finished


def test_a_feature_that_needs_the_tokens_at_once_turns_overlap_off():
    overlapping, at_once = Recording(), Recording(at_once=True)
    for feature, keeps_in_flight in ((overlapping, True), (at_once, False)):
        engine = _engine_with(feature)  # asynchronous scheduling
        engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        engine.step()
        engine.step()  # steady decoding: overlapped unless a feature says otherwise
        assert (engine._in_flight is not None) is keeps_in_flight
        if keeps_in_flight:  # the step in flight is committed in the next call: its before_commit comes later
            assert feature.calls[-1] == "commits_at_once"
        else:
            assert feature.calls[-3:] == ["before_commit", "amend_update", "after_commit"]
        while engine.has_unfinished_requests():
            engine.step()


def test_a_step_with_nothing_scheduled_still_asks_before_and_after_scheduling():
    feature = Recording()
    engine = _engine_with(feature)
    assert engine.step() == [] and feature.calls == ["before_schedule", "after_schedule"]


def _attributes(function) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_the_step_names_no_feature_and_has_no_test_hook():
    features = {"spec", "beams", "structured", "routed", "events", "spec_plan", "beam_candidates"}
    for function in (LLMEngine.step, LLMEngine._keeps_in_flight, StepRunner.run, RequestLifecycle.advance,
                     RequestLifecycle.commit):
        named = _attributes(function) & features
        assert not named, f"{function.__qualname__} names {sorted(named)}: plug the feature in through StepFeature"
