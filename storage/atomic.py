"""Atomic writes: a reader sees either the old file (or directory) or the whole new one.

Every file the project writes that another process may read goes through here: the manifest, the
target head, shards, the tokenized corpus and the trainer's checkpoints (docs/design.md, "The
cache contract"). The pattern is a temp name in the same directory, fsync, os.replace, fsync of
the directory, so a crash at any point leaves no half-written file under the final name.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under `path` (or `path` itself if it is a file)."""
    path = Path(path)
    if path.is_file():
        fsync_path(path)
        return
    for root, _dirs, names in os.walk(path, topdown=False):
        for name in names:
            fsync_path(Path(root) / name)
        fsync_path(root)


def remove_path(path: str | os.PathLike) -> None:
    """Remove a file, link or directory tree if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_path_tolerant(path: str | os.PathLike, *, attempts: int = 20) -> None:
    """remove_path for a tree another process may still be changing (a writer orphaned by a killed
    build): entries vanishing under the walk are fine, and a directory that is refilled while it
    is removed (ENOTEMPTY) is retried a few times before the error is raised."""
    path = Path(path)
    for attempt in range(attempts):
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, onerror=_ignore_vanished)
            elif path.exists() or path.is_symlink():
                path.unlink()
            if not (path.exists() or path.is_symlink()):
                return
        except FileNotFoundError:
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == attempts - 1:
                raise
        time.sleep(0.05 * (attempt + 1))
    raise OSError(errno.ENOTEMPTY, "still being written by another process", str(path))


def _ignore_vanished(function, path, exc_info) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Create `path` atomically: `write(tmp_path)` fills a temp file in the same directory, which
    is fsynced and renamed over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_dir(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Create directory `path` atomically: `write(tmp_dir)` fills a temp sibling directory, which is
    fsynced and renamed to `path`. An existing `path` is replaced (moved aside first, removed after
    the rename), so callers must only point this at a directory they own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = path.parent / f".{path.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        write(tmp)
        fsync_tree(tmp)
        if path.exists():
            old = path.parent / f".{path.name}.old-{tag}"
            os.replace(path, old)
            os.replace(tmp, path)
            remove_path(old)
        else:
            os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        remove_path(tmp)
        raise
