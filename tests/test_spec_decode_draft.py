"""Speculative decoding with a draft model (jaxpaged/spec_decode/draft_model.py).

The draft is a smaller model: the tiny target's embeddings, first layer and head (one layer of two),
so its page buffer has another shape and its proposals are sometimes wrong (both verification
paths run). Oracles: the engine without speculation (greedy token identity), the exact target
distribution (rejection sampling with the draft's q), the pool (no page held after each run) and
JAX's compile events (none after warm-up)."""

import dataclasses

import jax
import numpy as np
import pytest

from compile_watch import backend_compiles
from jaxpaged.config import EngineConfig
from jaxpaged.planner.request import SamplingParams
from test_spec_decode import _PLAIN, NUM_DRAWS, SMALL_VOCAB, _engine_args, _greedy, _prompts, _run, _tv
from tp_fixtures import TINY, make_engine, tiny_params

DRAFT = dataclasses.replace(TINY, num_layers=1)


def draft_config(k: int) -> dict:
    return {"method": "draft_model", "model": "tiny-first-layer", "num_speculative_tokens": k,
            "disable_by_batch_size": 64}  # several requests at once: the CPU default (1) would not speculate


@pytest.fixture(scope="module")
def models():
    params = tiny_params()
    draft = jax.tree_util.tree_map_with_path(
        lambda path, x: x[:1] if "layers" in jax.tree_util.keystr(path) else x, params)
    return params, (DRAFT, draft)


CASES = [(2, "swap"), (3, "recompute"), (5, "roomy")]
SLOW_CASES = [(k, m) for m in ("roomy", "recompute", "swap") for k in range(1, 6) if (k, m) not in CASES]


@pytest.mark.parametrize("k,mode", CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES])
def test_draft_model_greedy_identical_to_plain(models, k, mode):
    """Token identity with the plain engine, prefix caching on (a second run of a prompt is served
    from the cache, the draft's K/V included), preemption by recompute or swap forced; no page held
    afterwards, no compilation after warm-up."""
    params, draft = models
    prompts = _prompts()
    if mode not in _PLAIN:
        plain = make_engine(params, **_engine_args(mode), warmup=False)
        _PLAIN[mode] = ([o.outputs[0].token_ids for o in _run(plain, prompts, [_greedy()] * len(prompts))],
                        plain.stats()["num_steps"])  # shared with test_spec_decode.py
    expected = _PLAIN[mode][0]
    spec = make_engine(params, **_engine_args(mode), speculative_config=draft_config(k), draft_model=draft)
    with backend_compiles() as compiled:
        got = [o.outputs[0].token_ids for o in _run(spec, prompts, [_greedy()] * len(prompts))]
        again = _run(spec, prompts[:1], [_greedy(max_tokens=12)])[0].outputs[0].token_ids
    assert got == expected
    assert again == expected[0][:12]
    stats = spec.stats()
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert stats["num_used_pages"] == 0 and stats["num_waiting"] == 0
    if mode == "roomy":  # a tight pool has evicted the first run's pages by then
        assert stats["prefix_hit_tokens"] >= 16
    assert 0 < stats["num_spec_accepted_tokens"] < stats["num_spec_draft_tokens"]  # both paths ran
    assert stats["num_spec_accepted_tokens_pos0"] >= stats[f"num_spec_accepted_tokens_pos{k - 1}"]
    if mode != "roomy":
        assert stats["num_preemptions"] > 0


# ---------------------------------------------------------------- rejection sampling with the draft's q


