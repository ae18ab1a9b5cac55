"""One `LLM` used from several threads, and streams left half-consumed (issue 18 items 3, 4).

Every wait is bounded: a call that hangs fails the test instead of hanging the suite.
"""

import threading

import pytest

from jaxpaged import SamplingParams
from test_llm_inputs import tiny_llm

TIMEOUT_S = 60


def run_bounded(fn, *args):
    """fn(*args) in a daemon thread; fails if it does not return within TIMEOUT_S."""
    result = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 (re-raised below, in the test's thread)
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), f"{fn.__name__} did not return within {TIMEOUT_S} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


PROMPTS_A = [[504, 3575, 282], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
PROMPTS_B = [[17, 18], [700, 800, 900, 1000], [42] * 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _streamed(llm, prompts, params):
    """Per request, the concatenated delta_token_ids of a stream and its final token ids."""
    deltas, final = {}, {}
    for out in llm.stream(prompts, params):
        deltas.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        if out.finished:
            final[out.request_id] = out.outputs[0].token_ids
    assert deltas == final
    return list(final.values())


def test_threads_calling_generate_and_stream_get_their_own_outputs(llm):
    want_a = _tokens(llm.generate(PROMPTS_A, GREEDY))
    want_b = _tokens(llm.generate(PROMPTS_B, GREEDY))
    for _ in range(3):
        results = {}
        barrier = threading.Barrier(3)

        def worker(name, fn):
            barrier.wait()
            results[name] = fn()

        threads = [
            threading.Thread(target=worker, args=("a", lambda: _tokens(llm.generate(PROMPTS_A, GREEDY)))),
            threading.Thread(target=worker, args=("b", lambda: _tokens(llm.generate(PROMPTS_B, GREEDY)))),
            threading.Thread(target=worker, args=("s", lambda: _streamed(llm, PROMPTS_B, GREEDY))),
        ]
        for t in threads:
            t.daemon = True
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        assert not any(t.is_alive() for t in threads), "a call hung"
        assert results == {"a": want_a, "b": want_b, "s": want_b}
        stats = llm.stats()
        assert stats["num_used_pages"] == 0 and stats["num_requests"] == 0


def test_half_consumed_stream_keeps_running_and_its_pages_are_counted(llm):
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = _tokens(llm.generate([PROMPTS_A[0]], long))[0]

    stream = llm.stream([PROMPTS_A[0]], long)
    first = next(stream)
    stats = llm.stats()
    assert stats["num_requests"] == 1 and stats["num_used_pages"] > 0

    # Another call steps the engine: the stream's request advances with it, and stays counted.
    assert _tokens(run_bounded(llm.generate, PROMPTS_B, SamplingParams(temperature=0.0, max_tokens=3)))
    stats = llm.stats()
    assert stats["num_requests"] == 1 and stats["num_used_pages"] > 0

    # Nothing was lost: the rest of the stream's deltas complete its tokens.
    rest = run_bounded(list, stream)
    tokens = list(first.outputs[0].delta_token_ids)
    for out in rest:
        tokens += out.outputs[0].delta_token_ids
    assert tokens == want and rest[-1].finished and rest[-1].outputs[0].token_ids == want
    assert llm.stats()["num_used_pages"] == 0


def test_half_consumed_stream_that_finishes_during_another_call_gets_its_final_output(llm):
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = _tokens(llm.generate([PROMPTS_A[1]], short))[0]
    stream = llm.stream([PROMPTS_A[1]], short)
    first = next(stream)
    # This call outlives the stream's request: its final output must wait for the stream.
    run_bounded(llm.generate, PROMPTS_B, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stats = llm.stats()
    assert stats["num_requests"] == 0 and stats["num_used_pages"] == 0  # finished: pages already free
    rest = run_bounded(list, stream)
    tokens = list(first.outputs[0].delta_token_ids)
    for out in rest:
        tokens += out.outputs[0].delta_token_ids
    assert rest[-1].finished and rest[-1].outputs[0].token_ids == want and tokens == want


def test_closing_a_half_consumed_stream_frees_its_pages(llm):
    stream = llm.stream([PROMPTS_A[1]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    next(stream)
    assert llm.stats()["num_used_pages"] > 0
    stream.close()
    stats = llm.stats()
    assert stats["num_used_pages"] == 0 and stats["num_requests"] == 0


def test_a_call_whose_request_was_retired_elsewhere_raises_instead_of_looping(llm):
    stream = llm.stream([PROMPTS_A[0]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    first = next(stream)
    llm.engine.abort_request(first.request_id)  # retired behind the call's back
    with pytest.raises(RuntimeError, match="aborted outside this call"):
        run_bounded(list, stream)
    assert llm.stats()["num_used_pages"] == 0
