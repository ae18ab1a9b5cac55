#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: checks and measures jaxpaged's whole device path in at
# most 9 minutes of wall time, nothing fetched (scripts/gpu_check.py says what each stage does).
#
#   scripts/gpu_check.sh [--out DIR] [--dry-run] [--skip STAGE,...]
#
# Stages (limits in scripts/gpu_check.py): env 40 s, pytest -m gpu 110 s, every decode bucket vs its
# floor 170 s, K1 70 s, W1 (jaxpaged, dense baseline, transformers' continuous batching) 150 s. Each
# writes its JSON under DIR as it goes (7 files: env, pytest, decode_steps, kernels, w1, the summary
# gpu_check.json and gpu_check.log; default benchmarks/results/gpu/); one summary table is printed
# last. --dry-run runs every stage on any machine at tiny sizes (GPU figures null).
#
# On the lent H200 (the device tool; /work/.library/device/README.md), prepared here first:
#   bash scripts/fetch_gpu_wheels.sh          # .whl/: the wheels of scripts/gpu_wheels.txt (1.6 MB)
# then one call of the tool, the commit written in (the tree travels without .git):
#   run(command="JAXPAGED_COMMIT=<git rev-parse HEAD> bash scripts/gpu_check.sh --out $OUT", carry=[".whl"], timeout_s=600)
# and copy what comes back (files_at) into benchmarks/results/gpu/ before committing it.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
python="${PYTHON:-$(command -v python3 || command -v python)}"
if compgen -G ".whl/*.whl" > /dev/null; then  # the wheels the machine's image lacks, never from a registry
  site="${TMPDIR:-/tmp}/jaxpaged_gpu_site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu_check.py "$@"
