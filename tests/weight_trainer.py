"""A trainer in its own JAX process (tests/test_weight_transfer.py spawns it): reads a checkpoint's
weights, changes them (`changed`), and pushes them into a server's engine through vLLM's
weight-sync routes with the jax_transfer backend: JSON control, array bytes pulled by the engine.

    python -m tests.weight_trainer CHECKPOINT_DIR BASE_URL WEIGHT_VERSION   (from the repository root)
"""

import glob
import os
import sys

import numpy as np


def changed(name: str, array: np.ndarray) -> np.ndarray:
    """The 'trained' weights: a fixed change of every tensor, the same bits in any process."""
    return (np.roll(array, 1, axis=-1) * np.float32(1.25) + np.float32(0.01)).astype(array.dtype)


def checkpoint_weights(directory: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    weights = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        weights.update(load_file(path))
    return weights


def main(directory: str, base_url: str, weight_version: str) -> None:
    import jax.numpy as jnp

    from jaxpaged.rl import HTTPWeightSyncClient, TrainerWeightTransfer

    new = {name: jnp.asarray(changed(name, array)) for name, array in checkpoint_weights(directory).items()}
    sender = TrainerWeightTransfer("127.0.0.1:0")
    client = HTTPWeightSyncClient(base_url, timeout=120)
    client.init_weight_transfer_engine({"init_info": sender.init_info()})
    sender.send_weights(client, new, kind="weights", weight_version=weight_version, chunk_bytes=64 * 1024)
    print(f"sent {sender.num_bytes_offered} bytes", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
