"""Output processing's fast paths against the general ones, with the bundled (byte-level) tokenizer.

- Lazy detokenizing (a request without stop strings decodes its new tokens only when an output is
  made: once at its finish under `only_finished`) gives the text token-by-token decoding gives.
- Stop strings (decoded eagerly) give the same outputs in both modes, and streaming never shows one.
- `BlockTableRows`' fast path (same batch as the previous step) gives the rows the general path gives.
"""

import numpy as np
import pytest

from jaxpaged.models.loading import default_model_path
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.sequence import Sequence, SequenceStatus
from jaxpaged.device.step_input import BlockTableRows
from jaxpaged.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = Tokenizer.from_gguf(default_model_path())
    tokenizer.detokenizer()  # builds the byte table the streams below pick from
    return tokenizer


def random_streams(tokenizer, rng, num: int) -> list[list[int]]:
    """Token streams mixing ordinary ids, lone bytes of multi-byte characters and special ids."""
    lone_bytes = [i for i, b in enumerate(tokenizer._token_bytes) if len(b) == 1 and b[0] >= 0x80]
    special = sorted(tokenizer._special_ids)
    streams = []
    for _ in range(num):
        ids = rng.integers(0, tokenizer.vocab_size, int(rng.integers(1, 30))).tolist()
        ids += rng.choice(lone_bytes, int(rng.integers(0, 6))).tolist() + rng.choice(special, 2).tolist()
        rng.shuffle(ids)
        # A UTF-8 character split over tokens: 😀 is F0 9F 98 80.
        emoji = [tokenizer._token_bytes.index(bytes([b])) for b in "😀".encode()]  # one byte per token
        at = int(rng.integers(0, len(ids) + 1))
        streams.append(ids[:at] + emoji + ids[at:])
    return streams


def streamed_text(tokenizer, ids: list[int], finished: bool) -> str:
    """The reference: one token at a time through a fresh detokenizer."""
    detokenizer = tokenizer.detokenizer()
    text = "".join(detokenizer.step(t) for t in ids)
    return text + detokenizer.flush() if finished else text


def run(tokenizer, streams, stops, only_finished: bool, min_tokens: int = 0, stop_at: int | None = None,
        per_step: int = 1, **extra):
    """Feeds each stream `per_step` tokens per step (more than one: a speculative step), as
    Scheduler.commit does; returns the final outputs and the concatenated streamed deltas per request."""
    processor = OutputProcessor(tokenizer)
    seqs = []
    for i, (ids, stop) in enumerate(zip(streams, stops)):
        params = SamplingParams(max_tokens=len(ids), stop=stop, ignore_eos=True, min_tokens=min_tokens,
                                stop_token_ids=[] if stop_at is None else [ids[stop_at]], **extra)
        seq = Sequence([1, 2, 3], params)
        seq.status = SequenceStatus.RUNNING
        processor.add_request(str(i), None, seq, params, seed=0)
        seqs.append(seq)
    finals, deltas, delta_ids = {}, {}, {}
    step = 0
    while processor.requests:
        appended = []
        for seq, ids in zip(seqs, streams):
            for t in range(step, step + per_step):
                if seq.is_finished:
                    break
                seq.append_token(ids[t])
                if t + 1 == len(ids):
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                if t == stop_at:  # what Scheduler.commit does at a stop token
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
                appended.append((seq, ids[t]))
        outputs, stopped = processor.process(appended, list(range(len(appended))), None, only_finished=only_finished)
        for seq in stopped:  # what the engine does with Scheduler.finish
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
        for out in outputs:
            completion = out.outputs[0]
            deltas[out.request_id] = deltas.get(out.request_id, "") + completion.delta_text
            delta_ids[out.request_id] = delta_ids.get(out.request_id, []) + completion.delta_token_ids
            if out.finished:
                finals[out.request_id] = completion
        step += per_step
    return finals, deltas, delta_ids


