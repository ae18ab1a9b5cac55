#!/usr/bin/env bash
# Downloads the wheels of scripts/gpu_wheels.txt into .whl/ (git-ignored) for the H200 machine:
# CPython 3.12, manylinux x86_64, no dependencies (the list names every one). Run once, here, before
# the run that carries .whl (scripts/gpu_check.sh's header says how); prints the total size.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
mkdir -p .whl
grep -v '^\s*#' scripts/gpu_wheels.txt | grep -v '^\s*$' | while read -r spec; do
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
for whl in .whl/*.whl; do  # a Requires-Dist that is neither listed nor on the image stops the install there
  unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed "s|^|$(basename "$whl"): |" || true
done
du -ch .whl/*.whl | tail -1
