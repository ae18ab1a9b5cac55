"""Structured outputs' sample first (structured/matchers.py, sample/step_sampler.py), in its parts.

1. The host's check replaces llguidance's mask: on SmolLM2's tokenizer (49152 tokens), walking
   several grammars token by token, the set the check allows (the forced token alone, else every
   token validate_tokens accepts, eos where the matcher accepts) IS the mask, token for token
   (the default suite checks the mask's tokens and 3000 others per state, `slow` every token).
2. The device's redraw is exact: drawing unmasked, then redrawing the rejected rows under the mask,
   gives the always-masked distribution p(t) / p(A): total variation to it < 0.03 at 16384 seeds,
   23 allowed tokens of 96, ~80% of first draws rejected (the masked path's own draw measures
   0.019, the redraw 0.014; the seeds are fixed, so the test is deterministic). Greedy tokens are
   equal row for row. Redrawing with the first draw's uniform instead (draw 0) fails the bound.
   With candidates (the draw and 31 more without replacement; a rejected row takes the first
   allowed one, and only rows with none are redrawn) the tokens are distributed alike; greedy rows
   have no candidates, and their tokens equal the masked path's.
Engine-level checks (greedy tokens equal, seeds reproducible, first tokens distributed alike on the
tiny model) are in test_structured_outputs.py, beside its warmed engine.
"""

import numpy as np
import pytest

from jaxpaged import StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler():
    from jaxpaged.models.loading import default_model_path
    from jaxpaged.models.tokenizer import Tokenizer
    from jaxpaged.structured.grammar import GrammarCompiler, make_ll_tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    return GrammarCompiler(make_ll_tokenizer(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_id))


SPECS = [
    StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": -5, "maximum": 300},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 2},
        "zip": {"type": "string", "pattern": "^[0-9]{3}$"}, "ok": {"type": "boolean"}},
        "required": ["name", "n", "zip"], "additionalProperties": False}),
    StructuredOutputsParams(json={"anyOf": [{"type": "number", "minimum": 0.5}, {"type": "null"}]}),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"(cat|category|dog)s? [0-9]{2,3}( [a-z]+)?"),
    StructuredOutputsParams(choice=["alpha", "alphabet", "beta gamma"]),
    StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'),
]


