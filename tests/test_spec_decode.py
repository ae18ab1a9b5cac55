"""Speculative decoding (jaxpaged/spec_decode/): n-gram proposals, verification, rollback.

Oracles: the engine without speculation (greedy token identity), the exact target distribution
(rejection sampling), and exact expectations for the proposer and the logits layout."""

import numpy as np
import pytest

from jaxpaged.config import EngineConfig
from jaxpaged.engine.beam_search import BeamSearchParams
from jaxpaged.planner.request import SamplingParams
from jaxpaged.spec_decode.ngram import propose_ngram
from tp_fixtures import TINY, make_engine, tiny_params

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


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
    assert spec == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5, "prompt_lookup_min": 1}


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("mode", ["roomy", "recompute", "swap"])
def test_greedy_identical_to_plain(params, k, mode):
    """Token identity with the non-speculative engine, prefix caching on; in the tight modes the
    pool is small enough that sequences are preempted (recompute, or swap to host and back)."""
    prompts = _prompts()
    engine_args = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    if mode != "roomy":
        engine_args.update(num_pages=14, preemption_mode=mode)
        if mode == "swap":
            engine_args["swap_space_bytes"] = 1 << 22
    plain = make_engine(params, **engine_args)
    expected = [o.outputs[0].token_ids for o in _run(plain, prompts, [_greedy()] * len(prompts))]
    spec = make_engine(params, **engine_args, speculative_config={**NGRAM, "num_speculative_tokens": k})
    num_compiles = spec.stats()["num_compiles"]
    got = [o.outputs[0].token_ids for o in _run(spec, prompts, [_greedy()] * len(prompts))]
    assert got == expected
    stats = spec.stats()
    assert stats["num_compiles"] == num_compiles  # verification buckets were warmed
    assert stats["num_used_pages"] == 0 and stats["num_waiting"] == 0  # nothing leaked
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # both paths ran
    assert stats["spec_mean_accepted_length"] > 1
    assert stats["num_steps"] < plain.stats()["num_steps"]
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

    from jaxpaged.device.sampler import SamplingArrays, sampling_logits
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
    tokens, num_accepted, _ = (np.asarray(a) for a in verifier.verify(logits, arrays, always_accept=always_accept))
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
