"""Beam search bookkeeping on a tiny pool (page_size 4, pages 1..10), with scripted candidates.

No model and no jax: the test plays the device, handing each beam that samples its top candidates
(log-probabilities and token ids, best first), as `sampler.beam_candidates` would. Token 9 is eos.
"""

import numpy as np
import pytest

from jaxpaged.engine.beam_search import BeamSearch, BeamSearches, BeamSearchParams
from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.request import SamplingParams
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence

EOS = 9


def make(max_tokens, beam_width=2, length_penalty=1.0, early_stopping=False, prompt=(1, 2, 3, 4, 5),
         max_num_batched_tokens=64):
    bm = BlockManager(11, 4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, max_model_len=64)
    seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add(seq)
    params = BeamSearchParams(beam_width, max_tokens, length_penalty=length_penalty, early_stopping=early_stopping)
    search = BeamSearch("r0", None, seq, params, max_tokens, frozenset([EOS]))
    beams = BeamSearches()
    beams.add(search)
    return bm, sched, beams, search


def step(sched, beams, candidates):
    """One engine step: schedule, 'run' it, hand each beam `candidates[beam]` = [(token, logprob), ...]."""
    out = sched.schedule()
    sched.advance(out, [None] * len(out.seqs))  # beams get no placeholder: the search picks their token
    sched.commit(out, [])
    reported = [(i, seq) for i, seq in enumerate(out.seqs) if out.samples[i]]
    assert {seq for _, seq in reported} == set(candidates), "the test scripted the wrong beams"
    logprobs = np.zeros((len(out.seqs), 4), np.float32)
    token_ids = np.zeros((len(out.seqs), 4), np.int32)
    for i, seq in reported:
        token_ids[i], logprobs[i] = zip(*candidates[seq])
    finished = beams.commit(sched, reported, logprobs, token_ids)
    return out, finished


def test_beams_fork_share_pages_copy_on_write_and_free_pruned_beams():
    bm, sched, beams, search = make(max_tokens=3)
    (a,) = search.live

    # Step 1: the 5-token prompt on pages [1, 2] (page 2 holds token 4 only). Its candidates, best
    # first: 10, 11, 12, eos. The top 2 that do not stop continue: a takes 10, a fork b takes 11;
    # eos ranks 4th (>= k), so it is no hypothesis. b shares both pages: no copy yet.
    out, finished = step(sched, beams, {a: [(10, -0.1), (11, -0.5), (12, -1.0), (EOS, -2.0)]})
    assert [s.seq_id for s in out.seqs] == [a.seq_id] and not finished
    b = search.live[1]
    assert a.output_token_ids == [10] and b.output_token_ids == [11]
    assert a.block_table == b.block_table == [1, 2] and bm.ref_counts[1] == bm.ref_counts[2] == 2
    assert search.max_page_ref_count == 2 and search.finished == []

    # Step 2: a writes token 5 into shared page 2: its copy-on-write copy is page 3 (front of the
    # free list), copied before the step's writes; b then holds page 2 alone and writes it in place.
    # Totals: a+eos -0.15, b+30 -0.7, b+31 -0.8, a+20 -1.1. a's eos ranks first (< k): hypothesis
    # [10, eos] scored -0.15 / 2. Both running beams continue b, so a is pruned (page 3 freed at
    # once, page 1 loses a sharer) and b forks c, sharing b's pages [1, 2].
    out, finished = step(sched, beams, {
        a: [(EOS, -0.05), (20, -1.0), (21, -2.0), (22, -3.0)],
        b: [(30, -0.2), (31, -0.3), (EOS, -3.0), (32, -4.0)],
    })
    assert out.copies == [(2, 3)] and bm.num_cow_copies == 1 and not finished
    assert a.is_finished and a.block_table == []
    c = search.live[1]
    assert search.live == [b, c] and b.output_token_ids == [11, 30] and c.output_token_ids == [11, 31]
    assert b.block_table == c.block_table == [1, 2] and bm.ref_counts[1:4] == [2, 2, 0]
    assert list(bm.free_page_ids) == [3, 4, 5, 6, 7, 8, 9, 10]
    (hyp,) = search.finished
    assert hyp.token_ids == [10, EOS] and hyp.reason == "stop" and hyp.score == np.float32(-0.15) / 2

    # Step 3, the last (max_tokens 3): every candidate stops, the top 2 become hypotheses scored by
    # length 3. b copies page 2 to page 3 before writing. The 2 best of the 3 hypotheses are kept,
    # the search ends and every page goes back.
    out, finished = step(sched, beams, {
        b: [(40, -0.1), (42, -5.0), (43, -6.0), (44, -7.0)],
        c: [(41, -0.2), (45, -5.0), (46, -6.0), (47, -7.0)],
    })
    assert out.copies == [(2, 3)] and bm.num_cow_copies == 2
    assert finished == [search] and search.done and not beams
    result = search.output(lambda ids: " ".join(map(str, ids)))
    assert [beam.token_ids for beam in result.beams] == [[10, EOS], [11, 30, 40]]
    assert [beam.finish_reason for beam in result.beams] == ["stop", "length"]
    assert result.beams[1].cumulative_logprob == pytest.approx(-0.8) and result.beams[1].score == pytest.approx(-0.8 / 3)
    assert result.beams[1].text == "11 30 40"
    assert bm.num_free_pages == 10 and not sched.has_unfinished() and beams.owner == {}