def _allowed(mask_words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(mask_words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def _walk_and_compare(compiler, num_walks: int, max_states: int, num_sampled_tokens: int | None):
    """Random walks through every spec, comparing at each state the check's allowed set with the
    mask, over every token (num_sampled_tokens None) or the mask's tokens plus that many others."""
    from jaxpaged.structured.matchers import StructuredState, drawn_allowed, forced_token

    vocab, eos = compiler.vocab_size, compiler.ll_tokenizer.eos_token
    state = StructuredState(vocab, eos)  # its mask: llguidance's, with eos where nothing is allowed
    rng = np.random.default_rng(0)
    num_states = num_forced = num_ended = 0
    for spec in SPECS:
        template = compiler.submit(spec).result()
        for _ in range(num_walks):
            matcher = template.deep_copy()
            for _ in range(max_states):
                mask = np.zeros(state.num_words, np.int32)
                matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                state.allow_eos_where_empty(mask[None], [0])
                want = _allowed(mask, vocab)
                tokens = np.arange(vocab) if num_sampled_tokens is None else np.union1d(
                    np.flatnonzero(want), rng.choice(vocab, num_sampled_tokens, replace=False))
                forced = forced_token(matcher)
                got = tokens == forced if forced >= 0 else np.array([drawn_allowed(matcher, int(t), eos) for t in tokens])
                np.testing.assert_array_equal(tokens[got], tokens[want[tokens]])
                num_states, num_forced = num_states + 1, num_forced + (forced >= 0)
                token = int(rng.choice(np.flatnonzero(want)))
                if token == eos:
                    num_ended += 1
                    break
                assert matcher.consume_token(token)
    return num_states, num_forced, num_ended


def test_the_check_allows_the_tokens_of_llguidances_mask(compiler):
    """Every state of one walk per grammar (up to 12), over the mask's tokens and 3000 others."""
    num_states, num_forced, num_ended = _walk_and_compare(compiler, 1, 12, 3000)
    assert num_states >= 50 and 10 <= num_forced < num_states and num_ended >= 2, (num_states, num_forced, num_ended)


@pytest.mark.slow
def test_the_check_allows_exactly_the_tokens_of_llguidances_mask_over_the_whole_vocabulary(compiler):
    num_states, num_forced, num_ended = _walk_and_compare(compiler, 2, 40, None)
    assert num_states >= 100 and 20 <= num_forced < num_states and num_ended >= 6, (num_states, num_forced, num_ended)


def test_check_with_masks_ahead_equals_the_mask_and_puts_in_forced_tokens_and_candidates(compiler):
    """StepMask.check over walks of 8 JSON sequences (6 sampled, 2 greedy), each drawn token a
    forbidden one 30% of the time: with the masks of the sampled rows filled ahead (masks_ahead)
    and without, the verdict is the same and equals llguidance's mask: the rejected rows are the
    forbidden draws, forced rows get their forced tokens put in, a redraw's mask rows are the
    other rejected rows' masks, and a step whose rejected rows are all forced has no redraw.
    Ahead, the only masks computed after the draw are greedy rows' and the first step's (nothing
    was prefetched before it). A third state is given candidates (8 a row, the drawn token first,
    -1 padding some): each rejected free row takes its first allowed candidate, and only rows
    with none are redrawn, under their masks."""
    from jaxpaged.planner.request import SamplingParams
    from jaxpaged.planner.sequence import Sequence, SequenceStatus
    from jaxpaged.structured.matchers import StructuredState, forced_token

    vocab, eos = compiler.vocab_size, compiler.ll_tokenizer.eos_token
    template = compiler.submit(SPECS[0]).result()
    ahead, lazy, cand = (StructuredState(vocab, eos) for _ in range(3))
    lazy.masks_ahead = False
    ahead.templates["r"] = lazy.templates["r"] = cand.templates["r"] = template
    rng = np.random.default_rng(2)

    def fresh(r):
        seq = Sequence([1, 2], SamplingParams(temperature=0.0 if r >= 6 else 1.0))
        seq.status = SequenceStatus.RUNNING
        return [seq, template.deep_copy()]  # the sequence and the test's own matcher

    walks = [fresh(r) for r in range(8)]
    want_lazy = num_puts = num_redraws = num_taken = num_cand_redraws = 0
    for step in range(40):
        rows = [(r, seq, "r", True) for r, (seq, _) in enumerate(walks)]
        checks = [state.step_mask(rows, len(walks)) for state in (ahead, lazy, cand)]
        masks = np.zeros((len(walks), ahead.num_words), np.int32)
        drawn = np.zeros(len(walks), np.int32)
        candidates = np.full((len(walks), 8), -1, np.int32)
        for r, (_, matcher) in enumerate(walks):
            matcher.unsafe_compute_mask_ptr(masks[r].ctypes.data, masks[r].nbytes)
            ahead.allow_eos_where_empty(masks[r][None], [0])
            allowed = _allowed(masks[r], vocab)
            drawn[r] = rng.choice(np.flatnonzero(~allowed if rng.random() < 0.3 else allowed))
            # mostly forbidden candidates (an allowed one in ~half the rows), some rows cut short by -1
            more = rng.choice(np.flatnonzero(~allowed), 7, replace=False)
            if rng.random() < 0.5:
                more[rng.integers(7)] = rng.choice(np.flatnonzero(allowed))
            candidates[r] = np.concatenate([[drawn[r]], more])
            candidates[r, 1 + rng.integers(8):] = -1
        rejected = np.array([not _allowed(masks[r], vocab)[t] for r, t in enumerate(drawn)])
        forced = np.array([forced_token(m) for _, m in walks])
        free = rejected & (forced < 0)
        fixes = [c.check(drawn) for c in checks[:2]]
        fix_cand = checks[2].check(drawn, candidates)
        if not rejected.any():
            assert fixes == [None, None] and fix_cand is None
        elif not free.any():  # forced rows only: their tokens put in
            num_puts += 1
            for fix in fixes + [fix_cand]:
                assert fix.mask is None and fix.rejected is None
                np.testing.assert_array_equal(fix.tokens, np.where(rejected, forced, drawn))
        else:
            num_redraws += 1
            for fix in fixes:
                np.testing.assert_array_equal(fix.rejected, free)
                np.testing.assert_array_equal(fix.mask[free], masks[free])
                assert (fix.mask[~free] == -1).all()
                np.testing.assert_array_equal(fix.tokens[~free], np.where(rejected, forced, drawn)[~free])
            want_lazy += sum(1 for r in np.flatnonzero(free) if r >= 6 or step == 0)
        if free.any():  # the candidates' verdict: the first allowed one, else a redraw
            taken = np.array([next((t for t in candidates[r, 1:] if t >= 0 and _allowed(masks[r], vocab)[t]), -1)
                              for r in range(len(walks))])
            left = free & (taken < 0)
            want = np.where(free & (taken >= 0), taken, np.where(rejected, forced, drawn))
            num_taken += int((free & (taken >= 0)).sum())
            np.testing.assert_array_equal(fix_cand.tokens[~left], want[~left])
            if left.any():
                num_cand_redraws += 1
                np.testing.assert_array_equal(fix_cand.rejected, left)
                np.testing.assert_array_equal(fix_cand.mask[left], masks[left])
                assert (fix_cand.mask[~left] == -1).all()
            else:
                assert fix_cand.mask is None and fix_cand.rejected is None
        for r, (seq, matcher) in enumerate(walks):
            token = int(drawn[r]) if not rejected[r] else int(rng.choice(np.flatnonzero(_allowed(masks[r], vocab))))
            if token == eos:
                seq.status = SequenceStatus.FINISHED
                walks[r] = fresh(r)
            else:
                assert matcher.consume_token(token)
                seq.output_token_ids.append(token)
        for state in (ahead, lazy, cand):
            state.release({"r"})
            state.prefetch()
    assert num_puts >= 3 and num_redraws >= 3, (num_puts, num_redraws)
    assert ahead.num_puts == lazy.num_puts == num_puts
    assert ahead.num_redraws == lazy.num_redraws == num_redraws
    assert ahead.num_rows_rejected_lazy == want_lazy < lazy.num_rows_rejected_lazy, (
        ahead.num_rows_rejected_lazy, want_lazy, lazy.num_rows_rejected_lazy)
    assert cand.num_rows_candidate == num_taken >= 3 and 0 < num_cand_redraws == cand.num_redraws < num_redraws, (
        num_taken, num_cand_redraws, num_redraws)


def _bitmask(allowed: np.ndarray) -> np.ndarray:
    num_rows, vocab = allowed.shape
    bits = np.zeros((num_rows, -(-vocab // 32) * 32), np.uint8)
    bits[:, :vocab] = allowed
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def _draws(logits, allowed, temperature, draw):
    """(always-masked tokens, sample-first tokens): row r uses seed r; `draw`: the redraw's uniform."""
    import jax.numpy as jnp

    from jaxpaged.sample.sampler import RowSpec, make_sampling_arrays, sample
    from jaxpaged.sample.rows import resample_padded

    num_rows, vocab = logits.shape
    mask = _bitmask(allowed)
    arrays = make_sampling_arrays([RowSpec(row_idx=r, temperature=temperature, seed=r, step=3) for r in range(num_rows)],
                                  num_rows)
    masked = np.asarray(sample(logits, arrays, token_bitmask=mask)[0])
    first = sample(logits, arrays)[0]
    rejected = ~allowed[np.arange(num_rows), np.asarray(first)]
    if draw > 0:
        redrawn = resample_padded(logits, arrays, first, mask, rejected, num_out=num_rows)
    else:  # the same uniform as the first draw: biased, what the test must catch
        again = sample(logits, arrays, token_bitmask=mask, draw=0)[0]
        redrawn = jnp.where(rejected, again, first)
    return masked, np.asarray(redrawn), rejected.mean()


def _draws_with_candidates(logits, allowed, temperature):
    """The engine's sample first (step_sampler._redraw_rejected): the draw and its candidates, a
    rejected row's first allowed candidate, the device's redraw for rows with none. Returns
    (tokens, share of rows rejected, share of those that took a candidate)."""
    from jaxpaged.sample.sampler import RowSpec, make_sampling_arrays
    from jaxpaged.sample.rows import resample_padded, sample_first_padded

    num_rows, _ = logits.shape
    arrays = make_sampling_arrays([RowSpec(row_idx=r, temperature=temperature, seed=r, step=3) for r in range(num_rows)],
                                  num_rows)
    tokens, candidates = (np.asarray(a) for a in sample_first_padded(logits, arrays, num_out=num_rows))
    if temperature > 0:  # the draw first; greedy rows have none
        np.testing.assert_array_equal(candidates[:, 0], tokens)
    else:
        assert (candidates == -1).all()
    rows = np.arange(num_rows)
    rejected = ~allowed[rows, tokens]
    ok = (candidates[:, 1:] >= 0) & allowed[rows[:, None], np.maximum(candidates[:, 1:], 0)]  # [R, C - 1]
    has = ok.any(axis=1)
    fixed = np.where(rejected & has, candidates[rows, 1 + np.argmax(ok, axis=1)], tokens)
    left = rejected & ~has
    out = np.asarray(resample_padded(logits, arrays, fixed.astype(np.int32), _bitmask(allowed), left, num_out=num_rows))
    return out, rejected.mean(), (rejected & has).sum() / max(rejected.sum(), 1)


def _tv(tokens, probs):
    return 0.5 * np.abs(np.bincount(tokens, minlength=len(probs)) / len(tokens) - probs).sum()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_redraw_gives_the_masked_distribution(temperature):
    rng = np.random.default_rng(1)
    vocab, num_rows = 96, 16384
    row_logits = rng.normal(size=vocab).astype(np.float32)
    allowed_row = rng.random(vocab) < 0.3
    allowed_row[np.argmax(row_logits)] = False  # the likeliest token is forbidden: many rejections
    logits, allowed = np.tile(row_logits, (num_rows, 1)), np.tile(allowed_row, (num_rows, 1))
    scaled = np.where(allowed_row, row_logits / temperature, -np.inf)
    want = np.exp(scaled - scaled.max())
    want /= want.sum()  # p(t) / p(A) at this temperature

    masked, redrawn, rejected = _draws(logits, allowed, temperature, draw=1)
    assert allowed_row[masked].all() and allowed_row[redrawn].all()
    assert 0.3 < rejected < 0.9, rejected
    assert _tv(masked, want) < 0.03 and _tv(redrawn, want) < 0.03, (_tv(masked, want), _tv(redrawn, want))
    if temperature == 1.0:  # the bound has teeth: the first draw's uniform again is 0.08 away
        _, biased, _ = _draws(logits, allowed, temperature, draw=0)
        assert _tv(biased, want) > 0.06, _tv(biased, want)

    greedy_logits = logits[:64] + rng.normal(size=(64, vocab)).astype(np.float32)
    greedy_masked, greedy_redrawn, _ = _draws(greedy_logits, allowed[:64], 0.0, draw=1)
    np.testing.assert_array_equal(greedy_redrawn, greedy_masked)


@pytest.mark.parametrize("temperature,share_allowed,taken", [(1.0, 0.3, (0.95, 1.0)), (0.6, 0.3, (0.95, 1.0)),
                                                            (1.0, 0.04, (0.05, 0.6))])
def test_candidates_give_the_masked_distribution(temperature, share_allowed, taken):
    """The engine's sample first with candidates (the first allowed of the draw and 31 more without
    replacement, else the device's redraw) draws p(t) / p(A): TV < 0.03 at 16384 seeds, as the
    always-masked path, whether the candidates settle nearly every rejected row (30% of 96 tokens
    allowed) or few (4%: most go to the redraw, which must then stay exact too). Greedy rows take no
    candidate: their redraw gives the masked path's tokens, row for row."""
    rng = np.random.default_rng(1)
    vocab, num_rows = 96, 16384
    row_logits = rng.normal(size=vocab).astype(np.float32)
    allowed_row = rng.random(vocab) < share_allowed
    allowed_row[np.argsort(row_logits)[:2]] = True  # two unlikely tokens allowed: A is never empty
    allowed_row[np.argmax(row_logits)] = False  # the likeliest token is forbidden: many rejections
    logits, allowed = np.tile(row_logits, (num_rows, 1)), np.tile(allowed_row, (num_rows, 1))
    scaled = np.where(allowed_row, row_logits / temperature, -np.inf)
    want = np.exp(scaled - scaled.max())
    want /= want.sum()  # p(t) / p(A) at this temperature

    tokens, rejected, share_taken = _draws_with_candidates(logits, allowed, temperature)
    assert allowed_row[tokens].all()
    assert 0.3 < rejected < 0.995 and taken[0] <= share_taken <= taken[1], (rejected, share_taken)
    assert _tv(tokens, want) < 0.03, _tv(tokens, want)

    # Greedy rows have no candidates: a rejected one is redrawn, to the masked path's argmax.
    greedy_logits = logits[:256] + rng.normal(size=(256, vocab)).astype(np.float32)
    greedy, greedy_rejected, greedy_taken = _draws_with_candidates(greedy_logits, allowed[:256], 0.0)
    masked, _, _ = _draws(greedy_logits, allowed[:256], 0.0, draw=1)
    np.testing.assert_array_equal(greedy, masked)
    assert greedy_rejected > 0.3 and greedy_taken == 0, (greedy_rejected, greedy_taken)
