"""The H100 as a compile target on this CPU-only machine (issue 23): numbers, environment, compile.

Two processes, on purpose. The CUDA PJRT plugin lives only in the toolchain dir
(`scripts/install_h100_toolchain.sh`), never in the normal environment, so a CPU user of the
system python sees no change. Compiling happens in a child process started with `h100_env()`:

    python -m jaxpaged.static_profile.target my_script.py args...     # run a script in that environment
    run_in_h100_python(["my_script.py", ...])                  # the same from Python

and inside it:

    from jaxpaged.static_profile.target import H100, compile_for_h100, spec
    out = compile_for_h100(step, (spec((256, 1024), jnp.bfloat16), ...), donate_argnums=(1,), dump_dir=True)
    out.hlo_text, out.dump_dir, out.compiled.memory_analysis()

`python -m jaxpaged.static_profile.target` alone prints the target's numbers and the environment.
Every time and byte figure derived from these numbers is an estimate; nothing here runs on a GPU.
"""

import dataclasses
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET_CONFIG = Path(__file__).with_name("h100_sxm.txtpb")
TARGET_CONFIGS = {"h100": TARGET_CONFIG, "h200": Path(__file__).with_name("h200_sxm.txtpb")}  # chip -> description
TOOLCHAIN_ENV = "JAXPAGED_H100_TOOLCHAIN"  # overrides the default <repo>/.h100-toolchain


@dataclasses.dataclass(frozen=True)
class H100Target:
    """What the performance model needs, read from `h100_sxm.txtpb` except where noted."""

    name: str
    num_sms: int  # 132
    hbm_bandwidth: float  # bytes/s, 3.35e12 (HBM3, SXM)
    hbm_bytes: int
    l2_bytes: int  # 50 MiB
    smem_per_sm: int  # 233,472 B = 228 KiB
    smem_per_block_optin: int  # 232,448 B = 227 KiB, the most one block may opt in to
    registers_per_sm: int  # 65,536 32-bit registers
    max_threads_per_sm: int  # 2048
    clock_ghz: float
    # Not in the txtpb: NVIDIA's H100 SXM datasheet, dense (no 2:4 sparsity) BF16 tensor-core peak.
    bf16_dense_flops: float = 989e12
    # Not in the txtpb: compute capability 9.0 limits from the CUDA C Programming Guide (table
    # "Technical Specifications per Compute Capability") and the occupancy calculator.
    max_blocks_per_sm: int = 32
    max_registers_per_thread: int = 255
    register_alloc_unit: int = 256  # registers, allocated per warp
    smem_alloc_unit: int = 128  # bytes
    smem_reserved_per_block: int = 1024  # bytes the driver reserves per resident block (sm_80+)
    # Not in the txtpb: NVLink 4 on the H100 / H200 SXM, 900 GB/s per GPU both directions together
    # (NVIDIA's datasheets): 450 GB/s each way, what a ring all-reduce's bus bandwidth is measured against.
    nvlink_bandwidth: float = 450e9

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // 32


def load_target(path: Path = TARGET_CONFIG) -> H100Target:
    text = re.sub(r"#.*", "", path.read_text())
    field = lambda key: re.search(rf"\b{key}:\s*\"?([^\"\n]+)\"?", text).group(1)
    return H100Target(
        name=field("device_description_str"), num_sms=int(field("core_count")),
        hbm_bandwidth=float(field("memory_bandwidth")), hbm_bytes=int(field("device_memory_size")),
        l2_bytes=int(field("l2_cache_size")), smem_per_sm=int(field("shared_memory_per_core")),
        smem_per_block_optin=int(field("shared_memory_per_block_optin")),
        registers_per_sm=int(field("registers_per_core_limit")),
        max_threads_per_sm=int(field("threads_per_core_limit")), clock_ghz=float(field("clock_rate_ghz")))


H100 = load_target()
H200 = load_target(TARGET_CONFIGS["h200"])
TARGETS = {"h100": H100, "h200": H200}


