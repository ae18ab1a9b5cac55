"""Speculative decoding on the host: proposals into a step, verification rows, rollback, stats.

One step with proposals, for a decoding sequence with L tokens (the last one not yet computed):

    schedule()  proposals d_0..d_{m-1} are appended to token_ids for the scheduler to see, so it
                schedules 1 + m tokens and gives the sequence pages for L + m tokens (preemption and
                copy-on-write as for any step); proposals of a sequence the step did not take whole
                (not scheduled, preempted) are removed again at once.
    dispatch    the target step returns logits at all 1 + m positions (StepInput.logits_indices
                holds several rows per such sequence); verifier.verify keeps a <= m proposals and
                draws one more token.
    commit      token_ids = the L known tokens + the a + 1 new ones (each through the token-level
                stop rules); num_computed_tokens = L + a: the K/V slots of the m - a rejected
                proposals are simply written again later. Pages past the new length are freed.
                Only then does Scheduler.commit register full pages in the prefix cache, so a
                registered page never holds a rejected token.

A step with proposals is committed at once (not one step late): the next proposal needs the tokens
this step accepted. The engine therefore steps synchronously while speculation is on.

Proposers (vLLM's names): "ngram" proposes on the host inside schedule(); "draft_model" reserves m
placeholder tokens there, and `propose` (after the step's swaps and copies, before its input is
prepared) runs the draft model (draft_model.py) and writes its proposals over them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.device.step_input import default_buckets
from jaxpaged.engine.features import StepFeature
from jaxpaged.planner.request import seed_for, token_stop_reason
from jaxpaged.planner.scheduler import Scheduler
from jaxpaged.planner.sequence import SequenceStatus
from jaxpaged.sample.sampler import GREEDY_TEMPERATURE, RowSpec
from jaxpaged.spec_decode.draft_model import DraftModelProposer, DraftRow
from jaxpaged.spec_decode.ngram import propose_ngram
from jaxpaged.spec_decode.verifier import make_verify_arrays, verify

RUNNING = SequenceStatus.RUNNING


@dataclasses.dataclass
class SpecPlan:
    """Where a step's logits rows lie: sequence i owns rows first[i] .. first[i] + num_logits[i]."""

    drafts: list[list[int] | None]  # per scheduled sequence, its proposals this step (None: none)
    num_logits: np.ndarray  # int32 per scheduled sequence: 1 + len(proposals), or 1
    first: list[int]
    draft_probs: jax.Array | None = None  # the draft model's q [max_num_seqs, K, V] (verification rows)


@dataclasses.dataclass
class SpecPending:
    """A dispatched verification: the sequences with proposals and the verifier's device outputs."""

    seqs: list  # [(sequence, proposals)] in verification-row order
    tokens: jax.Array
    num_accepted: jax.Array
    appended: list = dataclasses.field(default_factory=list)  # at commit: (sequence, token) accepted or drawn
    finished: list = dataclasses.field(default_factory=list)  # at commit: (sequence, stop reason)