@pytest.mark.parametrize("always_accept", [False, True])
def test_rejection_sampling_with_draft_probs(always_accept):
    """Proposals drawn from a draft distribution q far from the target's p: each emitted token is
    distributed as p (TV < 0.01 at NUM_DRAWS draws, per position), and "always accept" fails that.
    The rule reads the real q: position 0 keeps its proposal at the rate sum_x min(p(x), q(x)) of
    Leviathan et al. (the point-mass rule, also exact, would keep it at sum_x q(x) p(x) only)."""
    from jaxpaged.sample.sampler import SamplingArrays, sampling_logits
    from jaxpaged.spec_decode import verifier

    t = 0.8
    logits = jax.random.normal(jax.random.key(11), (3, SMALL_VOCAB)) * 1.5  # target, positions 0, 1, 2
    exact = np.asarray(jax.nn.softmax(sampling_logits(logits, SamplingArrays(
        row_idx=np.arange(3, dtype=np.int32), temperature=np.full(3, t, np.float32), top_k=np.zeros(3, np.int32),
        top_p=np.ones(3, np.float32), min_p=np.zeros(3, np.float32), seed=np.zeros(3, np.uint32),
        step=np.zeros(3, np.int32), banned_ids=np.full((3, 4), -1, np.int32))), axis=-1))
    rng = np.random.default_rng(5)
    q = rng.dirichlet(np.full(SMALL_VOCAB, 0.7), size=2).astype(np.float32)  # the draft's, positions 0, 1
    n = NUM_DRAWS
    drafts = np.stack([rng.choice(SMALL_VOCAB, n, p=q[j] / q[j].sum()) for j in range(2)], axis=1).astype(np.int32)
    arrays = verifier.VerifyArrays(
        first_row=np.zeros(n, np.int32), num_drafts=np.full(n, 2, np.int32), drafts=drafts,
        temperature=np.full(n, t, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
        min_p=np.zeros(n, np.float32), seed=np.arange(n, dtype=np.uint32), step=np.full(n, 3, np.int32))
    draft_probs = np.broadcast_to(q[None], (n, 2, SMALL_VOCAB))
    tokens, num_accepted = (np.asarray(a) for a in verifier.verify(
        logits, arrays, draft_probs, always_accept=always_accept))
    counts = lambda x: np.bincount(x, minlength=SMALL_VOCAB)  # noqa: E731
    tvs = [_tv(counts(tokens[:, 0]), exact[0]), _tv(counts(tokens[num_accepted >= 1, 1]), exact[1]),
           _tv(counts(tokens[num_accepted == 2, 2]), exact[2])]
    assert (num_accepted == 2).sum() > 1000 and (always_accept or (num_accepted == 0).sum() > 1000)  # both branches
    if always_accept:
        assert max(tvs) > 0.05, tvs
    else:
        assert max(tvs) < 0.01, tvs
        rate, want = (num_accepted >= 1).mean(), np.minimum(exact[0], q[0]).sum()
        assert abs(rate - want) < 0.01 and abs(want - (exact[0] * q[0]).sum()) > 0.05, (rate, want)


def test_draft_model_sampled_reproducible_no_leaks(models):
    """Seeded sampled requests (n = 2, top-k / top-p) draw the same tokens alone and batched, the draft
    samples from q (with_probs programs warmed: nothing compiles), and no page is left behind."""
    params, draft = models
    # Prefix caching off: the second run of prompts[1] would be one decode-bucket row fanned out to n = 2
    # sampler rows, a (logits rows, sampler rows) pair the plain engine's warm-up does not compile either.
    spec = make_engine(params, max_num_batched_tokens=32, enable_prefix_caching=False,
                       speculative_config=draft_config(3), draft_model=draft)
    prompts = _prompts()
    sp = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=20, seed=s, ignore_eos=True,
                         n=2 if s == 1 else 1) for s in range(len(prompts))]
    with backend_compiles() as compiled:
        batch = _run(spec, prompts, sp)
        alone = _run(spec, [prompts[1]], [sp[1]])[0]
    assert compiled == [], f"compiled after warm-up: {compiled}"
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batch[1].outputs]
    assert all(len(c.token_ids) == 20 for out in batch for c in out.outputs)
    stats = spec.stats()
    assert stats["num_used_pages"] == 0 and stats["num_spec_draft_tokens"] > 0


def test_draft_model_config_errors(models):
    params, (draft_cfg, draft_params) = models
    with pytest.raises(ValueError, match="needs 'model'"):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(speculative_config={**draft_config(2), "prompt_lookup_max": 3})
    assert EngineConfig(speculative_config={"model": "x", "num_speculative_tokens": 2}).speculative_config == {
        "method": "draft_model", "model": "x", "num_speculative_tokens": 2, "disable_by_batch_size": None}  # vLLM infers the method from 'model'
    with pytest.raises(ValueError, match="needs the draft model"):
        make_engine(params, warmup=False, speculative_config=draft_config(2))
    with pytest.raises(ValueError, match="method='draft_model'"):
        make_engine(params, warmup=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                    draft_model=(draft_cfg, draft_params))
    other_vocab = dataclasses.replace(draft_cfg, vocab_size=128)
    with pytest.raises(ValueError, match="same tokenizer|tokenizer"):
        make_engine(params, warmup=False, speculative_config=draft_config(2), draft_model=(other_vocab, draft_params))


