#!/usr/bin/env bash
# The checks that need a GPU, on one CUDA device, each section in its own process and time limit
# (about 10 minutes in all on an H200; docs/benchmarks.md, "GPU check"):
#   tests      the CUDA / flex / bf16 tests of the drafter and the trainer;
#   attention  bf16 flex vs SDPA at the real shape, loss and gradients (benchmarks/gpu_check.py);
#   step       the 5-layer default drafter's step: time, compile time, recompiles, host syncs, MFU, memory;
#   loader     the map loader's rate on this node against its decompression floor and a rank's need;
#   stage1     stage 1 through ShardBuilder and its writer at --batch-tokens 8192.
# A section that fails or runs out of time is recorded and the next one runs; each table prints as
# soon as it is measured; the exit status is 1 if any section failed, 2 if a need is missing.
#
#   bash benchmarks/gpu_check.sh              (PYTHON=... to use another interpreter than .venv/bin/python)
#   bash benchmarks/gpu_check.sh --cpu-smoke  (toy sizes on CPU: what CI runs; the CUDA tests are skipped)
set -uo pipefail  # no -e: every section runs whatever the one before it did
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
SMOKE=()
if [[ "${1:-}" == "--cpu-smoke" ]]; then SMOKE=(--cpu-smoke); fi
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Needs, one line each, checked by one interpreter (each import of torch costs seconds).
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "need python: MISSING, no interpreter at $PYTHON (make the venv or set PYTHON=...)"
    exit 2
fi
CUDA_NEEDED=$([[ ${#SMOKE[@]} -eq 0 ]] && echo 1 || echo 0) "$PYTHON" - <<'PY'
import os, sys

def need(name, check):
    try:
        found = check()
    except Exception as error:  # an ImportError, or a need that is not met
        print(f"need {name}: MISSING, {str(error).splitlines()[0] if str(error) else type(error).__name__}")
        return False
    print(f"need {name}: ok, {found}")
    return True

def torch_build():
    import torch
    return f"torch {torch.__version__}, CUDA build {torch.version.cuda}"

def cuda_device():
    import torch
    if torch.version.cuda is None:
        raise RuntimeError("this torch is a CPU build (install a CUDA torch)")
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA torch but no device visible (CUDA_VISIBLE_DEVICES? driver?)")
    return f"{torch.cuda.get_device_name()}, {torch.cuda.device_count()} device(s)"

def version(module):
    return lambda: f"{module} {__import__(module).__version__}"

def alrira():
    import pipeline.train.loop, transformers, zarr  # noqa: F401
    return f"transformers {transformers.__version__}, zarr {zarr.__version__}"

checks = [("torch", torch_build)] + ([("cuda", cuda_device)] if os.environ["CUDA_NEEDED"] == "1" else [])
checks += [("pytest", version("pytest")), ("psutil", version("psutil")), ("alrira", alrira)]
results = [need(name, check) for name, check in checks]  # every line, even after a miss
sys.exit(0 if all(results) else 1)
PY
if [[ $? -ne 0 ]]; then
    echo "gpu_check.sh: install what is MISSING above; nothing was run" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true

WORK="$(mktemp -d -t alrira-gpu-check-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
names=() statuses=() seconds=()
section() {  # section NAME LIMIT_S COMMAND...: runs it, records "ok", "FAILED (exit N)" or "TIMED OUT"
    local name=$1 limit=$2 start=$SECONDS rc status
    shift 2
    echo
    echo "== $name (at most $limit s)"
    timeout --kill-after=15 "$limit" "$@"
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMED OUT after $limit s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    echo "== $name: $status, $((SECONDS - start)) s"
    names+=("$name") statuses+=("$status") seconds+=("$((SECONDS - start))")
}

if [[ ${#SMOKE[@]} -eq 0 ]]; then
    section tests 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_drafter.py tests/test_train.py \
        -k "flex or cuda or bf16 or attention or host_sync" --durations=10
else
    names+=(tests) statuses+=("skipped (--cpu-smoke)") seconds+=(0)
fi
for spec in attention:90 step:180 loader:120 stage1:180; do
    section "${spec%%:*}" "${spec##*:}" "$PYTHON" benchmarks/gpu_check.py --section "${spec%%:*}" --work "$WORK" "${SMOKE[@]}"
done

echo
echo "gpu_check.sh summary"
failed=0
for i in "${!names[@]}"; do
    printf '  %-10s %-28s %5s s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"
    [[ ${statuses[$i]} == ok || ${statuses[$i]} == skipped* ]] || failed=1
done
exit $failed
