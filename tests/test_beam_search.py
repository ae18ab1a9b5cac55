"""Beam search on the bundled SmolLM2-135M-Instruct against Hugging Face's `generate(num_beams=k)`.

The oracle is transformers' model from the same GGUF (torch, float32, CPU), asked for all k beams
with their scores (`num_return_sequences=k`, `output_scores=True`). jaxpaged runs the prompts'
searches together in one engine; the beams share pages and copy on write.
"""

import os

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.beam_search import BeamSearchParams

QUESTIONS = [
    "What is the capital of France?",  # every beam ends with eos within 8 tokens (k = 2 and 4)
    "How many legs does a spider have?",  # the best beam ends with eos at token 8
    "What does HTTP stand for?",  # no beam ends within 8 tokens
]
MORE_QUESTIONS = ["Give me a name for a pet turtle.", "Say hello.", "Write a haiku about the sea."]
# No warm-up: only the buckets these searches use are compiled (on 2 shared cores, all of them take a minute).
SMALL = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, warmup=False)


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


def chat_ids(llm, question):
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.loading import default_model_path

    torch.set_num_threads(1)
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


def hf_beams(hf_model, ids, params: BeamSearchParams, eos):
    """HF's k beams, best first: (generated token ids, score)."""
    import torch

    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), num_beams=params.beam_width, num_return_sequences=params.beam_width,
            do_sample=False, max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
            early_stopping=params.early_stopping, eos_token_id=eos, pad_token_id=eos,
            temperature=None, top_p=None, top_k=None, return_dict_in_generate=True, output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # generated tokens per beam (eos included)
    return [(out.sequences[i, len(ids):len(ids) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def assert_same_as_hf(llm, hf_model, questions, params):
    prompts = [chat_ids(llm, q) for q in questions]
    outputs = llm.beam_search(prompts, params)
    eos = llm.tokenizer.eos_token_id
    for q, ids, out in zip(questions, prompts, outputs):
        want = hf_beams(hf_model, ids, params, eos)
        got = [(b.token_ids, b.score) for b in out.beams]
        assert got[0][0] == want[0][0], f"{q!r}, {params}: best beam differs"
        assert [g[0] for g in got] == [w[0] for w in want], f"{q!r}, {params}: beams differ"
        np.testing.assert_allclose([g[1] for g in got], [w[1] for w in want], rtol=1e-4, atol=1e-5)
        for beam in out.beams:
            assert beam.text == llm.tokenizer.decode(beam.token_ids)
            assert beam.score == pytest.approx(beam.cumulative_logprob / len(beam.token_ids) ** params.length_penalty)
            assert beam.finish_reason == ("stop" if beam.token_ids[-1] == eos else "length")
    assert llm.stats()["num_used_pages"] == 0 and not llm.engine.has_unfinished_requests()
    return outputs


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beams_equal_hugging_face_with_eos_endings(llm, hf_model, beam_width):
    outputs = assert_same_as_hf(llm, hf_model, QUESTIONS, BeamSearchParams(beam_width, max_tokens=8))
    eos = llm.tokenizer.eos_token_id
    assert outputs[0].beams[0].token_ids[-1] == eos and outputs[0].beams[0].finish_reason == "stop", \
        "the best beam of the first prompt must end with eos"
    assert all(b.finish_reason == "length" for b in outputs[2].beams), "the third prompt must not stop early"


@pytest.mark.slow  # the slow searches below cover length penalties 0.5 and 2.0 on more prompts
def test_length_penalty_like_hugging_face(llm, hf_model):
    assert_same_as_hf(llm, hf_model, QUESTIONS[:2], BeamSearchParams(2, max_tokens=12, length_penalty=2.0))


@pytest.mark.slow
@pytest.mark.parametrize("beam_width", [2, 4])
@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.5, False), (1.0, True), (2.0, "never")])
def test_longer_searches_equal_hugging_face(llm, hf_model, beam_width, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width, max_tokens=24, length_penalty=length_penalty, early_stopping=early_stopping)
    assert_same_as_hf(llm, hf_model, QUESTIONS + MORE_QUESTIONS, params)


def run_watching_pages(engine, until=None):
    """Steps to the end (or until `until(step_idx)`); returns the largest page ref count seen."""
    max_ref = 0
    outputs = []
    step_idx = 0
    while engine.has_unfinished_requests() and not (until and until(step_idx)):
        outputs += engine.step()
        max_ref = max([max_ref] + list(engine.block_manager.ref_count_histogram()))
        step_idx += 1
    return max_ref, outputs


def assert_pool_empty(engine):
    stats = engine.block_manager.stats()
    assert stats["num_free_pages"] == stats["num_pages"], f"pages leaked: {stats}"
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()


