"""The blocked inverse-CDF draw (jaxpaged/sample/inverse_cdf.py) against a float64 inverse CDF."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.sample.inverse_cdf import blocked_draw, full_cdf_draw


def test_worked_example_from_the_docstring():
    probs = jnp.array([[0.1, 0.0, 0.6, 0.3, 0.0, 0.0]])
    # u * total = 0.5: block 1 (tokens 2, 3) is the first whose cumulative mass reaches it; 0.4 is
    # left inside, and token 2 alone holds 0.6.
    assert blocked_draw(probs, jnp.array([0.5]), block=2).tolist() == [2]
    assert blocked_draw(probs, jnp.array([0.05]), block=2).tolist() == [0]
    assert blocked_draw(probs, jnp.array([0.99]), block=2).tolist() == [3]  # never the empty block 2


def float64_draw(probs: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The exact first token reaching u * total, and the distance of u * total to the nearest cdf step."""
    cdf = np.cumsum(probs.astype(np.float64), axis=1)
    threshold = u.astype(np.float64)[:, None] * cdf[:, -1:]
    return (cdf < threshold).sum(axis=1), np.min(np.abs(cdf - threshold), axis=1)


@pytest.mark.parametrize("vocab_size, block", [(1000, 64), (49152, 256), (37, 8)])  # 1000, 37: a padded last block
def test_draws_the_float64_token_and_never_a_zero_probability_one(vocab_size, block):
    logits = 3 * jax.random.normal(jax.random.key(0), (16, vocab_size))
    banned = jax.random.uniform(jax.random.key(1), (16, vocab_size)) < 0.5  # half the tokens: probability 0
    probs = jax.nn.softmax(jnp.where(banned, -jnp.inf, logits), axis=1)
    probs_np = np.asarray(probs)
    for seed in range(20):
        u = jax.random.uniform(jax.random.key(100 + seed), (16,), minval=1e-30)
        drawn = np.asarray(blocked_draw(probs, u, block=block))
        assert (probs_np[np.arange(16), drawn] > 0).all()
        exact, margin = float64_draw(probs_np, np.asarray(u))
        clear = margin > 1e-5  # away from a cdf step by more than float32 rounding of the partial sums
        np.testing.assert_array_equal(drawn[clear], exact[clear])
        np.testing.assert_array_equal(drawn[clear], np.asarray(full_cdf_draw(probs, u))[clear])


def test_frequencies_follow_the_probabilities():
    probs = jnp.array([[0.05, 0.0, 0.25, 0.1, 0.0, 0.4, 0.2]])  # 7 tokens in blocks of 3: one padded
    u = (jnp.arange(10000) + 0.5) / 10000  # an even grid over (0, 1): exact frequencies
    drawn = jax.vmap(lambda x: blocked_draw(probs, x[None], block=3)[0])(u)
    np.testing.assert_allclose(np.bincount(np.asarray(drawn), minlength=7) / 10000, probs[0], atol=2e-4)


def test_a_row_with_no_probability_mass_draws_token_zero_as_the_full_cumsum_does():
    probs = jnp.full((2, 10), jnp.nan).at[1].set(0.1)  # row 0: every logit was -inf (softmax gives NaN)
    u = jnp.array([0.35, 0.35])  # row 1: cdf 0.1, 0.2, 0.3, 0.4, ... -> token 3
    assert blocked_draw(probs, u, block=4).tolist() == full_cdf_draw(probs, u).tolist() == [0, 3]


def _excluded_float64_draw(probs: np.ndarray, drawn: np.ndarray, u: np.ndarray):
    """float64_draw from probs with each row's earlier draws (`drawn`, [R, j]) set to 0."""
    left = probs.astype(np.float64).copy()
    np.put_along_axis(left, drawn, 0.0, axis=1)
    return float64_draw(left, u)


@pytest.mark.parametrize("blocked", [True, False])
def test_successive_draws_are_the_float64_draws_without_replacement(blocked):
    """Each candidate is the float64 inverse-CDF draw from probs with the row's earlier candidates
    zeroed (vocabulary 3000: 12 blocks of 256, the last padded), distinct and of positive
    probability; column 0 is the given first draw."""
    from jaxpaged.sample.inverse_cdf import successive_draws

    num_rows, vocab_size, num_more = 32, 3000, 7
    logits = 2 * jax.random.normal(jax.random.key(3), (num_rows, vocab_size))
    banned = jax.random.uniform(jax.random.key(4), (num_rows, vocab_size)) < 0.5
    probs = jax.nn.softmax(jnp.where(banned, -jnp.inf, logits), axis=1)
    probs_np = np.asarray(probs)
    first = blocked_draw(probs, jax.random.uniform(jax.random.key(5), (num_rows,), minval=1e-30))
    u = jax.random.uniform(jax.random.key(6), (num_rows, num_more), minval=1e-30)
    candidates = np.asarray(successive_draws(probs, first, u, blocked=blocked))
    assert candidates.shape == (num_rows, num_more + 1)
    np.testing.assert_array_equal(candidates[:, 0], np.asarray(first))
    assert all(len(set(row)) == num_more + 1 for row in candidates.tolist())
    assert (probs_np[np.arange(num_rows)[:, None], candidates] > 0).all()
    num_clear = 0
    for j in range(1, num_more + 1):
        exact, margin = _excluded_float64_draw(probs_np, candidates[:, :j], np.asarray(u[:, j - 1]))
        clear = margin > 1e-5
        np.testing.assert_array_equal(candidates[clear, j], exact[clear])
        num_clear += clear.sum()
    assert num_clear > 0.9 * num_rows * num_more


@pytest.mark.parametrize("blocked", [True, False])
def test_successive_draws_stop_at_minus_one_when_no_mass_is_left(blocked):
    """Three tokens of positive probability: the fourth candidate on is -1 (never a zero-probability
    or repeated token)."""
    from jaxpaged.sample.inverse_cdf import successive_draws

    probs = jnp.zeros((2, 600)).at[:, jnp.array([5, 300, 599])].set(jnp.array([0.2, 0.5, 0.3]))
    candidates = np.asarray(successive_draws(probs, jnp.array([300, 5]), jnp.full((2, 5), 0.5), blocked=blocked))
    assert sorted(candidates[0, :3].tolist()) == sorted(candidates[1, :3].tolist()) == [5, 300, 599]
    assert (candidates[:, 3:] == -1).all()


@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("gap", [20.0, 24.0])
def test_successive_draws_after_a_dominant_token_weigh_its_block_right(blocked, gap):
    """Token 0 holds nearly all the mass (the others sit `gap` below it in logits: 2e-9 and 4e-11
    each), as when a model strongly prefers a token its grammar rejects. Drawn first, it leaves 255
    tokens in its block of 256 and 256 in the next: the next draw must land in its block 255/511 of
    the time. Subtracting its probability from the float32 block sum left rounding (47.8% at gap
    20, 0% at 24)."""
    from jaxpaged.sample.inverse_cdf import successive_draws

    num_rows = 20000
    logits = jnp.full((1, 512), -gap).at[0, 0].set(0.0)
    probs = jnp.tile(jax.nn.softmax(logits, axis=1), (num_rows, 1))
    u = jax.random.uniform(jax.random.key(7), (num_rows, 1), minval=1e-30)
    second = np.asarray(successive_draws(probs, jnp.zeros(num_rows, jnp.int32), u, blocked=blocked))[:, 1]
    assert (second > 0).all()
    assert abs((second < 256).mean() - 255 / 511) < 0.015, (second < 256).mean()
