"""The asynchronous engine on a tiny random model: the same outputs as synchronous stepping, the
overlap itself (instrumented, not timed), and streaming that never shows a stop string.

The tokenizer is a stand-in whose token `t` reads as a fixed piece of text, so stop strings can be
placed exactly: across two tokens, or deep inside one long piece.
"""

import jax
import numpy as np
import pytest

from jaxpaged.ops.attention import reference_paged_attention
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.config import EngineConfig
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.llama import init_params
from jaxpaged.planner.request import SamplingParams
from step_events import record_events

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, max_position_embeddings=128,
)
PAGE_SIZE = 4


class PieceTokenizer:
    """Token t reads as `piece(t)`; no eos."""

    eos_token_id = None

    def __init__(self, piece):
        self.piece = piece

    def detokenizer(self, prompt_token_ids=(), skip_special_tokens=True):
        tokenizer = self

        class Detokenizer:
            def step(self, token_id):
                return tokenizer.piece(token_id)

            def flush(self):
                return ""

        return Detokenizer()


@pytest.fixture(scope="module")
def tiny_params():
    # std 0.02 weights give nearly flat logits: sharpen, so that greedy tokens vary.
    return jax.tree.map(lambda x: np.asarray(x) * 5, init_params(TINY, jax.random.key(0)))


def make_engine(params, *, async_scheduling=True, piece=lambda t: f"<{t}>", num_pages=64, max_num_seqs=4,
                max_num_batched_tokens=16):
    config = EngineConfig(
        page_size=PAGE_SIZE, num_pages=num_pages, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=64, async_scheduling=async_scheduling,
        warmup=False,
    ).resolved(on_gpu=False, model_max_len=TINY.max_position_embeddings)
    return LLMEngine(TINY, params, PieceTokenizer(piece), config, num_pages=num_pages,
                     attention_fn=reference_paged_attention)


