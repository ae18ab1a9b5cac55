"""Structured outputs on a model: JSON schemas, regex, choice, grammar (jaxpaged/structured/).

The tiny random model (tests/tiny_checkpoint.py, a byte-level tokenizer) has no idea of JSON: every
token of its output is chosen by the grammar mask, the strongest test of the masking itself. The
expectations are exact: jsonschema validation, re.fullmatch, choice membership, the unconstrained
output where it already satisfies the constraint, zero compiles, no leaked pages or matchers.
"""

import json
import os
import re

import jsonschema
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from compile_watch import backend_compiles
from tiny_checkpoint import write_tiny_checkpoint

SCHEMAS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")))
PROMPT = "Answer in JSON:"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")))
    return LLM(path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, num_pages=160, page_size=8)


def _engine(llm):
    return llm.engine


def _assert_idle(llm):
    engine = _engine(llm)
    assert not engine.has_unfinished_requests()
    assert len(engine.structured) == 0, "matcher state leaked"
    assert engine.block_manager.stats()["num_used_pages"] == 0, "pages leaked"


def _json_params(schema, **kw):
    return SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema), **kw)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_every_schema_output_parses_and_validates(llm, mode):
    assert len(SCHEMAS) >= 50
    kw = dict(temperature=0.0) if mode == "greedy" else dict(temperature=1.0, top_p=0.95, seed=7)
    params = [_json_params(s, **kw) for s in SCHEMAS]
    before = _counts(_engine(llm).structured.state)
    # One free row in the batch: constrained and unconstrained rows mixed.
    outputs = llm.generate([PROMPT] * len(SCHEMAS) + ["free"], params + [SamplingParams(temperature=0, max_tokens=8)])
    for schema, out in zip(SCHEMAS, outputs):
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert outputs[-1].outputs[0].finish_reason == "length"
    ahead, now, checked, rejected, forced = (b - a for a, b in zip(before, _counts(_engine(llm).structured.state)))
    if mode == "greedy":  # drawn first, then checked (the random model's token is often rejected) or forced
        assert checked + forced > rejected > 0 and forced > 0 and checked > 0 and ahead == 0
    else:  # top_p: the mask comes first, most computed ahead, at the previous commit
        assert ahead > now > 0 and checked == forced == 0
    _assert_idle(llm)


def _counts(state):
    if state is None:
        return (0,) * 5
    return (state.num_rows_ahead, state.num_rows_now, state.num_rows_checked, state.num_rows_rejected,
            state.num_rows_forced)


def _num_compiles(llm) -> tuple[int, int, int, int]:
    """(step programs compiled, sampler programs compiled: both variants, every row count, the
    sample-first sampler with candidates, and the grammar's redraw programs)."""
    from jaxpaged.sample.rows import resample_padded, sample_first_padded, sample_padded

    return (_engine(llm).stats()["num_compiles"], sample_padded._cache_size(), sample_first_padded._cache_size(),
            resample_padded._cache_size())


def test_zero_compiles_after_warmup_with_mixed_rows(llm):
    before = _num_compiles(llm)
    state = _engine(llm).structured.state
    counts0 = (state.num_puts, state.num_redraws, state.num_rows_candidate) if state is not None else (0, 0, 0)
    schema = SCHEMAS[0]
    # Rows drawn first (greedy, n = 3 at a temperature) beside a top-k row masked first and a free row.
    with backend_compiles() as compiled:  # every executable built, traced or not (a placement miss is not)
        llm.generate(["a", "bb", "ccc", "d"], [_json_params(schema, temperature=0.0), SamplingParams(temperature=0.7, max_tokens=9),
                                                _json_params(schema, temperature=0.9, seed=3, n=3),
                                                _json_params(schema, temperature=0.8, top_k=5, seed=4)])
        # Only rows drawn first (the sampler with candidates) beside a free row; the regex allows ~10%
        # of the byte-level tokens, so the random model's rejected rows often find one in 32 candidates.
        letters = StructuredOutputsParams(regex=r"[a-z ]{4,30}")
        llm.generate(["a", "bb", "ccc"], [_json_params(schema, temperature=0.0), SamplingParams(temperature=0.7, max_tokens=9),
                                          SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=30, structured_outputs=letters)])
        llm.generate(["a"], SamplingParams(temperature=0.0, max_tokens=5))  # back to the unmasked variant
    assert _num_compiles(llm) == before
    assert compiled == [], f"compiled after warm-up: {compiled}"
    state = _engine(llm).structured.state  # every fix of rejected rows ran: tokens put in (forced or a
    assert state.num_puts > counts0[0] and state.num_redraws > counts0[1]  # candidate), a redraw
    assert state.num_rows_candidate > counts0[2]


