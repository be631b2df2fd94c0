"""Waiting on an event in a kill, interrupt or timeout test.

No test decides pass or fail by a wall-clock bound on the code under test: on a shared, loaded
machine a Ray start or a target load can take minutes. A test waits on the event itself (a shard
published, a process started, a thread ended); the cap only turns a hang into a failure that says
so, and is generous (ALRIRA_TEST_HANG_CAP_S, 900 s by default). A whole script a test runs (a
benchmark at its --quick size, the demo, a serving check) gets twice that: under two busy loops
Ray's workers, which run at niceness 15, took over 10 minutes for a --quick benchmark
(docs/benchmarks.md, "Chaos")."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Callable, TypeVar

HANG_CAP_S = float(os.environ.get("ALRIRA_TEST_HANG_CAP_S", "900"))
SCRIPT_CAP_S = 2 * HANG_CAP_S

T = TypeVar("T")


def wait_for(check: Callable[[], T], *, what: str, ended: Callable[[], bool] | None = None, cap_s: float = HANG_CAP_S, poll_s: float = 0.02) -> T | None:
    """Call `check()` until it returns a truthy value, and return that value. Returns None when
    `ended()` turns true first (the process or thread that should have made the event is gone: the
    caller says what that means). Fails after `cap_s` with a message naming `what`."""
    deadline = time.monotonic() + cap_s
    while True:
        found = check()
        if found:
            return found
        if ended is not None and ended():
            return None
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: still not seen after {cap_s:.0f} s (a cap against hangs, not a speed bound)")
        time.sleep(poll_s)


def run_to_end(command: list[str], *, cap_s: float = SCRIPT_CAP_S, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, **kwargs), its output kept; a
    command still running after `cap_s` is killed and fails with a message that says so."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=cap_s, **kwargs)
    except subprocess.TimeoutExpired as expired:
        shown = " ".join(str(part) for part in command)[:200]
        tail = (expired.stderr or b"")[-1500:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise AssertionError(f"{shown}: still running after {cap_s:.0f} s (a cap against hangs, not a speed bound; ALRIRA_TEST_HANG_CAP_S): {tail}") from None
