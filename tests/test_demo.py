"""The README's main job end to end at `--quick` size: world, Ray cache build, five trainings,
speculative decoding, table, results.json and plot; then a rerun that resumes every phase. Its
figures are the ones docs/ records (docs/demo/quick-seed0.json): a change that moves any demo number
fails here until `bash .ci/demo --record` has regenerated docs/ (docs/results.md, "The demo")."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pipeline.demo.record import QUICK_FILE, RECORD_COMMAND, figures
from pipeline.demo.run import DEMO_METHODS, PLOT_FILE, RESULTS_FILE
from pipeline.outputs import differences
from tests.waits import run_to_end

ROOT = Path(__file__).resolve().parents[1]


def _run_demo(out, ray_address):
    command = [sys.executable, "-m", "pipeline.demo", "--quick", "--out", str(out), "--temperatures", "0"]
    # RAY_ADDRESS makes the demo's `alrira-cache build` join the session's cluster instead of starting one.
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    return run_to_end(command, env=env)


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory, ray_address):
    """One quick demo for the module: its --out and its first run."""
    out = tmp_path_factory.mktemp("quick-demo") / "demo"
    first = _run_demo(out, ray_address)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return out, first


def test_quick_demo_runs_every_phase_and_resumes(quick_demo, ray_address):
    out, first = quick_demo
    report = json.loads((out / RESULTS_FILE).read_text())
    assert list(report["methods"]) == list(DEMO_METHODS)
    for method, result in report["methods"].items():
        t0 = result["T0"]
        # Lossless: at T = 0 every prompt decoded exactly the target's own greedy text.
        assert t0["lossless_mismatches"] == 0, method
        assert 1.0 <= t0["tau"] <= 16.0, (method, t0["tau"])
        assert t0["speedup"] > 0
        assert result["train_s"] > 0 and result["final_loss"] > 0
    assert (out / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = first.stdout[first.stdout.index("method   tau T=0") :]
    for method in DEMO_METHODS:
        assert f"\n{method} " in table
    assert (out / "cache" / "manifest.json").is_file()
    for method in DEMO_METHODS:
        assert (out / "runs" / method / "drafter" / "config.json").is_file()

    # A second run finds every phase done and prints the same numbers.
    second = _run_demo(out, ray_address)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "world: reusing" in second.stdout and "cache: reusing" in second.stdout
    assert all(f"train {m}: reusing" in second.stdout for m in DEMO_METHODS)
    again = json.loads((out / RESULTS_FILE).read_text())
    for method in DEMO_METHODS:
        assert again["methods"][method]["T0"]["tau"] == report["methods"][method]["T0"]["tau"]


def test_quick_demo_figures_are_the_ones_docs_record(quick_demo):
    """Every tau, loss, per-slot accuracy and world statistic of a fresh quick run equals the
    recorded run's as an exact float, and each trained drafter's weights its bytes: at one torch
    thread they are a function of the code and the seeds, whatever the core count or the load (docs/results.md, "The demo"). Another torch version,
    instruction set or CPU model rounds fp32 sums otherwise, so a machine of another kind has no
    record to compare with."""
    out, _ = quick_demo
    report = json.loads((out / RESULTS_FILE).read_text())
    recorded = json.loads((ROOT / QUICK_FILE).read_text())
    kind = {k: report["environment"].get(k) for k in ("torch", "cpu_capability", "cpu")}
    recorded_kind = {k: recorded["environment"].get(k) for k in kind}
    if kind != recorded_kind:
        pytest.skip(f"{QUICK_FILE} was recorded on {recorded_kind}, this machine is {kind}")
    changed = differences(figures(recorded), figures(report))
    assert not changed, (
        f"the quick demo's figures are not {QUICK_FILE}'s ({len(changed)} differ: {'; '.join(changed[:4])}): "
        f"the code changes the demo's numbers. If that is intended, regenerate docs/demo/ and the "
        f"tables of docs/results.md with: {RECORD_COMMAND}"
    )
