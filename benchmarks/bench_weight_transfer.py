"""Weight sync across processes (entrypoints/weight_transfer.py, backend "jax_transfer"): seconds per
sync and bytes moved at Qwen3-0.6B's shapes (random weights, bfloat16 as Qwen3 ships them), trainer
and engine in two processes on this machine, 127.0.0.1.

    python -m benchmarks.bench_weight_transfer [--syncs 3] [--dtype bfloat16] \
        [--json benchmarks/results/weight_transfer_cpu.json]

The trainer child draws the parameter tree (jaxpaged's, kind "params") and offers all of it once per
sync; this process holds an engine with the same shapes and, per sync, pulls every leaf
(`TransferReceiver.pull`: the bytes over TCP into arrays) and applies them (`params_from_leaves` +
`engine.update_params`, between two steps as `finish_weight_update` does). The control lines
(init_info, update_info) go over the child's stdin/stdout as JSON; they are not timed. The first
sync includes the connection's set-up. Then, as a baseline, the same bytes sent raw on one TCP
socket into preallocated numpy buffers (the child converts its leaves to host arrays first, untimed).
A SHA-256 of the embedding's bytes from the trainer is checked
against the engine's copy after each sync.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import environment, format_table
from benchmarks.workloads import QWEN3_0_6B_SHAPES


def model_config(dtype: str):
    from jaxpaged.models.config import ModelConfig

    return ModelConfig(**{**QWEN3_0_6B_SHAPES, "dtype": dtype})


def digest(array) -> str:
    return hashlib.sha256(np.asarray(array).tobytes()).hexdigest()


def trainer(dtype: str) -> None:
    """The child: offers its whole tree once per line read from stdin."""
    import jax

    from jaxpaged.models.llama import init_params
    from jaxpaged.rl import TrainerWeightTransfer, leaves_by_path

    leaves = leaves_by_path(init_params(model_config(dtype), jax.random.key(1)))
    jax.block_until_ready(leaves)
    sender = TrainerWeightTransfer("127.0.0.1:0")
    embedding = next(v for k, v in leaves.items() if "embed" in k)
    print(json.dumps({"init_info": sender.init_info(), "embedding_sha256": digest(embedding)}), flush=True)
    host_leaves = None
    for line in sys.stdin:
        if line.startswith("socket"):  # the baseline: every leaf's bytes on one TCP connection
            import socket

            host_leaves = host_leaves or [np.asarray(v) for v in leaves.values()]
            with socket.create_connection(("127.0.0.1", int(line.split()[1]))) as conn:
                for array in host_leaves:
                    conn.sendall(memoryview(array.view(np.uint8).reshape(-1)))
            print("{}", flush=True)
        else:
            print(json.dumps(sender.offer(leaves, kind="params")), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        return trainer(args.dtype)

    import jax
    import jax.numpy as jnp

    from jaxpaged.config import EngineConfig
    from jaxpaged.device.backends import attention_fn
    from jaxpaged.engine.build import engine_from_parts
    from jaxpaged.entrypoints.weight_transfer import TransferReceiver, params_from_leaves
    from jaxpaged.models.llama import init_params
    from jaxpaged.models.loading import default_model_path
    from jaxpaged.models.tokenizer import Tokenizer
    from jaxpaged.rl import leaves_by_path

    child = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_weight_transfer", "--trainer", "--dtype",
                              args.dtype], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        config = model_config(args.dtype)
        engine_config = EngineConfig(page_size=16, num_pages=64, max_num_seqs=4, max_num_batched_tokens=64,
                                     max_model_len=256, warmup=False).resolved(on_gpu=False, model_max_len=256)
        engine = engine_from_parts(config, init_params(config, jax.random.key(0)),
                                   Tokenizer.from_gguf(default_model_path()), engine_config,
                                   num_pages=engine_config.num_pages, attention_fn=attention_fn("chunked"))
        hello = json.loads(child.stdout.readline())
        receiver = TransferReceiver()
        receiver.init({"init_info": hello["init_info"]})
        rows = []
        for sync in range(args.syncs):
            child.stdin.write("offer\n")
            child.stdin.flush()
            info = json.loads(child.stdout.readline())
            t0 = time.perf_counter()
            _, leaves = receiver.pull(info)
            t1 = time.perf_counter()
            engine.update_params(params_from_leaves(engine.params, leaves), version=f"sync-{sync}", in_flight="keep")
            jax.block_until_ready(engine.params)
            t2 = time.perf_counter()
            embedding = next(v for k, v in leaves_by_path(engine.params).items() if "embed" in k)
            assert digest(embedding) == hello["embedding_sha256"], "the engine's embedding is not the trainer's"
            num_bytes = sum(int(np.prod(shape)) * jnp.dtype(name).itemsize
                            for shape, name in zip(info["shapes"], info["dtype_names"]))
            rows.append({"sync": sync, "num_arrays": len(info["names"]), "bytes": num_bytes,
                         "pull_s": round(t1 - t0, 3), "apply_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3),
                         "pull_GB_per_s": round(num_bytes / (t1 - t0) / 1e9, 3)})
            print(format_table([rows[-1]], [(k, k) for k in rows[-1]]), flush=True)
        baseline = []
        for _ in range(args.syncs):
            baseline.append(socket_baseline(child, info))
            print(f"baseline: raw bytes on one socket into numpy buffers {baseline[-1]} s", flush=True)
    finally:
        child.stdin.close()
        child.wait(60)
    result = {
        "what": "weight sync trainer process -> engine process, jax_transfer backend, 127.0.0.1 (measured on this "
                "machine's CPU)",
        "model": "Qwen3-0.6B shapes, random weights", "dtype": args.dtype, "kind": "params (jaxpaged tree paths)",
        "environment": environment(), "rows": rows,
        "steady_state_total_s": round(float(np.median([r["total_s"] for r in rows[1:] or rows])), 3),
        "baseline_socket_s": baseline,
        "baseline": "the same bytes as one TCP stream (socket.sendall of each leaf, recv_into preallocated numpy "
                    "buffers), no JAX transport: what the pull costs over the wire alone",
    }
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def socket_baseline(child, info) -> float:
    """Seconds to receive every leaf's bytes over one 127.0.0.1 socket into preallocated buffers."""
    import socket

    import jax.numpy as jnp

    buffers = [np.empty(int(np.prod(shape)) * jnp.dtype(name).itemsize, np.uint8)
               for shape, name in zip(info["shapes"], info["dtype_names"])]
    with socket.create_server(("127.0.0.1", 0)) as server:
        child.stdin.write(f"socket {server.getsockname()[1]}\n")
        child.stdin.flush()
        conn, _ = server.accept()
        with conn:
            t0 = time.perf_counter()
            for buffer in buffers:
                view, got = memoryview(buffer), 0
                while got < len(buffer):
                    got += conn.recv_into(view[got:])
            elapsed = time.perf_counter() - t0
    child.stdout.readline()
    return round(elapsed, 3)


if __name__ == "__main__":
    main()
