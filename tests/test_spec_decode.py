"""Speculative decoding (jaxpaged/spec_decode/): n-gram proposals, verification, rollback.

Oracles: the engine without speculation (greedy token identity), the exact target distribution
(rejection sampling), and exact expectations for the proposer and the logits layout."""

import numpy as np
import pytest

from compile_watch import backend_compiles
from step_events import record_events
from jaxpaged.config import EngineConfig
from jaxpaged.engine.beam_search import BeamSearchParams
from jaxpaged.planner.request import SamplingParams
from jaxpaged.spec_decode.ngram import propose_ngram
from tp_fixtures import TINY, make_engine, tiny_params

# disable_by_batch_size: these tests batch several requests, and the CPU default (1) would turn proposals off.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def _prompts():
    rng = np.random.default_rng(3)
    base = rng.integers(0, TINY.vocab_size, 6).tolist()
    # Copy-heavy prompts (repeated runs), a random one, one across a page boundary.
    return [base * 3, (base[:4] * 3)[:9], rng.integers(0, TINY.vocab_size, 5).tolist(), base[:3] + base * 2]


def _run(engine, prompts, params_list):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def _greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_propose_ngram():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 1, 3) == [4, 5, 9]  # longest n-gram "1 2 3"
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 2, 1, 3) == [4, 5]
    assert propose_ngram([1, 2, 3], 2, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([5, 5, 5, 5], 2, 1, 2) == [5, 5]  # the most recent match followed by k tokens
    assert propose_ngram([7, 1, 8, 2, 8, 1], 3, 1, 1) == [8, 2, 8]  # n = 1: "1" occurred at index 1
    assert propose_ngram([7, 1, 8, 2, 8, 1], 3, 2, 2) == []  # "8 1" never occurred before
    # The latest match's continuation ends exactly at the sequence's end: it still counts as k known tokens.
    assert propose_ngram([1, 2, 9, 1, 2, 8, 1, 2], 3, 2, 2) == [8, 1, 2]


@pytest.mark.parametrize("greedy_only", [True, False])
def test_verify_fewer_proposals_than_k_target_zero(greedy_only):
    """A row with m = 1 < K = 3 proposals whose target after them is token 0: the padded columns
    (also 0) are never compared, so exactly one proposal is kept and 0 is the bonus token."""
    from jaxpaged.spec_decode import verifier

    vocab, k = 8, 3
    logits = np.full((4, vocab), -5.0, np.float32)
    logits[0, 5] = 5.0  # position 0 predicts 5 (the proposal): kept
    logits[1:, 0] = 5.0  # positions 1.. predict 0, the same id the padding holds
    arrays = verifier.make_verify_arrays([(0, [5], 0.0, 0, 1.0, 0.0, 1, 0)], 1, k)
    tokens, num_accepted = (np.asarray(a) for a in verifier.verify(logits, arrays, greedy_only=greedy_only))
    assert num_accepted.tolist() == [1]
    assert tokens[0, :2].tolist() == [5, 0]


def test_speculative_config_validation():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1})
    with pytest.raises(ValueError, match="not supported"):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                                         "prompt_lookup_max": 2})
    spec = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config
    assert spec == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5, "prompt_lookup_min": 1,
                    "disable_by_batch_size": None}
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0})


_PLAIN: dict = {}  # mode -> the non-speculative engine's outputs (the oracle), computed once


def _engine_args(mode):
    args = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    if mode != "roomy":  # a pool small enough that sequences are preempted
        args.update(num_pages=14, preemption_mode=mode)
        if mode == "swap":
            args["swap_space_bytes"] = 1 << 22
    return args


# The default suite runs each k once and each preemption mode once; the full matrix is slow.
CASES = [(1, "roomy"), (2, "swap"), (3, "recompute"), (4, "roomy"), (5, "recompute")]
SLOW_CASES = [(k, m) for m in ("roomy", "recompute", "swap") for k in range(1, 6) if (k, m) not in CASES]


