"""The batched sampler: greedy exactness, seeded reproducibility across batches, the filters'
supports against a plain numpy oracle, empirical distributions, logprobs, and no retracing."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.sample.sampler import (
    NUM_CANDIDATES,
    RowSpec,
    _rank_keep_mask,
    make_sampling_arrays,
    sample,
    sampling_logits,
)

# A hand-made distribution over 6 tokens, at shuffled ids so that "most likely" is not "lowest id".
HAND_PROBS = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
HAND_IDS = np.array([4, 0, 5, 2, 1, 3])  # HAND_PROBS[i] belongs to token HAND_IDS[i]


def hand_logits() -> np.ndarray:
    logits = np.empty(6, np.float32)
    logits[HAND_IDS] = np.log(HAND_PROBS)
    return logits[None, :]  # [1, 6]


def draw_many(logits: np.ndarray, num_draws: int, **spec) -> np.ndarray:
    """num_draws samples from logits row 0, one output row per draw, seeds 0..num_draws-1."""
    rows = [RowSpec(row_idx=0, seed=seed, **spec) for seed in range(num_draws)]
    token_ids, _ = sample(jnp.asarray(logits), make_sampling_arrays(rows, num_draws))
    return np.asarray(token_ids)


def chi_square(token_ids: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(token_ids, minlength=len(probs))
    expected = probs * len(token_ids)
    return float(np.sum((counts - expected) ** 2 / expected))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_is_argmax_of_raw_logits_with_ties_to_lowest_id():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 300)).astype(np.float32)
    logits[1, [17, 200]] = 10.0  # a tie at the top: argmax takes 17
    logits[3, 299] = 10.0  # the last id wins
    # Greedy rows carry filters and seeds that must be ignored.
    rows = [RowSpec(i, temperature=0.0, top_k=3, top_p=0.5, min_p=0.5, seed=i) for i in range(5)]
    token_ids, _ = sample(jnp.asarray(logits), make_sampling_arrays(rows, 8))
    token_ids = np.asarray(token_ids)
    np.testing.assert_array_equal(token_ids[:5], np.argmax(logits, axis=1))
    assert token_ids[1] == 17 and token_ids[3] == 299
    np.testing.assert_array_equal(token_ids[5:], np.argmax(logits[0]))  # padding rows read row 0


def test_top_k_1_is_greedy_for_any_seed_and_temperature():
    logits = np.random.default_rng(1).normal(size=(1, 500)).astype(np.float32)
    logits[0, [40, 41]] = logits.max() + 1.0  # a tie: the sort is stable, so 40 is the one kept
    token_ids = draw_many(logits, 200, temperature=1.5, top_k=1)
    assert set(token_ids.tolist()) == {40}


# --- reproducibility ------------------------------------------------------------------------------


def test_seeded_row_draws_the_same_tokens_in_any_batch_position_and_bucket():
    vocab_size = 2 * NUM_CANDIDATES
    rng = np.random.default_rng(2)
    # High entropy, so that the target draws different tokens at different steps.
    target_logits = rng.normal(size=vocab_size).astype(np.float32)
    target = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.01, seed=1234)
    filtered_target = dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.0, seed=99)

    def run(target_spec, num_rows, position, neighbours, steps):
        """The target's tokens at `position` among `neighbours`, in a bucket of num_rows."""
        out = []
        for step in steps:
            logits = rng.normal(size=(num_rows, vocab_size)).astype(np.float32)  # other rows vary
            logits[position] = target_logits
            rows = [RowSpec(i, *spec[1:]) for i, spec in enumerate(neighbours)]
            rows.insert(position, RowSpec(position, step=step, **target_spec))
            token_ids, _ = sample(jnp.asarray(logits), make_sampling_arrays(rows, num_rows))
            out.append(int(token_ids[position]))
        return out

    steps = range(6)
    candidate_neighbours = [
        RowSpec(0, 1.0, 5, 0.5, 0.0, seed) for seed in range(5)
    ]  # top-k candidates
    full_sort_neighbours = [
        RowSpec(0, 1.0, NUM_CANDIDATES + 1, 1.0, 0.0, 7)
    ]  # k beyond the candidates
    greedy_neighbours = [RowSpec(0)] * 2
    for spec in (target, filtered_target):
        alone = run(spec, 1, 0, [], steps)
        assert len(set(alone)) > 3, "the target row should draw different tokens at different steps"
        assert run(spec, 8, 5, candidate_neighbours, steps) == alone
        assert run(spec, 4, 1, full_sort_neighbours, steps) == alone
        assert run(spec, 4, 2, greedy_neighbours, steps) == alone


