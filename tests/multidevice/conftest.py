"""Tests that need several devices. They run in their own pytest process (started by
tests/test_tensor_parallel.py) because the device count is fixed when jax is first imported, and
the rest of the suite must keep the default single CPU device."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
