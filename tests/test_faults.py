"""Faults under load: a cache build killed mid-way and rerun at once while busy loops hold every
core must finish (exit 0) with a cache identical to a clean build.

The killed driver's actors live on (Ray reaps orphans asynchronously): still writing a shard's temp
directory and holding the cluster's CPUs when the rerun starts. The rerun stops them first
(ray_jobs.pool.stop_earlier_workers), so its clean-up of their temp files races no writer and its
own actors find room. ALRIRA_FAULT_ROUNDS=N repeats the round (for measuring; CI runs one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from ray_jobs.cli import cache_cli
from storage.format import SHARD_DIR
from storage.manifest import load_manifest
from storage.verify import verify_cache
from tests.test_cache_build import _cli_args
from tests.waits import wait_for

pytestmark = pytest.mark.slow

NUM_ROUNDS = int(os.environ.get("ALRIRA_FAULT_ROUNDS", "1"))
LOAD_SECONDS = 60  # per round; the busy loops stop themselves even if the test process dies
# Niced so that the build still gets most of the cores (the test stays short), while every core
# is contended: the scheduler keeps preempting the killed build's orphans and the rerun.
LOAD_NICE = int(os.environ.get("ALRIRA_FAULT_NICE", "10"))
BUSY_LOOP = "import os, time\nos.nice({nice})\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def _busy_loops(seconds: float) -> list[subprocess.Popen]:
    """One spinning process per core, each ending itself after `seconds`."""
    code = BUSY_LOOP.format(seconds=seconds, nice=LOAD_NICE)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]


def _kill_during_build(args: list[str], manifest_path, *, load: list) -> int:
    """Start `alrira-cache build` in a subprocess; once its manifest lists a shard put every core
    under load (appended to `load`) and SIGKILL the driver: its actors are orphaned, one usually
    mid-write. Returns the number of shards listed. It waits on the first shard, not on a clock (a
    Ray start and a target load can take minutes on a machine loaded by others): tests/waits.py."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from ray_jobs.cli import cache_cli; cache_cli()", *args],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def listed() -> int:
        return len(json.loads(manifest_path.read_text())["shards"]) if manifest_path.exists() else 0

    try:
        wait_for(listed, what="the build publishing its first shard", ended=lambda: proc.poll() is not None, poll_s=0.01)
    finally:
        load.extend(_busy_loops(LOAD_SECONDS))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return listed()


def test_kill_and_rerun_under_cpu_load_gives_identical_cache(ray_address, toy_target, toy_corpus, shard1_reference, tmp_path):
    reference = load_manifest(shard1_reference)
    expected = [(s.name, s.checksum) for s in reference.shards]
    for round_index in range(NUM_ROUNDS):
        out = tmp_path / f"killed-{round_index}"
        args = _cli_args(toy_target, toy_corpus, out, ray_address, "--shard-size", "1", "--workers", "2")
        loops, started = [], time.monotonic()
        try:
            listed = _kill_during_build(args, out / "manifest.json", load=loops)
            killed_s = time.monotonic() - started
            assert listed >= 1, f"round {round_index}: the build ended before it published a shard"
            assert listed < reference.num_shards_planned, f"round {round_index}: the build finished before it could be killed"
            started = time.monotonic()
            result = CliRunner().invoke(cache_cli, args)
            rerun_s = time.monotonic() - started
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        assert result.exit_code == 0, f"round {round_index}: {result.output}"
        resumed = load_manifest(out)
        assert resumed.is_complete and [(s.name, s.checksum) for s in resumed.shards] == expected
        assert not [p for p in (out / SHARD_DIR).iterdir() if p.name.startswith(".tmp")]
        assert verify_cache(out) == [], round_index
        notes = [line for line in result.output.splitlines() if not line.startswith("cache:")]
        print(f"round {round_index}: killed at {listed} shards after {killed_s:.1f}s, rerun {rerun_s:.1f}s under load: {notes}")
