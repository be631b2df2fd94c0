"""docs/results.md's demo tables come from runs: each names the results.json of the run it shows
(copied under docs/demo/), and is that file rendered by the demo's own table code."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.demo.run import format_table

ROOT = Path(__file__).resolve().parents[1]
NAMED_TABLE = re.compile(r"`(docs/demo/[\w.-]+\.json)`[^`]*```\n(.*?)\n```", re.S)  # the file named right before the table


def test_every_demo_table_is_the_run_it_names():
    section = (ROOT / "docs" / "results.md").read_text().split("\n## The demo\n", 1)[1].split("\n## ", 1)[0]
    tables = NAMED_TABLE.findall(section)
    assert tables, "docs/results.md, The demo: no table names the run it comes from (`docs/demo/....json`)"
    for name, table in tables:
        report = json.loads((ROOT / name).read_text())
        assert table == format_table(report["methods"], temperatures=report["temperatures"]), f"{name}: the doc's table is not this run's"
        assert all(r[f"T{t:g}"]["lossless_mismatches"] in (0, None) for r in report["methods"].values() for t in report["temperatures"])