def _generate_sample_first(llm, prompts, params, sample_first: bool):
    """llm.generate with constrained rows drawn first (the default) or always under their full mask."""
    llm.generate(["w"], _json_params({"type": "boolean"}, temperature=0.0))  # the engine's grammar state exists
    state = _engine(llm).structured.state
    state.sample_first = sample_first
    try:
        return llm.generate(prompts, params)
    finally:
        state.sample_first = True


def test_sample_first_equals_the_always_masked_path(llm):
    """Greedy tokens identical to the always-masked path; seeded sampled tokens the same run twice;
    the first token of a regex the random model almost never draws by itself (~99% rejected),
    distributed alike over 512 seeds both ways (TV < 0.1; 0.05 is the noise of two 512-draw samples)."""
    specs = [StructuredOutputsParams(json=s) for s in SCHEMAS[:6]] + [
        StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}"), StructuredOutputsParams(choice=["yes", "no", "maybe"])]
    greedy = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=s) for s in specs]
    state = _engine(llm).structured.state
    rejected0, puts0 = (state.num_rows_rejected, state.num_puts) if state is not None else (0, 0)
    first = _generate_sample_first(llm, [PROMPT] * len(specs), greedy, True)
    state = _engine(llm).structured.state
    assert state.num_rows_rejected > rejected0  # the random model's tokens are rejected
    assert state.num_puts > puts0  # steps whose rejected rows were all fixed on the host: no redraw
    masked = _generate_sample_first(llm, [PROMPT] * len(specs), greedy, False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in masked]

    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, structured_outputs=s) for i, s in enumerate(specs)]
    free0, lazy0 = state.num_rows_rejected - state.num_rows_rejected_forced, state.num_rows_rejected_lazy
    runs = [llm.generate([PROMPT] * len(specs), sampled) for _ in range(2)]
    # Most rejected free rows took the mask the worker filled ahead (first tokens are computed after the draw).
    free, lazy = state.num_rows_rejected - state.num_rows_rejected_forced - free0, state.num_rows_rejected_lazy - lazy0
    assert free > 2 * lazy, (free, lazy)
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    for out in runs[0][:6]:
        assert out.outputs[0].finish_reason == "stop"
        json.loads(out.outputs[0].text)

    one = [SamplingParams(temperature=1.0, seed=i, n=8, max_tokens=1,
                          structured_outputs=StructuredOutputsParams(regex=r"[a-d]x")) for i in range(64)]
    counts = []
    for sample_first in (True, False):
        outs = _generate_sample_first(llm, ["q"] * len(one), one, sample_first)
        letters = [c.text for o in outs for c in o.outputs]
        assert len(letters) == 512 and set(letters) <= set("abcd")
        counts.append(np.array([letters.count(x) for x in "abcd"]) / 512)
    assert 0.5 * np.abs(counts[0] - counts[1]).sum() < 0.1, counts
    _assert_idle(llm)


