"""Where a benchmark's figures were taken (`environment`), and how they are printed and plotted.

The figures themselves are computed by jaxpaged/baseline/measure.py, the same way for every system.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess

import numpy as np

from jaxpaged.baseline.measure import Run


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


def write_report(report: dict, path: str) -> None:
    """`report` as indented JSON at `path`, its folder made if need be."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


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


def h100_child_rows(module: str, flags: list[str], out_dir: str, name: str) -> list:
    """The rows `python -m module *flags --child-out F` writes, run in the H100 toolchain's Python
    (jaxpaged/static_profile/target.py: only that process sees the CUDA plugin); F, a scratch file
    `.<name>.child.json` under out_dir, is removed once read."""
    from jaxpaged.static_profile.target import run_in_h100_python

    child_out = os.path.join(out_dir, f".{name}.child.json")
    run_in_h100_python(["-m", module, *flags, "--child-out", child_out])
    with open(child_out) as f:
        rows = json.load(f)
    os.remove(child_out)
    return rows
