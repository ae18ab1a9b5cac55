"""The engine: one step = plan on the host, run the model on device, sample, apply stop rules.

    add_request ──► Scheduler.add ──► waiting
    step():  Scheduler.schedule()                    host: which sequences, how many tokens each
             prepare_step_input + ModelRunner.execute device: K/V written, logits of last tokens
             fork the n-1 siblings of a request at its first sample (they share the prompt's pages)
             sample (jitted, one row per sampling sequence)
             Scheduler.update                        host: append tokens, token-level stop rules
             detokenize, stop strings                host: text-level stop rules
             RequestOutput for every request that moved

The engine owns the requests (a request is n sequences); the scheduler owns the sequences' states
and pages. Everything is single-threaded: JAX's asynchronous dispatch overlaps device work with the
host only up to the point where sampled tokens are read back.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import jax
import numpy as np

from jaxpaged.block_manager import BlockManager
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model_runner import ModelRunner
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampler import RowSpec, make_sampling_arrays, sample
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import Scheduler
from jaxpaged.sequence import Sequence

logger = logging.getLogger("jaxpaged")

_SEED_MASK = 2**31 - 1


@dataclasses.dataclass
class _Request:
    """Engine-side view of one request: its n samples and their text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # sample j draws with seed_for(seed, j)
    seqs: list[Sequence]  # seqs[j] is sample j; starts with the parent alone, siblings join at fork
    detokenizers: list  # one incremental detokenizer per sample
    texts: list[str]
    finish_reasons: list[str | None]
    logprobs: list[list[float]]
    sent_tokens: list[int]  # per sample, tokens already reported (for streaming deltas)
    sent_text: list[int]  # per sample, characters already reported

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(r is not None for r in self.finish_reasons)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def seed_for(seed: int, sample_idx: int) -> int:
    """Seed of a request's sample `sample_idx`; sample 0 uses the request's own seed."""
    return seed if sample_idx == 0 else (seed * 1_000_003 + sample_idx * 7_919) & _SEED_MASK


