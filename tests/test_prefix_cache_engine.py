"""The prefix cache through the engine: what a finished request leaves behind for the next one."""

import pytest

from jaxpaged import SamplingParams
from test_llm_inputs import tiny_llm

PROMPT = list(range(300, 313))  # 13 tokens: 3 full pages of 4, and one partial page


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_finished_in_its_first_step_leaves_its_prompt_pages_to_the_cache(async_scheduling):
    # max_tokens=1: the request finishes in the step that commits its first token. Under
    # asynchronous stepping that commit also frees its pages; the prompt's full pages must be
    # registered in the prefix cache first, or the next request with the same prompt recomputes them.
    llm = tiny_llm(async_scheduling=async_scheduling)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    first = llm.generate([PROMPT], greedy)[0]
    second = llm.generate([PROMPT], greedy)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 12  # the 3 full prompt pages
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.stats()["num_used_pages"] == 0