def test_fan_out_rows_from_one_logits_row_draw_independently():
    logits = np.zeros((2, 1000), np.float32)  # row 0 uniform: 8 draws almost surely differ
    logits[1, 7] = 100.0
    rows = [RowSpec(0, temperature=1.0, seed=s) for s in range(8)] + [
        RowSpec(1, temperature=1.0, seed=3)
    ]
    token_ids = np.asarray(sample(jnp.asarray(logits), make_sampling_arrays(rows, 16))[0])
    assert len(set(token_ids[:8].tolist())) >= 6
    assert token_ids[8] == 7  # row 8 reads logits row 1
    # Same (seed, step) on the same logits row: the same token, wherever the row sits.
    rows = [RowSpec(0, temperature=1.0, seed=5, step=2)] * 3
    token_ids = np.asarray(sample(jnp.asarray(logits), make_sampling_arrays(rows, 16))[0])
    assert len(set(token_ids[:3].tolist())) == 1


# --- filters: supports ----------------------------------------------------------------------------


def test_top_k_never_samples_outside_the_k_largest():
    logits = np.random.default_rng(3).normal(size=(1, 50)).astype(np.float32)
    top5 = set(np.argsort(-logits[0])[:5].tolist())
    token_ids = draw_many(logits, 3000, temperature=2.0, top_k=5)
    assert set(token_ids.tolist()) == top5  # never outside, and every one of the five appears


@pytest.mark.parametrize(
    "top_k, top_p, num_kept",
    [
        (0, 0.75, 3),  # 0.40 + 0.25 = 0.65 < 0.75, + 0.15 = 0.80: three tokens
        (0, 0.30, 1),  # the most likely token alone already has 0.40
        (0, 0.66, 3),  # 0.65 just misses
        (3, 0.75, 2),  # top-p runs on the renormalized top 3: 0.50 + 0.3125 >= 0.75
    ],
)
def test_top_p_keeps_exactly_the_smallest_prefix_reaching_p(top_k, top_p, num_kept):
    token_ids = draw_many(hand_logits(), 3000, temperature=1.0, top_k=top_k, top_p=top_p)
    assert set(token_ids.tolist()) == set(HAND_IDS[:num_kept].tolist())


def test_top_p_boundary_is_exclusive_a_prefix_reaching_p_exactly_stops_there():
    """p = [0.5, 0.25, 0.25] (exact in float32), top_p = 0.5: the first token alone reaches 0.5, so the
    second (mass before it: exactly 0.5, not < 0.5) is out. vLLM and HF keep the smallest prefix whose
    mass reaches top_p; a `<=` at the boundary would keep a second token."""
    logits = np.log(np.array([[0.5, 0.25, 0.25]], np.float32))
    token_ids = draw_many(logits, 200, temperature=1.0, top_p=0.5)
    assert set(token_ids.tolist()) == {0}
    token_ids = draw_many(logits, 200, temperature=1.0, top_p=0.5 + 1e-6)  # just past: the next token joins
    assert set(token_ids.tolist()) == {0, 1}


