"""On-device batched sampling: one jitted call draws one token per output row.

Each output row r reads logits row `row_idx[r]`, so the engine can draw n samples from one prompt's
logits (fan-out) without copying logits on the host. Per row, in the order of vLLM / Hugging Face:

    raw logits x ─► grammar bitmask: tokens outside it to -inf (only when the step passes one)
         │
         ├─────► banned ids to -inf (eos and stop_token_ids while fewer than min_tokens outputs)
         │
    masked x ─────► greedy? (temperature 0) ──────────────────► argmax(x)   (ties: lowest id)
         │
         └─► x / temperature ─► top-k ─► top-p ─► min-p ─► inverse CDF at u(seed, step)
                                (rank)   (nucleus  (>= min_p   (= a draw from the renormalized
                                          over the   * max      distribution of the kept tokens)
                                          top k)     prob)

The returned log-probability is always that of the model's unmodified distribution,
`log_softmax(x)[token]`, whatever filters (min_tokens' ban included) chose the token.

Reproducibility: row r's randomness is one uniform `u(fold_in(key(seed[r]), step[r]))`, and the
token is a function of u and the row's own logits, so a seeded request draws the same tokens alone
or in any batch, at any row, in any bucket. The filters decide only which token ids are kept, and which path a batch
takes (see Cost) does not change a row's kept set, up to float rounding exactly at a top-p boundary.

Ranges assumed (SamplingParams validates them; nothing is checked here):
  temperature: 0 (greedy) or > 0; values below 1e-5 are treated as greedy, since dividing logits by
    them overflows float32.
  top_k: <= 0 or >= vocab_size means off; otherwise keep the k highest (ties broken by lower id).
  top_p: in (0, 1]; 1 means off. Keeps the smallest prefix of the sorted top-k distribution whose
    mass reaches top_p (always at least the most likely token).
  min_p: in [0, 1]; 0 means off. Keeps tokens whose probability is >= min_p * the largest one.
  seed: any Python int, taken modulo 2**32. step: >= 0, the number of tokens the sequence has
    generated so far.
  row_idx: in [0, num_seqs) of the logits it is used with (JAX clamps out-of-range gathers).
  banned_ids: token ids in [0, vocab_size); -1 pads. The host fills them only for rows that are
    still under min_tokens, so the ban ends without anything here knowing min_tokens.

Cost, and branches. On CPU (`branch_free=False`, the default there) each step chooses its work
with `jax.lax.cond`: an all-greedy batch draws no random numbers and ranks nothing; a batch where no
sampling row uses top-k or top-p draws one uniform per row but ranks nothing; otherwise every row
takes its NUM_CANDIDATES largest logits (`lax.top_k`), and only if some row needs more (top-k above
NUM_CANDIDATES, or a top-p those candidates do not reach) is every row fully sorted.
On an accelerator (`branch_free=True`, the default off CPU) a data-dependent `cond` makes XLA read
its predicate back to the host every step, stalling the asynchronous engine's overlap; there every
path is computed and selected per row with `jnp.where` (the full sort included, which on a 2-core
CPU costs ~40x the greedy step, hence the split). Both modes draw the same tokens.

With logprobs and penalties (`sample_ext`): steps in which no row asks for logprobs or uses
penalties / logit_bias / allowed_token_ids run `sample` unchanged (nothing extra computed or copied
back). Any other step runs `sample_ext`, which draws exactly as `sample` does from the penalized logits:

    raw ─► + bias, penalties (penalties.py; only with `penalties`) ─► banned ids ─► sample's draw
    logprobs of every row under `dist`:
        "raw_logprobs":       log_softmax(raw)                       (the model's distribution)
        "processed_logprobs": log_softmax(what the row drew from)    (penalized, temperature-scaled,
                              top-k/top-p/min-p filtered, -inf outside the kept set; greedy rows:
                              penalized and banned, unscaled)
    chosen logprob, its 1-based rank (1 + #ids with a larger logprob), and the top NUM_TOP_LOGPROBS
    (values descending, ties: lower id first) of every row (logprobs.py `token_logprobs`).

Fixed shapes: the top-k width is always NUM_TOP_LOGPROBS (the host slices each row to its k), so a
step compiles once per (rows, penalties or not) and the mode; the engine warms them all.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt

from jaxpaged.ops.ordered_sum import ordered_log_softmax
from jaxpaged.sample.inverse_cdf import blocked_draw, full_cdf_draw
from jaxpaged.sample.logprobs import token_logprobs
from jaxpaged.sample.penalties import PenaltyArrays, TokenState, add_tokens, apply_penalties

# Legend: R=num_rows (output rows, a bucket size) V=vocab_size C=candidates per row (top-k / top-p)

GREEDY_TEMPERATURE = 1e-5  # below this a row is sampled greedily (as vLLM's _SAMPLING_EPS)
PRNG_IMPL = "threefry2x32"  # fixed so that seeded outputs do not depend on jax_default_prng_impl
NUM_CANDIDATES = 1024  # top-k / top-p first look at this many largest logits per row
MIN_BANNED_WIDTH = 4  # banned_ids columns: this, or the next power of two that fits (few compiles)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # sample_ext: the distribution logprobs are read from


class RowSpec(NamedTuple):
    """What one output row samples: the host-side form of a `SamplingArrays` row."""

    row_idx: int  # which logits row to sample from
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0  # the request's seed; for an unseeded request the engine draws one at arrival
    step: int = 0  # tokens this sequence has generated so far; with seed, fixes the draw
    banned_ids: tuple[int, ...] = ()  # token ids this row must not draw (min_tokens not reached)


_PADDING_ROW = RowSpec(row_idx=0)

HostOrDevice = Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-output-row sampling parameters, padded to the bucket size `num_rows`: built as numpy
    arrays on the host, jax arrays inside the jitted sampler.

    Padding rows are greedy reads of logits row 0; the engine ignores their tokens.
    """

    row_idx: Int[HostOrDevice, "num_rows"]  # int32, logits row each output row samples from
    temperature: Float[HostOrDevice, "num_rows"]  # float32, 0 = greedy argmax of the raw logits
    top_k: Int[HostOrDevice, "num_rows"]  # int32, <= 0 = off
    top_p: Float[HostOrDevice, "num_rows"]  # float32, 1 = off
    min_p: Float[HostOrDevice, "num_rows"]  # float32, 0 = off
    seed: UInt[HostOrDevice, "num_rows"]  # uint32, the request's seed
    step: Int[HostOrDevice, "num_rows"]  # int32, tokens generated so far (folded into the seed's key)
    banned_ids: Int[HostOrDevice, "num_rows num_banned"]  # int32, ids whose logits become -inf; -1 pads


