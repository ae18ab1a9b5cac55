"""Prometheus metrics, every one declared once here, names `jaxpaged_<thing>_<unit>`.

Two kinds:

- Events the bridge sees (tokens, per-request latencies, step time): counters and histograms updated
  as they happen.
- Engine state (the page pool, the queues): the engine thread publishes a snapshot of
  `engine.stats()` after every step (`publish`), and a collector turns the latest snapshot into
  metric families at scrape time. The scrape never touches the engine, which only its thread calls.

Queueing, as vLLM reports it: `jaxpaged_requests_waiting` (vllm:num_requests_waiting, sequences
queued for admission, preempted ones included) beside `jaxpaged_requests_running`, and
`jaxpaged_request_queue_time_seconds` (vllm:request_queue_time_seconds: arrival to first admission).

Derived figures, each computed here and nowhere else:
  usage ratio = used pages / usable pages;  KV bytes in use = used pages * bytes per page;
  fragmentation = 1 - live slots / (used pages * page_size)  (the unfilled tails of last pages).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_REF_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32)


class ServerMetrics:
    def __init__(self, *, page_size: int, bytes_per_page: int, registry: CollectorRegistry | None = None,
                 model_name: str = "jaxpaged"):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.page_size = page_size
        self.model_name = model_name
        self.bytes_per_page = bytes_per_page
        self._snapshot: dict = {}
        self._published_at = float("-inf")
        self.published_at_unix = 0.0  # wall-clock time of the last snapshot (vllm:lora_requests_info's value)
        self._lock = threading.Lock()

        r = self.registry
        self.prompt_tokens = Counter("jaxpaged_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("jaxpaged_generation_tokens", "Generated tokens", registry=r)
        self.time_to_first_token = Histogram(
            "jaxpaged_time_to_first_token_seconds", "Admission to first output token",
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.time_per_output_token = Histogram(
            "jaxpaged_time_per_output_token_seconds", "Mean time per output token after the first, per request",
            buckets=_TOKEN_BUCKETS_S, registry=r)
        self.e2e_latency = Histogram(
            "jaxpaged_e2e_request_latency_seconds", "Admission to last output token",
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_time = Histogram(
            "jaxpaged_request_queue_time_seconds",
            "Time a request waited for its first admission to the running batch (vllm:request_queue_time_seconds)",
            buckets=_LATENCY_BUCKETS_S, registry=r)
        self.step_duration = Histogram(
            "jaxpaged_step_duration_seconds", "Wall time of one engine step (host + device)",
            buckets=_TOKEN_BUCKETS_S, registry=r)
        # vLLM's names (v1 engine, labels model_name and engine), so its dashboards and alerts read
        # jaxpaged unchanged; each is updated with its jaxpaged_* twin.
        labels = dict(labelnames=["model_name", "engine"], registry=r)
        self._vllm_labels = (model_name, "0")
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", **labels)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", **labels)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                   buckets=_LATENCY_BUCKETS_S, **labels)
        self.vllm_tpot = Histogram("vllm:request_time_per_output_token_seconds", "Mean time per output token, per request",
                                   buckets=_TOKEN_BUCKETS_S, **labels)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                                  buckets=_LATENCY_BUCKETS_S, **labels)
        self.vllm_queue_time = Histogram("vllm:request_queue_time_seconds", "Time in the waiting queue",
                                         buckets=_LATENCY_BUCKETS_S, **labels)
        self.vllm_request_success = Counter("vllm:request_success", "Finished requests, by finish reason",
                                            labelnames=["model_name", "engine", "finished_reason"], registry=r)
        r.register(_EngineStateCollector(self))

    # ---------------------------------------------------------------- bridge (event) side

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)
        self.vllm_prompt_tokens.labels(*self._vllm_labels).inc(n)

    def add_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self.vllm_generation_tokens.labels(*self._vllm_labels).inc(n)

    def observe_queue_time(self, seconds: float) -> None:
        self.queue_time.observe(seconds)
        self.vllm_queue_time.labels(*self._vllm_labels).observe(seconds)

    # ---------------------------------------------------------------- engine thread

    # Busy engines publish at most this often: the snapshot walks the page pool (ref-count histogram,
    # live slots), O(num_pages), too much for every few-millisecond GPU step of a large pool.
    publish_interval_s = 0.1

    def publish(self, engine, *, force: bool = True) -> None:
        """Snapshot the engine's state for the next scrape (called by the engine thread only).

        `force=False` (after a busy step) skips the snapshot if the last one is younger than
        `publish_interval_s`; the engine thread forces one whenever the engine falls idle.
        """
        now = time.monotonic()
        if not force and now - self._published_at < self.publish_interval_s:
            return
        self._published_at = now
        self.published_at_unix = time.time()
        snapshot = dict(engine.stats())
        snapshot["ref_count_histogram"] = engine.page_ref_counts()
        with self._lock:
            self._snapshot = snapshot

    def step_done(self, seconds: float) -> None:
        self.step_duration.observe(seconds)

    def request_done(self, arrival: float, first_token: float | None, end: float, num_tokens: int,
                     finish_reason: str | None = None) -> None:
        vllm = self._vllm_labels
        self.e2e_latency.observe(end - arrival)
        self.vllm_e2e.labels(*vllm).observe(end - arrival)
        if finish_reason is not None:
            self.vllm_request_success.labels(*vllm, finish_reason).inc()
        if first_token is not None:
            self.time_to_first_token.observe(first_token - arrival)
            self.vllm_ttft.labels(*vllm).observe(first_token - arrival)
            if num_tokens > 1:
                self.time_per_output_token.observe((end - first_token) / (num_tokens - 1))
                self.vllm_tpot.labels(*vllm).observe((end - first_token) / (num_tokens - 1))

    # ---------------------------------------------------------------- scrape side

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._snapshot)


class _EngineStateCollector:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        s = self.metrics.snapshot()
        if not s:
            return
        num_used = s["num_used_pages"]
        allocated_slots = num_used * self.metrics.page_size

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("jaxpaged_kv_pages_total", "Usable KV pages (page 0, the padding page, excluded)", s["num_pages"])
        yield gauge("jaxpaged_kv_pages_free", "KV pages free (some may still cache a prefix)", s["num_free_pages"])
        yield gauge("jaxpaged_kv_pages_used", "KV pages held by requests", num_used)
        yield gauge("jaxpaged_kv_usage_ratio", "Used / usable KV pages", num_used / max(1, s["num_pages"]))
        yield gauge("jaxpaged_kv_used_bytes", "KV memory in pages held by requests", num_used * self.metrics.bytes_per_page)
        yield gauge("jaxpaged_kv_fragmentation_ratio", "Share of allocated KV slots holding no live token",
                    1.0 - s.get("num_live_slots", allocated_slots) / allocated_slots if allocated_slots else 0.0)
        yield counter("jaxpaged_kv_page_allocations", "Fresh KV pages handed out", s.get("num_page_allocations", 0))
        yield counter("jaxpaged_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                      s.get("prefix_query_tokens", 0))
        yield counter("jaxpaged_prefix_cache_hit_tokens", "Prompt tokens whose K/V the prefix cache held",
                      s.get("prefix_hit_tokens", 0))
        yield counter("jaxpaged_prefix_cache_host_hit_tokens", "Of the hit tokens, those brought back from the host tier",
                      s.get("prefix_hit_tokens_host", 0))
        yield counter("jaxpaged_preemptions", "Sequences preempted (pages freed: recomputed, or swapped to host)",
                      s.get("num_preemptions", 0))
        yield counter("jaxpaged_swaps_out", "Preemptions by swap: a sequence's KV pages copied to host memory",
                      s.get("num_swaps_out", 0))
        if "num_spec_draft_tokens" in s:  # speculative decoding (jaxpaged/spec_decode/)
            yield counter("jaxpaged_spec_decode_draft_tokens", "Proposed tokens verified", s["num_spec_draft_tokens"])
            yield counter("jaxpaged_spec_decode_accepted_tokens", "Proposed tokens accepted",
                          s["num_spec_accepted_tokens"])
            yield gauge("jaxpaged_spec_decode_acceptance_ratio", "Accepted / proposed tokens", s["spec_acceptance_rate"])
            yield gauge("jaxpaged_spec_decode_mean_accepted_length",
                        "New tokens per verified sequence per step (accepted + 1)", s["spec_mean_accepted_length"])
            # vLLM's SpecDecodingProm names, so dashboards written for vLLM read these unchanged.
            yield counter("vllm:spec_decode_num_drafts", "Proposals verified (a sequence in a step)",
                          s["num_spec_verified"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified", s["num_spec_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                          s["num_spec_accepted_tokens"])
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens at each proposal position", labels=["position"])
            prefix = "num_spec_accepted_tokens_pos"
            for pos in sorted(int(k.removeprefix(prefix)) for k in s if k.startswith(prefix)):
                per_pos.add_metric([str(pos)], s[f"{prefix}{pos}"])
            yield per_pos
        yield gauge("jaxpaged_requests_running", "Sequences holding pages (vllm:num_requests_running)",
                    s.get("num_running", 0))
        yield gauge("jaxpaged_requests_waiting", "Sequences waiting for admission (vllm:num_requests_waiting)",
                    s.get("num_waiting", 0))

        # The same state under vLLM's names and labels.
        label_values = [self.metrics.model_name, "0"]

        def vllm(kind, name, doc, value):
            family = kind(name, doc, labels=["model_name", "engine"])
            family.add_metric(label_values, value)
            return family

        yield vllm(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch", s.get("num_running", 0))
        yield vllm(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting", s.get("num_waiting", 0))
        yield vllm(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full",
                   num_used / max(1, s["num_pages"]))
        yield vllm(CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens",
                   s.get("prefix_query_tokens", 0))
        yield vllm(CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix-cache hits, in tokens",
                   s.get("prefix_hit_tokens", 0))
        yield vllm(CounterMetricFamily, "vllm:num_preemptions", "Preemptions", s.get("num_preemptions", 0))
        if "max_lora" in s:  # vLLM's: one sample whose labels name the adapters in use, its value the time
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                                     labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
            info.add_metric([s["running_lora_adapters"], str(s["max_lora"]), s["waiting_lora_adapters"]],
                            self.metrics.published_at_unix)
            yield info

        # Snapshot distribution of ref counts over used pages (a page shared by k sequences counts k).
        hist = s.get("ref_count_histogram", {})
        buckets = [(str(bound), sum(n for r, n in hist.items() if r <= bound)) for bound in _REF_COUNT_BUCKETS]
        yield HistogramMetricFamily(
            "jaxpaged_kv_page_ref_count", "Ref counts of the KV pages in use, at the last step",
            buckets=buckets + [("+Inf", sum(hist.values()))], sum_value=sum(r * n for r, n in hist.items()))
