"""Every difference between the JAX versions the project runs on (0.10.2 to 0.12.x), in one place.

Each entry is a feature test or an API both versions have, never a version number:

- `TRITON_COMPILER_PARAMS`: Pallas's Triton backend (`jax.experimental.pallas.triton`), deprecated
  from JAX 0.11 ("migrate to the Mosaic GPU backend"); None where JAX no longer ships it.
- `InterpretGPUParams`: Mosaic GPU interpret mode's parameters, public from JAX 0.11.1.
- `cuda_target(device_kind)`: lowering for a CUDA GPU from a host without one. From JAX 0.12 the
  Triton lowering asks for the GPU's kind (its compute capability) while lowering, and a CPU host
  has none: it must come from the abstract device of `jax.sharding.use_abstract_mesh`, which JAX
  0.10.2 already has (and ignores there). An abstract mesh with no axes changes no sharding.
- `jax_paged_attention_module()`: JAX's own `pallas.ops.gpu.paged_attention` (the kernels' peer in
  benchmarks), deprecated from JAX 0.12 and importable without its warning while JAX ships it.

Mosaic GPU's `plgpu.transpose_ref(ref, perm)` (deprecated in 0.12) needs no entry: `ref.transpose(perm)`
is what it always called, on every version.
"""

import warnings

import jax

try:  # deprecated from JAX 0.11, possibly absent later
    from jax.experimental.pallas import triton as _pallas_triton

    TRITON_COMPILER_PARAMS = _pallas_triton.CompilerParams
except ImportError:  # pragma: no cover - depends on the installed JAX
    TRITON_COMPILER_PARAMS = None

from jax.experimental.pallas import mosaic_gpu as _plgpu

try:  # JAX >= 0.11.1
    InterpretGPUParams = _plgpu.InterpretGPUParams
except AttributeError:  # JAX 0.10.x: only under jax._src
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

# The kind an H100 SXM reports (and the H100 static profile's target description names).
H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


def cuda_target(device_kind: str = H100_DEVICE_KIND, num_cores: int | None = None):
    """Context manager: programs traced and lowered inside it target a CUDA GPU of `device_kind`
    (e.g. `.lower(lowering_platforms=("cuda",))` or a deviceless compile on a CPU host)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def jax_paged_attention_module():
    """`jax.experimental.pallas.ops.gpu.paged_attention`, or None where this JAX has none."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*ops\.gpu\.paged_attention is deprecated", category=DeprecationWarning)
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention
        except ImportError:  # pragma: no cover - depends on the installed JAX
            return None
    return paged_attention