def make_sampling_arrays(rows: list[RowSpec | tuple], num_rows: int) -> SamplingArrays:
    """Packs per-row specs (RowSpec, or tuples in its field order) into padded numpy arrays, the
    jitted sampler's argument."""
    if len(rows) > num_rows:
        raise ValueError(
            f"{len(rows)} sampling rows do not fit in a bucket of {num_rows=}; "
            "pick a bucket with at least as many rows as sampled sequences"
        )
    # Columns in one C-level transpose (this runs every step for every sampled row).
    specs = [row if type(row) is RowSpec else RowSpec(*row) for row in rows]
    specs += [_PADDING_ROW] * (num_rows - len(specs))
    (row_idx, temperature, top_k, top_p, min_p, seed, step, banned) = zip(*specs)
    num_banned = max(MIN_BANNED_WIDTH, max(map(len, banned)))
    num_banned = 1 << (num_banned - 1).bit_length()
    banned_ids = np.full((num_rows, num_banned), -1, np.int32)
    for r, ids in enumerate(banned):
        if ids:  # rows under min_tokens only
            banned_ids[r, : len(ids)] = ids
    arrays = SamplingArrays(
        row_idx=np.array(row_idx, np.int32),
        temperature=np.array(temperature, np.float32),
        top_k=np.array(top_k, np.int32),
        top_p=np.array(top_p, np.float32),
        min_p=np.array(min_p, np.float32),
        seed=np.fromiter(map((2**32).__rmod__, seed), np.uint32, num_rows),  # any Python int seed
        step=np.array(step, np.int32),
        banned_ids=banned_ids,
    )
    # Host arrays, not `jax.device_put`: the jitted sampler takes numpy arguments through jit's C++
    # fast path (~0.1 ms for 256 rows here), where device_put of the pytree cost ~0.8 ms a step.
    return arrays