@pytest.mark.parametrize("k,mode", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES])
def test_greedy_identical_to_plain(params, k, mode):
    """Token identity with the non-speculative engine, prefix caching on, with preemption by
    recompute or by swap forced in the tight modes; no page leaks, no compilation after warm-up."""
    prompts = _prompts()
    if mode not in _PLAIN:
        plain = make_engine(params, **_engine_args(mode), warmup=False)
        _PLAIN[mode] = ([o.outputs[0].token_ids for o in _run(plain, prompts, [_greedy()] * len(prompts))],
                        plain.stats()["num_steps"])
    expected, plain_steps = _PLAIN[mode]
    spec = make_engine(params, **_engine_args(mode), speculative_config={**NGRAM, "num_speculative_tokens": k})
    num_compiles = spec.stats()["num_compiles"]
    with backend_compiles() as compiled:  # every executable built, traced or not
        got = [o.outputs[0].token_ids for o in _run(spec, prompts, [_greedy()] * len(prompts))]
    assert got == expected
    assert compiled == [], f"compiled after warm-up: {compiled}"
    stats = spec.stats()
    assert stats["num_compiles"] == num_compiles  # verification buckets were warmed
    assert stats["num_used_pages"] == 0 and stats["num_waiting"] == 0  # nothing leaked
    assert 0 < stats["num_spec_accepted_tokens"] < stats["num_spec_draft_tokens"]  # both paths ran
    assert stats["spec_mean_accepted_length"] > 1
    assert stats["num_steps"] < plain_steps
    if mode != "roomy":
        assert stats["num_preemptions"] > 0


# ---------------------------------------------------------------- rejection sampling


def _tv(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


SMALL_VOCAB = 8
NUM_DRAWS = 200_000  # rows of one verifier call; the expected TV of an exact sampler is ~0.003 here


@pytest.mark.parametrize("always_accept", [False, True])
@pytest.mark.parametrize("filters", [dict(temperature=1.0, top_k=0, top_p=1.0),
                                     dict(temperature=0.7, top_k=6, top_p=0.9)])
def test_rejection_sampling_matches_target(always_accept, filters):
    """Each token the verifier emits is distributed as the non-speculative sampler's p_j (the
    filtered softmax of the target logits): the first token for all draws, the second among draws
    that kept the first proposal, the bonus token among those that kept both. TV < 0.01 at
    NUM_DRAWS draws; with the rule replaced by "always accept" the same check fails."""
    import jax

    from jaxpaged.sample.sampler import SamplingArrays, sampling_logits
    from jaxpaged.spec_decode import verifier

    logits = jax.random.normal(jax.random.key(7), (3, SMALL_VOCAB)) * 1.5  # positions 0, 1, 2
    t, k_, p_ = filters["temperature"], filters["top_k"], filters["top_p"]
    exact = np.asarray(jax.nn.softmax(sampling_logits(logits, SamplingArrays(
        row_idx=np.arange(3, dtype=np.int32), temperature=np.full(3, t, np.float32), top_k=np.full(3, k_, np.int32),
        top_p=np.full(3, p_, np.float32), min_p=np.zeros(3, np.float32), seed=np.zeros(3, np.uint32),
        step=np.zeros(3, np.int32), banned_ids=np.full((3, 4), -1, np.int32))), axis=-1))
    drafts = [int(np.argmax(exact[0])), int(np.argsort(exact[1])[-2])]  # a likely and a less likely proposal
    n = NUM_DRAWS
    arrays = verifier.VerifyArrays(
        first_row=np.zeros(n, np.int32), num_drafts=np.full(n, 2, np.int32),
        drafts=np.tile(np.array(drafts, np.int32), (n, 1)), temperature=np.full(n, t, np.float32),
        top_k=np.full(n, k_, np.int32), top_p=np.full(n, p_, np.float32), min_p=np.zeros(n, np.float32),
        seed=np.arange(n, dtype=np.uint32), step=np.full(n, 5, np.int32))
    tokens, num_accepted = (np.asarray(a) for a in verifier.verify(logits, arrays, always_accept=always_accept))
    counts = lambda x: np.bincount(x, minlength=SMALL_VOCAB)  # noqa: E731
    kept_first = num_accepted >= 1
    tvs = [_tv(counts(tokens[:, 0]), exact[0]),
           _tv(counts(tokens[kept_first, 1]), exact[1]),
           _tv(counts(tokens[num_accepted == 2, 2]), exact[2])]
    assert (num_accepted == 2).sum() > 1000  # every position was exercised
    if always_accept:
        assert max(tvs) > 0.1, tvs
    else:
        assert max(tvs) < 0.01, tvs
        # Reproducible: the same seeds draw the same tokens.
        again = np.asarray(verifier.verify(logits, arrays)[0])
        assert (again == tokens).all()


# ---------------------------------------------------------------- the engine around it


class _CommaTokenizer:
    """Token t reads "t," so that stop strings can name tokens."""

    eos_token_id = None

    class _Detokenizer:
        def step(self, token_id):
            return f"{token_id},"

        def flush(self):
            return ""

        def decode(self, ids):
            return "".join(f"{t}," for t in ids)

    def detokenizer(self, *args, **kwargs):
        return self._Detokenizer()

    incremental_detokenizer = detokenizer


def _pair(params, **engine_args):
    """A plain engine and a speculative one over the comma tokenizer."""
    from jaxpaged.engine.engine import LLMEngine
    from tp_fixtures import ENGINE

    engines = []
    for spec in (None, NGRAM):
        config = EngineConfig(**{**ENGINE, "max_num_batched_tokens": 32, **engine_args, "speculative_config": spec})
        config = config.resolved(on_gpu=False, model_max_len=TINY.max_position_embeddings)
        engines.append(LLMEngine(TINY, params, _CommaTokenizer(), config, num_pages=config.num_pages,
                                 attention_fn=_attention()))
    return engines


def _attention():
    from jaxpaged.ops.attention import chunked_paged_attention_from_buffer

    return chunked_paged_attention_from_buffer


def test_stops_max_tokens_logprobs_inside_accepted_runs(params):
    """Stop tokens, stop strings and max_tokens landing inside an accepted run end the output
    exactly where the plain engine ends it; logprobs of accepted tokens match the plain ones."""
    plain, spec = _pair(params, warmup=False)
    prompt = _prompts()[0]
    (full,) = _run(plain, [prompt], [_greedy()])
    out_ids = full.outputs[0].token_ids
    cases = [_greedy(logprobs=True)]
    for j in (3, 7, 11):
        cases += [_greedy(stop_token_ids=[out_ids[j]]), _greedy(max_tokens=j + 1),
                  _greedy(stop=[f"{out_ids[j]},"]),
                  _greedy(stop=["never"], max_tokens=j + 1)]  # decoded token by token, ended by length
    prompts = [prompt] * len(cases)
    want = _run(plain, prompts, cases)
    got = _run(spec, prompts, cases)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    chosen = lambda c: [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids)]  # noqa: E731
    np.testing.assert_allclose(chosen(got[0].outputs[0]), chosen(want[0].outputs[0]), atol=1e-4)
    assert spec.stats()["num_spec_accepted_tokens"] > 0
    assert spec.stats()["num_used_pages"] == 0