def test_regex_fullmatches_and_choice_is_one_of_them(llm):
    regexes = [r"[a-c]{3}-[0-9]{2}", r"(yes|no)!?", r"[0-9]{1,4}\.[0-9]{2}", r"[A-Z][a-z]{2,6}( [A-Z][a-z]{2,6}){0,2}"]
    choices = ["alpha", "beta", "gamma delta", "ε"]
    params, checks = [], []
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.3)):
        for rx in regexes:
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=40,
                                         structured_outputs=StructuredOutputsParams(regex=rx)))
            checks.append(lambda t, rx=rx: re.fullmatch(rx, t) is not None)
        params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=40, n=2,
                                     structured_outputs=StructuredOutputsParams(choice=choices)))
        checks.append(lambda t: t in choices)
    outputs = llm.generate(["x"] * len(params), params)
    for out, check in zip(outputs, checks):
        for c in out.outputs:
            assert c.finish_reason == "stop" and check(c.text), c.text
    _assert_idle(llm)


def test_lark_grammar(llm):
    grammar = 'start: expr\nexpr: NUMBER | "(" expr OP expr ")"\nOP: "+" | "*"\nNUMBER: /[0-9]{1,2}/'
    outs = llm.generate(["calc"] * 3, [SamplingParams(temperature=t, seed=5, max_tokens=60,
                                                      structured_outputs=StructuredOutputsParams(grammar=grammar))
                                       for t in (0.0, 1.0, 2.0)])
    for out in outs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        # The grammar's NUMBER allows "05": Python's eval does not, so leading zeros go first.
        assert re.fullmatch(r"[0-9()+*]+", text) and eval(re.sub(r"\b0+(?=[0-9])", "", text)) >= 0  # noqa: S307


def test_gbnf_grammar(llm):
    # vLLM's EBNF / llama.cpp's GBNF ("::="), converted to Lark by llguidance.
    grammar = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
    outs = llm.generate(["q"] * 2, [SamplingParams(temperature=t, seed=3, max_tokens=20,
                                                   structured_outputs=StructuredOutputsParams(grammar=grammar))
                                    for t in (0.0, 1.5)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(r"(yes|no) (yes|no)", out.outputs[0].text)
    with pytest.raises(ValueError, match="not valid GBNF"):
        llm.generate("q", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= (")))
    _assert_idle(llm)


def test_mask_removes_only_forbidden_tokens(llm):
    """Where the unconstrained greedy output already satisfies the constraint, the constrained greedy
    output is the same tokens: the mask only removed tokens the model did not want anyway."""
    prompts = [f"prompt {i}" for i in range(64)]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    # Outputs that are whole UTF-8 text of tokenizer ids: the random model often writes half a
    # character, or ids past the tokenizer's 258 (the model's vocabulary is 320), which no text allows.
    valid = [o for o in free if "\ufffd" not in o.outputs[0].text and max(o.outputs[0].token_ids) < 256]
    assert len(valid) >= 2, "too few prompts whose free output is valid text; add prompts"
    for out in valid[:4]:
        c = out.outputs[0]
        anything = StructuredOutputsParams(regex=r"(?s:.*)")  # every text satisfies it
        one_of = StructuredOutputsParams(choice=[c.text, c.text + "zz", "q"])  # the free output is a choice
        con = llm.generate([out.prompt] * 2, [SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=s)
                                              for s in (anything, one_of)])
        assert con[0].outputs[0].token_ids == c.token_ids and con[0].outputs[0].finish_reason == "length"
        # The choice's tokens are the free ones; then only "zz" or eos may follow.
        assert con[1].outputs[0].token_ids[:len(c.token_ids)] == c.token_ids
        assert con[1].outputs[0].text in (c.text, c.text + "zz")


def test_max_tokens_cuts_json_with_length_and_stop_strings_cut_it_with_stop(llm):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "b"], "additionalProperties": False}
    cut, stopped, never = llm.generate(["p"] * 3, [
        SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=60, stop=['"b"'], structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(regex="a{1000}")),
    ])
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 4
    assert cut.outputs[0].text == '{"a"'  # one token a byte: cut mid-object, not valid JSON
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].text.startswith('{"a": "')
    assert '"b"' not in stopped.outputs[0].text and stopped.outputs[0].text.endswith(", ")
    assert never.outputs[0].finish_reason == "length" and never.outputs[0].text == "a" * 10  # can only end by length
    _assert_idle(llm)


def test_min_tokens_holds_while_the_grammar_allows_more_and_yields_where_it_can_only_end(llm):
    """vLLM's rule: min_tokens bans eos while the grammar allows other tokens; where the grammar
    allows only eos (it ended), the grammar wins and the output stops under min_tokens."""
    more, ended, boolean = llm.generate(["p"] * 3, [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, min_tokens=6,
                       structured_outputs=StructuredOutputsParams(**spec))
        for s, spec in ((1, dict(regex="a{2,9}")), (2, dict(choice=["yes", "no"])), (3, dict(json={"type": "boolean"})))])
    assert more.outputs[0].finish_reason == "stop" and re.fullmatch("a{6,9}", more.outputs[0].text), more.outputs[0].text
    assert ended.outputs[0].finish_reason == "stop" and ended.outputs[0].text in ("yes", "no")
    assert boolean.outputs[0].finish_reason == "stop" and boolean.outputs[0].text in ("true", "false")
    _assert_idle(llm)


@pytest.mark.parametrize("spec, words", [
    (dict(json={"type": "foo"}), ["json", "foo"]),
    (dict(json="{not json"), ["json", "JSON"]),
    (dict(regex="a(b"), ["regex", "unclosed"]),
    (dict(grammar="start: undefined_rule"), ["grammar", "undefined_rule"]),
    (dict(choice=[]), ["choice"]),
    (dict(json={"type": "object"}, regex="x"), ["exactly one"]),
])
def test_bad_specs_are_value_errors_naming_the_problem_and_nothing_leaks(llm, spec, words):
    with pytest.raises(ValueError) as e:
        llm.generate(["p"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(**spec)))
    assert all(w in str(e.value) for w in words), str(e.value)
    _assert_idle(llm)
    assert llm.generate(["p"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].finish_reason == "length"


def test_unsatisfiable_regex_finishes_with_abort_and_the_engine_keeps_serving(llm):
    nothing = StructuredOutputsParams(regex=r"[^\x00-\U0010FFFF]")  # a valid regex no string matches
    bad, good = llm.generate(["p", "q"], [SamplingParams(max_tokens=5, structured_outputs=nothing),
                                          SamplingParams(temperature=0, max_tokens=3)])
    assert bad.outputs[0].finish_reason == "abort" and bad.outputs[0].token_ids == []
    assert good.outputs[0].finish_reason == "length"
    _assert_idle(llm)


def test_aborts_mid_generation_free_pages_and_matchers_at_once(llm):
    """A client disconnect: constrained requests aborted while running (one with n=2, one whose
    masks are being computed ahead) or still waiting for their grammar; nothing stays held, even
    though the engine does not step again, and the next request runs."""
    engine = _engine(llm)
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 30}
    ids = [engine.add_request([65, 66], _json_params(schema, temperature=1.0, seed=i, n=1 + i % 2)) for i in range(3)]
    for _ in range(4):
        engine.step()
    assert len(engine.structured) > 0 and engine.block_manager.stats()["num_used_pages"] > 0
    pending = engine.add_request([67], _json_params({"type": "object", "properties": {"late": {"type": "null"}}}))
    for request_id in ids + [pending]:
        engine.abort_request(request_id)
    _assert_idle(llm)
    assert llm.generate(["p"], _json_params({"type": "boolean"}, temperature=0.0))[0].outputs[0].text in ("true", "false")
    _assert_idle(llm)