def test_lazy_detokenizing_equals_token_by_token(tokenizer):
    rng = np.random.default_rng(0)
    streams = random_streams(tokenizer, rng, 60)
    no_stops = [()] * len(streams)
    offline, offline_deltas, _ = run(tokenizer, streams, no_stops, only_finished=True)
    streaming, deltas, delta_ids = run(tokenizer, streams, no_stops, only_finished=False)
    for i, ids in enumerate(streams):
        want = streamed_text(tokenizer, ids, finished=True)
        assert want == tokenizer.decode(ids)
        got = offline[str(i)]
        assert got.text == want and got.token_ids == ids and got.finish_reason == "length"
        assert offline_deltas[str(i)] == want  # one output, at the finish: its delta is the whole text
        assert streaming[str(i)].text == want and deltas[str(i)] == want and delta_ids[str(i)] == ids


def test_lazy_decode_in_chunks_equals_steps(tokenizer):
    """ByteLevelDetokenizer.decode over any chunking of a stream equals step() over its tokens."""
    rng = np.random.default_rng(1)
    for ids in random_streams(tokenizer, rng, 100):
        detokenizer = tokenizer.detokenizer()
        cuts = sorted(rng.choice(len(ids) + 1, int(rng.integers(0, 5)), replace=False).tolist())
        pieces = [detokenizer.decode(ids[a:b]) for a, b in zip([0, *cuts], [*cuts, len(ids)])]
        assert "".join(pieces) + detokenizer.flush() == streamed_text(tokenizer, ids, finished=True)


def test_stop_strings_same_in_both_modes_and_never_streamed(tokenizer):
    rng = np.random.default_rng(2)
    streams = random_streams(tokenizer, rng, 60)
    stops = []
    for ids in streams:  # stop strings that occur in the text, and some that do not
        text = tokenizer.decode(ids)
        start = int(rng.integers(0, max(1, len(text) - 3)))
        stops.append([text[start : start + int(rng.integers(1, 4))] or "x", "\u2603never"])
    offline, _, _ = run(tokenizer, streams, stops, only_finished=True)
    streaming, deltas, _ = run(tokenizer, streams, stops, only_finished=False)
    num_stopped = 0
    for i, ids in enumerate(streams):
        key = str(i)
        a, b = offline[key], streaming[key]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert deltas[key] == b.text
        # Reference: the first token whose streamed text contains a stop string ends the text there.
        for k in range(len(ids)):
            text = streamed_text(tokenizer, ids[: k + 1], finished=k + 1 == len(ids))
            hits = [text.find(s) for s in stops[i] if s in text]
            if hits:
                assert b.finish_reason == "stop" and b.text == text[: min(hits)] and b.token_ids == ids[: k + 1]
                num_stopped += 1
                break
        else:
            assert b.finish_reason == "length" and b.text == tokenizer.decode(ids)
        assert not any(s in b.text for s in stops[i])
    assert num_stopped > 30


def test_several_tokens_per_step_give_what_one_per_step_gives(tokenizer):
    """A speculative step commits several tokens of a sequence at once, the last one finishing it:
    every token's text still counts, stop strings and min_tokens see each token's own number."""
    rng = np.random.default_rng(4)
    streams = random_streams(tokenizer, rng, 30)
    stops = [[tokenizer.decode(ids)[3:5] or "x"] for ids in streams]
    for only_finished in (True, False):
        for kwargs in (dict(), dict(min_tokens=2), dict(stop_at=3)):
            one, _, _ = run(tokenizer, streams, stops, only_finished, **kwargs)
            three, deltas, _ = run(tokenizer, streams, stops, only_finished, per_step=3, **kwargs)
            for key in one:
                a, b = one[key], three[key]
                assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason), key
                if not only_finished:
                    assert deltas[key] == b.text
            lazy_one, _, _ = run(tokenizer, streams, [[]] * len(streams), only_finished, **kwargs)
            lazy_three, _, _ = run(tokenizer, streams, [[]] * len(streams), only_finished, per_step=3, **kwargs)
            assert {k: (o.text, o.token_ids) for k, o in lazy_one.items()} == \
                {k: (o.text, o.token_ids) for k, o in lazy_three.items()}


