"""Beam search on shared pages: the host-side bookkeeping (numpy and stdlib only, never jax).

A search is one request. Its live beams are ordinary running `Sequence`s; the device computes, for
every beam that samples, the top C log-probabilities of its next token (`sampler.beam_candidates`:
top-C of log_softmax, float32) and this module decides the rest, with Hugging Face transformers'
semantics (`GenerationMixin._beam_search`, transformers 5.x):

    step t (g = tokens generated so far by every live beam):
      totals  = cum_logprob[beam] + logprob[beam, token]          float32, over beams x vocab
      top C   of totals (C = max(2, 1 + number of stop ids) * k), best first
      hit     = token is a stop id, or g + 1 == max_tokens
      running = the first k candidates that do not hit             (next step's beams)
      among the first k candidates (rank < k), the ones that hit become finished hypotheses,
        scored total / (g + 1) ** length_penalty (g + 1 counts the new token, eos included);
        the k best hypotheses so far are kept
      stop when every candidate hits (max_tokens), when early_stopping is True and k hypotheses
        exist, or when k hypotheses exist and the best running beam cannot beat the worst of them:
        cum / g' ** length_penalty <= min score, g' = g + 1 (or max_tokens with early_stopping
        "never" and length_penalty > 0)

On the pages: a running candidate continues its parent beam. A parent with no continuation is
finished first, freeing its pages; the parent's first continuation keeps the parent's sequence; each
further one is `Scheduler.fork(parent)` (every page shared, ref counts up, no copy). On a hybrid model
(Qwen3-Next) a fork also copies its parent's recurrent state into a slot of the search's own k
(`open_fork_group` at the request, `close_fork_group` when it ends: planner/state_pool.py).
Forks share the partial last page too: the scheduler's `append_slot` gives a beam that writes into a
shared page its copy-on-write copy (`SchedulerOutput.copies`) before the step's K/V writes.

A search advances only when every live beam has reported its candidates for the same length. A
beam that reported waits (it has no token to compute, so the scheduler skips it); a beam preempted
after reporting forgets its candidates (`BeamSearches.forget`) and reports again once recomputed
(with preemption_mode="swap" too: the scheduler recomputes a sequence with nothing left to compute
rather than swap it, since swapped back in it would have no token to schedule).
"""

from __future__ import annotations

import dataclasses
from typing import no_type_check

import numpy as np

from jaxpaged.engine.features import StepFeature
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import Sequence, SequenceStatus

