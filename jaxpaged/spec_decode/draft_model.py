"""Draft-model proposals: a smaller model with the target's vocabulary proposes k tokens per step.

The draft's K/V live in a second page buffer with the target's page ids (decision: DESIGN.md,
"Speculative decoding"): one block table, one allocator and one prefix cache serve both models, so
preemption, swap, copy-on-write, prefix-cache hits and rollback need no second bookkeeping, and the
draft can leak no page of its own. The draft's buffer holds num_pages pages of the draft's own
(smaller) size; the step's page ids index both.

Invariant: the draft has computed every token the target has (positions < num_computed_tokens),
because after each target step the draft runs the same StepInput (`mirror`: same tokens, slots,
block tables), writing only K/V. A step with proposals, for a sequence with L known tokens:

    propose (before the target step; the scheduler gave pages for L + m tokens)
      draft step j = 0 .. m-1: input token L-1+j (j = 0: the last known token; j > 0: d_{j-1},
      read on the device from step j-1's draws), K/V written at slot L-1+j, draws d_j ~ q_j
    target step: verifies d_0 .. d_{m-1} at positions L-1 .. L+m-1
    mirror: the draft runs that step too (rewrites L-1 .. L+m-2 with the same tokens, adds L+m-1)
    rollback: slots past the accepted tokens hold rejected tokens in both buffers; overwritten later

q_j is the distribution the request's own filters (temperature, top-k, top-p, min-p) give the
draft's logits; greedy requests propose the draft's argmax. The k draft steps chain on the device;
the host reads the proposals once, to place them in the target step's tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.device.kv_transfer import HostKVStore
from jaxpaged.device.runner import ModelRunner, StepInput
from jaxpaged.sample.sampler import GREEDY_TEMPERATURE, RowSpec, make_sampling_arrays, sampling_logits
from jaxpaged.spec_decode.verifier import uniforms

_PROPOSE = 3  # the `purpose` of a draft draw's uniform (verifier.py uses 1 and 2)


@dataclasses.dataclass
class DraftRow:
    """One sequence's proposal: m draft steps from its last known token at position L-1."""

    num_known: int  # L
    num_drafts: int  # m >= 1
    last_token: int  # token_ids[L - 1]
    block_table: list[int]
    spec: RowSpec  # sampling filters, seed, step = output index of d_0 (row_idx is set here)


@functools.partial(jax.jit, static_argnames=("num_out", "with_probs"))
def draft_sample(logits, arrays, *, num_out: int, with_probs: bool):
    """One draft step's draws: tokens [num_out] int32 (padded with 0) and, `with_probs`, q [num_out, V]
    float32 (the distribution each sampled row drew from; rows of greedy requests are never read)."""
    raw = logits.astype(jnp.float32)
    greedy = jnp.argmax(raw, axis=-1).astype(jnp.int32)
    pad = num_out - logits.shape[0]
    if not with_probs:
        return jnp.pad(greedy, (0, pad)), None
    q = jax.nn.softmax(sampling_logits(logits, arrays), axis=-1)
    cdf = jnp.cumsum(q, axis=-1)
    u = uniforms(arrays.seed, arrays.step, _PROPOSE, 1)[:, 0]
    drawn = jnp.minimum(jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=-1), q.shape[-1] - 1).astype(jnp.int32)
    tokens = jnp.where(arrays.temperature >= GREEDY_TEMPERATURE, drawn, greedy)
    return jnp.pad(tokens, (0, pad)), jnp.pad(q, ((0, pad), (0, 0)))


@jax.jit
def _stack(*qs):
    return jnp.stack(qs, axis=1)  # [S, K, V]


