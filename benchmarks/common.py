"""What every benchmark of BENCHMARKS.md reports, computed the same way for every system.

A run is a list of `StepSample`s (one per device step, taken right after it) plus, per request,
when its first token and its last token came back. From those `summarize` derives throughput,
TTFT / time per output token, KV waste, concurrency and where the host spent its time; `CompileCounter`
counts XLA compilations during the timed part; `environment` says where the figures were taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import subprocess

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


def percentile(values, q: float) -> float | None:
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


@contextlib.contextmanager
def environment_variables(env: dict[str, str]):
    """`env` set in os.environ inside the block, the previous values (or their absence) restored after:
    a setting's variables while its engine is built (e.g. JAXPAGED_CPU_KERNELS, read at engine build)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def git_commit() -> str | None:
    """HEAD, with "-dirty" when jaxpaged/ or benchmarks/ differ from it (paths from the repository root:
    run from benchmarks/, the pathspecs had named benchmarks/jaxpaged and benchmarks/benchmarks)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jaxpaged", "benchmarks"], cwd=root,
                               capture_output=True, text=True, check=True)
        return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    import jax

    device = jax.devices()[0]
    return {
        "device": f"{device.platform}: {getattr(device, 'device_kind', '')}",
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: `columns` is [(header, key)], missing values print as '-'."""

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    cells = [[cell(row.get(key)) for _, key in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) for (h, _), w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def plot_runs(runs: list[Run], path: str, title: str) -> None:
    """Two panels over wall time: output throughput (tokens/s, smoothed) and KV utilisation.

    Utilisation is live tokens over the KV budget: what fraction of the memory holds K/V that a
    running sequence still needs.
    """
    try:
        import matplotlib
    except ImportError:  # a GPU machine may have only what jaxpaged needs: the JSON still gets written
        print(f"matplotlib is not installed: no plot {path}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tput, ax_kv) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for run in runs:
        if not run.steps:
            continue
        t = np.array([s.t for s in run.steps])
        tokens = np.cumsum([s.num_output_tokens for s in run.steps])
        # Throughput over a sliding window of ~5% of the run (at least one step).
        window = max(run.wall_s * 0.05, 1e-9)
        start_idx = np.searchsorted(t, t - window)
        before = np.where(start_idx > 0, tokens[np.maximum(start_idx - 1, 0)], 0)
        t_before = np.where(start_idx > 0, t[np.maximum(start_idx - 1, 0)], 0.0)
        rate = (tokens - before) / np.maximum(t - t_before, 1e-9)
        ax_tput.plot(t, rate, label=f"{run.system} ({tokens[-1] / run.wall_s:.0f} tok/s overall)")
        util = np.array([s.num_live_tokens for s in run.steps]) / run.kv_capacity_tokens
        ax_kv.step(t, 100 * util, where="post", label=run.system)
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title(title)
    ax_tput.legend(fontsize=8)
    ax_kv.set_ylabel("KV budget holding live tokens (%)")
    ax_kv.set_xlabel("wall time (s)")
    ax_kv.set_ylim(0, 105)
    ax_kv.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
