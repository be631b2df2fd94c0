"""tests/waits.py, and the rule it serves: no test decides pass or fail by a
wall-clock bound on the code under test. Caps only turn a hang into a failure that says so."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.waits import HANG_CAP_S, run_to_end

TESTS = Path(__file__).resolve().parent

# Literal timeouts that bound no code under test: one poll of a loop that has its own cap, the
# teardown of a server already told to stop, the CUDA-only GPU check, and the connect timeout whose
# own behaviour test_security_store.py tests.
ALLOWED = {
    ("s3_fixtures.py", "urlopen("),
    ("s3_fixtures.py", "server.wait("),
    ("test_gpu_check.py", "timeout=3600"),
    ("test_security_store.py", "probe_ray_address("),
}


def test_a_command_past_its_cap_fails_saying_it_is_a_hang_cap():
    with pytest.raises(AssertionError, match=r"still running after 1 s \(a cap against hangs, not a speed bound"):
        run_to_end([sys.executable, "-c", "import time; time.sleep(60)"], cap_s=1)
    done = run_to_end([sys.executable, "-c", "print('done')"], cap_s=HANG_CAP_S)
    assert done.returncode == 0 and done.stdout == "done\n"


def test_no_test_bounds_a_command_by_a_literal_number_of_seconds():
    """A `timeout=600` on a benchmark's run failed the suite beside two busy loops (Ray's workers
    run at a lower priority and took longer): every cap comes from tests/waits.py."""
    found = []
    for path in sorted(set(TESTS.glob("*.py")) - {Path(__file__).resolve()}):  # this file names them
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\btimeout(_s)?=\d", line) and not any(path.name == name and marker in line for name, marker in ALLOWED):
                found.append(f"{path.name}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
