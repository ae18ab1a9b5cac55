"""Time floors of one compiled step on each chip: HBM bytes, kernel launches, NVLink. All estimates.

    bytes floor (ms)         HBM bytes / the chip's HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s)
    launch-aware floor (ms)  bytes floor + launches x PER_LAUNCH_S
    NVLink floor (ms)        each collective's bus bytes / the chip's NVLink bandwidth one way (450 GB/s:
                             NVLink 4's 900 GB/s per GPU counts both directions); bus bytes of a payload
                             S over N devices, as NCCL's bus bandwidth counts them: all-reduce
                             2 (N-1)/N S, all-gather / reduce-scatter / all-to-all (N-1)/N S

PER_LAUNCH_S is the one constant of the launch term: what each kernel or copy on the stream costs
beyond its bytes (the launch, the tail of a small grid, the gap to the next kernel). 2 us is an
estimate for kernels replayed from a CUDA graph on a Hopper GPU (XLA captures the whole step in
command buffers when it can: `command_buffers` in the profile's rows); no GPU run has calibrated it
yet. Calibrate it from a measured step: (measured ms - bytes floor ms) / launches.
"""

from __future__ import annotations

PER_LAUNCH_S = 2.0e-6  # seconds per kernel / copy on the stream: an ESTIMATE, not yet calibrated on a GPU

# Bus bytes per payload byte of a collective over n devices (NCCL's "bus bandwidth" convention).
_BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
               "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
               "ragged-all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0}


def bus_bytes(opcode: str, payload: int, num_devices: int) -> float:
    """Bytes one device sends over NVLink for a collective whose per-device result is `payload`."""
    if num_devices <= 1:
        return 0.0
    kind = opcode.removesuffix("-start")
    if kind not in _BUS_FACTOR:
        raise ValueError(f"no bus-bytes rule for collective {opcode!r}; add one to floors._BUS_FACTOR")
    return _BUS_FACTOR[kind](num_devices) * payload


def floors(hbm_bytes: int, ideal_bytes: int, launches: int, target, nvlink_bytes: float = 0.0) -> dict:
    """The step's floors on `target` (a target.H100Target: H100 or H200), in ms, rounded for a table."""
    bytes_ms = hbm_bytes / target.hbm_bandwidth * 1e3
    return {
        "bytes_floor_ms": round(bytes_ms, 4),
        "launch_floor_ms": round(bytes_ms + launches * PER_LAUNCH_S * 1e3, 4),
        "ideal_floor_ms": round(ideal_bytes / target.hbm_bandwidth * 1e3, 4),
        "nvlink_floor_ms": round(nvlink_bytes / target.nvlink_bandwidth * 1e3, 4),
    }
