"""One of two processes serving one tensor-parallel engine (started by tests/test_multiprocess.py).

    python two_process_worker.py COORDINATOR_PORT PROCESS_ID

Each process has 2 forced CPU devices; `jax.distributed` joins them into one 4-device mesh, and
both processes run the same program on the same request stream (the replicated planner, DESIGN.md).
Process 0 prints the greedy tokens as one JSON line.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax  # noqa: E402

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]  # this checkout's jaxpaged, and tests/tp_fixtures.py
from tp_fixtures import greedy, prompts, tiny_params  # noqa: E402


def main(port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    assert jax.device_count() == 4 and jax.local_device_count() == 2, (jax.device_count(), jax.local_device_count())
    from jaxpaged.device.sharding import make_mesh, per_device_bytes

    mesh = make_mesh(4)  # devices of both processes: each holds one KV head of TINY's 4
    tokens, engine = greedy(tiny_params(), prompts(), mesh=mesh)
    local = per_device_bytes(engine.runner.kv_pages)
    if process_id == 0:
        print("RESULT " + json.dumps({"tokens": tokens, "local_kv_bytes": list(local.values()),
                                      "num_compiles": engine.runner.num_compiles,
                                      "num_step_programs": engine.runner.num_step_programs,
                                      "kv_heads": engine.runner.kv_pages.shape[2]}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
