#!/usr/bin/env bash
# The project on the newest JAX (and Python 3.13), as CI runs it (issue 49).
#
#   scripts/newest_jax.sh            # build or reuse the chroot, install, run the subset
#   JAX_SPEC="jax[cpu]==0.11.2" scripts/newest_jax.sh     # another JAX (its own venv in the same chroot)
#
# Needs root on a Debian-like host (debootstrap, chroot, mount) and network to PyPI and the Debian mirror.
# What it builds lives in <repo>/.newest-jax/ (git-ignored; delete it to start from scratch):
#   trixie/               Debian trixie minbase (Python 3.13), the host's resolv.conf and CA bundle copied in
#   trixie/opt/<venv>/    a venv with JAX_SPEC, flax and the project's dependencies (torch left out: the
#                         subset below needs no torch oracle); `pip install -U` on every run: the newest
#   trixie/opt/<venv>-h100-toolchain/   scripts/install_h100_toolchain.sh for that venv's jaxlib
# The repo is bind-mounted at /repo inside for the run (copied there where mount --bind is refused) and
# unmounted on exit. The subset: the kernels in interpret mode, the engine's backend variants, and the H100
# static gate compiled with the plugin of that jaxlib, in two xdist workers as the README's command.
# Prints the Python / JAX / flax versions and pytest's counts.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOT="${NEWEST_JAX_DIR:-$REPO/.newest-jax}"
CHROOT="$ROOT/trixie"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
JAX_SPEC="${JAX_SPEC:-jax[cpu]}"
VENV="/opt/$(printf '%s' "$JAX_SPEC" | tr -c 'A-Za-z0-9.' '-' | sed 's/-*$//')"
SUBSET=(tests/test_pallas_decode.py tests/test_pallas_ragged.py tests/test_mosaic_attention.py
        tests/test_engine_variants.py tests/test_gpu_path.py tests/test_h100_static_gate.py
        tests/test_w4a16_matmul.py tests/test_fp8_block_matmul.py tests/test_grouped_matmul.py)
start=$(date +%s)

if [[ ! -f "$CHROOT/.jaxpaged-chroot" ]]; then
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
  rm -rf -- "$CHROOT"  # a half-built one (no marker)
  mkdir -p "$ROOT" && printf '*\n' > "$ROOT/.gitignore"
  echo "[newest-jax] debootstrap trixie into $CHROOT"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    trixie "$CHROOT" "$MIRROR" > "$ROOT/debootstrap.log" 2>&1 || { tail -20 "$ROOT/debootstrap.log"; exit 1; }
  touch "$CHROOT/.jaxpaged-chroot"
fi
cp /etc/resolv.conf "$CHROOT/etc/resolv.conf"
cp /etc/ssl/certs/ca-certificates.crt "$CHROOT/etc/ssl/certs/ca-certificates.crt"  # a proxy's CA, if any

MOUNTED=()
cleanup() { for ((i=${#MOUNTED[@]}-1; i>=0; i--)); do umount "${MOUNTED[i]}" || true; done; }
trap cleanup EXIT
mount_once() {  # mount_once TARGET ARGS...: mount unless something is mounted there already
  local target=$1; shift
  mountpoint -q "$target" && return 0
  mount "$@" "$target" && MOUNTED+=("$target")
}
mount_once "$CHROOT/proc" -t proc proc
mount_once "$CHROOT/dev" --bind /dev
mkdir -p "$CHROOT/repo"
if ! mount_once "$CHROOT/repo" --bind "$REPO"; then
  echo "[newest-jax] mount --bind refused: copying the repo into the chroot"
  rm -rf -- "$CHROOT/repo" && mkdir -p "$CHROOT/repo"
  tar -C "$REPO" --exclude=./.newest-jax --exclude=./.git -cf - . | tar -C "$CHROOT/repo" -xf -
fi

in_chroot() {  # a clean environment: the host's PIP_* settings and constraints stay outside
  env -i HOME=/root LANG=C.UTF-8 PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" \
    JAXPAGED_H100_TOOLCHAIN="$VENV-h100-toolchain" /usr/sbin/chroot "$CHROOT" /bin/bash -c "cd /repo && $1"
}

echo "[newest-jax] installing $JAX_SPEC into $VENV"
in_chroot "[[ -x $VENV/bin/python ]] || python3 -m venv $VENV
  pip install -q -U '$JAX_SPEC' flax jaxtyping numpy transformers tokenizers safetensors gguf jinja2 orbax-checkpoint \
    tqdm fastapi uvicorn pydantic prometheus_client llguidance 'pytest>=8' pytest-xdist hypothesis beartype jsonschema httpx
  pip install -q --no-deps -e /repo
  bash scripts/install_h100_toolchain.sh $VENV-h100-toolchain"
ready=$(date +%s)

in_chroot "python -c 'import sys, jax, jaxlib, flax; print(\"[newest-jax] Python\", sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"flax\", flax.__version__)'"
set +e
in_chroot "python -m pytest -q -p no:cacheprovider -m 'not slow' -n 2 --dist loadfile ${SUBSET[*]}"
rc=$?
set -e
end=$(date +%s)
echo "[newest-jax] setup $((ready - start)) s, tests $((end - ready)) s, rc=$rc"
exit $rc