class DraftModelProposer:
    """Owns the draft model's runner (its params and page buffer) and its host pages for swap."""

    def __init__(self, model_config, params, target: ModelRunner, *, num_speculative_tokens: int,
                 max_model_len: int, attention_fn, num_host_pages: int):
        self.k = num_speculative_tokens
        self.runner = ModelRunner(
            model_config, params, num_pages=target.num_pages, page_size=target.page_size,
            max_num_seqs=target.max_num_seqs, max_num_batched_tokens=target.max_num_batched_tokens,
            max_model_len=max_model_len, attention_fn=attention_fn, buckets=target.buckets,
            decode_buckets=target.decode_buckets or None, kv_cache_dtype=target.kv_cache_dtype,
        )
        self.host_kv = HostKVStore(self.runner, num_host_pages)

    # ---------------------------------------------------------------- keeping the draft's K/V in step

    def before_step(self, out) -> None:
        """The step's planned swaps and copy-on-write copies, on the draft's buffer too."""
        if out.swap_out:
            self.host_kv.swap_out(out.swap_out)
        if out.swap_in:
            self.host_kv.swap_in(out.swap_in)
        if out.copies:
            self.runner.copy_pages(out.copies)

    def mirror(self, step_input: StepInput, prev_tokens=None) -> None:
        """The draft computes the target step's tokens (K/V only: its logits are not read). Logits
        rows as a plain step's, so the programs are the ones `ModelRunner.warmup` compiled.
        `prev_tokens`: the target's previous sampled tokens, where an overlapped step's input tokens are."""
        self.runner.execute(dataclasses.replace(
            step_input, logits_indices=np.zeros(step_input.num_seqs, np.int32), prompt_logprob_targets=None),
            prev_tokens)

    # ---------------------------------------------------------------- proposals

    def propose(self, rows: list[DraftRow]) -> tuple[list[list[int]], jax.Array | None]:
        """Runs max(m) draft decode steps for `rows`; returns each row's m proposals (host ints) and
        q [max_num_seqs, K, V] (row r = rows[r]), or None when every row is greedy."""
        runner = self.runner
        num_rows, ps = len(rows), runner.page_size
        bucket = next(d for d in runner.decode_buckets if d >= num_rows)
        num_steps = max(row.num_drafts for row in rows)
        with_probs = any(row.spec.temperature >= GREEDY_TEMPERATURE for row in rows)
        block_tables = np.zeros((bucket, runner.pages_per_seq), np.int32)
        for r, row in enumerate(rows):
            block_tables[r, : len(row.block_table)] = row.block_table
        num_known = np.array([row.num_known for row in rows], np.int32)
        num_drafts = np.array([row.num_drafts for row in rows], np.int32)
        query_start_loc = np.full(bucket + 1, num_rows, np.int32)
        query_start_loc[: num_rows + 1] = np.arange(num_rows + 1)
        logits_indices = np.zeros(bucket, np.int32)
        logits_indices[:num_rows] = np.arange(num_rows)
        first_tokens = np.zeros(bucket, np.int32)
        first_tokens[:num_rows] = [row.last_token for row in rows]
        from_prev = np.full(bucket, -1, np.int32)
        from_prev[:num_rows] = np.arange(num_rows)
        tokens, draws = None, []  # per step: (tokens [max_num_seqs], q [max_num_seqs, V] or None)
        for j in range(num_steps):
            active = num_drafts > j  # rows still drafting; the others write nothing and read nothing
            pos = num_known - 1 + j
            positions = np.zeros(bucket, np.int32)
            positions[:num_rows] = np.where(active, pos, 0)
            slots = np.full(bucket, runner.num_pages * ps, np.int32)
            page_ids = block_tables[np.arange(num_rows), np.minimum(pos // ps, runner.pages_per_seq - 1)]
            slots[:num_rows] = np.where(active, page_ids * ps + pos % ps, runner.num_pages * ps)
            seq_lens = np.zeros(bucket, np.int32)
            seq_lens[:num_rows] = np.where(active, pos + 1, 0)
            step_input = StepInput(
                token_ids=first_tokens if j == 0 else np.zeros(bucket, np.int32), positions=positions,
                slot_mapping=slots, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                logits_indices=logits_indices, prev_token_rows=np.full(bucket, -1, np.int32) if j == 0 else from_prev,
                decode_only=True,
            )
            logits = runner.execute(step_input, tokens)
            specs = [row.spec._replace(row_idx=r, step=row.spec.step + j) for r, row in enumerate(rows)]
            tokens, q = draft_sample(logits, make_sampling_arrays(specs, bucket), num_out=runner.num_prev_token_rows,
                                     with_probs=with_probs)
            tokens.copy_to_host_async()
            draws.append((tokens, q))
        drawn = np.stack([np.asarray(t)[:num_rows] for t, _ in draws], axis=1)  # [R, num_steps]
        proposals = [drawn[r, : row.num_drafts].tolist() for r, row in enumerate(rows)]
        if not with_probs:
            return proposals, None
        q_list = [q for _, q in draws]  # padded to K with the last (columns >= m are never read)
        return proposals, _stack(*(q_list + [q_list[-1]] * (self.k - num_steps)))

    # ---------------------------------------------------------------- warm-up, stats

    def warmup(self, host_transfers: bool) -> None:
        """Compiles the draft's step buckets (the mirror), its decode buckets with both sampler variants,
        the stack of K distributions and the draft's host transfers: proposing never compiles."""
        self.runner.warmup(host_transfers=host_transfers)
        for bucket in self.runner.decode_buckets:
            logits = self.runner.zeros_logits(bucket)
            arrays = make_sampling_arrays([RowSpec(row_idx=0, temperature=1.0, top_k=2, top_p=0.9)], bucket)
            for with_probs in (False, True):
                jax.block_until_ready(draft_sample(logits, arrays, num_out=self.runner.num_prev_token_rows,
                                                   with_probs=with_probs))
        q = self.runner.zeros_on_device((self.runner.num_prev_token_rows, self.runner.config.vocab_size), jnp.float32)
        jax.block_until_ready(_stack(*[q] * self.k))  # committed as draft_sample's probabilities are

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles
