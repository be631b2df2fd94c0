"""Our DSpark drafter against DeepSpec's reference code (benchmarks/checks/deepspec_check.py): the export
loads into its Qwen3DSparkModel, its drafts and heads equal ours, its loss equals ours where the
inputs coincide. Runs when ALRIRA_DEEPSPEC names a DeepSpec checkout (its Python package is
imported from there); skipped otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DEEPSPEC = os.environ.get("ALRIRA_DEEPSPEC")


@pytest.mark.skipif(not DEEPSPEC, reason="ALRIRA_DEEPSPEC does not name a DeepSpec checkout")
def test_export_drafts_and_loss_match_deepspec():
    from benchmarks.checks.deepspec_check import run_check

    assert (Path(DEEPSPEC) / "deepspec" / "modeling" / "dspark").is_dir(), f"{DEEPSPEC} is not a DeepSpec checkout"
    report = run_check(DEEPSPEC)
    assert report["load"] == {"missing": ["embed_tokens.weight", "lm_head.weight"], "unexpected": []}
    drafts = report["drafts"]
    assert drafts["tokens_equal"] and drafts["markov_changed_a_draft"]
    assert drafts["max_abs_logits"] < 1e-4 and drafts["max_abs_confidence"] < 1e-5
    assert report["loss"]["abs_diff"] < 1e-5 and report["loss"]["top8_l1_is_lower_bound"]
