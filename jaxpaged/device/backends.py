"""The attention backend an engine runs, chosen by name (EngineConfig.attention_backend).

    "reference"  plain jnp, reads every slot a block table can address (the oracle; ops/attention.py)
    "chunked"    jnp over the pages the batch's longest context needs (the CPU default); on the CPU,
                 C++ kernels where they can be built (ops/cpu_attention.py)
    "pallas"     the Triton-backend Pallas kernels over the whole KV buffer (the GPU default)
    "mosaic"     the Hopper (wgmma/TMA) Mosaic GPU kernels, bfloat16 pages only

Interpret mode follows the target. `platform=None`: the Triton kernels choose at lowering
(compiled when the step is lowered for a GPU, interpreted otherwise: pallas_kernels._common.by_target),
the Mosaic kernels by the host's backend (their interpreter cannot be lowered conditionally). An
explicit `platform` ("cuda", "cpu", ...) fixes both, e.g. to compile the engine's step for an H100
from a CPU machine (jaxpaged/static_profile/step_profile.py).
"""

from __future__ import annotations

import functools


def gpu_auto_backend(model_config, config, *, compute_capability: str, triton_available: bool | None = None) -> str:
    """What `attention_backend="auto"` runs on a GPU (DESIGN.md, "Attention backends").

    "pallas" (Triton) while JAX ships it: on the H100 static profile, Mosaic's decode step is not at least
    Triton's in every decode bucket (benchmarks/bench_backends_static.py). Without Triton (a feature test,
    pallas_kernels.jax_compat): "mosaic" where it can serve (a Hopper GPU, compute capability 9.x: wgmma;
    bfloat16 pages; head_dim 64/128/256; no sliding window), else "chunked" (XLA's ops).
    """
    if triton_available is None:
        from pallas_kernels.jax_compat import TRITON_COMPILER_PARAMS

        triton_available = TRITON_COMPILER_PARAMS is not None
    if triton_available:
        return "pallas"
    mosaic_serves = (str(compute_capability).startswith("9.") and config.dtype == "bfloat16"
                     and config.kv_cache_dtype == "auto" and model_config.head_dim in (64, 128, 256)
                     and all(w is None for w in model_config.layer_windows))
    return "mosaic" if mosaic_serves else "chunked"


def attention_fn(backend: str, *, platform: str | None = None, batch_invariant: bool = False):
    """The attention function of `backend`; `platform` (of the devices the step is compiled for)
    fixes the Pallas kernels' interpret mode: compiled for "cuda"/"gpu", interpreted for any other.
    `batch_invariant` (EngineConfig.batch_invariant): one kernel for every step ("chunked" on the CPU:
    the ragged kernel, decode-only steps included; device/batch_invariant.py checks what runs)."""
    if batch_invariant:
        from jaxpaged.device.batch_invariant import invariant_attention_fn

        return invariant_attention_fn(backend, platform)
    fn = _attention_fn(backend)
    if platform is None or backend not in ("pallas", "mosaic"):
        return fn
    fixed = functools.partial(fn, interpret=platform not in ("cuda", "gpu"))
    for attr in ("reads_whole_kv_buffer", "has_decode_kernel", "effects_when_interpreted"):  # what the model
        # and the runner read off a backend
        if hasattr(fn, attr):
            setattr(fixed, attr, getattr(fn, attr))
    return fixed


def _attention_fn(backend: str):
    if backend == "reference":
        from jaxpaged.ops.attention import reference_paged_attention

        return reference_paged_attention
    if backend == "chunked":
        from jaxpaged.ops import cpu_attention
        from jaxpaged.ops.attention import chunked_paged_attention_from_buffer

        kernels = cpu_attention.enabled_kernels()  # C++ kernels on the CPU (ops/cpu/*_attention.cc)
        if kernels:
            return cpu_attention.with_cpu_kernels(chunked_paged_attention_from_buffer, kernels)
        return chunked_paged_attention_from_buffer
    if backend == "mosaic":  # Hopper wgmma/TMA kernels, whole-buffer form; GPU interpret mode elsewhere
        from pallas_kernels.mosaic import paged_attention_from_buffer

        return paged_attention_from_buffer  # the decode kernel in decode-only steps, else the ragged one
    if backend == "pallas":
        import pallas_kernels

        # The whole-buffer kernels (no per-layer pool copies), the decode kernel in decode-only steps;
        # interpret=None: compiled on a GPU, interpreted elsewhere.
        return pallas_kernels.paged_attention_from_buffer
    raise ValueError(f"attention_backend={backend!r}: resolve 'auto' first (EngineConfig.resolved)")