def test_tokens_after_a_stop_string_in_the_finishing_step_are_dropped(tokenizer):
    # One step commits the whole stream and the scheduler finishes it at its last token (length, or a
    # stop token): the stop string inside the run still ends text and tokens there, as vLLM.
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    m = next(k + 1 for k in range(len(ids)) if "three" in tokenizer.decode(ids[: k + 1]))
    for stop_at in (None, len(ids) - 1):
        for only_finished in (True, False):
            finals, deltas, delta_ids = run(tokenizer, [ids], [["three"]], only_finished, stop_at=stop_at,
                                            per_step=len(ids))
            out = finals["0"]
            assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == \
                (tokenizer.decode(ids[:m]).split("three")[0], ids[:m], "stop", "three")
            if not only_finished:
                assert deltas["0"] == out.text and delta_ids["0"] == out.token_ids


def test_stop_strings_count_only_in_text_after_the_min_tokens_th_token(tokenizer):
    """vLLM's detokenizer (v1/engine/detokenizer.py, `num_output_tokens() > min_tokens`, searched
    from the min_tokens-th token's end): with min_tokens = m, a stop string completed by token m or
    earlier never stops; one that begins in that text and ends in a later token does."""
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    m = next(k + 1 for k in range(len(ids)) if "three" in tokenizer.decode(ids[: k + 1]))
    four = next(k + 1 for k in range(len(ids)) if "three four" in tokenizer.decode(ids[: k + 1]))
    assert 2 <= m < four < len(ids)
    finals, _, _ = run(tokenizer, [ids], [["three"]], only_finished=False, min_tokens=m - 1)
    assert finals["0"].finish_reason == "stop" and finals["0"].token_ids == ids[:m]
    assert finals["0"].text == tokenizer.decode(ids[:m]).split("three")[0]
    assert finals["0"].stop_reason == "three"
    finals, _, _ = run(tokenizer, [ids], [["three"]], only_finished=False, min_tokens=m)
    assert finals["0"].finish_reason == "length" and finals["0"].token_ids == ids
    assert finals["0"].stop_reason is None
    finals, _, _ = run(tokenizer, [ids], [["three four"]], only_finished=False, min_tokens=m)
    assert finals["0"].finish_reason == "stop" and finals["0"].token_ids == ids[:four]


def test_include_stop_str_in_output_keeps_the_stop_string_and_streams_it(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    m = next(k + 1 for k in range(len(ids)) if "three" in tokenizer.decode(ids[: k + 1]))
    full = tokenizer.decode(ids[:m])
    for only_finished in (True, False):
        finals, deltas, _ = run(tokenizer, [ids], [["three"]], only_finished, include_stop_str_in_output=True)
        assert finals["0"].text == full[: full.index("three") + len("three")] and finals["0"].stop_reason == "three"
        assert finals["0"].token_ids == ids[:m]
        if not only_finished:
            assert deltas["0"] == finals["0"].text


def test_a_stop_tokens_text_is_left_out_unless_asked_for(tokenizer):
    # vLLM's detokenizer skips the stop token (eos or stop_token_ids) unless include_stop_str_in_output;
    # stop_reason is the token id.
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    k = 2
    for stops in ([], ["\u2603never"]):  # the lazy path and the stop-string path
        for only_finished in (True, False):
            finals, deltas, _ = run(tokenizer, [ids], [stops], only_finished, stop_at=k)
            out = finals["0"]
            assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop" and out.stop_reason == ids[k]
            assert out.text == tokenizer.decode(ids[:k])
            if not only_finished:
                assert deltas["0"] == out.text
            finals, _, _ = run(tokenizer, [ids], [stops], only_finished, stop_at=k, include_stop_str_in_output=True)
            assert finals["0"].text == tokenizer.decode(ids[: k + 1])


def test_special_tokens_and_detokenize(tokenizer):
    special = tokenizer.eos_token_id
    ids = tokenizer.encode("one two", add_special_tokens=False) + [special] + tokenizer.encode(" three", add_special_tokens=False)
    finals, _, _ = run(tokenizer, [ids], [[]], True)
    assert finals["0"].text == tokenizer.decode(ids)  # skipped
    finals, _, _ = run(tokenizer, [ids], [[]], True, skip_special_tokens=False)
    assert finals["0"].text == tokenizer.decode(ids, skip_special_tokens=False) != tokenizer.decode(ids)
    for only_finished in (True, False):
        finals, deltas, delta_ids = run(tokenizer, [ids], [[]], only_finished, detokenize=False)
        assert finals["0"].text == "" and finals["0"].token_ids == ids
        if not only_finished:
            assert deltas["0"] == "" and delta_ids["0"] == ids
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)


