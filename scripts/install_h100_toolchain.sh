#!/usr/bin/env bash
# Install the H100 compile toolchain into an isolated directory (issue 23).
#
#   scripts/install_h100_toolchain.sh [DIR]      # DIR defaults to <repo>/.h100-toolchain
#
# What lands in DIR (pip install --target, --no-deps so nothing shadows the system numpy/jax):
#   jax_plugins/xla_cuda12/   jax-cuda12-pjrt   == installed jaxlib version (the PJRT CUDA plugin, XLA:GPU)
#   jax_cuda12_plugin/        jax-cuda12-plugin == installed jaxlib version (Triton / Mosaic GPU lowering)
#   nvidia/cuda_nvcc/         nvidia-cuda-nvcc-cu12 (bin/ptxas and nvvm/libdevice/libdevice.10.bc)
#
# Invariant: the system python never sees DIR. Only a subprocess started with PYTHONPATH=DIR
# (jaxpaged/static_profile/target.py does this) discovers the plugin, through the `jax_plugins` namespace
# package. No cuDNN/cuBLAS wheels: a deviceless compile does not load them.
#
# Idempotent: if DIR/.installed-for-jaxlib already names the installed jaxlib version and the
# three pieces are present, nothing is downloaded.
set -euo pipefail

PYTHON="${PYTHON:-python}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$REPO_ROOT/.h100-toolchain}"

JAXLIB_VERSION="$("$PYTHON" -c 'import jaxlib; print(jaxlib.__version__)')" || {
  echo "error: '$PYTHON' cannot import jaxlib; install the project first (pip install -e .[dev])" >&2
  exit 1
}
STAMP="$DIR/.installed-for-jaxlib"

have_all() {
  [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$JAXLIB_VERSION" ]] \
    && [[ -f "$DIR/jax_plugins/xla_cuda12/xla_cuda_plugin.so" ]] \
    && [[ -d "$DIR/jax_cuda12_plugin" ]] \
    && [[ -x "$DIR/nvidia/cuda_nvcc/bin/ptxas" ]] \
    && [[ -f "$DIR/nvidia/cuda_nvcc/nvvm/libdevice/libdevice.10.bc" ]]
}

if have_all; then
  echo "h100 toolchain already in $DIR for jaxlib $JAXLIB_VERSION ($(du -sh "$DIR" | cut -f1)); nothing to do"
  exit 0
fi

MARKER="$DIR/.h100-toolchain-dir"  # written first: only a directory holding it is ever deleted
if [[ -e "$DIR" ]] && [[ -n "$(ls -A "$DIR" 2>/dev/null)" ]]; then
  if [[ ! -f "$MARKER" ]]; then
    echo "error: $DIR exists, is not empty and was not made by this script; pass another DIR" >&2
    exit 1
  fi
  # A stale or partial install (other jaxlib version, interrupted download): start clean, since
  # pip --target does not remove files of an older version.
  echo "replacing stale toolchain in $DIR" >&2
  rm -rf -- "$DIR"
fi
mkdir -p "$DIR"
touch "$MARKER"

start=$(date +%s)
"$PYTHON" -m pip install --quiet --no-deps --target "$DIR" \
  "jax-cuda12-plugin==$JAXLIB_VERSION" \
  "jax-cuda12-pjrt==$JAXLIB_VERSION" \
  "nvidia-cuda-nvcc-cu12>=12.6"
chmod +x "$DIR/nvidia/cuda_nvcc/bin/"* 2>/dev/null || true
# Keep the directory out of git even where the repo's .gitignore does not list it.
printf '*\n' > "$DIR/.gitignore"
echo "$JAXLIB_VERSION" > "$STAMP"
end=$(date +%s)

if ! have_all; then
  echo "error: install into $DIR finished but a piece is missing (see the list at the top of $0)" >&2
  exit 1
fi
echo "installed h100 toolchain for jaxlib $JAXLIB_VERSION into $DIR in $((end - start)) s ($(du -sh "$DIR" | cut -f1))"
echo "ptxas: $("$DIR/nvidia/cuda_nvcc/bin/ptxas" --version | tail -1)"