def test_draft_kv_stays_right_through_overlapped_steps(models):
    """With more requests than disable_by_batch_size the engine overlaps steps (input tokens read on
    the device from the previous step's draws); the draft mirrors those steps too. A model drafting
    for itself must then be accepted every time once the request runs alone."""
    params, _ = models
    spec = make_engine(params, warmup=False, max_num_batched_tokens=32, draft_model=(TINY, params),
                       speculative_config={**draft_config(3), "disable_by_batch_size": 1})
    prompts = _prompts()[:2]
    _run(spec, prompts, [_greedy(max_tokens=30), _greedy(max_tokens=6)])
    stats = spec.stats()
    assert stats["num_spec_draft_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0
    assert stats["num_used_pages"] == 0


@pytest.mark.slow  # ~90 s on the shared machine (two LLMs compiling lazily); the engine tests above cover the draft
def test_llm_loads_the_draft_model_from_its_path(tmp_path):
    """`LLM(model, speculative_config={"model": path, ...})` loads the draft the way the target is loaded
    (build_engine); a model drafting for itself is always right, and the tokens equal plain generation."""
    from jaxpaged import LLM
    from tiny_checkpoint import write_tiny_checkpoint

    path = write_tiny_checkpoint(str(tmp_path / "tiny"))
    args = dict(max_model_len=96, max_num_seqs=2, max_num_batched_tokens=32, warmup=False)
    prompts = ["[user] the cat sat on the mat\n", "abc abc abc"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, **args).generate(prompts, greedy)]
    llm = LLM(path, **args, speculative_config={"model": path, "num_speculative_tokens": 2, "disable_by_batch_size": 4})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == plain
    stats = llm.stats()
    assert stats["num_spec_draft_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0
    assert stats["num_used_pages"] == 0


def test_an_int8_draft_calibrates_its_own_kv_centres(models):
    """An int8 cache's centres (device/kv_centres.py) are the model's own: the 1-layer draft's runner
    calibrates its own, not the target's (it runs its steps through `ModelRunner.execute`, which passes them)."""
    from jaxpaged.device.kv_centres import calibrate_kv_centres

    params, (draft_config_, draft_params) = models
    spec = make_engine(params, warmup=False, max_num_batched_tokens=32, kv_cache_dtype="int8",
                       draft_model=(draft_config_, draft_params), speculative_config=draft_config(2))
    target, draft = spec.runner, spec.spec.draft.runner
    assert target.kv_centres.shape == (TINY.num_layers, 2, TINY.num_kv_heads, TINY.head_dim)
    np.testing.assert_allclose(np.asarray(draft.kv_centres), np.asarray(calibrate_kv_centres(DRAFT, draft_params, "int8")),
                               atol=1e-6)


def test_sleep_level_2_restores_the_draft_model(models):
    """sleep(level=2) drops the target's weights (update_params brings new ones) but keeps the
    draft's on the host; wake_up puts them back: after it the draft proposes exactly as before
    (the same proposals accepted), and the tokens are the plain engine's."""
    params, draft = models
    prompts = _prompts()[:2]
    engine = make_engine(params, speculative_config=draft_config(3), draft_model=draft)

    def run():
        before = engine.stats()
        tokens = [o.outputs[0].token_ids for o in _run(engine, prompts, [_greedy(max_tokens=16)] * len(prompts))]
        after = engine.stats()
        return tokens, {key: after[key] - before[key] for key in ("num_spec_draft_tokens", "num_spec_accepted_tokens")}

    tokens, counts = run()
    assert counts["num_spec_accepted_tokens"] > 0
    engine.sleep(level=2)
    engine.update_params(params)
    engine.wake_up()
    assert run() == (tokens, counts)
    assert engine.stats()["num_used_pages"] == 0