def test_sampled_requests_reproducible_n2_no_leaks(params):
    """Seeded sampled requests (n = 2, top-k / top-p) draw the same tokens alone and in a batch with
    others, and leave no pages behind. (A request asking for logprobs is not speculated: its ranks and
    alternatives come from the sampler; see DESIGN.md.)"""
    (_, spec) = _pair(params, warmup=False)
    prompts = _prompts()
    sp = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=30, seed=s, ignore_eos=True,
                         n=2 if s == 1 else 1) for s in range(len(prompts))]
    batch = _run(spec, prompts, sp)
    alone = _run(spec, [prompts[1]], [sp[1]])[0]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batch[1].outputs]
    assert len(batch[1].outputs) == 2
    for out in batch:
        for c in out.outputs:
            assert len(c.token_ids) == 30
    stats = spec.stats()
    assert stats["num_used_pages"] == 0 and stats["num_spec_draft_tokens"] > 0


def test_beam_search_with_speculation_is_refused(params):
    engine = make_engine(params, warmup=False, speculative_config=NGRAM)
    with pytest.raises(ValueError, match="speculative"):
        engine.add_beam_request([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=4))
    assert not engine.has_unfinished_requests()


def test_verification_logits_rows():
    """Sequences with proposals take logits at each of their last 1 + m tokens, others at their last."""
    from types import SimpleNamespace

    from jaxpaged.device.step_input import prepare_step_input

    seqs = [SimpleNamespace(token_ids=list(range(10)), num_computed_tokens=6, block_table=[1, 2], seq_id=0),
            SimpleNamespace(token_ids=list(range(5)), num_computed_tokens=4, block_table=[3], seq_id=1)]
    out = SimpleNamespace(seqs=seqs, num_new_tokens=[4, 1], copies=[])
    step = prepare_step_input(out, page_size=8, num_pages=8, pages_per_seq=4, max_num_seqs=2, buckets=(16,),
                              num_logits=np.array([4, 1], np.int32), max_num_logits=6)
    assert step.logits_indices.tolist() == [0, 1, 2, 3, 4, 0]  # width min(16, 6), padding 0