def _rank_keep_mask(
    scaled: Float[Array, "num_rows vocab_size"],
    params: SamplingArrays,
    needs_rank: Bool[Array, "num_rows"],
    num_candidates: int,
) -> tuple[Bool[Array, "num_rows vocab_size"], Bool[Array, "num_rows"]]:
    """Top-k then top-p, decided on each row's `num_candidates` largest logits, mapped back to ids.

    Candidate position j of a row holds its j-th largest logit (equal logits: lower token id first).
    With probabilities p (after top-k) sorted descending, top-p keeps position j when the mass
    strictly before it is < top_p:

        p sorted:          0.5   0.3   0.15  0.05        top_p = 0.8
        mass before j:     0.0   0.5   0.8   0.95
        kept:              yes   yes   no    no       (0.5 + 0.3 reaches 0.8: the smallest prefix)

    Returns the keep mask (all True for rows not in needs_rank) and, per row, whether the
    candidates were enough to decide it: always with num_candidates == vocab_size; otherwise when
    top-k is on with k <= num_candidates, or top-k is off and the candidates hold top_p of the mass.
    """
    vocab_size = scaled.shape[1]
    values, token_ids = jax.lax.top_k(scaled, num_candidates)  # [R, C], descending
    rank = jax.lax.broadcasted_iota(jnp.int32, values.shape, 1)  # [R, C]

    top_k = params.top_k[:, None]  # [R, 1]
    top_k_on = (top_k > 0) & (top_k < vocab_size)
    keep_k = ~top_k_on | (rank < top_k)
    # top-p runs on the distribution renormalized over the top-k tokens, or over the whole row.
    log_norm = jnp.where(
        top_k_on,
        jax.nn.logsumexp(jnp.where(keep_k, values, -jnp.inf), axis=1, keepdims=True),
        jax.nn.logsumexp(scaled, axis=1, keepdims=True),
    )
    probs = jnp.where(keep_k, jnp.exp(values - log_norm), 0.0)
    mass_through = jnp.cumsum(probs, axis=1)
    mass_before = mass_through - probs
    top_p = params.top_p[:, None]
    # top_p >= 1 keeps everything explicitly: float cumsums can reach 1.0 before the tail ends.
    keep_p = (top_p >= 1.0) | (mass_before < top_p) | (rank == 0)

    row_ids = jax.lax.broadcasted_iota(jnp.int32, values.shape, 0)
    keep = (
        jnp.zeros(scaled.shape, jnp.bool_)
        .at[row_ids, token_ids]
        .set(keep_k & keep_p, unique_indices=True)
    )
    unfiltered = ~needs_rank[:, None]  # [R, 1]: greedy, or neither filter: nothing to decide
    keep |= unfiltered

    decided = (
        unfiltered
        | (top_k_on & (top_k <= num_candidates))
        | (~top_k_on & (mass_through[:, -1:] >= top_p))
        | (num_candidates == vocab_size)
    )
    return keep, decided[:, 0]


def _top_k_top_p_keep_mask(
    scaled: Float[Array, "num_rows vocab_size"],
    params: SamplingArrays,
    needs_rank: Bool[Array, "num_rows"],
    branch_free: bool,
) -> Bool[Array, "num_rows vocab_size"]:
    """The rank filters on the NUM_CANDIDATES largest logits, or on fully sorted rows where those
    do not decide a row (a top-k above NUM_CANDIDATES, or a top-p beyond their mass): for every row
    if one needs it, or (branch_free) per row with both computed. A full sort costs 20x more on
    CPU. Both keep the same tokens, up to float rounding exactly at a boundary."""
    vocab_size = scaled.shape[1]
    if vocab_size <= NUM_CANDIDATES:
        return _rank_keep_mask(scaled, params, needs_rank, vocab_size)[0]
    keep, decided = _rank_keep_mask(scaled, params, needs_rank, NUM_CANDIDATES)
    if branch_free:
        full_keep, _ = _rank_keep_mask(scaled, params, needs_rank, vocab_size)
        return jnp.where(decided[:, None], keep, full_keep)
    return jax.lax.cond(
        jnp.all(decided),
        lambda: keep,
        lambda: _rank_keep_mask(scaled, params, needs_rank, vocab_size)[0],
    )


