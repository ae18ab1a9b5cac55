"""The engine: plan a step on the host while the device runs the previous one.

    add_request ──► Scheduler.add ──► waiting (or waiting for its grammar)

    step() k:  Scheduler.schedule()            host: which sequences compute which tokens
               StepRunner.run                  host KV moves; StepInput (placeholders as rows); the
                                                 jitted step and the sampler, dispatched: decodes read
                                                 their input token from step k-1's sampled tokens,
                                                 still on the device
               RequestLifecycle.advance        host: placeholders for step k's tokens; n > 1 forks
               ── step k-1's tokens are read back here, while the device runs step k ──
               RequestLifecycle.commit(k-1)    host: fill placeholders, stop rules, RequestOutputs

Outputs arrive one step late: step() returns what became known in that call, and is called until
has_unfinished_requests() is False (the last call drains the step still in flight). A sequence that
turns out finished when its token lands has computed at most one more token, which is discarded.
With `EngineConfig(async_scheduling=False)` each step is committed right after its own dispatch
(the same code, no lag): for debugging, and as the benchmark's comparison. A feature whose next
step needs this one's tokens on the host (beams, grammars, speculation) commits it at once too.

Optional features (speculative decoding, beam search, structured outputs, routed experts) plug in
through `StepFeature` (engine/features.py): the step calls its hooks and names none of them.
The engine owns the requests (through the output processor: a request is n samples); the
scheduler owns the sequences' states and pages. Everything runs on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import numpy as np

from jaxpaged.config import EngineConfig, strict_json_schemas
from jaxpaged.device.kv_cache import bytes_per_page, host_page_counts, split_swap_space
from jaxpaged.device.kv_transfer import HostKVStore, HostStateStore
from jaxpaged.device.runner import ModelRunner, compile_in_parallel
from jaxpaged.device.step_runner import StepResult, StepRunner
from jaxpaged.engine.adapters import LoRAAdapters
from jaxpaged.engine.beam_search import BeamSearch, BeamSearches, BeamSearchOutput, BeamSearchParams, check_beam_request
from jaxpaged.engine.lifecycle import RequestLifecycle
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.outputs import RequestOutput
from jaxpaged.engine.routed_experts import routed_experts_recorder
from jaxpaged.engine.step_log import log_step
from jaxpaged.engine.structured_requests import StructuredRequests
from jaxpaged.engine.weights import WeightLifecycle, reset_prefix_cache
from jaxpaged.models.gguf_blocks import has_kept_weights
from jaxpaged.models.qwen3_next import state_bytes_per_slot
from jaxpaged.planner.prefix_cache import versioned_salt
from jaxpaged.planner.request import SEED_MASK, SamplingParams, check_prompt_token_ids, request_params
from jaxpaged.planner.scheduler import make_scheduler
from jaxpaged.planner.sequence import Sequence
from jaxpaged.planner.state_pool import num_snapshot_slots, refuse_hybrid_features
from jaxpaged.sample.step_sampler import StepSampler
from jaxpaged.spec_decode.speculator import Speculator, verification_buckets

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
        num_state_slots = num_host_state_slots = 0
        if model_config.is_hybrid:  # Qwen3-Next: a state pool beside the pages (planner/state_pool.py)
            for warning in refuse_hybrid_features(config):
                logger.warning(warning)
            num_state_slots = config.max_num_seqs
        self.kv_bytes_per_page = page_bytes = bytes_per_page(model_config, config.page_size, config.kv_cache_dtype)
        if model_config.is_hybrid and config.swap_space_bytes:  # swapped states come out of the swap space
            num_host_state_slots, swap_page_bytes = split_swap_space(config, state_bytes_per_slot(model_config))
            num_swap_pages, num_host_cache_pages = host_page_counts(
                dataclasses.replace(config, swap_space_bytes=swap_page_bytes), page_bytes)
        else:
            num_swap_pages, num_host_cache_pages = host_page_counts(config, page_bytes)
        self.scheduler = make_scheduler(  # every layer local (Mistral): pages behind the window are freed
            config, num_pages=num_pages, num_swap_pages=num_swap_pages, num_host_cache_pages=num_host_cache_pages,
            sliding_window=model_config.sliding_window if model_config.all_layers_local else None,
            num_state_slots=num_state_slots, num_host_state_slots=num_host_state_slots)
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
            batch_invariant=bool(config.batch_invariant),  # device/batch_invariant.py
            lora=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,  # device/lora_slots.py
            # the running slots, then the prefix cache's state snapshots (planner/state_pool.py)
            num_state_slots=num_state_slots + (num_snapshot_slots(config) if num_state_slots else 0),
        )
        self.processor = OutputProcessor(tokenizer)
        self.timings = {"schedule": 0.0, "prepare": 0.0, "device": 0.0, "postprocess": 0.0}
        num_host_pages = num_swap_pages + num_host_cache_pages
        # The optional features of the step (engine/features.py), each None when off, called in this order.
        self.routed = self.processor.routed_experts = routed_experts_recorder(config, model_config, num_pages,
                                                                               num_host_pages)
        self.spec = Speculator.create(config, self.runner, draft_model, attention_fn, mesh, num_host_pages,
                                      scheduler=self.scheduler, owner=self.processor.owner)
        self.structured = StructuredRequests(tokenizer, model_config.vocab_size, self.scheduler, self.processor,
                                             strict_json=strict_json_schemas(config.structured_outputs_config),
                                             compile_timeout_s=config.grammar_compile_timeout_s)
        sampler = StepSampler(self.runner, config.max_num_seqs, model_config.vocab_size, config.logprobs_mode)
        self.beams = BeamSearches(self.scheduler, tokenizer, sampler.beam_candidates)
        self.lora = LoRAAdapters(  # multi-LoRA (engine/adapters.py); None unless enable_lora
            model_config, self.runner.lora, self.scheduler, max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras or config.max_loras) if config.enable_lora else None
        self.features = [f for f in (self.routed, self.spec, self.structured, self.beams, self.lora) if f is not None]
        self.host_kv = HostKVStore(self.runner, num_host_pages)
        self.host_states = HostStateStore(self.runner, num_host_state_slots) if num_host_state_slots else None
        self.step_runner = StepRunner(self.runner, self.host_kv, sampler, max_num_seqs=config.max_num_seqs,
                                      features=self.features, timings=self.timings, host_states=self.host_states)
        self.lifecycle = RequestLifecycle(self.scheduler, self.processor, sampler, self.features, self.timings)
        self.weights = WeightLifecycle(  # version, epoch, sleep level, aborted outputs (engine/weights.py)
            self.runner, self.scheduler, self.processor, keeps_gguf_codes=has_kept_weights(params),
            draft_runner=self.spec.draft.runner if self.spec is not None and self.spec.draft is not None else None,
            beam_searches=self.beams)
        self._in_flight: StepResult | None = None  # dispatched, tokens not yet read (asynchronous scheduling)
        self._request_counter = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        if config.warmup:
            self.warmup()

    @property
    def block_manager(self):
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
        lora_request=None,
    ) -> str:
        self.validate_prompt(prompt_token_ids)
        params = request_params(params, self.config.max_logprobs, self.generation_eos_ids, self.model_config.vocab_size)
        lora_int_id, adapter_salt = self._adapter(lora_request)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pass a unique request_id")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, SEED_MASK))
        seq = Sequence(
            [int(t) for t in prompt_token_ids], params,
            cache_salt=versioned_salt(cache_salt, self.weights.epoch, adapter_salt),
            eos_token_id=self.tokenizer.eos_token_id, lora_int_id=lora_int_id,
        )
        if params.structured_outputs is None:
            self.scheduler.add(seq)  # raises ValueError (and queues nothing) if it can never run
        else:  # validates the spec (ValueError); the sequence waits in the scheduler until its grammar compiled
            self.structured.hold(request_id, seq, params.structured_outputs)
        self.processor.add_request(request_id, prompt, seq, params, seed, self.weights.version)
        return request_id

    def add_beam_request(
        self, prompt_token_ids: list[int], params: BeamSearchParams, *, prompt: str | None = None,
        request_id: str | None = None, lora_request=None,
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
        lora_int_id, adapter_salt = self._adapter(lora_request)
        seq = Sequence(
            [int(t) for t in prompt_token_ids],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),  # the search stops it
            cache_salt=versioned_salt(None, self.weights.epoch, adapter_salt), lora_int_id=lora_int_id,
        )
        self.block_manager.open_fork_group(seq, params.beam_width)  # a hybrid model: the beams' k state slots
        try:
            self.scheduler.add(seq)
        except ValueError:
            self.block_manager.close_fork_group(seq)
            raise
        self.beams.add(BeamSearch(request_id, prompt, seq, params, max_tokens, stop_ids))
        return request_id

    def _adapter(self, lora_request) -> tuple[int, tuple[int, int] | None]:
        """(lora_int_id, its prefix-cache salt part) of a request's adapter; (0, None): the base model."""
        if lora_request is None:
            return 0, None
        if self.lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True (and max_loras, max_lora_rank)")
        lora_int_id = self.lora.resolve(lora_request)
        return lora_int_id, self.lora.salt_part(lora_int_id)

    # vLLM's LoRA management (LLMEngine.add_lora / remove_lora / list_loras)
    def add_lora(self, lora_request) -> bool:
        """Loads an adapter (ValueError if bad; nothing changes); a known lora_int_id has its weights
        replaced in place, without recompiling (engine/adapters.py)."""
        if self.lora is None:
            raise ValueError("add_lora needs an engine started with enable_lora=True")
        return self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else set(self.lora.requests)

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
        return self.lifecycle.num_generated_tokens

    # ---------------------------------------------------------------- the step

    def step(self, *, only_finished: bool = False) -> list[RequestOutput | BeamSearchOutput]:
        """Plans and dispatches one step, then commits the previous one; returns the outputs that
        became known (for every request that got tokens), one step late under async scheduling.

        `only_finished=True` returns outputs only for requests that finished: building a snapshot
        copies every moved request's tokens, which offline generation does not need.
        """
        outputs = self.weights.take_aborted_outputs()  # of update_params(in_flight="abort")
        t0 = time.perf_counter()
        for feature in self.features:
            outputs += feature.before_schedule(self.scheduler)
        out = self.scheduler.schedule()
        for feature in self.features:
            feature.after_schedule(out)
        self.timings["schedule"] += time.perf_counter() - t0
        if out.seqs and logger.isEnabledFor(logging.DEBUG):
            log_step(logger, self.step_runner.num_steps + 1, out, self.block_manager.stats())
        step = self.step_runner.run(out, self.processor.owner, self._in_flight)  # None: nothing scheduled
        if step is not None:
            self.lifecycle.advance(step)

        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            outputs += self.lifecycle.commit(previous, only_finished)
        if step is not None:
            if self._keeps_in_flight(step):
                self._in_flight = step
            else:  # synchronous, a feature needs its tokens, or nothing left to overlap with (the drain)
                outputs += self.lifecycle.commit(step, only_finished)
        elif previous is None and not outputs and self.has_unfinished_requests():
            raise RuntimeError("the scheduler scheduled nothing while requests are waiting; this is a bug")
        return outputs

    def _keeps_in_flight(self, step: StepResult) -> bool:
        """Whether `step` stays on the device while the next one is planned (asynchronous scheduling)."""
        return (self.config.async_scheduling and step.fits_next_input and self.has_unfinished_requests()
                and not any(feature.commits_at_once(step) for feature in self.features))

    # ---------------------------------------------------------------- utilities

    def warmup(self) -> None:
        """Compiles every step bucket and the sampler for each, so serving never compiles.

        The step and sampler programs are first compiled side by side on threads (compile_in_parallel:
        the steps lowered ahead of time, the sampler run on zeros), then every warm-up call runs once,
        in order, and finds its program compiled; what the parallel pass missed the call compiles
        itself, so the guarantee does not rest on it."""
        compile_in_parallel(self.runner.compile_jobs() + self.step_runner.sampler.warmup_jobs(self.config.max_num_seqs))
        self.runner.warmup(host_transfers=self.host_kv.num_host_pages > 0)
        self.step_runner.sampler.warmup(self.config.max_num_seqs)
        for feature in self.features:
            feature.warmup(self.runner, self.step_runner.sampler)  # speculation: the verification steps' programs

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:  # vLLM's (engine/weights.py)
        return reset_prefix_cache([self], reset_running_requests)

    def update_params(self, params, *, version: int | str | None = None, in_flight: str = "keep") -> None:
        """New weights (a copy; same tree and shapes, any sharding), no recompiling, between two steps;
        requests in flight are kept, recomputed or aborted (engine/weights.py)."""
        self.weights.update_params(params, version=version, in_flight=in_flight)

    @property
    def weight_version(self) -> int | str:
        """The label of the weights tokens are sampled under now (update_params' version)."""
        return self.weights.version

    def set_weight_version(self, version: int | str) -> None:
        """Relabels the current weights (no weight changes): vLLM's update_weight_version."""
        self.weights.set_version(version)

    def abort_all_requests(self) -> int:
        """Finishes every request now with finish_reason "abort" (their final outputs come out of the next
        step()) and drops every beam search; returns how many requests were finished."""
        for search_id in list(self.beams.searches):
            self.abort_request(search_id)
        for request_id in list(self.processor.requests):
            self.structured.abort(request_id)
        return self.weights.abort_running()

    def sleep(self, level: int = 1) -> None:
        """Frees the KV pool; weights to host (1) or dropped (2). Only with no request in the engine."""
        if self.has_unfinished_requests():
            raise ValueError(f"{self.num_unfinished_requests} requests are in the engine; finish or abort them "
                             "before sleep (their K/V live in the pool that sleep frees)")
        self.weights.sleep(level)

    def wake_up(self) -> None:  # undoes sleep(); after level 2, update_params brings the weights
        self.weights.wake_up()

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
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.step_runner.num_steps,
            "num_compiles": self.runner.num_compiles,
            "weight_version": self.weights.version, "sleep_level": self.weights.sleep_level,
            # device -> host: swaps (a hybrid model's states too) and host-tier stores
            "swap_bytes_out": self.host_kv.num_bytes_out + (self.host_states.num_bytes_out if self.host_states else 0),
            # host -> device: swaps and host-tier hits
            "swap_bytes_in": self.host_kv.num_bytes_in + (self.host_states.num_bytes_in if self.host_states else 0),
            **{key: value for feature in self.features for key, value in feature.stats().items()},
        }
