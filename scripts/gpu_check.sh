#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: checks and measures jaxpaged's whole device path.
#
#   scripts/gpu_check.sh [--out DIR] [--dry-run]
#
# Runs from a plain checkout (PYTHONPATH=., nothing installed beyond jax[cuda], flax, transformers,
# orbax-checkpoint, jaxtyping, tokenizers, safetensors, numpy, pytest, hypothesis), in under 9
# minutes on an H100:
#   1. prints the device, JAX, jaxlib and CUDA versions (stops at once, exit 2, without a GPU);
#   2. pytest -m gpu: kernels compiled at real sizes, a pool > 2^31 elements, Pallas-vs-reference
#      greedy parity, donation and step scratch memory, zero compilations after warm-up;
#   3. benchmarks/bench_kernels.py --quick: K1 (decode) and K2 (ragged) against their peers, with the
#      measured copy bandwidth and bf16 matmul rate;
#   4. benchmarks/bench_throughput.py --preset h100 --workloads w1: jaxpaged against the dense
#      baseline on BENCHMARKS.md's W1 (random Qwen3-0.6B-shaped weights, no download);
# writes each stage's JSON and a summary (device, JAX version, commit) under DIR (default
# benchmarks/results/) and prints one summary table. --dry-run runs the same driver on any machine
# (CPU: gpu tests skipped, kernels in interpret mode at tiny sizes, throughput skipped) to check
# the script itself; its figures mean nothing.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" scripts/gpu_check.py "$@"