def test_preemption_and_prefix_caching_keep_outputs_valid(llm):
    # 16 requests of ~140 prompt tokens and 64+ output tokens do not fit the 159 pages of 8 tokens together: sequences are
    # preempted (recompute) and resumed with their matcher kept; the common first pages hit the
    # prefix cache.
    schema = {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 4}, "minItems": 8,
              "maxItems": 8}  # >= 64 output tokens each: running sequences outgrow the pool
    prompts = ["a common prefix of two pages..." + f" request {i:02d} " + chr(ord("a") + i) * 100 for i in range(16)]
    before = _engine(llm).stats()["num_preemptions"]
    outs = llm.generate(prompts, [_json_params(schema, temperature=1.0, seed=i) for i in range(16)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert _engine(llm).stats()["num_preemptions"] > before
    assert max(o.num_cached_tokens for o in outs) >= 16
    _assert_idle(llm)


def test_sampler_bitmask_equals_masking_the_logits_by_hand():
    """The device half alone: sample(logits, mask) == sample(logits with -inf where the mask's bit is
    0, no mask), greedy and sampled rows; an all-ones mask changes nothing."""
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.sample.sampler import RowSpec, make_sampling_arrays, sample

    rng = np.random.default_rng(0)
    vocab, num_rows = 100, 8  # 100 is not a multiple of 32: the last word is partly padding
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32) * 3
    rows = [RowSpec(row_idx=r, temperature=0.0 if r < 3 else 0.9, top_k=[0, 5][r % 2], top_p=[1.0, 0.8][r % 3 == 0],
                    seed=r, step=r) for r in range(num_rows)]
    arrays = make_sampling_arrays(rows, num_rows)
    allowed = rng.random((num_rows, vocab)) < 0.3
    allowed[:, 0] = False  # never the argmax's tie-break default
    bits = np.zeros((num_rows, 4 * 32), np.uint8)
    bits[:, :vocab] = allowed
    mask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [R, 4] int32 words
    tokens, logprobs = sample(logits, arrays, token_bitmask=mask)
    by_hand, _ = sample(np.where(allowed, logits, -np.inf).astype(np.float32), arrays)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(by_hand))
    assert allowed[np.arange(num_rows), np.asarray(tokens)].all()
    # The logprob stays the model's own (unmasked) log-softmax at the chosen token.
    want = np.asarray(jnp.take_along_axis(jnp.asarray(logits) - jnp.log(jnp.exp(logits).sum(1, keepdims=True)),
                                          jnp.asarray(tokens)[:, None], 1))[:, 0]
    np.testing.assert_allclose(np.asarray(logprobs), want, rtol=1e-5, atol=1e-5)
    ones = np.full((num_rows, 4), -1, np.int32)
    np.testing.assert_array_equal(np.asarray(sample(logits, arrays, token_bitmask=ones)[0]),
                                  np.asarray(sample(logits, arrays)[0]))