def toolchain_dir() -> Path:
    return Path(os.environ.get(TOOLCHAIN_ENV) or REPO_ROOT / ".h100-toolchain")


def h100_env(toolchain: Path | None = None, environ: dict | None = None) -> dict[str, str]:
    """Environment of a child process that compiles for the H100 with the pinned toolchain.

    PYTHONPATH: toolchain first (jax finds the plugin through the `jax_plugins` namespace package),
      then the repo (so `jaxpaged.static_profile` and `jaxpaged` import).
    XLA_FLAGS: --xla_gpu_cuda_data_dir=<toolchain>/nvidia/cuda_nvcc, else XLA silently takes
      /usr/local/cuda's libdevice and the first `ptxas` on PATH (CUDA 13.0 on this machine).
    PATH: the pinned ptxas first, for Mosaic GPU and ptxas_report.py.
    JAX_PLATFORMS=cpu: the plugin must not try to open a GPU; the compile is deviceless.
    JAX_ENABLE_COMPILATION_CACHE=false: a cache hit would skip XLA, and with it the dump.
    """
    toolchain = Path(toolchain or toolchain_dir()).resolve()
    if not (toolchain / "jax_plugins" / "xla_cuda12").is_dir():
        raise FileNotFoundError(f"no H100 toolchain in {toolchain}; run scripts/install_h100_toolchain.sh "
                                f"(or point {TOOLCHAIN_ENV} at one)")
    env = dict(os.environ if environ is None else environ)
    nvcc = toolchain / "nvidia" / "cuda_nvcc"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(toolchain), str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_cuda_data_dir={nvcc}".strip()
    env["PATH"] = os.pathsep.join((str(nvcc / "bin"), env.get("PATH", "")))
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # hide "Could not find cuda drivers" info lines
    env[TOOLCHAIN_ENV] = str(toolchain)
    return env


def run_in_h100_python(argv: list[str], *, toolchain: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
    """`python *argv` in the H100 environment; kwargs go to subprocess.run (check=True by default)."""
    kwargs.setdefault("check", True)
    return subprocess.run([sys.executable, *argv], env=h100_env(toolchain), cwd=kwargs.pop("cwd", REPO_ROOT), **kwargs)


def _plugin_importable() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no `jax_plugins` namespace package at all
        return False


def _require_h100_process() -> None:
    if not _plugin_importable():
        raise RuntimeError("the CUDA PJRT plugin is not importable in this process: run the script with "
                           "`python -m jaxpaged.static_profile.target SCRIPT` or run_in_h100_python([...]) "
                           "(install it with scripts/install_h100_toolchain.sh)")
    if "--xla_gpu_cuda_data_dir=" not in os.environ.get("XLA_FLAGS", ""):
        raise RuntimeError("XLA_FLAGS has no --xla_gpu_cuda_data_dir: XLA would compile with whatever CUDA "
                           "/usr/local/cuda holds; start this process with h100_env()")


@functools.cache
def topology():
    _require_h100_process()
    import jax
    from jax.experimental import topologies

    if not jax.config.jax_platforms:  # h100_env() sets JAX_PLATFORMS=cpu; keep the CUDA client unopened
        jax.config.update("jax_platforms", "cpu")
    return topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIG.read_text(), topology="1x1x1")


def h100_sharding():
    import jax

    return jax.sharding.SingleDeviceSharding(topology().devices[0])


@functools.cache
def chip_topology(chip: str = "h100", num_devices: int = 1):
    """`num_devices` virtual GPUs of `chip` ("h100" | "h200": TARGET_CONFIGS) in one process, as
    XLA's deviceless topology "1x1xN" gives them (one host, N devices: what a tensor-parallel mesh takes)."""
    if chip not in TARGET_CONFIGS:
        raise ValueError(f"unknown chip {chip!r}; one of {sorted(TARGET_CONFIGS)}")
    topology()  # the checks, and the CPU platform kept
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=TARGET_CONFIGS[chip].read_text(),
                                        topology=f"1x1x{num_devices}")


