"""Data parallelism: `data_parallel_size` whole engines, each on its own devices, behind one engine API.

    LLM ──► DataParallelEngine ──add_request──► a replica chosen by EngineConfig.data_parallel_routing
                                                 (engine/prefix_routing.py; default: the fewest unfinished)
                                ──step──────────► every busy replica, concurrently (one thread each)
            replica r: an LLMEngine on devices [r * tp, (r + 1) * tp) (a tp mesh, tp >= 1)

For throughput when the model fits one device (or one tensor-parallel group). Replicas share
nothing: each has its own planner, page pool and prefix cache. A request stays on the replica it
was given to. Request ids are this engine's; each replica's own ids never leave it.

A request's output does not depend on which replica serves it: seeds of requests that give none
are drawn here, in arrival order, from `EngineConfig.seed`, exactly as one engine draws them.
"""

from __future__ import annotations

import dataclasses
import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxpaged.engine import weights
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxpaged.engine.engine import LLMEngine
from jaxpaged.engine.outputs import RequestOutput
from jaxpaged.engine.prefix_routing import ReplicaRouter
from jaxpaged.planner.request import SEED_MASK, SamplingParams


# Counters without the num_ prefix: token and byte totals add up across replicas too.
SUMMED_STATS = frozenset({"prefix_query_tokens", "prefix_hit_tokens", "prefix_hit_tokens_device",
                          "prefix_hit_tokens_host", "swap_bytes_out", "swap_bytes_in"})


