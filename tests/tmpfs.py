"""A small tmpfs mounted for one test: a full disk (its size) or a read-only filesystem.

The tests run as root; where mounting is not permitted the test is skipped, saying why."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(path: Path, *, size: str = "1m", read_only: bool = False):
    """A tmpfs of `size` at `path` (created if missing), read-only if asked; unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
