"""`EngineClient`: the one interface every caller of an engine uses.

`LLM`, the command line and the server talk to an engine through these members and nothing else;
`LLMEngine` (one engine) and `DataParallelEngine` (several, each on its own devices) implement them.
A caller that needs something more adds it here and to both, never reaches into one of them.

    add_request / add_beam_request ──► step() ... step() ──► RequestOutput | BeamSearchOutput
    abort_request (any time, pages freed)       stats(), page_ref_counts() (observation)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from jaxpaged.config import EngineConfig
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxpaged.engine.outputs import RequestOutput
from jaxpaged.planner.request import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig  # resolved: no None defaults left
    model_config: object  # jaxpaged.models.config.ModelConfig
    tokenizer: object  # jaxpaged.models.tokenizer.Tokenizer
    generation_defaults: dict  # SamplingParams fields the model's generation_config sets (EngineConfig.generation_config)
    kv_bytes_per_page: int  # bytes of one KV page, all layers, K and V (scales included when quantized)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for a prompt the engine can never serve (RuntimeError while asleep); queues nothing."""

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, prompt: str | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Queues a request; returns its id (given, or made here). ValueError if it can never run."""

    def add_beam_request(self, prompt_token_ids: list[int], params: BeamSearchParams, *, prompt: str | None = None,
                         request_id: str | None = None) -> str:
        """Queues a beam search; its BeamSearchOutput comes out of step() when it ends."""

    def abort_request(self, request_id: str) -> None:
        """Stops a request or search now and frees its pages; unknown or finished ids are ignored."""

    def has_unfinished_requests(self) -> bool: ...

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` is still in the engine (not finished, not aborted)."""

    @property
    def num_unfinished_requests(self) -> int: ...

    @property
    def num_generated_tokens(self) -> int: ...

    def step(self, *, only_finished: bool = False) -> list[RequestOutput | BeamSearchOutput]:
        """One step; the outputs that became known (only finished requests' if `only_finished`)."""

    def warmup(self) -> None: ...

    def stats(self) -> dict:
        """Counters and gauges: pages, prefix cache, scheduler, tokens, compiles, `num_requests`."""

    def page_ref_counts(self) -> dict[int, int]:
        """{ref count: number of pages in use with it}."""

    @property
    def params(self):
        """The weights the engine runs."""

    def update_params(self, params, *, version: int | str | None = None, in_flight: str = "keep") -> None:
        """New weights of the same shapes (any sharding), without recompiling, between two steps;
        running requests are kept / recomputed / aborted per `in_flight` (engine/weights.py);
        tokens sampled from now on carry `version` (default: the current one + 1). Clears the prefix cache."""

    @property
    def weight_version(self) -> int | str:
        """The label of the weights tokens are sampled under now."""

    def set_weight_version(self, version: int | str) -> None:
        """Relabels the current weights without changing them (vLLM's update_weight_version)."""

    def abort_all_requests(self) -> int:
        """Finishes every request with finish_reason "abort" (final outputs: the next step()); drops beam
        searches; returns how many requests were finished."""

    def sleep(self, level: int = 1) -> None:
        """No request in the engine: frees the KV pool; weights to host memory (1) or dropped (2)."""

    def wake_up(self) -> None:
        """Undoes sleep(); after level 2, update_params must bring weights before requests are added."""

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forgets every cached page; with reset_running_requests, running requests are recomputed."""
