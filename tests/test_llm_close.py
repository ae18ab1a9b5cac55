"""`LLM.close()` and `with LLM(...) as llm:` (issue 53 item 1): requests of open calls aborted, the
KV cache and weights off the device, every later call refused; tiny random model, CPU."""

import jax
import pytest

from jaxpaged import SamplingParams
from test_llm_inputs import tiny_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_leaving_the_with_block_aborts_open_streams_and_frees_the_device():
    with tiny_llm() as llm:
        expected = llm.generate(["Hello there"], GREEDY)[0].outputs[0].token_ids
        stream = llm.stream(["Hello there"], GREEDY)
        first = next(stream)
        assert first.outputs[0].token_ids == expected[: len(first.outputs[0].token_ids)]
        engine = llm.engine
        device_bytes = engine.runner.kv_cache_bytes() + sum(x.nbytes for x in jax.tree.leaves(engine.params))
        live = _live_bytes()
    assert live - _live_bytes() >= device_bytes  # KV pages and weights deleted
    assert engine.stats()["num_used_pages"] == 0 and not engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="aborted outside this call"):
        next(stream)  # its request was aborted by close()
    for call in (lambda: llm.generate(["Hi"], GREEDY), lambda: list(llm.stream(["Hi"], GREEDY)), llm.wake_up):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    llm.close()  # again: nothing to do


def test_close_refuses_while_requests_it_does_not_own_run_and_closes_nothing():
    llm = tiny_llm()
    request_id = llm.engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="mode='wait'"):
        llm.close()
    assert llm.engine.has_request(request_id) and llm.engine.stats()["sleep_level"] == 0
    llm.engine.abort_request(request_id)
    llm.close()
    assert llm.engine.stats()["sleep_level"] == 2
