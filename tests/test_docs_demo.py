"""docs/results.md's demo tables come from runs: each names the results.json of the run it shows
(copied under docs/demo/), and is that file rendered by the demo's own table code. The default
run's file is what the demo's default settings produce, recorded together with the quick run that
tests/test_demo.py compares with the code (pipeline/demo/record.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from pipeline.demo.record import DEFAULT_FILE, QUICK_DIGEST_KEY, QUICK_FILE, RECORD_COMMAND, figures_digest, named_tables, render_tables
from pipeline.demo.run import DEMO_METHODS, DemoSizes, format_table

ROOT = Path(__file__).resolve().parents[1]


def _report(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


def test_every_demo_table_is_the_run_it_names():
    tables = named_tables((ROOT / "docs" / "results.md").read_text())
    assert tables, "docs/results.md, The demo: no table names the run it comes from (`docs/demo/....json`)"
    assert {DEFAULT_FILE, QUICK_FILE} <= {name for name, _ in tables}
    for name, table in tables:
        report = _report(name)
        assert table == format_table(report["methods"], temperatures=report["temperatures"]), f"{name}: the doc's table is not this run's"
        assert all(r[f"T{t:g}"]["lossless_mismatches"] in (0, None) for r in report["methods"].values() for t in report["temperatures"])


def test_the_recorded_runs_have_the_demos_settings():
    """Seed 0, T = 0, the five methods, one torch thread and the sizes `bash .ci/demo [--quick]` runs
    at: a changed default (epochs, world size, ...) needs the table regenerated."""
    for name, quick in ((DEFAULT_FILE, False), (QUICK_FILE, True)):
        report = _report(name)
        settings = {k: report[k] for k in ("seed", "quick", "temperatures", "sizes")}
        settings["methods"] = list(report["methods"])
        settings["torch_threads"] = report["environment"]["torch_threads"]
        sizes = json.loads(json.dumps(asdict(DemoSizes.make(seed=0, quick=quick))))
        expected = {"seed": 0, "quick": quick, "temperatures": [0.0], "sizes": sizes, "methods": list(DEMO_METHODS), "torch_threads": 1}
        assert settings == expected, f"{name} is not the run of the demo's settings; regenerate with: {RECORD_COMMAND}"


def test_the_default_run_was_recorded_with_the_quick_run_ci_checks():
    """tests/test_demo.py holds the quick file to the code; the default run's file carries the digest
    of the quick figures made beside it, so it cannot be left behind when the quick file is renewed."""
    digest = _report(DEFAULT_FILE).get(QUICK_DIGEST_KEY)
    assert digest == figures_digest(_report(QUICK_FILE)), (
        f"{DEFAULT_FILE} was not recorded with {QUICK_FILE}'s code; regenerate both with: {RECORD_COMMAND}"
    )


def test_render_tables_renders_the_named_tables_only():
    report = _report(QUICK_FILE)
    table = format_table(report["methods"], temperatures=report["temperatures"])
    page = (
        "# Results\n\n## The demo\n\nThe quick run (`docs/demo/quick-seed0.json`):\n\n```\nstale\n```\n\n"
        "Another (`docs/demo/other.json`):\n\n```\nkept\n```\n\n## Next\n\n`docs/demo/quick-seed0.json`\n\n```\nkept too\n```\n"
    )
    rendered = render_tables(page, {QUICK_FILE: report})
    assert rendered == page.replace("```\nstale\n```", f"```\n{table}\n```")
    assert named_tables(rendered) == [(QUICK_FILE, table), ("docs/demo/other.json", "kept")]
    with pytest.raises(ValueError, match="no table names docs/demo/seed0.json"):
        render_tables(page, {DEFAULT_FILE: report})