def test_min_tokens_bans_stop_tokens_up_to_output_m_and_eos_can_be_output_m_plus_1():
    """min_tokens = m: the row drawing output number k (k - 1 outputs out) bans eos while k - 1 < m,
    i.e. for outputs 1..m; output m + 1 may be eos (vLLM's MinTokensLogitsProcessor). Eos is the
    overwhelming favourite here, so a drawn non-eos token shows the ban."""
    from jaxpaged.sample.rows import row_spec
    from jaxpaged.planner.request import SamplingParams
    from jaxpaged.planner.sequence import Sequence

    eos, m = 3, 4
    params = SamplingParams(temperature=0.0, min_tokens=m, max_tokens=10)
    seq = Sequence([1, 2], params, eos_token_id=eos)
    logits = np.zeros((1, 8), np.float32)
    logits[0, eos] = 30.0
    logits[0, 5] = 1.0
    for num_out in range(m + 2):
        rows = [row_spec(0, params, 0, 0, seq, num_out)]
        token_ids, _ = sample(jnp.asarray(logits), make_sampling_arrays(rows, 1))
        assert int(token_ids[0]) == (5 if num_out < m else eos), num_out


def test_min_p_excludes_tokens_below_min_p_times_max():
    # min_p 0.3 -> threshold 0.3 * 0.40 = 0.12: keeps 0.40, 0.25, 0.15; drops 0.10, 0.06, 0.04.
    token_ids = draw_many(hand_logits(), 3000, temperature=1.0, min_p=0.3)
    assert set(token_ids.tolist()) == set(HAND_IDS[:3].tolist())


def reference_kept_ids(logits: np.ndarray, spec: RowSpec) -> set[int]:
    """Plain per-row float64 oracle of the HF/vLLM filter chain: which token ids stay samplable."""
    x = logits.astype(np.float64) / spec.temperature
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if 0 < spec.top_k < len(x):
        order = order[: spec.top_k]
    probs = softmax(x[order])
    kept, mass = [], 0.0
    for token_id, p in zip(order, probs):
        if mass >= spec.top_p and spec.top_p < 1.0:
            break
        kept.append(token_id)
        mass += p
    full_probs = softmax(x)
    return {i for i in kept if full_probs[i] >= spec.min_p * full_probs.max()}


@pytest.mark.parametrize(
    "path", ["candidates", "top_k_beyond_candidates", "top_p_beyond_candidates"]
)
def test_filter_supports_match_a_numpy_oracle_on_random_parameters(path):
    rng = np.random.default_rng(4)
    num_rows, vocab_size = 24, NUM_CANDIDATES + 476
    logits = (rng.normal(size=(num_rows, vocab_size)) * 3.0).astype(np.float32)
    rows = [
        RowSpec(
            row_idx=r,
            temperature=float(rng.choice([0.3, 1.0, 1.7])),
            top_k=int(rng.choice([0, 1, 5, 300, NUM_CANDIDATES, vocab_size, 5000])),
            top_p=float(rng.choice([1.0, rng.uniform(0.05, 0.99)])),
            min_p=float(rng.choice([0.0, rng.uniform(0.01, 0.5)])),
        )
        for r in range(num_rows)
    ]
    # One row the candidates cannot decide makes every row take the full ranking.
    if path == "top_k_beyond_candidates":
        rows[-1] = RowSpec(num_rows - 1, temperature=1.0, top_k=NUM_CANDIDATES + 10, top_p=0.999)
    if path == "top_p_beyond_candidates":  # a nearly flat row: the candidates hold ~70% of the mass
        logits[-1] *= 0.01
        rows[-1] = RowSpec(num_rows - 1, temperature=1.0, top_k=0, top_p=0.9)
    params = make_sampling_arrays(rows, num_rows)

    # Which path the batch takes: decided on the candidates alone, or not.
    scaled = jnp.asarray(logits) / params.temperature[:, None]
    needs_rank = jnp.asarray([0 < r.top_k < vocab_size or r.top_p < 1.0 for r in rows])
    _, decided = _rank_keep_mask(scaled, params, needs_rank, NUM_CANDIDATES)
    assert bool(np.all(decided)) == (path == "candidates")

    processed = np.asarray(sampling_logits(jnp.asarray(logits), params))
    for r, spec in enumerate(rows):
        kept = set(np.flatnonzero(np.isfinite(processed[r])).tolist())
        assert kept == reference_kept_ids(logits[r], spec), f"row {r}: {spec}"
        kept = sorted(kept)
        np.testing.assert_allclose(
            processed[r][kept], logits[r][kept] / spec.temperature, rtol=1e-6
        )


