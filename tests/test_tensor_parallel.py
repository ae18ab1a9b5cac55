"""Tensor parallelism. The mesh tests need 8 devices, which JAX fixes when it is first imported, so
they live in tests/multidevice/ and run here in their own pytest process with
`--xla_force_host_platform_device_count=8`; this process keeps its single CPU device."""

import os
import subprocess
import sys

import pytest

from jaxpaged.config import EngineConfig
from jaxpaged.models.config import ModelConfig
from jaxpaged.device.sharding import kv_head_replicas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_multidevice(marker: str, timeout: int,
                     modules=("test_tensor_parallel_mesh.py", "test_expert_parallel_mesh.py",
                              "test_gguf_blocks_replicas.py")) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAXPAGED_MULTIDEVICE="1",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
         *[os.path.join("tests", "multidevice", m) for m in modules]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_mesh_suite_on_eight_host_devices():
    """tp 2/4/8 greedy equality, real shardings, activation-only collectives, no compiles after warm-up,
    data_parallel_size=2 equal to one replica, MoE expert parallelism over 4 and 8 devices, and GGUF
    block codes (quantization="gguf") on two replicas."""
    proc = _run_multidevice("not slow", timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_data_parallel_entry_points_on_forced_host_devices():
    """tests/multidevice/test_data_parallel_entrypoints.py: LLM / CLI / server with data_parallel_size=2, and
    batch_invariant=True giving the same bits on either replica."""
    proc = _run_multidevice("not slow", timeout=900, modules=("test_data_parallel_entrypoints.py",))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "4 passed" in proc.stdout and "failed" not in proc.stdout


def test_update_params_reshards_from_a_trainer_mesh_on_eight_host_devices():
    """tests/multidevice/test_reshard_params.py: weights on a 2-device mesh update a tp=4 engine."""
    proc = _run_multidevice("not slow", timeout=600, modules=("test_reshard_params.py",))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.mark.slow
def test_slow_mesh_tests_on_eight_host_devices():
    proc = _run_multidevice("slow", timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # SmolLM2 tp=3, W1 on 2 replicas of tp 1 and of tp 2, quantized KV caches (int8 tp 2, fp8 tp 4)
    assert "5 passed" in proc.stdout


def _config(num_heads, num_kv_heads):
    return ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=4)


def test_kv_head_replicas_and_unsplittable_models():
    assert kv_head_replicas(_config(9, 3), 3) == 1  # SmolLM2-135M at tp=3
    assert kv_head_replicas(_config(8, 4), 2) == 1
    assert kv_head_replicas(_config(8, 4), 8) == 2  # each KV head on two devices
    assert kv_head_replicas(_config(8, 1), 8) == 8
    with pytest.raises(ValueError, match="num_heads=9 is not divisible by tensor_parallel_size=2"):
        kv_head_replicas(_config(9, 3), 2)
    with pytest.raises(ValueError, match="num_kv_heads=6 is not divisible"):
        kv_head_replicas(_config(12, 6), 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_head_replicas(_config(24, 4), 6)


def test_engine_config_rejects_non_positive_parallel_sizes():
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        EngineConfig(data_parallel_size=0)


def test_cli_tensor_parallel_size_beyond_devices_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.generate", "--prompt", "hi", "--tensor-parallel-size", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "tensor_parallel_size=2 needs 2 devices but only 1 are visible" in proc.stderr