def test_search_stops_early_when_no_running_beam_can_beat_the_hypotheses():
    """HF's early_stopping=False heuristic: with k hypotheses, stop once the best running beam's
    cumulative logprob / current length no longer beats the worst hypothesis."""
    bm, sched, beams, search = make(max_tokens=10)
    (a,) = search.live
    # Step 1: eos and 10 lead; eos (rank 0) is a hypothesis scoring -0.1 / 1.
    step(sched, beams, {a: [(EOS, -0.1), (EOS + 1, -0.2), (11, -0.3), (12, -5.0)]})
    assert len(search.finished) == 1 and [s.output_token_ids for s in search.live] == [[10], [11]]
    b = search.live[1]
    # Step 2: a+eos -0.4 (rank 0), b+eos -0.5 (rank 1): hypotheses -0.2 and -0.25, kept with
    # [eos] (-0.1): worst -0.2. The best
    # running beam, a+13 at -2.2, over length 2 is -1.1 <= -0.2: nothing can improve, stop.
    out, finished = step(sched, beams, {
        a: [(EOS, -0.2), (13, -2.0), (14, -3.0), (15, -4.0)],
        b: [(EOS, -0.2), (16, -3.0), (17, -3.0), (18, -4.0)],
    })
    assert finished == [search]
    assert [h.token_ids for h in search.finished] == [[EOS], [10, EOS]]
    assert bm.num_free_pages == 10 and not sched.has_unfinished()


def test_a_beam_that_reported_waits_and_a_preempted_one_reports_again():
    """The search moves only when every live beam has reported for the same length. A token budget
    of 4 chunks recomputed prompts, so beams report in different steps."""
    bm, sched, beams, search = make(max_tokens=4, max_num_batched_tokens=4)
    (a,) = search.live
    step(sched, beams, {})  # prompt tokens 0..3: a chunk, nothing sampled
    step(sched, beams, {a: [(10, -0.1), (11, -0.5), (12, -1.0), (EOS, -2.0)]})
    b = search.live[1]
    sched.running.remove(b)
    sched._preempt(b)  # as the scheduler does when pages run out
    beams.forget([b])

    # a decodes and reports; b is readmitted, 3 of its 6 tokens fit the budget: no report yet.
    out, _ = step(sched, beams, {a: [(20, -0.1), (21, -0.2), (22, -0.3), (23, -0.4)]})
    assert out.num_new_tokens == [1, 3] and a.seq_id in search.pending and search.num_generated == 1
    # a is preempted after reporting: its report is dropped, it must compute and report again.
    sched.running.remove(a)
    sched._preempt(a)
    beams.forget([a])
    assert a.seq_id not in search.pending
    out, _ = step(sched, beams, {b: [(30, -0.1), (31, -0.2), (32, -0.3), (33, -0.4)]})
    assert [s.seq_id for s in out.seqs] == [b.seq_id, a.seq_id] and search.num_generated == 1
    # b reported and waits: the scheduler skips it (nothing to compute) while a catches up.
    out, _ = step(sched, beams, {})
    assert [s.seq_id for s in out.seqs] == [a.seq_id] and out.num_new_tokens == [4]
    out, _ = step(sched, beams, {a: [(20, -0.1), (21, -0.2), (22, -0.3), (23, -0.4)]})
    assert [s.seq_id for s in out.seqs] == [a.seq_id] and search.num_generated == 2
    # Totals: a+20 -0.2, a+21 -0.3, a+22 -0.4, a+23 -0.5, b+30 -0.6: a continues twice, b is pruned.
    assert [s.output_token_ids for s in search.live] == [[10, 20], [10, 21]] and b.is_finished
    assert beams.abort("r0", sched) and not beams and bm.num_free_pages == 10 and not sched.has_unfinished()