def run(engine, requests):
    """Steps to the end; returns every output in order and the final output per request."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    stream, final = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            stream.append(out)
            if out.finished:
                final[out.request_id] = out
    assert engine._in_flight is None, "the last step in flight must be drained"
    assert engine.stats()["num_used_pages"] == 0, "pages leaked"
    return stream, [final[i] for i in ids]


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 31)), [5], [40, 41, 42, 43, 44, 45]]


def mixed_requests():
    """Greedy, seeded sampling, n > 1, logprobs, min_tokens and stop tokens, all in one batch."""
    return [
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, logprobs=True)),
        (PROMPTS[1], SamplingParams(temperature=1.0, seed=3, max_tokens=9, n=3)),
        (PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=7, logprobs=True)),
        (PROMPTS[3], SamplingParams(temperature=1.0, seed=11, max_tokens=14, stop_token_ids=[7, 13, 21],
                                    min_tokens=2)),
        (PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=10, n=2)),
    ]


def summary(outputs):
    return [
        [(c.token_ids, c.text, c.finish_reason, None if c.logprobs is None else np.round([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], 4).tolist())
         for c in out.outputs]
        for out in outputs
    ]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),
        dict(num_pages=14, max_num_seqs=4),  # 13 usable pages of 4 tokens: preemptions
        dict(max_num_batched_tokens=8, max_num_seqs=4),  # chunked prefill of the 21-token prompt
    ],
    ids=["plain", "preemption", "chunked"],
)
def test_async_stepping_gives_the_synchronous_outputs(tiny_params, engine_args):
    sync_engine = make_engine(tiny_params, async_scheduling=False, **engine_args)
    async_engine = make_engine(tiny_params, async_scheduling=True, **engine_args)
    _, want = run(sync_engine, mixed_requests())
    _, got = run(async_engine, mixed_requests())
    assert summary(got) == summary(want)
    assert any(c.finish_reason == "stop" for c in want[3].outputs) or len(want[3].outputs[0].token_ids) == 14
    if engine_args.get("num_pages") == 14:
        assert async_engine.stats()["num_preemptions"] > 0
    # Streaming deltas add up to the final outputs.
    stream, final = run(async_engine, mixed_requests())
    for out in final:
        parts = [o for o in stream if o.request_id == out.request_id]
        for j, completion in enumerate(out.outputs):
            deltas = [c for o in parts for c in o.outputs if c.index == j]
            assert sum((d.delta_token_ids for d in deltas), []) == completion.token_ids
            assert "".join(d.delta_text for d in deltas) == completion.text


def test_step_n_plus_1_is_dispatched_before_step_n_is_read_back(tiny_params, monkeypatch):
    engine = make_engine(tiny_params)
    events = record_events(engine, monkeypatch)
    run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)) for p in PROMPTS[:3]])
    dispatched = [step for kind, step in events if kind == "dispatch"]
    assert len(dispatched) >= 8
    # In steady decoding, step n's tokens are read only after step n+1 is on its way.
    for n in dispatched[:-1]:
        assert events.index(("dispatch", n + 1)) < events.index(("readback", n)), events
    # Synchronous stepping reads every step back before dispatching the next.
    sync_engine = make_engine(tiny_params, async_scheduling=False)
    sync_events = record_events(sync_engine, monkeypatch)
    run(sync_engine, [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))])
    assert sync_events == [(kind, n) for n in range(1, 5) for kind in ("dispatch", "readback")]


def test_logprobs_come_back_only_when_asked_and_prefill_chunks_wait_for_nothing(tiny_params, monkeypatch):
    engine = make_engine(tiny_params, max_num_batched_tokens=8)
    events = record_events(engine, monkeypatch)
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3))  # 21 tokens: 3 chunks of 8
    engine.step()
    assert engine._in_flight.tokens is None  # a chunk of a longer prompt samples nothing ...
    engine.step()
    engine.step()
    assert engine._in_flight.tokens is not None and engine._in_flight.logprobs is None  # ... nobody asked
    assert ("readback", 1) not in events and ("readback", 2) not in events
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, logprobs=True))
    while engine._in_flight is None or engine._in_flight.logprobs is None:
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert ("readback", 1) not in events and ("readback", 3) in events


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_streaming_never_shows_a_stop_string(tiny_params, async_scheduling):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    _, (free,) = run(make_engine(tiny_params, async_scheduling=async_scheduling), [(PROMPTS[0], params)])
    tokens = free.outputs[0].token_ids
    stop = f"<{tokens[4]}><{tokens[5]}"  # spans two tokens: the first half arrives a step early
    engine = make_engine(tiny_params, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop, "never-seen"])
    stream, (final,) = run(engine, [(PROMPTS[0], params)])
    want = free.outputs[0].text[: free.outputs[0].text.index(stop)]
    assert final.outputs[0].text == want and final.outputs[0].finish_reason == "stop"
    deltas = [o.outputs[0].delta_text for o in stream]
    assert "".join(deltas) == want, f"streamed {deltas}, final text {want!r}"
    assert all(o.outputs[0].text == "".join(deltas[: i + 1]) for i, o in enumerate(stream))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_string_deep_inside_one_long_token_is_found(tiny_params, async_scheduling):
    # Each token reads as 40 characters; a stop string at the start of one token's piece ends 35
    # characters before the text's end, beyond any fixed search window of len(stop) + 16.
    def piece(t):
        return f"[{t:02d}]" + "." * 36

    params = SamplingParams(temperature=0.0, max_tokens=8)
    _, (free,) = run(make_engine(tiny_params, async_scheduling=async_scheduling, piece=piece), [(PROMPTS[1], params)])
    tokens = free.outputs[0].token_ids
    stop = f"[{tokens[3]:02d}]"
    engine = make_engine(tiny_params, async_scheduling=async_scheduling, piece=piece)
    _, (final,) = run(engine, [(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, stop=stop))])
    text = free.outputs[0].text
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].text == text[: text.index(stop)]
    assert len(final.outputs[0].token_ids) == tokens.index(tokens[3]) + 1