def chip_sharding(chip: str = "h100"):
    """A SingleDeviceSharding on one virtual `chip` (h100_sharding() is chip_sharding("h100")'s twin)."""
    import jax

    return jax.sharding.SingleDeviceSharding(chip_topology(chip).devices[0])


def chip_mesh(chip: str, num_devices: int):
    """The engine's 1-D `tp` mesh (jaxpaged.device.sharding.make_mesh) over `num_devices` virtual `chip`s."""
    from jaxpaged.device.sharding import make_mesh

    return make_mesh(num_devices, chip_topology(chip, num_devices).devices)


def spec(shape, dtype):
    """An argument placed on the (virtual) H100: ShapeDtypeStruct with its SingleDeviceSharding."""
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=h100_sharding())


def specs_like(tree):
    """Every array / ShapeDtypeStruct leaf of `tree` as an H100 `spec` of the same shape and dtype;
    other leaves (Python scalars, None) are kept, so static config passes through."""
    import jax

    return jax.tree.map(lambda x: spec(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x, tree)


@dataclasses.dataclass
class H100Compiled:
    compiled: object  # jax.stages.Compiled; .memory_analysis() works, .cost_analysis() is None here
    hlo_text: str  # the GPU-optimized HLO (compiled.as_text()), what hlo_accounting.account reads
    dump_dir: str | None  # XLA dump (thunk sequence, PTX per kernel), when asked for
    lower_seconds: float
    compile_seconds: float


def compile_for_h100(fn, args: tuple, *, kwargs: dict | None = None, donate_argnums=(), donate_argnames=(),
                     static_argnums=(), static_argnames=(), dump_dir: str | bool | None = None,
                     compiler_options: dict | None = None) -> H100Compiled:
    """Compile `fn(*args, **kwargs)` for one H100 SXM without a GPU.

    fn: a plain function (jitted here with the given donate/static options) or an already
      `jax.jit`-ed one (then pass no jit options: its own are used).
    args, kwargs: `spec(...)`s / `specs_like(...)` pytrees for arrays, Python values for static args.
    dump_dir: True = a fresh temp dir; a path = that dir (must be empty or absent); None = no dump.
    compiler_options: XLA debug options for this compile only, e.g. {"xla_gpu_enable_triton_gemm": False}.
    """
    _require_h100_process()
    import jax

    from pallas_kernels.jax_compat import cuda_target

    topology()
    options = dict(donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                   static_argnums=static_argnums, static_argnames=static_argnames)
    if hasattr(fn, "trace"):
        if any(options.values()):
            raise ValueError("fn is already jitted: put donate/static options on its jax.jit, not here")
        jitted = fn
    else:
        jitted = jax.jit(fn, **{k: v for k, v in options.items() if v})
    if dump_dir is True:
        dump_dir = tempfile.mkdtemp(prefix="h100-dump-")
    elif dump_dir:
        if os.path.isdir(dump_dir) and os.listdir(dump_dir):
            raise ValueError(f"dump_dir {dump_dir} is not empty; give each compile a fresh directory")
        os.makedirs(dump_dir, exist_ok=True)
    t0 = time.perf_counter()
    with cuda_target(topology().devices[0].device_kind):  # JAX >= 0.12's Triton lowering reads the GPU's kind
        lowered = jitted.trace(*args, **(kwargs or {})).lower()
    t1 = time.perf_counter()
    options = dict(compiler_options or {}) | ({"xla_dump_to": str(dump_dir)} if dump_dir else {})
    compiled = lowered.compile(compiler_options=options or None)
    t2 = time.perf_counter()
    return H100Compiled(compiled, compiled.as_text(), str(dump_dir) if dump_dir else None, t1 - t0, t2 - t1)


if __name__ == "__main__":
    if len(sys.argv) > 1:  # run a script in the H100 environment
        sys.exit(run_in_h100_python(sys.argv[1:], check=False, cwd=os.getcwd()).returncode)
    print(H100)
    env = h100_env()
    for key in ("PYTHONPATH", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_COMPILATION_CACHE"):
        print(f"{key}={env[key]}")