class Speculator(StepFeature):
    """Speculative decoding as a feature of the step (engine/features.py): proposals in before the
    scheduler plans, verification after the sampler, rollback at commit."""

    name = "spec"

    def __init__(self, config, draft: DraftModelProposer | None = None, *, scheduler: Scheduler, owner: dict):
        spec_config, max_num_seqs = config.speculative_config, config.max_num_seqs
        self.method = spec_config["method"]
        self.draft = draft  # the draft model's proposer, for method "draft_model"
        if (self.method == "draft_model") != (draft is not None):
            raise ValueError(f"speculative_config method={self.method!r} needs a draft model exactly when it is "
                             "'draft_model' (build_engine loads speculative_config['model'])")
        self.k = spec_config["num_speculative_tokens"]
        self.lookup_min = spec_config.get("prompt_lookup_min")  # ngram only
        self.lookup_max = spec_config.get("prompt_lookup_max")
        self.max_num_seqs = max_num_seqs
        self.scheduler = scheduler
        self.owner = owner  # seq_id -> (request, sample index): the output processor's
        self._proposed: dict[int, tuple] = {}  # seq_id -> (sequence, proposals) put in before schedule()
        disable = spec_config.get("disable_by_batch_size")
        # Default: 1 on the CPU (bench_spec_decode, k = 5: batch 1 gains 1.6-1.75x, batch 4 ~1.05x, batch
        # 16 0.87x: batching amortises the weight reads there, and a verification step's extra tokens
        # cost compute); 32 elsewhere, not measured.
        self.disable_by_batch_size = disable or (1 if jax.default_backend() == "cpu" else 32)
        self.max_num_logits = max_num_seqs * (1 + self.k)  # logits rows of a verification step, at most
        self.num_draft_tokens = 0  # proposals verified
        self.num_accepted_tokens = 0  # of those, kept
        self.num_verified = 0  # (sequence, step) pairs verified: each yields accepted + 1 tokens
        self.num_emitted_tokens = 0  # tokens those verifications appended (stop rules may cut a run)
        self.num_accepted_per_pos = [0] * self.k  # verifications that kept the proposal at position j

    @classmethod
    def create(cls, config, runner, draft_model, attention_fn, mesh, num_host_pages: int, *, scheduler: Scheduler,
               owner: dict) -> Speculator | None:
        """The engine's speculator (None without speculative_config); `draft_model`: (ModelConfig, params)
        of the draft for method "draft_model", else None."""
        if not config.speculative_config:
            if draft_model is not None:
                raise ValueError("a draft model was given without speculative_config; pass "
                                 "speculative_config={'method': 'draft_model', ...}")
            return None
        return cls(config, draft_proposer(draft_model, runner, config, attention_fn, mesh, num_host_pages),
                   scheduler=scheduler, owner=owner)

    # ---------------------------------------------------------------- planning

    def before_schedule(self, scheduler: Scheduler) -> list:
        """Proposals for the decoding sequences the scheduler can take whole, appended to their tokens."""
        # Running sequences are scheduled first and in order: while their total demand fits the token
        # budget, each gets all its tokens, proposals included (none is cut into a chunk).
        if not self.enabled(scheduler):
            return []  # a large batch: no proposals, and the engine steps asynchronously
        budget = scheduler.max_num_batched_tokens
        for seq in scheduler.running:
            budget -= len(seq.token_ids) - seq.num_computed_tokens
        proposed = self._proposed
        for seq in scheduler.running[: scheduler.max_num_seqs]:
            if budget <= 0:
                break
            num_tokens = len(seq.token_ids)
            params = seq.sampling_params
            # No min_tokens ban to verify; and top-k logprobs (ranks, alternatives) come from the sampler
            # only, so a request asking for logprobs, penalties or a grammar is not speculated.
            if (seq.num_placeholders or seq.num_computed_tokens != num_tokens - 1
                    or seq.num_output_tokens < params.min_tokens or params.logprobs is not None
                    or params.needs_token_state or params.structured_outputs is not None):
                continue
            k = min(self.k, budget, seq.max_num_tokens - num_tokens - 1)  # room for the bonus token
            if k <= 0:
                continue
            # The draft model's proposals come after scheduling (they need the pages): placeholders.
            drafts = propose_ngram(seq.token_ids, k, self.lookup_min, self.lookup_max) if self.draft is None else [0] * k
            if drafts:
                seq.token_ids.extend(drafts)
                proposed[seq.seq_id] = (seq, drafts)
                budget -= len(drafts)
        return []

    def after_schedule(self, out) -> None:
        """Keeps the proposals of sequences scheduled whole (`out.spec_plan`); removes the others'."""
        proposed, self._proposed = self._proposed, {}
        if not proposed:
            return
        plan = [None] * len(out.seqs)
        for i, (seq, num_new) in enumerate(zip(out.seqs, out.num_new_tokens)):
            entry = proposed.pop(seq.seq_id, None)
            if entry is not None and entry[0] is seq:
                if num_new != 1 + len(entry[1]) or not out.samples[i]:
                    raise RuntimeError(f"sequence {seq.seq_id} was scheduled {num_new} tokens of its "
                                       f"{1 + len(entry[1])} with proposals; this is a bug")
                plan[i] = entry[1]
        for seq, drafts in proposed.values():  # not scheduled, or preempted: they never ran
            del seq.token_ids[len(seq.token_ids) - len(drafts) :]
        out.spec_plan = self._plan(plan) if any(plan) else None

    def enabled(self, scheduler: Scheduler) -> bool:
        """Whether steps propose now: at most disable_by_batch_size requests in the engine (vLLM's rule).
        While they do, each step is committed before the next is planned (the next proposals need its
        tokens); otherwise the engine overlaps steps as without speculation."""
        return scheduler.num_unfinished <= self.disable_by_batch_size

    def before_execute(self, out) -> dict:
        """For the draft model, after the step's swaps on the target: the same swaps and copies on the
        draft's buffer, then the draft's proposals in place of the placeholders. Returns the step
        input's logits rows (several per verified sequence)."""
        plan = out.spec_plan
        if self.draft is not None:
            self.draft.before_step(out)
            if plan is not None:
                self._propose_with_draft(out, plan)
        return self.logits_rows(plan) if plan is not None else {}

    def _propose_with_draft(self, out, plan: SpecPlan) -> None:
        owner = self.owner
        rows, idx = [], []
        for i, (seq, drafts) in enumerate(zip(out.seqs, plan.drafts)):
            if drafts:
                request, sample_idx = owner[seq.seq_id]
                p = request.params
                num_known = len(seq.token_ids) - len(drafts)
                spec = RowSpec(0, p.temperature, max(p.top_k, 0), p.top_p, p.min_p,
                               seed_for(request.seed, sample_idx), num_known - seq.num_prompt_tokens)
                rows.append(DraftRow(num_known, len(drafts), seq.token_ids[num_known - 1], seq.block_table, spec))
                idx.append(i)
        proposals, plan.draft_probs = self.draft.propose(rows)
        for i, row, drafts in zip(idx, rows, proposals):
            out.seqs[i].token_ids[row.num_known :] = drafts
            plan.drafts[i] = drafts

    def after_execute(self, step, step_input, prev_tokens, result):
        """The draft model computes the target step's tokens too (draft_model.py: its invariant)."""
        if self.draft is not None:
            self.draft.mirror(step_input, prev_tokens)
        return result

    def sample_args(self, out) -> dict:
        """Sequences with proposals are verified, not sampled; every sequence's logits row is plan.first[i]."""
        return {"plan": out.spec_plan} if out.spec_plan is not None else {}

    def after_sample(self, step, logits) -> None:
        if step.out.spec_plan is not None:
            step.pending[self.name] = self.verify(logits, step.out, self.owner)

    def commits_at_once(self, step) -> bool:
        """While steps propose, the next proposals need this step's tokens."""
        return self.enabled(self.scheduler)

    def _plan(self, drafts: list[list[int] | None]) -> SpecPlan:
        num_logits = np.array([1 + len(d) if d else 1 for d in drafts], np.int32)
        first = np.concatenate([[0], np.cumsum(num_logits)[:-1]]).astype(np.int32).tolist()
        return SpecPlan(drafts=drafts, num_logits=num_logits, first=first)

    # ---------------------------------------------------------------- the device side

    def verify(self, logits, out, owner) -> SpecPending:
        """Dispatches the verification of the step's proposals (not awaited)."""
        plan = out.spec_plan
        rows, seqs = [], []
        for i, (seq, drafts) in enumerate(zip(out.seqs, plan.drafts)):
            if not drafts:
                continue
            request, sample_idx = owner[seq.seq_id]
            params = request.params
            step = len(seq.token_ids) - len(drafts) - seq.num_prompt_tokens  # outputs before position 0
            rows.append((plan.first[i], drafts, params.temperature, max(params.top_k, 0), params.top_p,
                         params.min_p, seed_for(request.seed, sample_idx), step))
            seqs.append((seq, drafts))
        # Rows padded to at most the logits width (a sequence with proposals has >= 2 logits rows), so a
        # small verification step verifies few rows: no extra compiled variant per width.
        arrays = make_verify_arrays(rows, min(self.max_num_seqs, logits.shape[0]), self.k)
        greedy_only = bool((arrays.temperature < GREEDY_TEMPERATURE).all())
        tokens, num_accepted = verify(logits, arrays, draft_probs=plan.draft_probs, greedy_only=greedy_only)
        for array in (tokens, num_accepted):
            array.copy_to_host_async()
        return SpecPending(seqs=seqs, tokens=tokens, num_accepted=num_accepted)

    # ---------------------------------------------------------------- after the step

    def before_commit(self, step) -> None:
        """Before Scheduler.commit: each verified sequence's proposals rolled back, its accepted
        tokens and the drawn one appended (each through the token-level stop rules)."""
        pending: SpecPending | None = step.pending.get(self.name)
        if pending is None:
            return
        new_tokens = np.asarray(pending.tokens).tolist()
        num_accepted = np.asarray(pending.num_accepted).tolist()
        block_manager = self.scheduler.block_manager
        for r, (seq, drafts) in enumerate(pending.seqs):
            if seq.status is not RUNNING:
                continue  # finished or aborted since dispatch
            token_ids = seq.token_ids
            del token_ids[len(token_ids) - len(drafts) :]
            accepted = num_accepted[r]
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            self.num_verified += 1
            for j in range(accepted):
                self.num_accepted_per_pos[j] += 1
            for j in range(accepted + 1):
                token_id = new_tokens[r][j]
                token_idx = len(token_ids)
                token_ids.append(token_id)
                seq.output_token_ids.append(token_id)
                pending.appended.append((seq, token_id))
                self.num_emitted_tokens += 1
                reason = token_stop_reason(token_idx, token_id, len(seq.output_token_ids), seq.max_num_tokens,
                                           seq.stop_token_set, seq.sampling_params.min_tokens)
                if reason is not None:
                    pending.finished.append((seq, reason))
                    break
            # Slots past the last known token hold rejected proposals (or nothing): recomputed later.
            seq.num_computed_tokens = len(token_ids) - 1
            num_pages = -(-len(token_ids) // block_manager.page_size)
            if num_pages < len(seq.block_table):
                for page_id in reversed(seq.block_table[num_pages:]):  # pages left with no known token
                    block_manager.release_page(page_id)
                # A new list, not a truncated one: block tables are append-only while a sequence runs,
                # and the engine's BlockTableRows resyncs a row only for a new list (the same length
                # regrown with another page would keep the stale page id).
                seq.block_table = seq.block_table[:num_pages]

    def amend_update(self, step, update) -> None:
        """After Scheduler.commit (which registers full pages of known tokens only): the verified
        tokens join the update, after the sampled ones, and the sequences they stopped finish."""
        pending: SpecPending | None = step.pending.get(self.name)
        if pending is None:
            return
        for seq, reason in pending.finished:
            self.scheduler.finish(seq, reason)
        # Their rows lie past the sampler's (they index no logprobs: speculated requests asked for none).
        base = step.tokens.shape[0] if step.tokens is not None else 0
        update.appended += pending.appended
        update.rows += range(base, base + len(pending.appended))
        update.finished += [seq for seq, _ in pending.finished]

    # ---------------------------------------------------------------- warm-up and stats

    def logits_rows(self, plan: SpecPlan) -> dict:
        """ModelRunner.prepare's arguments for a step with proposals: logits rows per sequence."""
        return dict(num_logits=plan.num_logits, max_num_logits=self.max_num_logits)

    def warmup(self, runner, step_sampler) -> None:
        """Compiles the verification variant of every token bucket (its logits rows), the samplers
        (`step_sampler`: the engine's) and the verifier at those widths, and the draft model's
        programs: a step with proposals never compiles."""
        widths = tuple(sorted({min(bucket, self.max_num_logits) for bucket in runner.buckets}))
        step_sampler.warmup(self.max_num_seqs, widths)  # sequences without proposals sample there
        for bucket in runner.buckets:
            width = min(bucket, self.max_num_logits)  # logits rows of a verification step
            dummy = runner.dummy_step_input(bucket)
            logits = runner.execute(dataclasses.replace(dummy, logits_indices=np.zeros(width, np.int32)))
            arrays = make_verify_arrays([(0, [1], 1.0, 2, 0.9, 0.0, 0, 0)], min(self.max_num_seqs, width), self.k)
            qs = [None]
            if self.draft is not None:  # the variants with the draft's distributions (None: all greedy)
                qs.append(jnp.full((self.max_num_seqs, self.k, logits.shape[-1]), 1.0 / logits.shape[-1], jnp.float32,
                                   device=runner.placement))  # committed as the draft's stack is: jit keys on it
            for q in qs:
                for greedy_only in (False, True):
                    jax.block_until_ready(verify(logits, arrays, draft_probs=q, greedy_only=greedy_only))
        if self.draft is not None:
            self.draft.warmup(host_transfers=self.draft.host_kv.num_host_pages > 0)

    def stats(self) -> dict:
        """Counts start with num_ (data parallelism sums those over replicas, averages the rest)."""
        return {
            "num_spec_draft_tokens": self.num_draft_tokens,
            "num_spec_accepted_tokens": self.num_accepted_tokens,
            "num_spec_verified": self.num_verified,
            "num_spec_emitted_tokens": self.num_emitted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
            # New tokens per verified sequence per step (accepted proposals + the drawn token).
            "spec_mean_accepted_length": self.num_emitted_tokens / max(1, self.num_verified),
            # vLLM's num_accepted_tokens_per_pos: verifications that kept the proposal at position j.
            **{f"num_spec_accepted_tokens_pos{j}": n for j, n in enumerate(self.num_accepted_per_pos)},
            "num_spec_draft_compiles": self.draft.num_compiles if self.draft is not None else 0,
        }


def draft_proposer(draft_model, runner, config, attention_fn, mesh, num_host_pages: int) -> DraftModelProposer | None:
    """The draft model's proposer for method "draft_model" (`draft_model`: its (ModelConfig, params)), else None."""
    spec = config.speculative_config
    if spec["method"] != "draft_model":
        if draft_model is not None:
            raise ValueError(f"a draft model was given but speculative_config method={spec['method']!r}; "
                             "use method='draft_model'")
        return None
    if draft_model is None:
        raise ValueError("speculative_config method='draft_model' needs the draft model: build the engine with "
                         "LLM(..., speculative_config={'model': ...}) or pass LLMEngine(..., draft_model=(config, params))")
    if mesh is not None:
        raise ValueError("speculative_config method='draft_model' runs on one device; use tensor_parallel_size=1 "
                         "(data_parallel_size may be > 1)")
    draft_config, draft_params = draft_model
    if draft_config.vocab_size != runner.config.vocab_size:
        raise ValueError(f"the draft model's vocab_size={draft_config.vocab_size} differs from the target's "
                         f"{runner.config.vocab_size}; a draft model must share the target's tokenizer")
    if draft_config.max_position_embeddings < config.max_model_len:
        raise ValueError(f"the draft model's context of {draft_config.max_position_embeddings} tokens is shorter "
                         f"than max_model_len={config.max_model_len}; lower max_model_len")
    return DraftModelProposer(draft_config, draft_params, runner, num_speculative_tokens=spec["num_speculative_tokens"],
                              max_model_len=config.max_model_len, attention_fn=attention_fn,
                              num_host_pages=num_host_pages)


def verification_buckets(config) -> tuple[int, ...] | None:
    """The target's token buckets with speculation: the default ones plus 1 + k tokens, one sequence's
    verification step, which would otherwise be padded to the smallest default bucket (at k = 3 a
    4-token step, not 16: on a CPU the padded tokens cost compute, 5x a decode step). None: off.
    (Larger batches verify in the default buckets: one more bucket per batch size costs compilations.)"""
    spec = config.speculative_config
    if not spec:
        return None
    buckets = default_buckets(config.max_num_batched_tokens)
    return tuple(sorted({*buckets, min(1 + spec["num_speculative_tokens"], buckets[0])}))
