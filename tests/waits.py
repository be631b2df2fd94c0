"""Waiting on an event in a kill, interrupt or timeout test (issue 30, item 4).

No test decides pass or fail by a wall-clock bound on the code under test: on a shared, loaded
machine a Ray start or a target load can take minutes. A test waits on the event itself (a shard
published, a process started, a thread ended); the cap only turns a hang into a failure that says
so, and is generous (ALRIRA_TEST_HANG_CAP_S, 900 s by default)."""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

HANG_CAP_S = float(os.environ.get("ALRIRA_TEST_HANG_CAP_S", "900"))

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