def _processed_logits(
    raw: Float[Array, "num_rows vocab_size"], params: SamplingArrays, branch_free: bool
) -> Float[Array, "num_rows vocab_size"]:
    """Temperature, top-k, top-p and min-p applied: scaled logits, -inf outside the kept tokens."""
    vocab_size = raw.shape[1]
    is_random = params.temperature >= GREEDY_TEMPERATURE
    temperature = jnp.where(is_random, params.temperature, 1.0)
    scaled = raw / temperature[:, None]

    top_k_on = (params.top_k > 0) & (params.top_k < vocab_size)
    needs_rank = is_random & (top_k_on | (params.top_p < 1.0))
    if branch_free:  # rows that need no rank come back all True
        keep = _top_k_top_p_keep_mask(scaled, params, needs_rank, branch_free)
    else:
        keep = jax.lax.cond(
            jnp.any(needs_rank),
            lambda: _top_k_top_p_keep_mask(scaled, params, needs_rank, branch_free),
            lambda: jnp.ones(scaled.shape, jnp.bool_),
        )
    # min-p in log space: p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p). The most likely
    # token survives top-k and top-p, so filtering before or after renormalizing is the same.
    row_max = jnp.max(scaled, axis=1, keepdims=True)
    keep &= scaled - row_max >= jnp.log(params.min_p)[:, None]
    return jnp.where(keep, scaled, -jnp.inf)


def mask_banned(
    raw: Float[Array, "num_rows vocab_size"], banned_ids: Int[Array, "num_rows num_banned"]
) -> Float[Array, "num_rows vocab_size"]:
    """raw with -inf at each row's banned ids; the -1 padding points past the vocabulary and is dropped."""
    vocab_size = raw.shape[1]
    columns = jnp.where(banned_ids < 0, vocab_size, banned_ids)  # [R, B]
    rows = jax.lax.broadcasted_iota(jnp.int32, columns.shape, 0)  # [R, B]
    return raw.at[rows, columns].set(-jnp.inf, mode="drop")


def apply_token_bitmask(
    raw: Float[Array, "num_rows vocab_size"], token_bitmask: Int[Array, "num_rows num_words"]
) -> Float[Array, "num_rows vocab_size"]:
    """raw with -inf where the row's bitmask bit is 0: bit (t % 32) of word t // 32 allows token t.

    Structured outputs' grammar mask (jaxpaged/structured/); rows without a grammar are all ones.
    """
    vocab_ids = jnp.arange(raw.shape[1], dtype=jnp.uint32)
    words = jax.lax.bitcast_convert_type(token_bitmask, jnp.uint32)[:, vocab_ids >> 5]  # [R, V]
    allowed = jax.lax.shift_right_logical(words, jnp.broadcast_to(vocab_ids & 31, words.shape)) & 1
    return jnp.where(allowed.astype(jnp.bool_), raw, -jnp.inf)


def row_uniforms(params: SamplingArrays, draw: int | Int[Array, ""] = 0) -> Float[Array, "num_rows"]:
    """One uniform in (0, 1) per row, from (seed, step) alone. `draw` (static > 0, or traced): an
    independent one from the same (seed, step) (structured outputs' candidates and redraw of a
    rejected token)."""

    def row_uniform(seed, step):
        key = jax.random.fold_in(jax.random.key(seed, impl=PRNG_IMPL), step)
        key = key if isinstance(draw, int) and draw == 0 else jax.random.fold_in(key, draw)
        return jax.random.uniform(key, (), jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)

    return jax.vmap(row_uniform)(params.seed, params.step)


