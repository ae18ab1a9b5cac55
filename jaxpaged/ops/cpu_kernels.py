"""The C++ kernels of `jaxpaged/ops/cpu/`, built for this machine and registered with XLA's FFI.

Each `cpu/NAME.cc` exports one XLA FFI handler, `jaxpaged_NAME`. `register(NAME)` compiles it at first
use with the host's C++ compiler (`-O3 -march=native`: AVX-512 where the CPU has it) into
`~/.cache/jaxpaged/kernels` (JAXPAGED_CACHE_DIR), keyed by the sources, jaxlib and the compiler, loads
it and registers the handler for the "cpu" platform. No compiler or a failed build: False, with the
reason logged once; the callers then keep XLA's own path. `JAXPAGED_CPU_KERNELS` (`enabled`) turns them
off, all or some; it is read at each engine build, so one process can compare both paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jaxlib

logger = logging.getLogger(__name__)

SOURCES = pathlib.Path(__file__).with_name("cpu")
DISABLE_ENV = "JAXPAGED_CPU_KERNELS"


def cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXPAGED_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxpaged")
    return pathlib.Path(root) / "kernels"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build(name: str, cxx: str, sources: pathlib.Path = SOURCES, march: str = "native") -> pathlib.Path:
    """The shared library of `sources/name.cc` for these sources, jaxlib, compiler and `-march`:
    compiled once, reused."""
    source = sources / f"{name}.cc"
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(jaxlib.__version__.encode() + version.encode() + march.encode())
    for path in sorted(sources.glob("*.h")) + [source]:
        digest.update(path.read_bytes())
    library = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:  # compiled aside, then renamed: atomic
        built = pathlib.Path(tmp) / library.name
        cmd = [cxx, "-O3", f"-march={march}", "-std=gnu++17", "-shared", "-fPIC", "-fno-math-errno",
               f"-I{jax.ffi.include_dir()}", f"-I{sources}", str(source), "-o", str(built)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed ({' '.join(cmd)}):\n{result.stderr[-4000:]}")
        os.replace(built, library)
    return library


@functools.cache
def register(name: str, march: str = "native") -> bool:
    """Whether the FFI target `target(name, march)` is built and registered for the CPU (other `march`
    values than the host's: tests of the kernels' AVX2 and generic code paths)."""
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found (set CXX): %s runs as XLA's own ops on the CPU", name)
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build(name, cxx, march=march)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("the CPU kernel %s is unavailable, XLA's own ops run instead: %s", name, e)
        return False
    handler = getattr(library, f"jaxpaged_{name}")
    jax.ffi.register_ffi_target(target(name, march), jax.ffi.pycapsule(handler), platform="cpu")
    return True


def target(name: str, march: str = "native") -> str:
    """The FFI target name of kernel `name` built for `march`."""
    return f"jaxpaged_{name}" if march == "native" else f"jaxpaged_{name}_{march.replace('-', '_')}"


def enabled(name: str) -> bool:
    """Whether engines built now use kernel `name`: it is available and JAXPAGED_CPU_KERNELS allows it
    (unset or "1": every kernel; "0": none; else a comma-separated list, e.g. "gguf_matmul")."""
    setting = os.environ.get(DISABLE_ENV, "1").strip()
    allowed = setting == "1" or name in {part.strip() for part in setting.split(",")}
    return allowed and register(name)
