"""docs/results.md's DSpark tables come from runs: the block between its markers is
benchmarks/speed/methods.py `dspark_section` of the two methods.json files it names (copied under
docs/dspark/), so a table cannot drift from the run it reports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.speed.methods import dspark_section, families_section

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- dspark_section\((docs/dspark/[\w.-]+\.json), (docs/dspark/[\w.-]+\.json)\) -->\n(.*?)\n<!-- end -->", re.S)


def test_the_dspark_tables_are_the_runs_they_name():
    blocks = BLOCK.findall((ROOT / "docs" / "results.md").read_text())
    assert len(blocks) == 1, "docs/results.md: no DSpark block naming its runs"
    full, without_head, text = blocks[0]
    full_report, without_report = (json.loads((ROOT / name).read_text()) for name in (full, without_head))
    assert text == dspark_section(full_report, without_report)
    # Every decode of those runs was lossless at T = 0.
    for report in (full_report, without_report):
        for replicate in report["replicates"]:
            assert all(m["T0"]["lossless_mismatches"] in (0, None) for m in replicate["methods"].values())


FAMILIES_BLOCK = re.compile(r"<!-- families_section\((docs/families/[\w.-]+\.json)\) -->\n(.*?)\n<!-- end -->", re.S)


def test_the_family_tables_are_the_run_they_name():
    """docs/results.md's drafter-family tables are `families_section` of the methods.json they name;
    every decode of that run was lossless at T = 0."""
    blocks = FAMILIES_BLOCK.findall((ROOT / "docs" / "results.md").read_text())
    assert len(blocks) == 1, "docs/results.md: no drafter-family block naming its run"
    name, text = blocks[0]
    report = json.loads((ROOT / name).read_text())
    assert text == families_section(report)
    for replicate in report["replicates"]:
        assert all(m["T0"]["lossless_mismatches"] in (0, None) for m in replicate["methods"].values())