def test_top_p_1_keeps_the_whole_vocabulary_when_the_mass_rounds_to_1_early():
    # Token 0 holds all but ~e^-60 of the mass, so a float32 cumsum is 1.0 from position 1 on; a
    # top_p=1 row must still keep everything, like it does when no row in the batch sorts.
    logits = np.zeros((1, 32), np.float32)
    logits[0, 0] = 60.0
    rows = [
        RowSpec(0, temperature=1.0, top_p=1.0),
        RowSpec(0, temperature=1.0, top_k=2),
    ]  # row 1 sorts
    processed = np.asarray(sampling_logits(jnp.asarray(logits), make_sampling_arrays(rows, 2)))
    assert np.isfinite(processed[0]).all()
    assert np.isfinite(processed[1]).sum() == 2


def equation_kind(eqn) -> str:
    """The primitive's name; a cond chosen by the platform the program is lowered for (no data
    decides it, nothing goes to the host) is "platform_cond"."""
    return "platform_cond" if eqn.params.get("branches_platforms") else eqn.primitive.name


def equation_paths(jaxpr, path=()):
    """(equation, kinds of the enclosing higher-order primitives) for every equation."""
    for eqn in jaxpr.eqns:
        yield eqn, path
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equation_paths(sub, path + (equation_kind(eqn),))


def test_on_cpu_ranking_and_noise_happen_only_inside_conditionals():
    vocab_size = 2 * NUM_CANDIDATES
    logits = jnp.zeros((4, vocab_size), jnp.float32)
    jaxpr = jax.make_jaxpr(functools.partial(sample, branch_free=False))(
        logits, make_sampling_arrays([RowSpec(0)], 4)).jaxpr
    paths = list(equation_paths(jaxpr))
    assert not any(eqn.primitive.name == "sort" for eqn, _ in paths)
    top_ks = {
        eqn.params["k"]: path.count("cond") for eqn, path in paths if eqn.primitive.name == "top_k"
    }
    noise = [path for eqn, path in paths if eqn.primitive.name in ("random_bits", "threefry2x32")]
    # Noise is skipped when every row is greedy.
    assert noise and all(path.count("cond") == 1 for path in noise)
    # Candidates only when a sampling row uses top-k / top-p; full ranking only if they fall short.
    assert top_ks == {NUM_CANDIDATES: 2, vocab_size: 3}


def test_branch_free_sampler_has_no_data_dependent_control_flow():
    """Off CPU a cond or while makes XLA copy its predicate to the host each step, stalling the
    asynchronous engine. The branch-free sampler (the default there) computes every path and
    selects per row: the candidates' top_k, the full ranking and the noise all appear, outside
    any control flow."""
    vocab_size = 2 * NUM_CANDIDATES
    logits = jnp.zeros((4, vocab_size), jnp.float32)
    arrays = make_sampling_arrays([RowSpec(0), RowSpec(1, temperature=1.0, top_k=5, banned_ids=(2,))], 4)
    for fn in (sample, sampling_logits):
        jaxpr = jax.make_jaxpr(functools.partial(fn, branch_free=True))(logits, arrays).jaxpr
        names = [equation_kind(eqn) for eqn, _ in equation_paths(jaxpr)]
        control = set(names) & {"cond", "while", "switch"}
        assert not control, f"{fn.__name__} has data-dependent control flow: {control}"
        assert "sort" in names or names.count("top_k") == 2  # candidates and the full ranking
        if fn is sample:
            assert {"random_bits", "threefry2x32"} & set(names)


