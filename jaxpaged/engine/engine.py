"""The engine: plan a step on the host while the device runs the previous one.

    add_request ──► Scheduler.add ──► waiting

    step() k:  Scheduler.schedule()                 host: which sequences compute which tokens
               prepare_step_input                   host: one packed int32 array (placeholders as rows)
               ModelRunner.execute, sample          device, dispatched: decodes read their input token
                                                      from step k-1's sampled tokens, still on device
               Scheduler.advance                    host: placeholders for step k's tokens; n > 1 forks
               ── step k-1's tokens are read back here, while the device runs step k ──
               Scheduler.commit(k-1)                host: fill placeholders, token-level stop rules
               OutputProcessor.process(k-1)         host: text, stop strings, RequestOutputs of k-1

Outputs arrive one step late: step() returns what became known in that call, and is called until
has_unfinished_requests() is False (the last call drains the step still in flight). A sequence that
turns out finished when its token lands has computed at most one more token, which is discarded.
With `EngineConfig(async_scheduling=False)` each step is committed right after its own dispatch
(the same code, no lag): for debugging, and as the benchmark's comparison.

The engine owns the requests (through the output processor: a request is n sequences); the
scheduler owns the sequences' states and pages. Everything runs on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import jax
import numpy as np

from jaxpaged.config import EngineConfig
from jaxpaged.device.kv_cache import bytes_per_page
from jaxpaged.device.kv_transfer import HostKVStore
from jaxpaged.device.runner import ModelRunner
from jaxpaged.device.step_input import BlockTableRows
from jaxpaged.engine.dispatched import Dispatched
from jaxpaged.engine.beam_search import BeamSearch, BeamSearches, BeamSearchOutput, BeamSearchParams, check_beam_request
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.routed_experts import routed_experts_recorder
from jaxpaged.engine.outputs import RequestOutput
from jaxpaged.engine.step_log import log_step
from jaxpaged.engine.structured_requests import StructuredRequests
from jaxpaged.engine import weights
from jaxpaged.planner.block_manager import BlockManager
from jaxpaged.planner.prefix_cache import versioned_salt
from jaxpaged.planner.request import SEED_MASK, SamplingParams, check_prompt_token_ids, request_params
from jaxpaged.planner.scheduler import Scheduler, SchedulerOutput
from jaxpaged.planner.sliding_window import SlidingWindowBlockManager
from jaxpaged.planner.sequence import Sequence
from jaxpaged.sample.logprobs import HostLogprobs, prompt_targets
from jaxpaged.sample.rows import beam_candidate_width, warmup_sampler
from jaxpaged.sample.sampler import beam_candidates
from jaxpaged.sample.step_sampler import StepSampler, fan_out_order
from jaxpaged.spec_decode.speculator import Speculator, commit_step, verification_buckets

logger = logging.getLogger("jaxpaged")


class LLMEngine:
    """Continuous-batching engine over a paged KV cache. `jaxpaged.LLM` wraps it for users.

    Implements `EngineClient` (engine/protocol.py): callers use that interface and nothing else.
    """

    def __init__(self, model_config, params, tokenizer, config: EngineConfig, *, num_pages: int, attention_fn,
                 mesh=None, draft_model=None):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        # From the model's generation_config (engine/build.py): SamplingParams defaults, and end tokens
        # besides the tokenizer's eos that stop requests unless ignore_eos (vLLM's).
        self.generation_defaults: dict = {}
        self.generation_eos_ids: tuple[int, ...] = ()
        self.kv_bytes_per_page = page_bytes = bytes_per_page(model_config, config.page_size, config.kv_cache_dtype)
        num_swap_pages = (config.swap_space_bytes or 0) // page_bytes
        num_host_cache_pages = (config.host_cache_bytes or 0) // page_bytes
        for name, value, count in (("swap_space_bytes", config.swap_space_bytes, num_swap_pages),
                                   ("host_cache_bytes", config.host_cache_bytes, num_host_cache_pages)):
            if value is not None and count == 0:
                raise ValueError(f"{name}={value} holds no page of {page_bytes} bytes; raise it")
        if (num_swap_pages or num_host_cache_pages) and jax.process_count() > 1:
            raise ValueError(
                "swap_space_bytes / host_cache_bytes keep pages in this process's memory, which a model spread "
                f"over {jax.process_count()} processes cannot gather; leave them unset (preemption_mode="
                "'recompute') when running under jax.distributed")
        # Every layer local (Mistral): pages behind the window are freed (planner/sliding_window.py).
        window = {"sliding_window": model_config.sliding_window} if model_config.all_layers_local else {}
        self.scheduler = Scheduler(
            (SlidingWindowBlockManager if window else BlockManager)(
                num_pages=num_pages, page_size=config.page_size, enable_prefix_caching=config.enable_prefix_caching,
                num_swap_pages=num_swap_pages, num_host_cache_pages=num_host_cache_pages, **window,
            ),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            preemption_mode=config.preemption_mode,
        )
        self.runner = ModelRunner(
            model_config,
            params,
            num_pages=num_pages,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            attention_fn=attention_fn, buckets=verification_buckets(config),  # None: the defaults
            mesh=mesh,  # tensor parallelism: jaxpaged/device/sharding.py
            kv_cache_dtype=config.kv_cache_dtype,  # "int8" / "float8_e4m3fn": jaxpaged/ops/kv_quant.py
            per_layer_weights=config.per_layer_weights,  # no weight copies in the step: device/layer_params.py
            return_routed_experts=config.enable_return_routed_experts,
        )
        self.processor = OutputProcessor(tokenizer)
        self.routed = self.processor.routed_experts = routed_experts_recorder(self, num_swap_pages + num_host_cache_pages)
        self.sampler = StepSampler(self.runner, config.max_num_seqs, model_config.vocab_size, config.logprobs_mode)
        self.structured = StructuredRequests(self)  # requests with structured_outputs, their grammars
        self.beams = BeamSearches()  # beam search requests (jaxpaged/engine/beam_search.py)
        self.host_kv = HostKVStore(self.runner, num_swap_pages + num_host_cache_pages)
        self.spec = Speculator.create(config, self.runner, draft_model, attention_fn, mesh,  # None when off
                                      self.host_kv.num_host_pages)
        self._block_table_rows = BlockTableRows(2 * config.max_num_seqs, self.runner.pages_per_seq)
        self._in_flight: Dispatched | None = None
        self._request_counter = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._num_generated_tokens = 0
        self._num_steps = 0
        self.weights = weights.WeightState(params)  # version, epoch, sleep level, aborted outputs (engine/weights.py)
        self.timings = {"schedule": 0.0, "prepare": 0.0, "device": 0.0, "postprocess": 0.0}
        # Tests set a list here to record ("dispatch", step) and ("readback", step) in order.
        self.events: list[tuple[str, int]] | None = None
        if config.warmup:
            self.warmup()

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def params(self):
        """The weights the engine runs (a pytree of jax arrays, placed as the engine places them)."""
        return self.runner.params

    # ---------------------------------------------------------------- requests

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """ValueError for a prompt this engine can never serve, RuntimeError while asleep; queues nothing."""
        self.weights.check_awake()
        check_prompt_token_ids(prompt_token_ids, self.model_config.vocab_size, self.config.max_model_len)

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
        params = request_params(params, self.config.max_logprobs, self.generation_eos_ids, self.model_config.vocab_size)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pass a unique request_id")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, SEED_MASK))
        seq = Sequence(
            [int(t) for t in prompt_token_ids], params, cache_salt=versioned_salt(cache_salt, self.weights.epoch),
            eos_token_id=self.tokenizer.eos_token_id,
        )
        if params.structured_outputs is None:
            self.scheduler.add(seq)  # raises ValueError (and queues nothing) if it can never run
        else:  # validates the spec (ValueError); the request waits there until its grammar compiled
            self.structured.hold(request_id, seq, params.structured_outputs)
        self.processor.add_request(request_id, prompt, seq, params, seed, self.weights.version)
        return request_id

    def add_beam_request(
        self, prompt_token_ids: list[int], params: BeamSearchParams, *, prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a beam search; its BeamSearchOutput comes out of step() when it finishes."""
        self.validate_prompt(prompt_token_ids)
        max_tokens, stop_ids = check_beam_request(
            params, len(prompt_token_ids), self.config, self.model_config.vocab_size, self.block_manager.num_pages - 1,
            self.tokenizer.eos_token_id,
        )
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.processor.requests or request_id in self.beams.searches:
            raise ValueError(f"request_id {request_id!r} is already in use; pass a unique request_id")
        seq = Sequence(
            [int(t) for t in prompt_token_ids],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),  # the search stops it
            cache_salt=versioned_salt(None, self.weights.epoch),
        )
        self.scheduler.add(seq)
        self.beams.add(BeamSearch(request_id, prompt, seq, params, max_tokens, stop_ids))
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stops a request now and frees its pages; unknown or finished ids are ignored.

        A token of it still on the device is discarded when it lands."""
        if self.beams.abort(request_id, self.scheduler):
            return
        self.structured.abort(request_id)
        request = self.processor.pop(request_id)
        if request is None:
            return
        for sample in request.samples:
            if not sample.seq.is_finished:
                self.scheduler.abort(sample.seq.seq_id)
        if request.params.structured_outputs is not None:
            self.structured.release(prefetch=False)  # its matchers and template, now

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests) or bool(self.beams) or bool(self.weights.aborted_outputs)

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` (a request or a beam search) is still in the engine."""
        return (request_id in self.processor.requests or request_id in self.beams.searches
                or any(o.request_id == request_id for o in self.weights.aborted_outputs))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.processor.requests) + len(self.beams.searches)

    @property
    def num_generated_tokens(self) -> int:
        return self._num_generated_tokens

    # ---------------------------------------------------------------- the step

    def step(self, *, only_finished: bool = False) -> list[RequestOutput | BeamSearchOutput]:
        """Plans and dispatches one step, then commits the previous one; returns the outputs that
        became known (for every request that got tokens), one step late under async scheduling.

        `only_finished=True` returns outputs only for requests that finished: building a snapshot
        copies every moved request's tokens, which offline generation does not need.
        """
        aborted, self.weights.aborted_outputs = self.weights.aborted_outputs, []  # by update_params
        t0 = time.perf_counter()
        failed = self.structured.admit(wait=not self.scheduler.has_unfinished()) if self.structured.pending else []
        out = self.scheduler.schedule() if self.spec is None else self.spec.schedule(self.scheduler)
        self.timings["schedule"] += time.perf_counter() - t0
        if out.swap_out:  # before this step's writes reuse the pages (swap-outs before swap-ins)
            self.host_kv.swap_out(out.swap_out)
        if out.swap_in:  # before this step reads them
            self.host_kv.swap_in(out.swap_in)
        if self.routed is not None:  # routed-expert rows move with their pages
            self.routed.add_swaps(out)
        dispatched = self._dispatch(out) if out.seqs else None

        previous, self._in_flight = self._in_flight, None
        outputs = failed + aborted + (self._commit(previous, only_finished) if previous is not None else [])
        if dispatched is not None:
            if self.config.async_scheduling and dispatched.next_can_read and self.has_unfinished_requests():
                self._in_flight = dispatched
            else:  # synchronous, beams, or nothing left to overlap with (the drain)
                outputs += self._commit(dispatched, only_finished)
        elif previous is None and not failed and self.has_unfinished_requests():
            raise RuntimeError("the scheduler scheduled nothing while requests are waiting; this is a bug")
        return outputs

    def _dispatch(self, out: SchedulerOutput) -> Dispatched:
        """Prepares and launches the step on the device, then advances the scheduler past it."""
        self._num_steps += 1
        if logger.isEnabledFor(logging.DEBUG):
            log_step(logger, self._num_steps, out, self.block_manager.stats())
        t0 = time.perf_counter()
        if self.spec is not None:  # the draft model's swaps, copies and proposals (before the input is read)
            self.spec.before_step(out, self.processor.owner)
        plan = out.spec_plan  # speculative verification: several logits rows per sequence
        step_input = self.runner.prepare(out, self._block_table_rows, **(self.spec.logits_rows(plan) if plan else {}))
        targets, prompt_chunks = prompt_targets(out, self.processor.owner, step_input.num_tokens)
        if targets is not None:  # some request wants prompt logprobs: the step's program that gives them
            step_input = dataclasses.replace(step_input, prompt_logprob_targets=targets)
        self.timings["prepare"] += time.perf_counter() - t0
        if out.copies:
            self.runner.copy_pages(out.copies)
        if out.preempted and self.beams:
            self.beams.forget(out.preempted)
        previous = self._in_flight
        prev_tokens = previous.tokens if previous is not None else None
        logits = self.runner.execute(step_input, prev_tokens)
        if self.spec is not None:
            self.spec.mirror(step_input, prev_tokens)  # the draft model computes the same tokens' K/V
        logits, routed = self.routed.plan(out, step_input.slot_mapping, logits) if self.routed else (logits, None)
        prompt_logprobs = None
        if targets is not None:
            logits, prompt_logprobs = logits
            for array in prompt_logprobs.values():
                array.copy_to_host_async()

        t1 = time.perf_counter()
        # Rows to sample: one per sampling sequence; a request with n > 1 draws n rows from its
        # parent's logits row at its first token, and advance() forks the parent n-1 times.
        sampled, beam_seqs = self.sampler.sample(
            out, logits, self.processor.owner, self.beams.owner,
            lambda entries, num_rows, first: self.structured.step_mask(out.seqs, entries, num_rows, first), plan)
        entries, num_rows = sampled.entries, sampled.num_rows
        candidates = None
        if beam_seqs:
            candidates = beam_candidates(  # one width, warmed up; each search reads the first it needs
                logits, num_candidates=beam_candidate_width(self.config.max_num_seqs, logits.shape[-1]))
            for array in candidates:
                array.copy_to_host_async()
        if self.events is not None:
            self.events.append(("dispatch", self._num_steps))

        children = self.scheduler.advance(out, entries)
        for child, (request, j) in zip(children, fan_out_order(out, entries, self.processor.owner)):
            self.processor.add_sample(request, child)
        if sampled.fan_out_slots:
            self.sampler.assign_children(out, entries, sampled.fan_out_slots, children)
        self.timings["postprocess"] += time.perf_counter() - t1
        return Dispatched(
            idx=self._num_steps, out=out, tokens=sampled.tokens, logprobs=sampled.logprobs,
            next_can_read=(num_rows <= self.runner.num_prev_token_rows and not beam_seqs and not sampled.constrained
                           and (self.spec is None or not self.spec.enabled(self.scheduler))),
            beam_seqs=beam_seqs, beam_candidates=candidates, prompt_logprobs=prompt_logprobs,
            prompt_chunks=prompt_chunks, spec=self.spec.verify(logits, out, self.processor.owner) if plan else None,
            routed=routed,
        )

    def _commit(self, dispatched: Dispatched, only_finished: bool) -> list[RequestOutput | BeamSearchOutput]:
        """Reads a dispatched step's tokens back (waiting for the device) and applies them."""
        t0 = time.perf_counter()
        tokens = logprobs = None
        if dispatched.tokens is not None:
            if self.events is not None:
                self.events.append(("readback", dispatched.idx))
            tokens = np.asarray(dispatched.tokens).tolist()  # waits for the device
            if dispatched.logprobs is not None:
                logprobs = HostLogprobs.read(dispatched.logprobs)
        if dispatched.routed is not None:
            self.routed.commit(dispatched.routed)
        if dispatched.prompt_chunks:
            self.processor.add_prompt_logprobs(HostLogprobs.read(dispatched.prompt_logprobs), dispatched.prompt_chunks)
        t1 = time.perf_counter()
        self.timings["device"] += t1 - t0

        update, logprobs = commit_step(self.scheduler, self.spec, dispatched, tokens, logprobs)  # spec: rollback too
        self._num_generated_tokens += len(update.appended)
        outputs, stopped = self.processor.process(update.appended, update.rows, logprobs, only_finished=only_finished)
        for seq in stopped:
            self.scheduler.finish(seq, "stop")
        self.structured.release()
        if dispatched.beam_seqs:
            beam_logprobs, beam_token_ids = (np.asarray(a) for a in dispatched.beam_candidates)
            for search in self.beams.commit(self.scheduler, dispatched.beam_seqs, beam_logprobs, beam_token_ids):
                outputs.append(search.output(self.tokenizer.decode))
        self.timings["postprocess"] += time.perf_counter() - t1
        return outputs

    # ---------------------------------------------------------------- utilities

    def warmup(self) -> None:
        """Compiles every step bucket and the sampler for each, so serving never compiles."""
        self.runner.warmup(host_transfers=self.host_kv.num_host_pages > 0)
        warmup_sampler(self.runner, self.config.max_num_seqs)
        self.sampler.warmup(self.config.max_num_seqs)
        if self.spec is not None:
            self.spec.warmup(self.runner, self.sampler)  # the verification steps' programs

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:  # vLLM's (engine/weights.py)
        return weights.reset_prefix_cache([self], reset_running_requests)

    def update_params(self, params, *, version: int | None = None, in_flight: str = "keep") -> None:
        """New weights (a copy; same tree and shapes, any sharding), no recompiling, between two steps;
        requests in flight are kept, recomputed or aborted (engine/weights.py)."""
        weights.update_params(self, params, version=version, in_flight=in_flight)

    def sleep(self, level: int = 1) -> None:  # frees the KV pool; weights to host (1) or dropped (2)
        weights.sleep(self, level)

    def wake_up(self) -> None:  # undoes sleep(); after level 2, update_params brings the weights
        weights.wake_up(self)

    def page_ref_counts(self) -> dict[int, int]:
        """{ref count: number of pages in use with it} (the server's histogram)."""
        return self.block_manager.ref_count_histogram()

    def stats(self) -> dict:
        """Pages, prefix cache, scheduler counters, tokens, steps, compiles, host transfers, and
        `num_requests` (requests and beam searches in the engine)."""
        return {
            **self.block_manager.stats(),
            **self.scheduler.stats(),
            "num_requests": self.num_unfinished_requests,
            "num_generated_tokens": self._num_generated_tokens,
            "num_steps": self._num_steps,
            "num_compiles": self.runner.num_compiles,
            "weight_version": self.weights.version, "sleep_level": self.weights.sleep_level,
            "swap_bytes_out": self.host_kv.num_bytes_out,  # device -> host: swaps and host-tier stores
            "swap_bytes_in": self.host_kv.num_bytes_in,  # host -> device: swaps and host-tier hits
            **(self.spec.stats() if self.spec is not None else {}),
        }