@no_type_check  # validates itself with ValueErrors that say what to do
@dataclasses.dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int  # k: beams kept per step, and hypotheses returned
    max_tokens: int = 16  # HF's max_new_tokens (capped by max_model_len - prompt length)
    length_penalty: float = 1.0  # hypothesis score = cumulative logprob / length ** length_penalty
    ignore_eos: bool = False  # eos is an ordinary token (HF: eos_token_id=None)
    early_stopping: bool | str = False  # HF's: False (heuristic), True (k hypotheses), "never"
    # vLLM's BeamSearchParams fields, at the values this search implements (others are refused):
    temperature: float = 0.0  # beams ranked by the model's log-probabilities
    include_stop_str_in_output: bool = False  # a beam's text leaves its eos out

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r} must be an int")
        if self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width} must be >= 1 (1 is greedy search; try 2 or 4)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not np.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty={self.length_penalty!r} must be a finite number (1.0 is HF's default)")
        if not (self.early_stopping is False or self.early_stopping is True or self.early_stopping == "never"):
            raise ValueError(f"early_stopping={self.early_stopping!r} must be False, True or 'never'")
        if self.temperature != 0.0:
            raise ValueError(f"temperature={self.temperature!r}: beam search here ranks by the model's own "
                             "log-probabilities (temperature 0); leave temperature out")
        if self.include_stop_str_in_output is not False:
            raise ValueError("include_stop_str_in_output=True is not supported by beam search; leave it out")

    def num_candidates(self, num_stop_ids: int) -> int:
        """C: candidates kept per step (HF's beams_to_keep), enough that k of them do not stop."""
        return max(2, 1 + num_stop_ids) * self.beam_width


def check_beam_request(params: BeamSearchParams, num_prompt_tokens: int, config, vocab_size: int,
                       num_usable_pages: int, eos_token_id: int | None) -> tuple[int, frozenset[int]]:
    """Raises ValueError for a search this engine cannot run; returns (max_tokens capped by
    max_model_len, the stop ids). `config` is the EngineConfig."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"expected BeamSearchParams, got {type(params).__name__}")
    if config.speculative_config is not None:
        raise ValueError("beam search cannot run with speculative decoding (speculative_config is set); "
                         "use an LLM without speculative_config for beam search")
    if config.enable_return_routed_experts:
        raise ValueError("beam search does not return routed experts; use an LLM without enable_return_routed_experts")
    k = params.beam_width
    if k > config.max_num_seqs:
        raise ValueError(
            f"beam_width={k} needs {k} sequences in one step but max_num_seqs={config.max_num_seqs}; "
            "raise max_num_seqs or lower beam_width"
        )
    stop_ids = frozenset() if params.ignore_eos or eos_token_id is None else frozenset([eos_token_id])
    if params.num_candidates(len(stop_ids)) > vocab_size:
        raise ValueError(f"beam_width={k} asks for more candidates than the {vocab_size} tokens; lower beam_width")
    max_tokens = min(params.max_tokens, config.max_model_len - num_prompt_tokens)
    max_len = num_prompt_tokens + max_tokens
    num_pages_per_beam = -(-max_len // config.page_size)
    # Every beam must fit at once: a preempted beam waits for pages its reported siblings hold.
    if k * num_pages_per_beam > num_usable_pages:
        raise ValueError(
            f"{k} beams of up to {max_len} tokens need up to {k * num_pages_per_beam} pages but the pool holds "
            f"{num_usable_pages}; give the KV cache more pages, lower beam_width or max_tokens, or shorten the prompt"
        )
    return max_tokens, stop_ids


@dataclasses.dataclass
class BeamOutput:
    """One finished hypothesis."""

    token_ids: list[int]  # generated tokens (the eos that ended it included)
    text: str
    cumulative_logprob: float  # sum of the tokens' log-probabilities
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty: what beams are ranked by
    finish_reason: str  # "stop" (a stop id) or "length"


@dataclasses.dataclass
class BeamSearchSequence:
    """vLLM's view of one hypothesis: `tokens` and `text` include the prompt, as vLLM's do."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str
    logprobs: None = None  # per-token alternatives are not kept by this search
    stop_reason: None = None


@dataclasses.dataclass
class BeamSearchOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    beams: list[BeamOutput]  # best first, beam_width of them (fewer only if the search was aborted)
    finished: bool = True
    # vLLM's `sequences` (BeamSearchSequence, best first), for code written against vLLM.
    sequences: list[BeamSearchSequence] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Hypothesis:
    score: np.float32
    cum: np.float32
    token_ids: list[int]
    reason: str


class BeamSearch:
    """One request's search: live beams (running sequences), finished hypotheses, pending candidates."""

    def __init__(self, request_id: str, prompt: str | None, seq: Sequence, params: BeamSearchParams,
                 max_tokens: int, stop_token_ids: frozenset[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(seq.prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens, capped by max_model_len
        self.stop_token_ids = stop_token_ids
        self.num_candidates = params.num_candidates(len(stop_token_ids))
        self.live: list[Sequence] = [seq]  # best first
        self.live_cum: list[np.float32] = [np.float32(0.0)]
        self.finished: list[_Hypothesis] = []  # best first, at most beam_width
        self.pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # seq_id -> (logprobs [C], token ids [C])
        self.num_generated = 0
        self.can_improve = True  # HF's is_early_stop_heuristic_unsatisfied (sticky)
        self.done = False
        # For tests: the most sharers any page of a live beam had after a step.
        self.max_page_ref_count = 0

    def ready(self) -> bool:
        return all(seq.seq_id in self.pending for seq in self.live)

    def select(self) -> list[tuple[int, int, np.float32]]:
        """HF's step on the pending candidates: updates the hypotheses and the stop flag, returns the
        next running beams as (parent index in `live`, token id, cumulative logprob), best first."""
        k, lp = self.params.beam_width, self.params.length_penalty
        C = self.num_candidates
        logprobs = np.stack([self.pending[seq.seq_id][0][:C] for seq in self.live])  # [B, C] float32
        token_ids = np.stack([self.pending[seq.seq_id][1][:C] for seq in self.live])  # [B, C]
        totals = (np.asarray(self.live_cum, dtype=np.float32)[:, None] + logprobs).astype(np.float32)
        parents = np.broadcast_to(np.arange(len(self.live))[:, None], totals.shape)
        # Best first; ties go to the lower flat (beam, token) index, as a flattened top-k would see them.
        order = np.lexsort((token_ids.ravel(), parents.ravel(), -totals.ravel()))[:C]
        cands = [(int(parents.flat[i]), int(token_ids.flat[i]), totals.flat[i]) for i in order]
        at_length = self.num_generated + 1 >= self.max_tokens
        hits = [at_length or token in self.stop_token_ids for _, token, _ in cands]

        running = [c for c, hit in zip(cands, hits) if not hit][:k]
        full = len(self.finished) == k
        if not (self.params.early_stopping is True and full):
            length_factor = np.float32((self.num_generated + 1) ** lp)
            for (parent, token, total), hit in zip(cands[:k], hits[:k]):
                if hit:
                    tokens = self.live[parent].output_token_ids + [token]
                    reason = "length" if token not in self.stop_token_ids else "stop"
                    self.finished.append(_Hypothesis(np.float32(total / length_factor), total, tokens, reason))
            # Stable: among equal scores the older hypothesis stays ahead.
            self.finished = sorted(self.finished, key=lambda h: -h.score)[:k]
        self.num_generated += 1

        full = len(self.finished) == k
        if self.can_improve and full and running:
            best_len = self.max_tokens if (self.params.early_stopping == "never" and lp > 0) else self.num_generated
            best_possible = np.float32(running[0][2] / np.float32(best_len ** lp))
            self.can_improve = bool(best_possible > min(h.score for h in self.finished))
        self.done = (all(hits) or not running or not self.can_improve
                     or (self.params.early_stopping is True and full))
        return running

    def advance(self, scheduler: Scheduler) -> tuple[list[Sequence], list[Sequence]]:
        """Applies `select()` to the sequences: forks, appends, frees. Returns (forked children, ended beams).

        When the search is done every live beam ends (its pages freed)."""
        running = self.select()
        self.pending.clear()
        ended: list[Sequence] = []
        if self.done:
            for seq in self.live:
                scheduler.finish(seq, "stop")
            scheduler.block_manager.close_fork_group(self.live[0])  # a hybrid model's state slots go back
            ended, self.live, self.live_cum = self.live, [], []
            return [], ended
        # Beams that fell out of the top k end first (their pages, and a hybrid model's state slots, go back
        # for the forks); then forks, while every parent still holds exactly the tokens its children inherit.
        parents = {parent for parent, _, _ in running}
        for idx, seq in enumerate(self.live):
            if idx not in parents:
                scheduler.finish(seq, "stop")
                ended.append(seq)
        claimed: set[int] = set()
        new_seqs: list[Sequence] = []
        children: list[Sequence] = []
        for parent, _, _ in running:
            if parent in claimed:
                child = scheduler.fork(self.live[parent])
                children.append(child)
                new_seqs.append(child)
            else:
                claimed.add(parent)
                new_seqs.append(self.live[parent])
        for seq, (_, token, _) in zip(new_seqs, running):
            seq.append_token(token)
        ref_counts = scheduler.block_manager.ref_counts
        for seq in new_seqs:
            self.max_page_ref_count = max([self.max_page_ref_count] + [ref_counts[p] for p in seq.block_table])
        self.live = new_seqs
        self.live_cum = [total for _, _, total in running]
        return children, ended

    def abort(self, scheduler: Scheduler) -> None:
        for seq in self.live:
            scheduler.finish(seq, "abort")
        if self.live:
            scheduler.block_manager.close_fork_group(self.live[0])
        self.live, self.live_cum, self.done = [], [], True

    def output(self, decode) -> BeamSearchOutput:
        """The hypotheses, best first; `decode(token_ids) -> str` detokenizes."""
        beams = [
            BeamOutput(token_ids=h.token_ids, text=decode(h.token_ids), cumulative_logprob=float(h.cum),
                       score=float(h.score), finish_reason=h.reason)
            for h in self.finished
        ]
        sequences = [BeamSearchSequence(self.prompt_token_ids + b.token_ids, decode(self.prompt_token_ids + b.token_ids),
                                        b.cumulative_logprob, b.finish_reason) for b in beams]
        return BeamSearchOutput(self.request_id, self.prompt, self.prompt_token_ids, beams, sequences=sequences)


class BeamSearches(StepFeature):
    """The engine's live searches, and which search each beam sequence belongs to; a feature of the
    step (engine/features.py): the sampler leaves beams out, their top candidates are taken from the
    step's logits instead, and a step with beams is committed at once."""

    name = "beams"

    def __init__(self, scheduler: Scheduler | None = None, tokenizer=None, candidates=None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # its decode(token ids) -> text, for the outputs
        # logits -> (logprobs, token ids) [rows, C] on the device, best first (sample/sampler.py's
        # beam_candidates at one warmed-up width)
        self.candidates = candidates
        self.searches: dict[str, BeamSearch] = {}  # request_id -> search
        self.owner: dict[int, BeamSearch] = {}  # seq_id of a live beam -> its search

    def after_schedule(self, out) -> None:
        if out.preempted and self.searches:
            self.forget(out.preempted)

    def sample_args(self, out) -> dict:
        return {"beam_owner": self.owner} if self.owner else {}

    def after_sample(self, step, logits) -> None:
        """The top candidates of every beam that sampled, dispatched (read at commit)."""
        if step.beam_seqs:
            step.pending[self.name] = candidates = self.candidates(logits)
            for array in candidates:
                array.copy_to_host_async()

    def commits_at_once(self, step) -> bool:
        return bool(step.beam_seqs)  # the search decides the beams' next tokens on the host

    def after_commit(self, step) -> list:
        if not step.beam_seqs:
            return []
        logprobs, token_ids = (np.asarray(a) for a in step.pending[self.name])
        return [search.output(self.tokenizer.decode) for search in self.commit(self.scheduler, step.beam_seqs, logprobs, token_ids)]

    def add(self, search: BeamSearch) -> None:
        self.searches[search.request_id] = search
        for seq in search.live:
            self.owner[seq.seq_id] = search

    def __bool__(self) -> bool:
        return bool(self.searches)

    def forget(self, preempted: list[Sequence]) -> None:
        """Preempted beams drop the candidates they reported: they report again once recomputed."""
        for seq in preempted:
            search = self.owner.get(seq.seq_id)
            if search is not None:
                search.pending.pop(seq.seq_id, None)

    def commit(self, scheduler: Scheduler, seqs: list[tuple[int, Sequence]], logprobs: np.ndarray,
               token_ids: np.ndarray) -> list[BeamSearch]:
        """Beam `seqs[i] = (row, seq)` reported `logprobs[row], token_ids[row]` (best first). Every
        search whose beams have all reported takes its step. Returns the searches that finished."""
        ready: dict[str, BeamSearch] = {}
        for row, seq in seqs:
            search = self.owner.get(seq.seq_id)
            if search is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while its step ran
            search.pending[seq.seq_id] = (logprobs[row], token_ids[row])
            ready[search.request_id] = search
        finished = []
        for search in ready.values():
            if not search.ready():
                continue
            children, ended = search.advance(scheduler)
            for seq in ended:
                del self.owner[seq.seq_id]
            for seq in children:
                self.owner[seq.seq_id] = search
            if search.done:
                del self.searches[search.request_id]
                finished.append(search)
        return finished

    def abort(self, request_id: str, scheduler: Scheduler) -> bool:
        """Ends a search now, freeing its beams' pages; False if there is no such search."""
        search = self.searches.pop(request_id, None)
        if search is None:
            return False
        for seq in search.live:
            self.owner.pop(seq.seq_id, None)
        search.abort(scheduler)
        return True