def _inverse_cdf_draw(
    processed: Float[Array, "num_rows vocab_size"], u: Float[Array, "num_rows"]
) -> Int[Array, "num_rows"]:
    """The first token whose cumulative probability reaches u: a draw from softmax(processed).

        probs:   0.1  0.0  0.6  0.3          u = 0.5
        cdf:     0.1  0.1  0.7  1.0          cdf < u at ids 0, 1  ->  token 2
    Tokens outside the kept set have probability 0 and can never be the first to reach u > 0.
    One random number per row instead of one per token id: on a CPU, generating vocab_size
    threefry values per row cost more than the model's decode step.
    """
    probs = jax.nn.softmax(processed, axis=1)
    # The CPU finds the block first (inverse_cdf.py: a full-vocabulary cumsum is most of the
    # sampler's time there); other backends keep the full cumulative sum, as before. Chosen by the
    # platform the program is lowered for, not the host's: a CUDA program compiled on a CPU host
    # keeps the GPU's draw.
    return jax.lax.platform_dependent(probs, u, cpu=blocked_draw, default=full_cdf_draw)


def resolve_branch_free(branch_free: bool | None) -> bool:
    """None: branch-free everywhere but on CPU, where cond skips work and costs no host round trip."""
    return jax.default_backend() != "cpu" if branch_free is None else branch_free


@functools.partial(jax.jit, static_argnames=("branch_free",))
def sampling_logits(
    logits: Float[Array, "num_seqs vocab_size"], params: SamplingArrays, branch_free: bool | None = None
) -> Float[Array, "num_rows vocab_size"]:
    """The logits each output row samples from: scaled by temperature, -inf outside the kept tokens.

    Rows with temperature 0 are returned unscaled and unfiltered (but banned ids are -inf). For tests and inspection;
    `sample` computes the same thing inline.
    """
    raw = logits.astype(jnp.float32)[params.row_idx]
    return _processed_logits(mask_banned(raw, params.banned_ids), params, resolve_branch_free(branch_free))


@functools.partial(jax.jit, static_argnames=("branch_free", "draw"))
def sample(
    logits: Float[Array, "num_seqs vocab_size"], params: SamplingArrays, branch_free: bool | None = None,
    token_bitmask: Int[Array, "num_rows num_words"] | None = None, draw: int = 0,
) -> tuple[Int[Array, "num_rows"], Float[Array, "num_rows"]]:
    """Draws one token per output row.

    Args:
      logits: float logits (cast to float32), one row per scheduled sequence, padding rows allowed.
      params: per-output-row parameters from `make_sampling_arrays`; row r samples from
        `logits[params.row_idx[r]]`.
      branch_free: static; True computes every path and selects per row (no `cond`, so no device to
        host predicate read on a GPU), False skips unneeded work with `cond`s; None (default) picks
        False on CPU and True elsewhere. The tokens are the same.
      token_bitmask: int32 [num_rows, ceil(vocab_size / 32)] or None: the structured-output grammar
        mask (see apply_token_bitmask), applied before everything else. None (a separate compiled
        variant) costs nothing; a step passes it only when some row has a grammar.
      draw: static; 0 is a row's draw, > 0 an independent uniform of the same (seed, step)
        (rows.py: resample_padded, a grammar-rejected token drawn again under the mask).

    Returns:
      token_ids: int32 [num_rows], the chosen token of each output row.
      logprobs: float32 [num_rows], `log_softmax(logits[row_idx])` at the chosen token, i.e. under
        the model's unmodified distribution.

    Compiles once per (num_seqs, num_rows, vocab_size, num_banned, bitmask or not); parameter
    values never retrace.
    """
    raw = logits.astype(jnp.float32)[params.row_idx]  # [R, V]
    constrained = raw if token_bitmask is None else apply_token_bitmask(raw, token_bitmask)
    allowed = mask_banned(constrained, params.banned_ids)  # [R, V]
    greedy_ids = jnp.argmax(allowed, axis=1).astype(jnp.int32)
    is_random = params.temperature >= GREEDY_TEMPERATURE
    branch_free = resolve_branch_free(branch_free)

    def random_ids():
        drawn = _inverse_cdf_draw(_processed_logits(allowed, params, branch_free), row_uniforms(params, draw))
        return jnp.where(is_random, drawn, greedy_ids)

    token_ids = random_ids() if branch_free else jax.lax.cond(jnp.any(is_random), random_ids, lambda: greedy_ids)
    chosen = jnp.take_along_axis(raw, token_ids[:, None], axis=1)[:, 0]
    logprobs = chosen - jax.nn.logsumexp(raw, axis=1)
    return token_ids, logprobs


