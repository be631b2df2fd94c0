"""The README's main job end to end at `--quick` size: world, Ray cache build, five trainings,
speculative decoding, table, results.json and plot; then a rerun that resumes every phase."""

from __future__ import annotations

import json
import os
import sys

from pipeline.demo.run import DEMO_METHODS, PLOT_FILE, RESULTS_FILE
from tests.waits import run_to_end


def _run_demo(out, ray_address):
    command = [sys.executable, "-m", "pipeline.demo", "--quick", "--out", str(out), "--temperatures", "0"]
    # RAY_ADDRESS makes the demo's `alrira-cache build` join the session's cluster instead of starting one.
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    return run_to_end(command, env=env)


def test_quick_demo_runs_every_phase_and_resumes(tmp_path, ray_address):
    out = tmp_path / "demo"
    first = _run_demo(out, ray_address)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

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