def test_masks_computed_ahead_equal_masks_computed_at_dispatch():
    """StructuredState alone (SmolLM2's tokenizer, no model): two states walk the same random
    sequences, one prefetching at every commit, one not; their masks match at every step,
    including a sequence that got a token after the prefetch (its mask is recomputed), one that is
    not running (never prefetched) and finished ones replaced by fresh sequences."""
    import numpy as np

    from jaxpaged.models.loading import default_model_path
    from jaxpaged.models.tokenizer import Tokenizer
    from jaxpaged.planner.sequence import Sequence, SequenceStatus
    from jaxpaged.structured.grammar import GrammarCompiler, make_ll_tokenizer
    from jaxpaged.structured.matchers import MIN_PREFETCH_ROWS, StructuredState

    tokenizer = Tokenizer.from_gguf(default_model_path())
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_token_id
    compiler = GrammarCompiler(make_ll_tokenizer(tokenizer.backend, vocab, eos))
    template = compiler.submit(StructuredOutputsParams(json=SCHEMAS[1])).result()
    ahead, now = StructuredState(vocab, eos), StructuredState(vocab, eos)
    ahead.templates["r"] = now.templates["r"] = template
    ahead.sample_first = now.sample_first = False  # full masks for these rows (sampled at temperature 1)

    def fresh():
        seqs = (Sequence([1, 2], SamplingParams()), Sequence([1, 2], SamplingParams()))
        for seq in seqs:
            seq.status = SequenceStatus.RUNNING
        return seqs

    pairs = [fresh() for _ in range(MIN_PREFETCH_ROWS + 2)]
    rng = np.random.default_rng(0)
    num_stale = stale = 0
    for step in range(40):
        computed_before = ahead.num_rows_now
        pairs[0][0].status = pairs[0][1].status = SequenceStatus.PREEMPTED if step % 7 == 3 else SequenceStatus.RUNNING
        rows = [[(r, pair[k], "r") for r, pair in enumerate(pairs)] for k in (0, 1)]
        mask_ahead, mask_now = ahead.bitmask(rows[0], len(pairs)), now.bitmask(rows[1], len(pairs))
        np.testing.assert_array_equal(mask_ahead, mask_now)
        assert not stale or ahead.num_rows_now > computed_before  # the stale row was computed again
        for r, (a, b) in enumerate(pairs):
            allowed = np.flatnonzero(np.unpackbits(mask_now[r].view(np.uint8), bitorder="little")[:vocab])
            token = int(rng.choice(allowed))
            if token == eos:
                a.status = b.status = SequenceStatus.FINISHED
                pairs[r] = fresh()
            else:
                a.output_token_ids.append(token)
                b.output_token_ids.append(token)
        ahead.release({"r"})
        now.release({"r"})
        ahead.prefetch()
        stale = step % 5 == 2
        if stale:  # a token lands after the prefetch: that mask is stale, recomputed at dispatch
            words = now.bitmask([(0, pairs[1][1], "r")], 1)[0]
            token = int(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])[0])
            stale = token != eos
            if stale:
                pairs[1][0].output_token_ids.append(token)
                pairs[1][1].output_token_ids.append(token)
        num_stale += stale
    assert ahead.num_rows_ahead > 0 and now.num_rows_ahead == 0 and num_stale >= 5


def test_closed_objects_names_additional_properties_false_where_the_schema_is_silent():
    from jaxpaged.structured.grammar import closed_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "patternProperties": {"^k": {"type": "string"}}}},
        "c": {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}},
        "d": {"anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}]},
    }, "$defs": {"p": {"type": "object", "properties": {"y": {"type": "string"}}, "additionalProperties": True}}}
    before = json.dumps(schema)
    closed = closed_objects(schema)
    assert json.dumps(schema) == before  # the request's schema is not changed
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["additionalProperties"] is False
    assert props["c"]["additionalProperties"] == {"type": "integer"}  # said by the schema: kept
    assert closed["$defs"]["p"]["additionalProperties"] is True
    assert "additionalProperties" not in props["d"] and "additionalProperties" not in props["a"]["properties"]["x"]
    assert closed_objects({"type": "object"}) == {"type": "object"}  # json_object: any object


@pytest.mark.parametrize("config, strict", [(None, True), ({"backend": "xgrammar"}, True),
                                            ({"backend": "guidance"}, False),
                                            ({"backend": "guidance", "disable_additional_properties": True}, True)])
def test_json_schema_objects_take_only_named_keys_unless_relaxed_as_vllm(llm, config, strict):
    """vLLM's default (xgrammar) admits no key a schema does not name; its structured_outputs_config
    {"backend": "guidance"} does. Checked on the compiled matcher: the whole text `{"a": 1, "b": 2}`
    is accepted exactly when relaxed, `{"a": 1}` always."""
    from jaxpaged.config import EngineConfig, strict_json_schemas
    from jaxpaged.structured.grammar import GrammarCompiler, make_ll_tokenizer

    engine = _engine(llm)
    assert strict_json_schemas(EngineConfig(structured_outputs_config=config).structured_outputs_config) is strict
    compiler = GrammarCompiler(make_ll_tokenizer(engine.tokenizer.backend, engine.runner.config.vocab_size,
                                                 engine.tokenizer.eos_token_id), strict_json=strict)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    template = compiler.submit(spec).result(timeout=60)
    for text, accepted in (('{"a": 1}', True), ('{"a": 1, "b": 2}', not strict)):
        tokens = engine.tokenizer.encode(text, add_special_tokens=False)
        assert (template.deep_copy().validate_tokens(tokens) == len(tokens)) is accepted, text
    compiler.shutdown()