def test_the_step_hook_drops_the_report_of_a_beam_the_scheduler_preempted():
    """The engine's path: a scheduled step whose SchedulerOutput lists a beam as preempted
    (after_schedule, the step-feature hook) drops that beam's report, so the search waits for it
    to be recomputed instead of advancing on candidates whose K/V are gone."""
    from jaxpaged.planner.scheduler_output import SchedulerOutput

    bm, sched, beams, search = make(max_tokens=4, max_num_batched_tokens=4)
    (a,) = search.live
    step(sched, beams, {})  # prompt tokens 0..3
    step(sched, beams, {a: [(10, -0.1), (11, -0.5), (12, -1.0), (EOS, -2.0)]})
    b = search.live[1]
    sched.running.remove(b)
    sched._preempt(b)
    beams.forget([b])
    out, _ = step(sched, beams, {a: [(20, -0.1), (21, -0.2), (22, -0.3), (23, -0.4)]})  # b recomputes 3 tokens
    assert a.seq_id in search.pending and b.seq_id not in search.pending
    sched.running.remove(a)
    sched._preempt(a)
    beams.after_schedule(SchedulerOutput(seqs=[], num_new_tokens=[], copies=[], preempted=[a], num_batched_tokens=0))
    assert a.seq_id not in search.pending and not search.ready()


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0), "beam_width=0 must be >= 1"),
    (dict(beam_width=2.0), "must be an int"),
    (dict(beam_width=2, max_tokens=0), "max_tokens=0 must be >= 1"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
])
def test_bad_beam_params_say_what_to_do(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_swap_mode_recomputes_a_beam_that_waits_for_its_search():
    """Preempting by swap, a sequence with no token left to compute (a beam that reported and waits
    for its search) is recomputed instead: swapped, it would come back with all its K/V and nothing
    to schedule, while its search, having dropped its report, waits for a new one forever. A
    sequence with a token to compute is swapped as usual."""
    bm = BlockManager(11, 4, enable_prefix_caching=False, num_swap_pages=8)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, preemption_mode="swap")
    waiting_beam = Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    decoding = Sequence([6, 7, 8, 9, 10], SamplingParams(max_tokens=8, ignore_eos=True))
    for seq in (waiting_beam, decoding):
        sched.add(seq)
    out = sched.schedule()  # both prompts computed
    sched.advance(out, [None, 0])  # the beam reports (no placeholder); `decoding` samples row 0
    sched.commit(out, [11])
    assert waiting_beam.num_computed_tokens == len(waiting_beam.token_ids) == 5  # nothing left to compute
    assert decoding.num_computed_tokens == 5 < len(decoding.token_ids) == 6

    sched._preempt(waiting_beam)
    assert waiting_beam.status.name == "PREEMPTED" and waiting_beam.num_computed_tokens == 0
    sched._preempt(decoding)
    assert decoding.status.name == "SWAPPED" and decoding.num_computed_tokens == 5
    assert sched.num_swaps_out == 1 and sched.num_recomputed_tokens == 5


def test_early_stopping_never_with_a_positive_length_penalty_bounds_by_max_tokens():
    """HF's `_check_early_stop_heuristic`: with early_stopping="never" and length_penalty > 0, the best
    a running beam can still score is its cumulative logprob over max_tokens ** length_penalty (its
    score can only improve by growing), not over its current length. Same steps as the heuristic test
    above, with a running beam that the current length would give up on but max_tokens does not."""
    bm, sched, beams, search = make(max_tokens=10, length_penalty=1.0, early_stopping="never")
    (a,) = search.live
    step(sched, beams, {a: [(EOS, -0.1), (EOS + 1, -0.2), (11, -0.3), (12, -5.0)]})
    b = search.live[1]
    # Step 2: hypotheses [eos] -0.1 and [10, eos] -0.4 / 2 = -0.2 (worst -0.2); b's -0.5 / 2 = -0.25
    # is dropped. The best running beam, a+13, has -1.2: over max_tokens, -1.2 / 10 = -0.12 > -0.2,
    # it may still win, so the search goes on (over its length 2, -0.6 <= -0.2 would stop it).
    _, finished = step(sched, beams, {
        a: [(EOS, -0.2), (13, -1.0), (14, -3.0), (15, -4.0)],
        b: [(EOS, -0.2), (16, -3.0), (17, -3.0), (18, -4.0)],
    })
    assert finished == [] and search.can_improve and not search.done
    assert [h.score for h in search.finished] == [np.float32(-0.1), np.float32(-0.4) / np.float32(2)]
    assert [s.output_token_ids for s in search.live] == [[10, 13], [10, 14]]  # -1.2, -3.2
    # Step 3: the best running beam falls to -2.2: -2.2 / 10 <= -0.2, nothing can improve: stop.
    live = search.live
    _, finished = step(sched, beams, {
        live[0]: [(20, -1.0), (21, -2.0), (22, -3.0), (23, -4.0)],
        live[1]: [(24, -3.0), (25, -3.0), (26, -3.0), (27, -4.0)],
    })
    assert finished == [search] and not search.can_improve
    assert [h.token_ids for h in search.finished] == [[EOS], [10, EOS]]
    assert bm.num_free_pages == 10 and not sched.has_unfinished()
