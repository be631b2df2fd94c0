"""The console scripts: installed entry points, clear one-line errors, docs/cli.md in sync."""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from ray_jobs.cli import cache_cli, cli_reference_markdown
from pipeline.cli import train_cli
from tests.waits import HANG_CAP_S, run_to_end

ROOT = Path(__file__).resolve().parents[1]


def test_docs_cli_reference_is_generated_from_the_commands():
    expected = cli_reference_markdown()
    assert (ROOT / "docs" / "cli.md").read_text() == expected, "regenerate: python -m ray_jobs.cli > docs/cli.md"


def test_console_scripts_are_installed():
    bin_dir = Path(sys.executable).parent
    for script in ("alrira-cache", "alrira-train", "alrira-eval"):
        result = run_to_end([str(bin_dir / script), "--help"], cap_s=HANG_CAP_S)
        assert result.returncode == 0, result.stderr
        assert "Usage:" in result.stdout


def test_bad_flag_values_are_one_line_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        cache_cli, ["build", "--target", str(tmp_path), "--corpus", "x.jsonl", "--out", str(tmp_path / "c"), "--feature-codec", "int4"]
    )
    assert result.exit_code == 2
    assert "--feature-codec must be one of bf16, fp8, e8m2, e8m3, e8m4, e8m5, e8m6, got 'int4'" in result.output
    result = runner.invoke(cache_cli, ["build", "--target", str(tmp_path), "--corpus", "x.jsonl", "--out", "o", "--layers", "1,x"])
    assert result.exit_code == 2 and "comma-separated integers" in result.output
    result = runner.invoke(train_cli, ["--cache", str(tmp_path), "--out", "o", "--method", "eagle"])
    assert result.exit_code == 2 and "--method must be one of" in result.output
    # A directory that is not a cache: one line naming the manifest file.
    result = runner.invoke(train_cli, ["--cache", str(tmp_path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 1
    error = result.output.strip()
    assert error.startswith("Error: ") and "manifest.json" in error and "\n" not in error
