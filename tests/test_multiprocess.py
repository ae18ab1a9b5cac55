"""Two processes on this machine (jax.distributed, gloo CPU collectives, coordinator on 127.0.0.1)
serve one tensor-parallel engine over their 2 + 2 devices; the greedy tokens equal one process's."""

import json
import os
import subprocess
import sys

import pytest

from serve_fixtures import free_port
from tp_fixtures import greedy, prompts, tiny_params

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multidevice", "two_process_worker.py")


def test_two_processes_one_tensor_parallel_engine_equal_one_process():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, WORKER, str(port), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    result = json.loads(next(line for line in outs[0][0].splitlines() if line.startswith("RESULT "))[7:])

    want, _ = greedy(tiny_params(), prompts())
    assert result["tokens"] == want
    assert result["kv_heads"] == 4
    whole = sum(result["local_kv_bytes"]) * 2  # process 0 holds 2 of the 4 KV-head shards
    assert len(result["local_kv_bytes"]) == 2 and set(result["local_kv_bytes"]) == {whole // 4}
    # every bucket (the token bucket and the decode buckets) compiled once at warm-up, never again
    assert result["num_compiles"] == result["num_step_programs"]


@pytest.mark.slow
def test_cli_three_processes_smollm2_tp3_equal_one_process():
    """README's multi-host recipe on one machine: three `python -m jaxpaged.generate` processes, one
    CPU device each, split SmolLM2-135M over its 3 KV heads; process 0 prints what one process prints."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--prompt", "What is the capital of France?", "--max-tokens", "12", "--json", "--max-model-len", "128",
            "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.generate", *args, "--tensor-parallel-size", "3",
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "3", "--process-id", str(i)],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    single = subprocess.run([sys.executable, "-m", "jaxpaged.generate", *args], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-4000:]

    def records(stdout):  # JSON lines only (gloo prints its own status lines on stdout)
        return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]

    assert records(outs[0][0]) == records(single.stdout) and len(records(single.stdout)) == 1
    assert all(records(out) == [] for out, _ in outs[1:])  # only process 0 prints
