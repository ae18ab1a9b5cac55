"""vLLM's RL names on `LLM`: pause_generation in its three modes, resume_generation, is_paused, and
weight updates staged with start_weight_update / update_weights / finish_weight_update, their version
(get_weight_version, update_weight_version) on every token. Tiny random model (tests/tp_fixtures.py),
a generate call on another thread, as a rollout worker's.

Oracles: "keep" with new weights differing only in lm_head (which K/V do not depend on) must give the
tokens of a fresh engine continuing from the same tokens; "abort" / "wait" are checked by finish
reasons, token counts and an empty pool; a paused engine is checked not to step at all.
"""

import threading
import time

import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.planner.request import SamplingParams
from tests.tp_fixtures import make_engine, prompts, tiny_params

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def start_generate(llm, prompt_list, max_tokens):
    """generate() on a thread; returns (thread, result holder)."""
    result = {}

    def run():
        try:
            result["outputs"] = llm.generate(prompt_list, SamplingParams(max_tokens=max_tokens, **GREEDY))
        except Exception as err:  # surfaced by the test
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def wait_for_tokens(llm, at_least, timeout=120):
    deadline = time.monotonic() + timeout
    while llm.engine.num_generated_tokens < at_least:
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.01)


def scaled_head(params, factor=-1.5):
    new = dict(params)
    new["params"] = dict(params["params"])
    new["params"]["lm_head"] = np.asarray(params["params"]["lm_head"]) * factor
    return new


def test_keep_freezes_requests_and_continues_them_under_new_weights(params):
    llm = LLM.from_engine(make_engine(params))
    prompt = prompts()[3]
    thread, result = start_generate(llm, [prompt], max_tokens=24)
    wait_for_tokens(llm, 3)
    llm.pause_generation(mode="keep")
    assert llm.is_paused()
    frozen = llm.engine.num_generated_tokens
    time.sleep(0.5)
    assert llm.engine.num_generated_tokens == frozen  # nothing steps while paused
    assert llm.engine.num_unfinished_requests == 1 and llm.stats()["num_used_pages"] > 0  # K/V kept
    new = scaled_head(params)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"params": new}})
    llm.finish_weight_update(weight_version="step-1")
    assert llm.get_weight_version() == "step-1"
    llm.resume_generation()
    thread.join(120)
    assert not llm.is_paused() and "error" not in result
    out = result["outputs"][0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24
    k = out.weight_versions.count(0)
    assert 3 <= k < 24 and out.weight_versions[k:] == ["step-1"] * (24 - k)
    # Oracle: a fresh engine on the new weights continuing from the tokens sampled under the old ones.
    fresh = make_engine(new)
    fresh.add_request(prompt + out.token_ids[:k], SamplingParams(max_tokens=24 - k, **GREEDY))
    tail = None
    while fresh.has_unfinished_requests():
        for o in fresh.step():
            tail = o.outputs[0].token_ids
    assert out.token_ids[k:] == tail


def test_abort_ends_requests_and_holds_new_ones_until_resume(params):
    llm = LLM.from_engine(make_engine(params))
    thread, result = start_generate(llm, prompts()[2:4], max_tokens=40)
    wait_for_tokens(llm, 2)
    llm.pause_generation(mode="abort")
    thread.join(60)
    assert not thread.is_alive() and "error" not in result
    outs = [o.outputs[0] for o in result["outputs"]]
    assert all(o.finish_reason == "abort" and len(o.token_ids) < 40 for o in outs)
    assert llm.stats()["num_used_pages"] == 0 and not llm.engine.has_unfinished_requests()
    later, later_result = start_generate(llm, prompts()[1:2], max_tokens=4)  # while paused: queued, not stepped
    time.sleep(0.5)
    assert later.is_alive() and llm.engine.num_unfinished_requests == 1
    llm.resume_generation()
    later.join(60)
    assert later_result["outputs"][0].outputs[0].finish_reason == "length"


def test_wait_lets_requests_finish_then_pauses(params):
    llm = LLM.from_engine(make_engine(params))
    thread, result = start_generate(llm, prompts()[2:4], max_tokens=12)
    wait_for_tokens(llm, 2)
    llm.pause_generation(mode="wait")
    assert llm.is_paused() and not llm.engine.has_unfinished_requests()
    thread.join(60)
    outs = [o.outputs[0] for o in result["outputs"]]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outs)
    llm.resume_generation()


def test_weight_update_steps_are_checked_and_versions_relabel(params):
    llm = LLM.from_engine(make_engine(params))
    with pytest.raises(ValueError, match="start_weight_update"):
        llm.update_weights({"update_info": {"params": params}})
    with pytest.raises(ValueError, match="start_weight_update"):
        llm.finish_weight_update()
    llm.start_weight_update()
    with pytest.raises(ValueError, match="already started"):
        llm.start_weight_update()
    with pytest.raises(ValueError, match="update_info"):
        llm.update_weights({"params": params})
    with pytest.raises(ValueError, match="nothing staged"):
        llm.finish_weight_update()
    with pytest.raises(ValueError, match="mode="):
        llm.pause_generation(mode="later")
    assert llm.get_weight_version() == "0"
    llm.update_weight_version("v7")
    assert llm.get_weight_version() == "v7"
    out = llm.generate([prompts()[0]], SamplingParams(max_tokens=2, **GREEDY))[0].outputs[0]
    assert out.weight_versions == ["v7", "v7"]
