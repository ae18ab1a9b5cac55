"""What every benchmark of BENCHMARKS.md reports, computed the same way for every system.

A run is a list of `StepSample`s (one per device step, taken right after it) plus, per request,
when its first token and its last token came back. From those `summarize` derives throughput,
TTFT / time per output token, KV waste, concurrency and where the host spent its time;
`live_tokens` counts the tokens whose K/V a set of running sequences holds (a shared page once);
`CompileCounter` counts XLA compilations during the timed part. benchmarks/common.py says where the
figures were taken (`environment`) and prints and plots them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PHASES = ("schedule", "prepare", "device", "postprocess")


@dataclasses.dataclass
class StepSample:
    t: float  # seconds since the run started, taken after the step
    kind: str  # "prefill" (the step computes prompt tokens) or "decode" (one token per sequence)
    num_output_tokens: int  # tokens sampled this step that the requests keep
    num_computed_tokens: int  # real tokens computed (prompt chunks + decodes), padding excluded
    num_running: int  # sequences holding KV memory after the step
    num_live_tokens: int  # tokens whose K/V those sequences hold
    num_allocated_tokens: int  # KV slots reserved for them (pages in use x page_size, or reserved rows)
    phases: dict[str, float]  # host seconds of this step per phase (see PHASES)


@dataclasses.dataclass
class RequestTimes:
    num_output_tokens: int = 0
    first_token: float | None = None  # seconds since the run started
    finish: float | None = None


@dataclasses.dataclass
class Run:
    """One system on one workload: what `summarize` turns into the reported figures."""

    system: str
    workload: str
    wall_s: float
    num_prompt_tokens: int
    steps: list[StepSample]
    requests: list[RequestTimes]
    kv_capacity_tokens: int  # the KV budget in tokens (for the utilisation plot)
    num_compiles: int = 0  # XLA compilations during the timed part
    extra: dict = dataclasses.field(default_factory=dict)  # preemptions, hit rate, outputs equal, ...


def percentile(values, q: int | float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(run: Run) -> dict:
    """The BENCHMARKS.md figures of one run, as a flat JSON-able dict."""
    num_out = sum(r.num_output_tokens for r in run.requests)
    ttft = [r.first_token for r in run.requests]
    tpot = [
        (r.finish - r.first_token) / (r.num_output_tokens - 1)
        for r in run.requests
        if r.finish is not None and r.first_token is not None and r.num_output_tokens > 1
    ]
    # KV waste, weighted by how long each step's memory state lasted.
    durations = np.diff([0.0] + [s.t for s in run.steps]) if run.steps else np.zeros(0)
    live = np.array([s.num_live_tokens for s in run.steps], float)
    allocated = np.array([s.num_allocated_tokens for s in run.steps], float)
    waste = 1.0 - float((durations * live).sum() / max((durations * allocated).sum(), 1e-12)) if run.steps else None
    phases = {p: sum(s.phases.get(p, 0.0) for s in run.steps) for p in PHASES}
    host = {p: phases[p] for p in ("schedule", "prepare", "postprocess")}
    by_kind = {}
    for kind in sorted({s.kind for s in run.steps}):
        steps = [s for s in run.steps if s.kind == kind]
        seconds = {p: sum(s.phases.get(p, 0.0) for s in steps) for p in PHASES}
        total = sum(seconds.values())
        by_kind[kind] = {
            "num_steps": len(steps),
            "seconds": round(total, 4),
            **{f"{p}_share": round(seconds[p] / total, 4) if total else None for p in PHASES},
        }
    return {
        "system": run.system,
        "workload": run.workload,
        "wall_s": round(run.wall_s, 4),
        "num_requests": len(run.requests),
        "num_prompt_tokens": run.num_prompt_tokens,
        "num_output_tokens": num_out,
        "output_tok_s": round(num_out / run.wall_s, 2),
        "total_tok_s": round((num_out + run.num_prompt_tokens) / run.wall_s, 2),
        "ttft_median_s": _round(percentile(ttft, 50)),
        "ttft_p99_s": _round(percentile(ttft, 99)),
        "tpot_median_s": _round(percentile(tpot, 50)),
        "tpot_p99_s": _round(percentile(tpot, 99)),
        "kv_waste_pct": _round(100 * waste if waste is not None else None, 2),
        "peak_running": max((s.num_running for s in run.steps), default=None),
        "num_steps": len(run.steps),
        "num_compiles_timed": run.num_compiles,
        # Share of the wall time the host spends outside the device call, per phase, and the
        # device call itself (dispatch + compute + reading the sampled tokens back).
        "host_share": {p: round(v / run.wall_s, 4) for p, v in host.items()} if run.steps else None,
        "host_share_total": round(sum(host.values()) / run.wall_s, 4) if run.steps else None,
        "device_share": round(phases["device"] / run.wall_s, 4) if run.steps else None,
        "by_step_kind": by_kind,
        **run.extra,
    }


def _round(x, digits: int = 5):
    return None if x is None else round(float(x), digits)


class CompileCounter:
    """Counts XLA compilations (lowerings to an HLO module) while active; `with` it around a run."""

    _EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",)

    def __init__(self):
        self.count = 0

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event in self._EVENTS:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._listen)


def live_tokens(running, page_size: int) -> int:
    """Tokens with K/V in the pages of the running sequences, each shared page counted once."""
    held: dict[int, int] = {}  # page id -> tokens it holds
    for seq in running:
        computed = seq.num_computed_tokens
        for i, page_id in enumerate(seq.block_table[: -(-computed // page_size)]):
            held[page_id] = max(held.get(page_id, 0), min(page_size, computed - i * page_size))
    return sum(held.values())
