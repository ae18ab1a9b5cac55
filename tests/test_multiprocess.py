"""Two processes on this machine (jax.distributed, gloo CPU collectives, coordinator on 127.0.0.1)
serve one tensor-parallel engine over their 2 + 2 devices; the greedy tokens equal one process's."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tp_fixtures import greedy, prompts, tiny_params

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multidevice", "two_process_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_one_tensor_parallel_engine_equal_one_process():
    port = _free_port()
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
    assert result["num_compiles"] == 1  # one bucket, compiled at warm-up, never again