def test_stats_metrics_and_cli_flag(params):
    """stats() counts proposals and acceptances; /metrics exports them; the CLI flag reaches the engine."""
    import argparse

    from prometheus_client import generate_latest

    from jaxpaged.entrypoints.cli import add_engine_args, engine_args
    from jaxpaged.entrypoints.serve.metrics import ServerMetrics

    engine = make_engine(params, warmup=False, max_num_batched_tokens=32, speculative_config=NGRAM)
    _run(engine, _prompts()[:2], [_greedy(max_tokens=20)] * 2)
    s = engine.stats()
    assert s["spec_acceptance_rate"] == s["num_spec_accepted_tokens"] / s["num_spec_draft_tokens"]
    assert s["spec_mean_accepted_length"] == s["num_spec_emitted_tokens"] / s["num_spec_verified"]
    assert 1 < s["spec_mean_accepted_length"] <= 1 + NGRAM["num_speculative_tokens"]
    metrics = ServerMetrics(page_size=8, bytes_per_page=1)
    metrics.publish(engine)
    text = generate_latest(metrics.registry).decode()
    assert f"jaxpaged_spec_decode_accepted_tokens_total {float(s['num_spec_accepted_tokens'])}" in text
    assert "jaxpaged_spec_decode_mean_accepted_length" in text
    # vLLM's names: counts, drafts, and acceptances per position (position 0 most often)
    assert f"vllm:spec_decode_num_draft_tokens_total {float(s['num_spec_draft_tokens'])}" in text
    assert f"vllm:spec_decode_num_drafts_total {float(s['num_spec_verified'])}" in text
    per_pos = [s[f"num_spec_accepted_tokens_pos{j}"] for j in range(NGRAM["num_speculative_tokens"])]
    assert sum(per_pos) == s["num_spec_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {float(per_pos[0])}' in text

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_args(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])


@pytest.mark.slow
@pytest.mark.parametrize("always_accept", [False, True])
def test_engine_sampled_distribution_small_vocab(monkeypatch, always_accept):
    """Through the whole engine, on a tiny random model with 8 tokens: the marginals of output
    tokens 2 and 3 (the ones speculation produces) over NUM seeds match the plain engine's, TV <
    0.05 at 4000 samples each (two empirical distributions over 8 outcomes differ by ~0.02 there);
    with "always accept" they do not."""
    import dataclasses
    import functools

    import jax

    from jaxpaged.engine.engine import LLMEngine
    from jaxpaged.models.llama import init_params
    from jaxpaged.spec_decode import speculator, verifier
    from tp_fixtures import ENGINE, SilentTokenizer

    small = dataclasses.replace(TINY, vocab_size=SMALL_VOCAB)
    params = jax.tree.map(np.asarray, init_params(small, jax.random.key(1)))
    if always_accept:
        monkeypatch.setattr(speculator, "verify", functools.partial(verifier.verify, always_accept=True))
    num = 4000
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    marginals = []
    for spec in (None, {**NGRAM, "disable_by_batch_size": num}):  # speculate with all requests queued
        config = EngineConfig(**{**ENGINE, "max_num_batched_tokens": 64, "max_num_seqs": 16, "num_pages": 80,
                                 "warmup": False, "speculative_config": spec})
        config = config.resolved(on_gpu=False, model_max_len=TINY.max_position_embeddings)
        engine = LLMEngine(small, params, SilentTokenizer(), config, num_pages=config.num_pages,
                           attention_fn=_attention())
        outs = _run(engine, [prompt] * num, [SamplingParams(temperature=1.0, max_tokens=3, seed=s, ignore_eos=True)
                                             for s in range(num)])
        tokens = np.array([o.outputs[0].token_ids for o in outs])
        marginals.append([np.bincount(tokens[:, j], minlength=SMALL_VOCAB) / num for j in (1, 2)])
        assert engine.stats()["num_used_pages"] == 0
    tvs = [0.5 * np.abs(a - b).sum() for a, b in zip(*marginals)]
    if always_accept:
        assert max(tvs) > 0.1, tvs
    else:
        assert max(tvs) < 0.05, tvs


def test_disable_by_batch_size(params, monkeypatch):
    """More requests than disable_by_batch_size: no proposals, and steps overlap (step k+1 is dispatched
    before step k's tokens are read back); one request alone is speculated again, with the same tokens."""
    engine = make_engine(params, warmup=False, max_num_batched_tokens=32,
                         speculative_config={**NGRAM, "disable_by_batch_size": 1})
    events = record_events(engine, monkeypatch)
    prompts = _prompts()[:2]
    both = _run(engine, prompts, [_greedy(max_tokens=12)] * 2)
    assert engine.stats()["num_spec_draft_tokens"] == 0
    assert events.index(("dispatch", 3)) < events.index(("readback", 2))
    alone = _run(engine, prompts[:1], [_greedy(max_tokens=12)])
    assert engine.stats()["num_spec_draft_tokens"] > 0
    assert alone[0].outputs[0].token_ids == both[0].outputs[0].token_ids