class DataParallelEngine:
    """`EngineClient` (engine/protocol.py) over several replicas (data_parallel_size > 1)."""

    def __init__(self, engines: list[LLMEngine]):
        if len(engines) < 2:
            raise ValueError(f"a DataParallelEngine needs >= 2 replicas, got {len(engines)}; use the LLMEngine")
        self.engines = engines
        self.config = engines[0].config
        self.model_config = engines[0].model_config
        self.tokenizer = engines[0].tokenizer
        self.kv_bytes_per_page = engines[0].kv_bytes_per_page
        self._route: dict[str, tuple[int, str]] = {}  # our request id -> (replica index, replica's id)
        self._reverse: dict[tuple[int, str], str] = {}
        self._request_counter = itertools.count()
        self._seed_rng = np.random.default_rng(self.config.seed)  # drawn as one LLMEngine draws
        self._pool = ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="jaxpaged-replica")
        # Which replica each request goes to (engine/prefix_routing.py); "prefix" tolerates a replica
        # holding up to one batch more requests than the least loaded before it balances instead.
        self._router = ReplicaRouter(self.config.data_parallel_routing, len(engines), self.config.page_size,
                                     max_imbalance=self.config.max_num_seqs)

    @property
    def params(self):
        """Replica 0's weights (every replica holds the same, on its own devices)."""
        return self.engines[0].params

    # ---------------------------------------------------------------- requests

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.engines[0].validate_prompt(prompt_token_ids)

    def _load(self, replica_idx: int) -> int:
        return sum(1 for r, _ in self._route.values() if r == replica_idx)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None, *,
                    prompt: str | None = None, request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Queues a request on the least-loaded replica (fewest unfinished requests; ties: lowest index)."""
        params = params or SamplingParams()
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._seed_rng.integers(0, SEED_MASK)))
        return self._add(request_id, lambda engine: engine.add_request(
            prompt_token_ids, params, prompt=prompt, cache_salt=cache_salt), prompt_token_ids, cache_salt)

    def add_beam_request(self, prompt_token_ids: list[int], params: BeamSearchParams, *, prompt: str | None = None,
                         request_id: str | None = None) -> str:
        """Queues a beam search on the least-loaded replica: a search runs whole on one replica."""
        return self._add(request_id, lambda engine: engine.add_beam_request(prompt_token_ids, params, prompt=prompt),
                         prompt_token_ids, None)

    def _add(self, request_id: str | None, add, prompt_token_ids: list[int], cache_salt) -> str:
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self._route:
            raise ValueError(f"request id {request_id!r} is already in use; pass a new one or None")
        loads = [self._load(r) for r in range(len(self.engines))]
        replica_idx = self._router.choose(prompt_token_ids, cache_salt, loads)
        inner_id = add(self.engines[replica_idx])
        self._route[request_id] = (replica_idx, inner_id)
        self._reverse[(replica_idx, inner_id)] = request_id
        return request_id

    @property
    def generation_defaults(self) -> dict:
        """The replicas' (one model, one generation_config)."""
        return self.engines[0].generation_defaults

    def abort_request(self, request_id: str) -> None:
        route = self._route.pop(request_id, None)
        if route is not None:
            del self._reverse[route]
            self.engines[route[0]].abort_request(route[1])

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines)

    def has_request(self, request_id: str) -> bool:
        route = self._route.get(request_id)
        return route is not None and self.engines[route[0]].has_request(route[1])

    @property
    def num_unfinished_requests(self) -> int:
        return sum(e.num_unfinished_requests for e in self.engines)

    @property
    def num_generated_tokens(self) -> int:
        return sum(e.num_generated_tokens for e in self.engines)

    # ---------------------------------------------------------------- stepping

    def step(self, *, only_finished: bool = False) -> list[RequestOutput | BeamSearchOutput]:
        """One step of every replica that has work, run concurrently; outputs in replica order."""
        busy = [r for r, e in enumerate(self.engines) if e.has_unfinished_requests()]
        futures = [(r, self._pool.submit(self.engines[r].step, only_finished=only_finished)) for r in busy]
        outputs = []
        for replica_idx, future in futures:
            for output in future.result():
                request_id = self._reverse.get((replica_idx, output.request_id))
                if request_id is None:  # aborted meanwhile
                    continue
                if isinstance(output, BeamSearchOutput) or output.finished:
                    del self._route[request_id], self._reverse[(replica_idx, output.request_id)]
                outputs.append(dataclasses.replace(output, request_id=request_id))
        return outputs

    # ---------------------------------------------------------------- state

    def warmup(self) -> None:
        for engine in self.engines:
            engine.warmup()

    def update_params(self, params, *, version: int | str | None = None, in_flight: str = "keep") -> None:
        """Every replica, in turn (each validates first: a bad tree fails on replica 0, changing nothing)."""
        for engine in self.engines:
            engine.update_params(params, version=version, in_flight=in_flight)

    @property
    def weight_version(self) -> int | str:
        return self.engines[0].weight_version

    def set_weight_version(self, version: int | str) -> None:
        for engine in self.engines:
            engine.set_weight_version(version)

    def abort_all_requests(self) -> int:
        return sum(engine.abort_all_requests() for engine in self.engines)  # outputs: the next step(), routed back

    def sleep(self, level: int = 1) -> None:
        if self.has_unfinished_requests():  # checked here so no replica sleeps while another refuses
            raise ValueError(f"{self.num_unfinished_requests} requests are in the engine; finish or abort them "
                             "before sleep")
        for engine in self.engines:
            engine.sleep(level)

    def wake_up(self) -> None:
        for engine in self.engines:
            engine.wake_up()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return weights.reset_prefix_cache(self.engines, reset_running_requests)  # every replica, or none

    def page_ref_counts(self) -> dict[int, int]:
        merged: dict[int, int] = {}
        for engine in self.engines:
            for ref_count, num_pages in engine.page_ref_counts().items():
                merged[ref_count] = merged.get(ref_count, 0) + num_pages
        return merged

    def stats(self) -> dict:
        """Counts (`num_*` and SUMMED_STATS) summed over replicas, other numbers averaged; `replicas`
        holds each one's."""
        per_replica = [e.stats() for e in self.engines]
        merged: dict = {}
        for key, value in per_replica[0].items():
            values = [s[key] for s in per_replica]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                merged[key] = value
            elif key.startswith("num_") or key in SUMMED_STATS:
                merged[key] = sum(values)
            else:
                merged[key] = sum(values) / len(values)
        # Ratios of the whole, from the summed counts (not the mean of each replica's ratio).
        merged["prefix_hit_rate"] = merged["prefix_hit_tokens"] / max(1, merged["prefix_query_tokens"])
        merged["usage"] = merged["num_used_pages"] / max(1, merged["num_pages"])
        merged["replicas"] = per_replica
        return merged