@pytest.mark.parametrize("path", ["candidates", "top_k_beyond_candidates", "top_p_beyond_candidates"])
def test_branch_free_and_branching_samplers_draw_the_same_tokens(path):
    """Random rows of every kind plus greedy ones, on each ranking path: same tokens, same logits."""
    rng = np.random.default_rng(8)
    num_rows, vocab_size = 16, NUM_CANDIDATES + 300
    logits = (rng.normal(size=(num_rows, vocab_size)) * 3.0).astype(np.float32)
    rows = [
        RowSpec(r, temperature=float(rng.choice([0.0, 0.5, 1.0])), top_k=int(rng.choice([0, 3, 40])),
                top_p=float(rng.choice([1.0, 0.8])), min_p=float(rng.choice([0.0, 0.05])), seed=r, step=r,
                banned_ids=(int(np.argmax(logits[r])),) if r % 3 == 0 else ())
        for r in range(num_rows)
    ]
    if path == "top_k_beyond_candidates":
        rows[-1] = RowSpec(num_rows - 1, temperature=1.0, top_k=NUM_CANDIDATES + 10, seed=1)
    if path == "top_p_beyond_candidates":
        logits[-1] *= 0.01
        rows[-1] = RowSpec(num_rows - 1, temperature=1.0, top_p=0.9, seed=2)
    arrays = make_sampling_arrays(rows, num_rows)
    x = jnp.asarray(logits)
    free_ids, free_lp = sample(x, arrays, branch_free=True)
    cond_ids, cond_lp = sample(x, arrays, branch_free=False)
    np.testing.assert_array_equal(np.asarray(free_ids), np.asarray(cond_ids))
    np.testing.assert_array_equal(np.asarray(free_lp), np.asarray(cond_lp))
    np.testing.assert_array_equal(np.asarray(sampling_logits(x, arrays, branch_free=True)),
                                  np.asarray(sampling_logits(x, arrays, branch_free=False)))


# --- banned ids (min_tokens) ----------------------------------------------------------------------


def test_banned_ids_are_never_drawn_and_padding_bans_nothing():
    """Rows under min_tokens ban eos (2) and a stop id (5), the two most likely tokens here: greedy
    rows take the third, sampling rows never draw them, and a row without bans is unchanged. The
    most likely token of the last row is the last id, where a -1 pad would land if it wrapped."""
    logits = np.full((2, 8), -1.0, np.float32)
    logits[0, [2, 5, 6]] = [5.0, 4.0, 3.0]
    logits[1, 7] = 5.0
    rows = [
        RowSpec(0, banned_ids=(2, 5)),  # greedy: 6
        RowSpec(0),  # greedy, no bans: 2
        RowSpec(1, banned_ids=(2,)),  # greedy: 7 (the -1 padding must not ban id 7)
    ] + [RowSpec(0, temperature=1.0, seed=s, banned_ids=(5, 2)) for s in range(61)]
    arrays = make_sampling_arrays(rows, 64)
    assert arrays.banned_ids.shape == (64, 4)  # MIN_BANNED_WIDTH columns
    token_ids, logprobs = (np.asarray(x) for x in sample(jnp.asarray(logits), arrays))
    assert token_ids[:3].tolist() == [6, 2, 7]
    drawn = token_ids[3:64]
    assert not np.isin(drawn, [2, 5]).any()
    assert (drawn == 6).mean() > 0.5  # e^3 against seven tokens at e^-1: ~0.84 of the mass
    # logprobs stay those of the unmodified distribution
    expected = logits[0, 6] - np.log(np.exp(logits[0].astype(np.float64)).sum())
    np.testing.assert_allclose(logprobs[0], expected, atol=1e-5)
    processed = np.asarray(sampling_logits(jnp.asarray(logits), arrays))
    assert np.isneginf(processed[0, [2, 5]]).all() and np.isfinite(processed[1]).all()


def test_banned_ids_width_grows_in_powers_of_two():
    arrays = make_sampling_arrays([RowSpec(0, banned_ids=tuple(range(5)))], 2)
    assert arrays.banned_ids.shape == (2, 8)
    np.testing.assert_array_equal(np.asarray(arrays.banned_ids)[0], [0, 1, 2, 3, 4, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(arrays.banned_ids)[1], [-1] * 8)


# --- distributions --------------------------------------------------------------------------------

# Chi-square 99.9% quantile with 7 degrees of freedom (8 tokens): a correct sampler passes with
# these fixed seeds; a wrong temperature gives statistics in the hundreds or thousands.
CHI2_7_DOF_999 = 24.32
DIST_LOGITS = np.array([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5]], np.float32)