def test_beams_share_pages_copy_on_write_and_leave_no_page(llm):
    """A search beside an ordinary greedy request (async engine): the beams share pages (ref counts
    > 1), writes into a shared page are copied first, the search stops early (every hypothesis
    ended with eos before max_tokens) and the greedy request's tokens are unchanged."""
    engine = llm.engine
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompts[2]], greedy)[0].outputs[0].token_ids
    copies_before = engine.block_manager.num_cow_copies

    beam_id = engine.add_beam_request(prompts[0], BeamSearchParams(4, max_tokens=40))
    greedy_id = engine.add_request(prompts[2], greedy)
    max_ref, outputs = run_watching_pages(engine)
    by_id = {o.request_id: o for o in outputs if o.finished}
    # The 4 beams share the prompt's pages (the greedy request may share its chat-template prefix too).
    assert max_ref >= 4, "the 4 beams should all share the prompt's pages"
    assert engine.block_manager.num_cow_copies > copies_before
    assert by_id[greedy_id].outputs[0].token_ids == alone
    beams = by_id[beam_id].beams
    assert len(beams) == 4 and all(b.finish_reason == "stop" and len(b.token_ids) < 40 for b in beams)
    assert_pool_empty(engine)


def test_abort_or_error_mid_search_frees_every_page(llm, monkeypatch):
    engine = llm.engine
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    request_id = engine.add_beam_request(prompts[2], BeamSearchParams(4, max_tokens=30))
    max_ref, _ = run_watching_pages(engine, until=lambda i: i == 5)
    assert max_ref > 1 and engine.has_unfinished_requests()
    engine.abort_request(request_id)
    assert_pool_empty(engine)

    # An error in the middle of LLM.beam_search: its searches are aborted, the engine keeps serving.
    real_step, calls = engine.step, []

    def failing_step(**kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return real_step(**kwargs)

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.beam_search(prompts, BeamSearchParams(2, max_tokens=30))
    monkeypatch.undo()
    assert_pool_empty(engine)
    out = llm.beam_search([prompts[0]], BeamSearchParams(2, max_tokens=8))
    assert len(out[0].beams) == 2
    assert_pool_empty(engine)


@pytest.mark.parametrize("make_call,match", [
    (lambda llm, p: llm.beam_search([p], BeamSearchParams(9, max_tokens=4)), "raise max_num_seqs or lower beam_width"),
    (lambda llm, p: llm.beam_search([p], SamplingParams()), "expected BeamSearchParams"),
    (lambda llm, p: llm.beam_search([p], BeamSearchParams(0)), "beam_width=0 must be >= 1"),
    (lambda llm, p: llm.beam_search([[]], BeamSearchParams(2)), "prompt is empty"),
    (lambda llm, p: [llm.engine.add_beam_request(p, BeamSearchParams(2), request_id="x") for _ in range(2)],
     "already in use"),
])
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(llm, make_call, match):
    prompt = chat_ids(llm, QUESTIONS[0])
    with pytest.raises(ValueError, match=match):
        make_call(llm, prompt)
    llm.engine.abort_request("x")
    assert_pool_empty(llm.engine)
    assert len(llm.beam_search([prompt], BeamSearchParams(2, max_tokens=3))[0].beams) == 2


def test_a_pool_too_small_for_the_beams_is_refused():
    small = LLM(**SMALL, num_pages=40)  # 39 usable pages of 16 tokens
    prompt = chat_ids(small, QUESTIONS[0])
    with pytest.raises(ValueError, match="give the KV cache more pages, lower beam_width or max_tokens"):
        small.beam_search([prompt], BeamSearchParams(4, max_tokens=200))
    assert small.stats()["num_used_pages"] == 0


def test_beams_and_greedy_requests_under_swap_preemption_match_an_unconstrained_run(llm):
    """A pool too small for two searches and four long greedy requests at once, preempting by swap:
    every search gives the beams it gives alone, every greedy request its tokens alone, sequences
    were swapped out and back, and no page is left in either pool. (A beam that reported and waits
    for its search is recomputed instead: it has no token left to compute.)"""
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    params = BeamSearchParams(2, max_tokens=12)
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    beams_alone = [[b.token_ids for b in out.beams] for out in llm.beam_search(prompts[:2], params)]
    greedy_alone = [o.outputs[0].token_ids for o in llm.generate(prompts + prompts[:1], greedy)]

    page_bytes = _page_bytes(llm)
    small = LLM(**SMALL, num_pages=20, preemption_mode="swap", swap_space_bytes=64 * page_bytes)
    engine = small.engine
    beam_ids = [engine.add_beam_request(p, params) for p in prompts[:2]]
    greedy_ids = [engine.add_request(p, greedy) for p in prompts + prompts[:1]]
    _, outputs = run_watching_pages(engine)
    by_id = {o.request_id: o for o in outputs if o.finished}
    assert [[b.token_ids for b in by_id[i].beams] for i in beam_ids] == beams_alone
    assert [by_id[i].outputs[0].token_ids for i in greedy_ids] == greedy_alone
    stats = engine.stats()
    assert stats["num_swaps_out"] > 0 and stats["num_swaps_in"] == stats["num_swaps_out"], stats
    assert_pool_empty(engine)
    assert stats["num_swap_pages_free"] == 64


def _page_bytes(llm):
    from jaxpaged.device.kv_cache import kv_cache_bytes_per_page

    return kv_cache_bytes_per_page(llm.engine.runner.config, llm.engine.config.page_size)
