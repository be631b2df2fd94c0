"""benchmarks/speed/wds_storage.py still runs at its --quick size and reports what it must (no timings)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.waits import run_to_end

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_wds_storage_benchmark_reports_every_storage_for_both_codecs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = run_to_end([sys.executable, "-m", "benchmarks.speed.wds_storage", "--quick", "--out", str(tmp_path / "work")], cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("storage ")]
    assert len(tables) == 2  # bf16, fp8
    for start in tables:
        rows = {}
        for line in lines[start + 2 : start + 6]:
            cells = re.split(r"\s{2,}", line.strip())
            rows[cells[0]] = cells
        assert list(rows) == ["zarr", "wds compressed", "wds compressed, no CRC", "wds uncompressed .npy"]
        megabytes = {label: float(cells[1]) for label, cells in rows.items()}
        assert max(megabytes["wds compressed"], megabytes["wds compressed, no CRC"]) < megabytes["wds uncompressed .npy"]
        assert rows["zarr"][-1] == "-" and all(float(cells[-1]) > 0 for label, cells in rows.items() if label != "zarr")
