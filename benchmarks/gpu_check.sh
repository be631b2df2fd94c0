#!/usr/bin/env bash
# The checks that need a GPU, in one run on one CUDA device (under 8 minutes on an H200):
#   1. the CUDA / flex / bf16 tests of the drafter and the trainer;
#   2. benchmarks/gpu_check.py: a bf16 training step at the Qwen3-4B DFlash shape (SDPA and flex)
#      and a stage-1 batch through a random Qwen3-4B-shaped target (docs/benchmarks.md, "Real shapes").
#
#   bash benchmarks/gpu_check.sh          (PYTHON=... to use another interpreter than .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA device ($PYTHON: torch.cuda.is_available() is False); run it on a GPU machine" >&2
    exit 1
fi
"$PYTHON" -c 'import torch; print("gpu_check.sh:", torch.cuda.get_device_name(), "torch", torch.__version__)'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true

echo "== 1/2 CUDA tests"
start=$SECONDS
timeout 270 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_drafter.py tests/test_train.py \
    -k "flex or cuda or bf16 or attention" --durations=10
echo "tests: $((SECONDS - start)) s"

echo "== 2/2 training step and stage-1 batch at real shapes"
start=$SECONDS
timeout 210 "$PYTHON" benchmarks/gpu_check.py
echo "gpu_check.py: $((SECONDS - start)) s"
