"""Our DFlash2 drafter against speculators 0.9's (benchmarks/checks/dflash2_reference.py): with the same
weights and batch its unary logits and selector scores equal ours, and its loss and gradients
equal ours given the target's whole softmax, for its default KL, its TV option and D-PACE weights.
Runs when ALRIRA_SPECULATORS_VENV names a virtualenv holding speculators 0.9 (the module runs again
under its python); skipped otherwise."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.waits import run_to_end

ROOT = Path(__file__).resolve().parents[1]
VENV = os.environ.get("ALRIRA_SPECULATORS_VENV")


@pytest.mark.skipif(not VENV, reason="ALRIRA_SPECULATORS_VENV does not name a speculators 0.9 virtualenv")
def test_forward_scores_and_loss_match_speculators(tmp_path):
    out = tmp_path / "dflash2_reference.json"
    result = run_to_end([sys.executable, "-m", "benchmarks.checks.dflash2_reference", "--json", str(out)], cap_s=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["speculators"] == "0.9.0"
    forward = report["forward"]
    assert forward["candidates_equal"] and forward["logits_max_abs_diff"] < 1e-5 and forward["scores_max_abs_diff"] < 1e-5
    assert set(report["loss"]) == {"kl", "kl+tv", "kl+tv dpace"}
    for name, loss in report["loss"].items():
        assert loss["loss_abs_diff"] < 1e-5 * max(1.0, abs(loss["theirs"])), name
        assert loss["grad_max_abs_diff"] < 1e-5 * max(1.0, loss["grad_max_abs"]), name
