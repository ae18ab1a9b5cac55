"""The engine with the Pallas kernels (interpret mode on the CPU) gives the reference's tokens."""

import pytest

from jaxpaged import LLM, SamplingParams

SMALL = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, page_size=16)
PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]


@pytest.mark.slow
def test_pallas_backend_matches_reference_greedy():
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = LLM(attention_backend="reference", **SMALL)
    want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params)]
    pallas = LLM(attention_backend="pallas", **SMALL)
    got = [o.outputs[0].token_ids for o in pallas.generate(PROMPTS, params)]
    assert got == want
    assert pallas.stats()["num_used_pages"] == 0
