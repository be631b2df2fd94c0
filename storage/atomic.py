"""Atomic writes: a reader sees either the old file (or directory) or the whole new one.

Every file the project writes that another process may read goes through here: the manifest, the
target head, shards, the tokenized corpus, the trainer's checkpoints, a drafter export, an
output's lock and record (docs/design.md, "The cache contract"). The pattern is a temp name in the
same directory, fsync, os.replace, fsync of the directory, so a crash at any point leaves no
half-written file under the final name. This is the one place that renames a temp name into place:

- `atomic_write_bytes` / `atomic_write_text`: a whole file from bytes or text;
- `atomic_write(path, write)`: `write(tmp_path)` fills the temp file (a library's own saver);
- `atomic_write_dir(path, write)`: the same for a directory;
- `move_into_place(tmp, final)`: a temp file or directory the caller finished itself, renamed over
  `final` (a download's partial file, a shard's temp directory);
- `create_exclusive_text(path, text)`: a new file, never seen empty, FileExistsError if the name
  is taken (a lock).

`sync=False` (atomic_write, move_into_place) keeps the rename and skips the fsyncs, for scratch
files that a crash makes moot anyway (a download cache, a vLLM worker's hand-off file).

A store URL (storage.location) has no rename: a file is written to a local temp file and uploaded
as one object, which appears whole or not at all; a directory is uploaded file by file, so on a
store its files are atomic one by one, not together (docs/design.md, "Caches on object stores").
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from storage.location import is_url, remove_path, remove_path_tolerant, resolve

# remove_path and remove_path_tolerant live in storage.location (its LocalDir removes with them);
# they stay importable from here.
__all__ = [
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_dir",
    "atomic_write_text",
    "create_exclusive_text",
    "fsync_path",
    "fsync_tree",
    "move_into_place",
    "remove_path",
    "remove_path_tolerant",
]


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# fsyncs in flight together: the filesystem's journal commits them together instead of one
# commit each (a Zarr shard is ~100 files and directories; docs/benchmarks.md, "Real shapes" (e)).
FSYNC_THREADS = 8


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory under `path` (or `path` itself if it is a file), several at
    a time; all are done when it returns (nothing is published before, so their order is free)."""
    path = Path(path)
    if path.is_file():
        fsync_path(path)
        return
    paths = [Path(root) / name for root, _dirs, names in os.walk(path) for name in [*names, ""]]
    with concurrent.futures.ThreadPoolExecutor(max_workers=FSYNC_THREADS, thread_name_prefix="fsync") as pool:
        list(pool.map(fsync_path, paths))  # (an error of one raises here)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], *, sync: bool = True) -> None:
    """Create `path` atomically: `write(tmp_path)` fills a temp file in the same directory, which
    is fsynced and renamed over `path`; for a store URL, a local temp file uploaded as one object.
    `sync` False: renamed without the fsyncs (still never seen half-written, not durable)."""
    if is_url(path):
        _upload_written(str(path), write)
        return
    path = Path(path)
    tmp = str(path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask's mode, as a plain open (mkstemp's is 0600)
    try:
        write(tmp)
        move_into_place(tmp, path, sync=sync)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def move_into_place(tmp: str | os.PathLike, final: str | os.PathLike, *, sync: bool = True) -> None:
    """Rename `tmp`, a finished file or directory on `final`'s filesystem, over `final` (a local
    path; an existing directory at `final` is refused by the OS). With `sync`, `tmp` (its whole
    tree) is fsynced first and `final`'s directory after, so the rename survives a crash."""
    if sync:
        fsync_tree(tmp)
    os.replace(tmp, final)
    if sync:
        fsync_path(Path(final).parent)


def create_exclusive_text(path: str | os.PathLike, text: str) -> None:
    """Create the local file `path` holding `text`, or raise FileExistsError when the name is
    taken. The text is written to a temp name first and hard-linked into place (a link fails if
    the name exists), so the file is never seen empty or partial: a lock whose holder is unreadable
    would refuse every later process. Where the filesystem has no hard links: an exclusive create,
    removed again if writing the text fails."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.new-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(text)
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            raise
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    if is_url(path):  # one PUT, no temp file
        parent, _, name = str(path).rstrip("/").rpartition("/")
        resolve(parent).write_bytes(name, data)
        return
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_dir(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Create directory `path` atomically: `write(tmp_dir)` fills a temp sibling directory, which is
    fsynced and renamed to `path`. An existing `path` is replaced (moved aside first, removed after
    the rename), so callers must only point this at a directory they own. For a store URL the temp
    directory is local and its files are uploaded one object each, over the objects of an older
    write, whose other objects are removed after: each file is whole, the set is not atomic."""
    if is_url(path):
        _upload_written_dir(str(path), write)
        return
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


def _upload_written(url: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a local temp file, uploaded as the one object `url`."""
    parent, _, name = url.rstrip("/").rpartition("/")
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        resolve(parent).put_file(tmp, name)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _upload_written_dir(url: str, write: Callable[[Path], None]) -> None:
    """`write(tmp_dir)` fills a local temp directory, uploaded file by file under `url`."""
    with tempfile.TemporaryDirectory(prefix=f".{url.rstrip('/').rpartition('/')[2]}.tmp-") as tmp:
        write(Path(tmp))
        resolve(url).upload_dir(tmp)
