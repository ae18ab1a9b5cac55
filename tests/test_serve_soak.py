"""The soak under faults (jaxpaged/baseline/soak.py) against the in-process server over a tiny random model:
64 requests opened at once per round, with client disconnects, malformed bodies, a weight update and a
pause(abort) + sleep + wake in the middle of each round. After every round: no request in flight or in
the engine and no KV page in use; every well-formed request answered or ended "abort"; every malformed
one a 4xx in OpenAI's shape; RSS flat after the warm-up round; latency percentiles reported."""

import time

import jax
import pytest

from jaxpaged.baseline.soak import SoakPlan, run_soak, serving, sleep_wake_event, update_weights_event
from jaxpaged.models.llama import init_params
from test_llm_inputs import tiny_llm

MODEL = "tiny"


def soak(plan: SoakPlan) -> tuple[dict, object]:
    engine = tiny_llm(max_model_len=128, num_pages=256, max_num_seqs=16, max_num_batched_tokens=128).engine
    step = engine.step

    def slow_step():  # >= 5 ms a step: when the pause comes (16 answered), the other ~25 are still in flight
        time.sleep(0.005)
        return step()

    engine.step = slow_step
    new_params = init_params(engine.model_config, jax.random.key(1))
    events = [update_weights_event(lambda: new_params, after_first_tokens=8), sleep_wake_event(after_answered=16)]
    with serving(engine, served_model_name=MODEL) as (base, bridge):
        return run_soak(base, MODEL, bridge, plan, events), engine


def check(report: dict, plan: SoakPlan, engine) -> None:
    assert report["num_failures"] == 0, [r["failures"] for r in report["rounds"]]
    num_malformed = round(plan.num_streams * plan.malformed_fraction)
    num_disconnect = round(plan.num_streams * plan.disconnect_fraction)
    for r in report["rounds"]:
        outcomes = r["outcomes"]
        assert r["leaks"] == {"num_in_flight": 0, "num_requests": 0, "num_used_pages": 0}, r
        assert r["events"] == ["update_weights", "sleep_wake"], r  # both faults hit every round
        assert sum(outcomes.values()) == plan.num_streams + plan.num_asleep_arrivals, outcomes
        assert outcomes.get("refused") == num_malformed, outcomes
        # A disconnect whose stream ended (by the pause's abort) before it could leave counts as one too.
        assert outcomes.get("disconnected") == num_disconnect, outcomes
        assert outcomes.get("answered", 0) >= 16 and outcomes.get("aborted", 0) >= 1, outcomes  # the pause aborted some
    assert report["leaks_after_every_round"]
    assert 0 < report["latency_s"]["p50"] <= report["latency_s"]["p99"]
    assert 0 < report["ttft_s"]["p50"] <= report["ttft_s"]["p99"]
    assert report["rss_growth"] < 0.10, [r["rss_mib"] for r in report["rounds"]]
    assert engine.stats()["weight_version"] != 0 and engine.stats()["sleep_level"] == 0  # updated, and awake


def test_a_short_soak_under_faults_leaks_nothing_and_answers_every_well_formed_request():
    plan = SoakPlan(num_streams=64, num_rounds=3, max_tokens=24)
    report, engine = soak(plan)
    check(report, plan, engine)


@pytest.mark.slow
def test_a_long_soak_keeps_rss_flat():
    plan = SoakPlan(num_streams=64, num_rounds=12, max_tokens=64, seed=1)
    report, engine = soak(plan)
    check(report, plan, engine)