class FakeSeq:
    def __init__(self, seq_id, block_table):
        self.seq_id, self.block_table, self.num_computed_tokens = seq_id, block_table, 0


def test_block_table_rows_fast_path_equals_general_path():
    """Random steps: tables grow (mostly), sequences join and leave, lists are replaced (preemption),
    a page is replaced in place (copy-on-write, with resync). Every step's rows hold each sequence's
    block table, zero-padded, whichever path served it."""
    rng = np.random.default_rng(3)
    page_size, pages_per_seq = 4, 12
    rows = BlockTableRows(16, pages_per_seq)
    seqs = [FakeSeq(i, [int(p) for p in rng.integers(1, 100, 2)]) for i in range(5)]
    next_id = 5
    for _ in range(400):
        copies = False
        event = rng.random()
        if event < 0.1 and len(seqs) > 1:
            seqs.pop(int(rng.integers(len(seqs))))
        elif event < 0.2 and len(seqs) < 8:
            seqs.append(FakeSeq(next_id, [int(rng.integers(1, 100))]))
            next_id += 1
        elif event < 0.25:
            seqs[int(rng.integers(len(seqs)))].block_table = [int(rng.integers(1, 100))]  # freed, readmitted
        elif event < 0.3:
            seq = seqs[int(rng.integers(len(seqs)))]
            seq.num_computed_tokens = page_size * (len(seq.block_table) - 1)
            seq.block_table[-1] = int(rng.integers(100, 200))  # copy-on-write of the page being written
            copies = True
        for seq in seqs:
            if rng.random() < 0.3 and len(seq.block_table) < pages_per_seq:
                seq.block_table.append(int(rng.integers(1, 100)))
        got = rows.table[rows.rows(seqs, page_size, resync_write_page=copies)]
        want = np.zeros((len(seqs), pages_per_seq), np.int32)
        for i, seq in enumerate(seqs):
            want[i, : len(seq.block_table)] = seq.block_table
        np.testing.assert_array_equal(got, want)
    assert 100 < rows.num_fast < 400  # both paths ran


def test_streamed_snapshots_keep_what_they_showed_when_read_later(tokenizer):
    """Outputs share the engine's growing token and logprob lists instead of copying them; an
    output read steps later (or after its request finished) still shows the tokens, logprobs and
    text it had when it was made, and compares and prints like a plain record."""
    from jaxpaged.sample.logprobs import HostLogprobs
    from jaxpaged.engine.outputs import CompletionOutput, Logprob

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    seq = Sequence([1, 2, 3], params)
    seq.status = SequenceStatus.RUNNING
    processor.add_request("r", None, seq, params, seed=0)
    ids, kept = [330, 1115, 28, 2115, 30, 11], []
    for step, token_id in enumerate(ids):
        seq.append_token(token_id)
        if step + 1 == len(ids):
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        step_logprobs = HostLogprobs([-0.5 * i for i in range(len(ids))], [1] * len(ids), [[]] * len(ids), [[]] * len(ids))
        outputs, _ = processor.process([(seq, token_id)], [step], step_logprobs)
        kept.append(outputs[0].outputs[0])
    for step, completion in enumerate(kept):  # read only now, after the request finished
        assert completion.token_ids == ids[: step + 1]
        assert [d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids)] == [
            -0.5 * i for i in range(step + 1)]
        assert completion.text == tokenizer.decode(ids[: step + 1])
        assert completion.delta_token_ids == [ids[step]]
    first = kept[0]
    assert first == CompletionOutput(0, first.text, [ids[0]], None, first.logprobs, first.text, [ids[0]])
    assert first.logprobs == [{ids[0]: Logprob(-0.0, 1, tokenizer.decode([ids[0]]))}]
    assert "token_ids=[330]" in repr(first) and first.token_ids is first.token_ids  # sliced once