def test_temperature_1_matches_softmax():
    token_ids = draw_many(DIST_LOGITS, 20000, temperature=1.0)
    assert chi_square(token_ids, softmax(DIST_LOGITS[0])) < CHI2_7_DOF_999


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_rescales_the_distribution(temperature):
    token_ids = draw_many(DIST_LOGITS, 20000, temperature=temperature)
    assert chi_square(token_ids, softmax(DIST_LOGITS[0] / temperature)) < CHI2_7_DOF_999
    assert chi_square(token_ids, softmax(DIST_LOGITS[0])) > 10 * CHI2_7_DOF_999  # not the T=1 one
    top_share = np.mean(token_ids == 4)  # token 4 has the largest logit
    assert (top_share > softmax(DIST_LOGITS[0])[4]) == (temperature < 1.0)  # sharper below 1


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits_at_the_chosen_ids():
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(4, 200)) * 3.0).astype(np.float32)
    rows = [
        RowSpec(0),
        RowSpec(1, temperature=0.5, top_k=10, seed=1),
        RowSpec(2, temperature=2.0, top_p=0.5, min_p=0.1, seed=2),
        RowSpec(2, temperature=1.0, seed=3),
        RowSpec(3, temperature=0.7, seed=4, step=9),
    ]
    token_ids, logprobs = sample(jnp.asarray(logits), make_sampling_arrays(rows, 8))
    token_ids, logprobs = np.asarray(token_ids), np.asarray(logprobs)
    row_idx = np.array([r.row_idx for r in rows])
    x = logits[row_idx].astype(np.float64)
    log_softmax = (
        x
        - x.max(1, keepdims=True)
        - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
    )
    expected = log_softmax[np.arange(len(rows)), token_ids[: len(rows)]]
    np.testing.assert_allclose(logprobs[: len(rows)], expected, atol=1e-5)
    assert token_ids[0] == np.argmax(logits[0])


# --- compilation ----------------------------------------------------------------------------------


