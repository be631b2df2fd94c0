"""Names that come from outside (a store listing, a tar member, a manifest value) made into local
paths only after a check (docs/design.md, "Bad input"): a name that would land outside its
directory is refused in one line naming it, before anything touches the disk."""

from __future__ import annotations

import os
import re
from pathlib import Path

_DRIVE = re.compile(r"^[A-Za-z]:")  # C:, d:... a Windows drive


def unsafe_name_reason(name: object) -> str | None:
    """Why `name` (a posix path relative to a directory) could leave that directory, or None."""
    if not isinstance(name, str) or not name:
        return "an empty name"
    if "\\" in name or "\x00" in name:
        return "a backslash or NUL in it"
    if name.startswith("/") or _DRIVE.match(name):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "an empty, '.' or '..' segment"
    return None


def checked_join(root: str | os.PathLike, name: str, *, source: str) -> Path:
    """`root / name`, or ValueError naming `source` and `name` when `name` is not a plain relative
    path (`..`, absolute, drive-like, backslashes) or resolves, through a symlink already on disk,
    outside `root`. `source` says where the name came from (a listing URL, a tar, a manifest)."""
    reason = unsafe_name_reason(name)
    if reason is None:
        path = Path(root) / name
        real_root = Path(root).resolve()
        if path.resolve().is_relative_to(real_root) and path.resolve() != real_root:
            return path
        reason = "a symlink out of the directory"
    raise ValueError(f"{source}: refused name {name!r} ({reason}): it would be written outside {root}")