class LLMEngine:
    """Continuous-batching engine over a paged KV cache. `jaxpaged.LLM` wraps it for users."""

    def __init__(self, model_config, params, tokenizer, config: EngineConfig, *, num_pages: int, attention_fn,
                 mesh=None):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.block_manager = BlockManager(
            num_pages=num_pages, page_size=config.page_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )
        self.runner = ModelRunner(
            model_config,
            params,
            num_pages=num_pages,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            attention_fn=attention_fn,
            mesh=mesh,  # tensor parallelism: jaxpaged/sharding.py
        )
        self._requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, tuple[_Request, int]] = {}  # seq_id -> (request, sample index)
        self._request_counter = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._num_generated_tokens = 0
        self._num_steps = 0
        self.timings = {"schedule": 0.0, "prepare": 0.0, "device": 0.0, "postprocess": 0.0}
        if config.warmup:
            self.warmup()

    # ---------------------------------------------------------------- requests

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for a prompt this engine can never serve (nothing is queued)."""
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt is empty; give at least one token or a non-empty string")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(
                f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}; "
                "encode the text with this model's tokenizer"
            )
        if len(prompt_token_ids) + 1 > self.config.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens but max_model_len={self.config.max_model_len} "
                "leaves no room for an output token; raise max_model_len or shorten the prompt"
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        self.validate_prompt(prompt_token_ids)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pass a unique request_id")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, _SEED_MASK))
        seq = Sequence(
            [int(t) for t in prompt_token_ids], params, cache_salt=cache_salt,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        self.scheduler.add(seq)  # raises ValueError (and queues nothing) if it can never run
        request = _Request(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(seq.prompt_token_ids), params=params,
            seed=seed, seqs=[seq], detokenizers=[self.tokenizer.detokenizer(seq.prompt_token_ids)],
            texts=[""], finish_reasons=[None], logprobs=[[]], sent_tokens=[0], sent_text=[0],
        )
        self._requests[request_id] = request
        self._seq_owner[seq.seq_id] = (request, 0)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stops a request now and frees its pages; unknown or finished ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for j, seq in enumerate(request.seqs):
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)
            if request.finish_reasons[j] is None:
                request.finish_reasons[j] = "abort"
            self._seq_owner.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_generated_tokens(self) -> int:
        return self._num_generated_tokens

    # ---------------------------------------------------------------- the step

    def step(self, *, only_finished: bool = False) -> list[RequestOutput]:
        """Runs one engine step; returns an output for every request that produced tokens.

        `only_finished=True` returns outputs only for requests that finished this step: building a
        snapshot copies every moved request's tokens, which offline generation does not need.
        """
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.timings["schedule"] += t1 - t0
        if not out.seqs:
            if self._requests:
                raise RuntimeError("the scheduler scheduled nothing while requests are waiting; this is a bug")
            return []
        self._num_steps += 1
        if logger.isEnabledFor(logging.DEBUG):
            self._log_step(out)

        step_input = self.runner.prepare(out)
        t2 = time.perf_counter()
        self.timings["prepare"] += t2 - t1
        if out.copies:
            self.runner.copy_pages(out.copies)
        logits = self.runner.execute(step_input)

        # Rows to sample: every sequence whose scheduled tokens reach the end of what it knows. A
        # request with n > 1 samples n rows from its parent's logits row at its first token; the
        # scheduler then forks the parent n-1 times (the children share the prompt's pages).
        rows: list[RowSpec] = []
        entries: list[int | list[int] | None] = [None] * len(out.seqs)  # row(s) per scheduled sequence
        for i, (seq, num_new) in enumerate(zip(out.seqs, out.num_new_tokens)):
            if seq.num_computed_tokens + num_new < len(seq.token_ids):
                continue  # a chunk of a longer prompt: nothing to sample yet
            request, sample_idx = self._seq_owner[seq.seq_id]
            if len(request.seqs) < request.params.n:
                entries[i] = list(range(len(rows), len(rows) + request.params.n))
                rows += [self._row(i, request, j, seq) for j in range(request.params.n)]
            else:
                entries[i] = len(rows)
                rows.append(self._row(i, request, sample_idx, seq))

        if rows:
            # Rows fit the step's logits bucket unless n > 1 fan-out adds more.
            num_rows = logits.shape[0] if len(rows) <= logits.shape[0] else _next_pow2(len(rows))
            tokens_dev, logprobs_dev = sample(logits, make_sampling_arrays(rows, num_rows))
            tokens = np.asarray(tokens_dev).tolist()  # waits for the device
            logprobs = np.asarray(logprobs_dev).tolist()
        else:
            jax.block_until_ready(logits)
        t3 = time.perf_counter()
        self.timings["device"] += t3 - t2

        sampled = [
            None if e is None else [tokens[r] for r in e] if isinstance(e, list) else tokens[e] for e in entries
        ]
        update = self.scheduler.update(out, sampled)

        # Register the children the scheduler forked, in the order their parents were scheduled.
        children = iter(update.forked)
        row_of: dict[int, int] = {}  # seq_id -> its sampling row
        for seq, e in zip(out.seqs, entries):
            if isinstance(e, list):
                request, _ = self._seq_owner[seq.seq_id]
                row_of[seq.seq_id] = e[0]
                for j, r in enumerate(e[1:], start=1):
                    child = next(children)
                    self._add_sample(request, child, j)
                    row_of[child.seq_id] = r
            elif e is not None:
                row_of[seq.seq_id] = e

        moved: dict[str, _Request] = {}
        for seq, token_id in update.appended:
            request, j = self._seq_owner[seq.seq_id]
            self._num_generated_tokens += 1
            if request.params.logprobs:
                request.logprobs[j].append(logprobs[row_of[seq.seq_id]])
            request.texts[j] += request.detokenizers[j].step(token_id)
            if seq.is_finished:
                request.texts[j] += request.detokenizers[j].flush()
            self._apply_stop_strings(request, j, seq)
            if seq.is_finished and request.finish_reasons[j] is None:
                request.finish_reasons[j] = seq.finish_reason
            moved[request.request_id] = request

        outputs = [
            self._make_output(request, delta=True)
            for request in moved.values()
            if not only_finished or request.finished
        ]
        for request in moved.values():
            if request.finished:
                self._retire(request)
        self.timings["postprocess"] += time.perf_counter() - t3
        return outputs

    def _add_sample(self, request: _Request, seq: Sequence, sample_idx: int) -> None:
        assert len(request.seqs) == sample_idx, "samples join a request in order"
        request.seqs.append(seq)
        request.detokenizers.append(self.tokenizer.detokenizer(seq.prompt_token_ids))
        request.texts.append("")
        request.finish_reasons.append(None)
        request.logprobs.append([])
        request.sent_tokens.append(0)
        request.sent_text.append(0)
        self._seq_owner[seq.seq_id] = (request, sample_idx)

    def _row(self, logits_row: int, request: _Request, sample_idx: int, seq: Sequence) -> RowSpec:
        p = request.params
        return RowSpec(
            row_idx=logits_row, temperature=p.temperature, top_k=max(p.top_k, 0), top_p=p.top_p,
            min_p=p.min_p, seed=seed_for(request.seed, sample_idx), step=seq.num_output_tokens,
        )

    def _apply_stop_strings(self, request: _Request, sample_idx: int, seq: Sequence) -> None:
        stops = request.params.stop
        if not stops or seq.num_output_tokens < request.params.min_tokens:
            return
        text = request.texts[sample_idx]
        # Only the tail can hold a stop string that this token completed.
        window = max(len(s) for s in stops) + 16
        start = max(0, len(text) - window)
        hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
        if not hits:
            return
        request.texts[sample_idx] = text[: min(hits)]
        request.finish_reasons[sample_idx] = "stop"
        if not seq.is_finished:
            self.scheduler.finish(seq, "stop")

    def _make_output(self, request: _Request, *, delta: bool) -> RequestOutput:
        completions = []
        for j, seq in enumerate(request.seqs):
            text = request.texts[j]
            tokens = list(seq.output_token_ids)
            completions.append(CompletionOutput(
                index=j, text=text, token_ids=tokens, finish_reason=request.finish_reasons[j],
                logprobs=list(request.logprobs[j]) if request.params.logprobs else None,
                delta_text=text[request.sent_text[j]:] if delta else "",
                delta_token_ids=tokens[request.sent_tokens[j]:] if delta else [],
            ))
            if delta:
                request.sent_text[j] = len(text)
                request.sent_tokens[j] = len(tokens)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=completions, num_cached_tokens=request.seqs[0].num_cached_tokens,
        )

    def _retire(self, request: _Request) -> None:
        self._requests.pop(request.request_id, None)
        for seq in request.seqs:
            self._seq_owner.pop(seq.seq_id, None)

    def _log_step(self, out) -> None:
        decodes = sum(1 for n in out.num_new_tokens if n == 1)
        logger.debug(
            "step %d: %d seqs (%d decode, %d prefill chunks), %d tokens; seqs=%s",
            self._num_steps, len(out.seqs), decodes, len(out.seqs) - decodes, out.num_batched_tokens,
            [(s.seq_id, n, len(s.block_table)) for s, n in zip(out.seqs, out.num_new_tokens)][:16],
        )
        for seq in out.preempted:
            logger.debug("  preempted seq %d (%d tokens will be recomputed)", seq.seq_id, len(seq.token_ids))
        if out.copies:
            logger.debug("  copy-on-write page copies: %s", out.copies)
        stats = self.block_manager.stats()
        logger.debug("  pages: %s", stats)

    # ---------------------------------------------------------------- utilities

    def warmup(self) -> None:
        """Compiles every step bucket and the sampler for each, so serving never compiles."""
        self.runner.warmup()
        for num_rows in sorted({min(b, self.config.max_num_seqs) for b in self.runner.buckets}):
            logits = self.runner.zeros_logits(num_rows)  # placed as real logits are: no recompile later
            rows = [RowSpec(row_idx=0, temperature=1.0, top_k=2, top_p=0.9, seed=0, step=0)]
            jax.block_until_ready(sample(logits, make_sampling_arrays(rows, num_rows)))

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def update_params(self, params) -> None:
        """Swaps the model weights (same shapes) without recompiling; drops K/V cached under the old ones."""
        if self._requests:
            raise ValueError(
                f"{len(self._requests)} requests are in flight; finish or abort them before update_params "
                "(their cached K/V were computed with the old weights)"
            )
        self.runner.update_params(params)
        self.block_manager.reset_prefix_cache()

    def stats(self) -> dict:
        bm = self.block_manager.stats()
        bm = bm if isinstance(bm, dict) else dataclasses.asdict(bm)
        sched = self.scheduler.stats() if hasattr(self.scheduler, "stats") else {}
        return {
            **bm,
            **(sched if isinstance(sched, dict) else dataclasses.asdict(sched)),
            "num_generated_tokens": self._num_generated_tokens,
            "num_steps": self._num_steps,
            "num_compiles": self.runner.num_compiles,
        }