def test_parameter_values_never_recompile_only_new_buckets_do():
    compiles = []

    def on_event(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    logits = jnp.asarray(np.random.default_rng(6).normal(size=(4, 128)).astype(np.float32))
    batches = [
        [RowSpec(0)],  # all greedy: neither noise nor sort
        [RowSpec(1, temperature=0.8, seed=3, step=4)],  # sampling, no sort
        [RowSpec(2, temperature=1.2, top_k=7, seed=1), RowSpec(0, min_p=0.2)],  # sort path
        [RowSpec(3, temperature=0.4, top_p=0.3, min_p=0.1, seed=2**40 + 1, step=100)] * 3,
    ]
    sample(logits, make_sampling_arrays(batches[0], 4))[0].block_until_ready()  # warm-up
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        for rows in batches:
            sample(logits, make_sampling_arrays(rows, 4))[0].block_until_ready()
        assert compiles == []
        sample(logits, make_sampling_arrays(batches[0], 8))[0].block_until_ready()  # a new bucket
        assert len(compiles) >= 1  # the listener does see compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def test_make_sampling_arrays_pads_and_rejects_overfull_buckets():
    arrays = make_sampling_arrays([(2, 0.5, 3, 0.9, 0.1, 2**32 + 7, 11)], 3)
    np.testing.assert_array_equal(np.asarray(arrays.row_idx), [2, 0, 0])
    np.testing.assert_array_equal(np.asarray(arrays.temperature), np.float32([0.5, 0.0, 0.0]))
    np.testing.assert_array_equal(np.asarray(arrays.seed), [7, 0, 0])  # modulo 2**32
    np.testing.assert_array_equal(np.asarray(arrays.step), [11, 0, 0])
    with pytest.raises(ValueError, match="do not fit in a bucket"):
        make_sampling_arrays([RowSpec(0)] * 3, 2)


def test_make_sampling_arrays_columns_match_each_row():
    """The column-wise packing against a row-by-row reference: random specs, banned ids of several
    lengths on some rows only, tuples and RowSpecs mixed, seeds beyond 32 and 64 bits."""
    rng = np.random.default_rng(0)
    for num_rows in (1, 5, 64):
        specs = []
        for _ in range(int(rng.integers(1, num_rows + 1))):
            banned = tuple(int(b) for b in rng.integers(0, 500, int(rng.choice([0, 0, 1, 3, 6]))))
            spec = RowSpec(int(rng.integers(0, 64)), float(rng.random()), int(rng.integers(-1, 50)),
                           float(rng.random()), float(rng.random()), int(rng.choice([3, 2**40 + 9, 2**70 + 5])),
                           int(rng.integers(0, 1000)), banned)
            specs.append(tuple(spec) if rng.random() < 0.3 else spec)
        arrays = make_sampling_arrays(specs, num_rows)
        full = [RowSpec(*s) for s in specs] + [RowSpec(0)] * (num_rows - len(specs))
        width = np.asarray(arrays.banned_ids).shape[1]
        assert width >= max(4, *(len(s.banned_ids) for s in full)) and width & (width - 1) == 0
        for r, spec in enumerate(full):
            assert int(arrays.row_idx[r]) == spec.row_idx and int(arrays.top_k[r]) == spec.top_k
            assert float(arrays.temperature[r]) == np.float32(spec.temperature)
            assert float(arrays.top_p[r]) == np.float32(spec.top_p) and float(arrays.min_p[r]) == np.float32(spec.min_p)
            assert int(arrays.seed[r]) == spec.seed % 2**32 and int(arrays.step[r]) == spec.step
            banned = np.asarray(arrays.banned_ids[r])
            assert banned[: len(spec.banned_ids)].tolist() == list(spec.banned_ids)
            assert (banned[len(spec.banned_ids) :] == -1).all()


@pytest.mark.parametrize("branch_free", [False, True])
@pytest.mark.parametrize("with_random_row", [False, True])
def test_processed_logprobs_of_greedy_rows_give_banned_tokens_minus_inf(branch_free, with_random_row):
    """processed_logprobs: a greedy row's distribution is its penalized and banned logits, so a token
    banned by min_tokens (banned_ids) or by the grammar (bitmask bit 0) has logprob -inf, even when it
    is the model's favourite; the chosen token's logprob is log_softmax over the allowed ones."""
    from jaxpaged.sample.sampler import sample_ext

    vocab_size = 32  # one bitmask word per row
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, vocab_size)).astype(np.float32)
    logits[0, 3] = logits[1, 5] = 10.0  # the raw favourites, each banned below
    rows = [RowSpec(0, banned_ids=(3,)), RowSpec(1)]
    if with_random_row:  # the batch takes the random path; greedy rows must still read `allowed`
        rows.append(RowSpec(2, temperature=1.0, seed=1))
    bitmask = np.full((4, 1), -1, np.int32)  # all tokens allowed
    bitmask[1, 0] = np.int32(~(1 << 5))  # row 1's grammar forbids token 5
    tokens, out, _ = sample_ext(jnp.asarray(logits), make_sampling_arrays(rows, 4), None, None, jnp.asarray(bitmask),
                                logprobs_mode="processed_logprobs", num_out=4, branch_free=branch_free)
    tokens = np.asarray(tokens)
    top_ids, top_values = np.asarray(out["top_ids"]), np.asarray(out["top_values"])
    for r, banned in ((0, 3), (1, 5)):
        allowed = logits[r].astype(np.float64).copy()
        allowed[banned] = -np.inf
        want = allowed - np.log(np.exp(allowed[np.isfinite(allowed)]).sum())
        assert tokens[r] == int(np.argmax(allowed)) != banned
        assert int(np.asarray(out["rank"])[r]) == 1
        np.testing.assert_allclose(float(np.asarray(out["chosen"])[r]), want[tokens[r]], rtol=1e-5)
        assert top_ids[r, 0] == tokens[r]
        np.testing.assert_allclose(top_values[r], np.sort(want)[::-1][:20], rtol=1e-5)  # the banned id is not among them