def test_the_engine_compiles_strict_schemas_by_default_and_refuses_unknown_config(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=schema)) for s in range(8)]
    for out in llm.generate([PROMPT] * 8, params):
        assert out.outputs[0].finish_reason == "stop"
        assert set(json.loads(out.outputs[0].text)) <= {"a"}, out.outputs[0].text
    _assert_idle(llm)
    from jaxpaged.config import EngineConfig
    for bad in ({"backend": "outlines"}, {"strict": True}, {"disable_additional_properties": "yes"}):
        with pytest.raises(ValueError, match="structured_outputs_config"):
            EngineConfig(structured_outputs_config=bad)


def test_a_grammar_past_its_compile_timeout_aborts_its_request_and_is_not_cached(llm, monkeypatch):
    """grammar_compile_timeout_s: a compile still running after it (here made slow by hand) ends its
    request with "abort"; other requests are served meanwhile, the spec compiles anew next time."""
    import threading
    import time

    from jaxpaged.config import EngineConfig

    structured = _engine(llm).structured
    llm.generate(["p"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[ab]+")))
    compiler = structured.compiler
    release, real_compile = threading.Event(), compiler._compile

    def slow_compile(kind, grammar):
        release.wait(30)
        return real_compile(kind, grammar)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    monkeypatch.setattr(structured, "compile_timeout_s", 0.5)
    spec = StructuredOutputsParams(regex="[xyz]{3}")
    started = time.monotonic()
    slow, free = llm.generate(["p", "q"], [SamplingParams(max_tokens=5, structured_outputs=spec),
                                          SamplingParams(temperature=0, max_tokens=3)])
    assert slow.outputs[0].finish_reason == "abort" and slow.outputs[0].token_ids == []
    assert free.outputs[0].finish_reason == "length"
    assert time.monotonic() - started < 20 and structured.num_compile_timeouts >= 1
    release.set()
    monkeypatch.setattr(compiler, "_compile", real_compile)
    again = llm.generate(["p"], SamplingParams(max_tokens=5, structured_outputs=spec))[0].outputs[0]
    assert again.finish_reason == "stop" and re.fullmatch("[xyz]{3}", again.text)
    _assert_idle(llm)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="grammar_compile_timeout_s"):
            EngineConfig(grammar_compile_timeout_s=bad)


def test_a_compile_stuck_past_its_timeout_does_not_wedge_the_compile_worker(llm, monkeypatch):
    """The worker compiling a grammar that never finishes is given up at the timeout and replaced:
    a different grammar sent while the first is still stuck compiles and is served."""
    import threading

    structured = _engine(llm).structured
    llm.generate(["p"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[ab]+")))
    compiler = structured.compiler
    release, real_compile = threading.Event(), compiler._compile

    def stuck_on_one(kind, grammar):
        if "q{4}" in grammar:  # this one grammar never finishes (until the test ends)
            release.wait(60)
        return real_compile(kind, grammar)

    monkeypatch.setattr(compiler, "_compile", stuck_on_one)
    monkeypatch.setattr(structured, "compile_timeout_s", 1.0)
    num_abandoned = compiler.num_abandoned
    try:
        stuck = llm.generate(["p"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
            regex="q{4}")))[0].outputs[0]
        assert stuck.finish_reason == "abort"
        later = llm.generate(["p"], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
            regex="[uvw]{2}")))[0].outputs[0]  # the stuck compile still holds its thread
        assert later.finish_reason == "stop" and re.fullmatch("[uvw]{2}", later.text), later
        assert compiler.num_abandoned == num_abandoned + 1
    finally:
        release.set()
    _assert_idle(llm)