@functools.partial(jax.jit, static_argnames=("logprobs_mode", "num_out", "branch_free", "ordered"),
                   donate_argnames=("state",))
def sample_ext(
    logits: Float[Array, "num_seqs vocab_size"], params: SamplingArrays, penalties: PenaltyArrays | None,
    state: TokenState | None, token_bitmask: Int[Array, "num_rows num_words"], *, logprobs_mode: str, num_out: int,
    branch_free: bool | None = None, ordered: bool = False,
):
    """Returns (tokens int32 [num_out] padded with 0, logprobs dict of device arrays, the updated state).

    `ordered` (static; EngineConfig.batch_invariant): the logprobs' log_softmax sums in an order fixed
    by the vocabulary size alone (ops/ordered_sum.py), as jaxpaged.rl.token_logprobs sums them; XLA's
    own reduction orders them by the number of rows.
    logprobs: "chosen" f32 [R], "rank" int32 [R], "top_values" f32 [R, 20], "top_ids" int32 [R, 20].
    `penalties` None (and state None) skips the penalty path: a separate compiled program.
    `token_bitmask`: the structured-output mask (all ones for rows without a grammar), applied after
    the penalties and before the min_tokens ban, as `sample` applies it.
    """
    raw = logits.astype(jnp.float32)[params.row_idx]  # [R, V]
    x = raw if penalties is None else apply_penalties(raw, state, penalties)
    allowed = mask_banned(apply_token_bitmask(x, token_bitmask), params.banned_ids)
    greedy_ids = jnp.argmax(allowed, axis=1).astype(jnp.int32)
    is_random = params.temperature >= GREEDY_TEMPERATURE
    branch_free = resolve_branch_free(branch_free)

    def random_path():
        processed = _processed_logits(allowed, params, branch_free)
        drawn = _inverse_cdf_draw(processed, row_uniforms(params))
        return jnp.where(is_random, drawn, greedy_ids), jnp.where(is_random[:, None], processed, allowed)

    if branch_free:
        token_ids, processed = random_path()
    else:
        token_ids, processed = jax.lax.cond(jnp.any(is_random), random_path, lambda: (greedy_ids, allowed))
    if penalties is not None:
        state = add_tokens(state, penalties.slot, token_ids)

    dist = raw if logprobs_mode == "raw_logprobs" else processed
    logprobs = ordered_log_softmax(dist) if ordered else jax.nn.log_softmax(dist, axis=1)
    out = token_logprobs(logprobs, token_ids)
    tokens = jnp.pad(token_ids, (0, num_out - token_ids.shape[0]))
    return tokens, out, state


@functools.partial(jax.jit, static_argnames=("num_candidates",))
def beam_candidates(
    logits: Float[Array, "num_seqs vocab_size"], num_candidates: int
) -> tuple[Float[Array, "num_seqs num_candidates"], Int[Array, "num_seqs num_candidates"]]:
    """Beam search's device half: per logits row, the `num_candidates` most likely next tokens.

    Returns (log_softmax(logits) of those tokens, float32, best first; their token ids, int32), as
    Hugging Face computes them (log_softmax of float32 logits). The host adds each beam's cumulative
    log-probability and picks the step's top candidates over all beams (jaxpaged/engine/beam_search.py): a
    beam's best C candidates contain every candidate of it that can enter the global top C.
    Compiles once per (num_seqs, num_candidates).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    values, token_ids = jax.lax.top_k(logprobs, num_candidates)
    return values, token_ids.astype(jnp.int32)
