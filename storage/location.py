"""Where a cache lives: a local directory, or a prefix on an object store (any fsspec URL).

`resolve(path_or_url)` gives a `LocalDir` or a `StorePrefix` with the same few operations, so the
cache code is written once: exists, list, read and write bytes, open, remove a file or a tree, the
files under a prefix with their sizes, and a local copy of a prefix for code that needs real files
(np.load with mmap, safetensors). A path without `://` and a `file://` URL are local; `s3://...`
and every other fsspec protocol are stores. Credentials and endpoints come the usual way
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, fsspec config), never from the URL.

What differs (docs/design.md, "Caches on object stores"): a store has no rename, so nothing here
pretends to make a tree appear at once; one object written whole (`write_bytes`, `put_file`, a
file from `open_write` committed on close) is atomic, which is what the cache's publish rule
relies on. Atomic writes of a local file (temp, fsync, rename) are storage.atomic's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from storage.errors import first_line

LOCAL_COPIES_DIR = "alrira-store-copies"  # under the temp dir ($TMPDIR): node-local copies of store prefixes
SAFETENSORS_HEADER_LIMIT = 100 << 20  # safetensors refuses larger headers too


def is_url(where: str | os.PathLike) -> bool:
    """Whether `where` names a store URL (`proto://...`) rather than a local path."""
    return not isinstance(where, os.PathLike) and "://" in str(where)


def resolve(where: str | os.PathLike | Location) -> Location:
    """The location a path or URL names; ValueError naming it for an unknown protocol."""
    if isinstance(where, (LocalDir, StorePrefix)):
        return where
    if not is_url(where):
        return LocalDir(Path(where))
    url = str(where).rstrip("/")
    if url.startswith("file://"):
        return LocalDir(Path(url.removeprefix("file://")))
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    # No listing cache: another process (a worker, a second build) changes the prefix meanwhile.
    options = {"use_listings_cache": False}
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ValueError, ImportError) as error:
        raise ValueError(f"{url}: not a storage location fsspec can open ({first_line(error)})") from None
    if isinstance(fs, LocalFileSystem):
        return LocalDir(Path(root))
    return StorePrefix(fs=fs, root=root.rstrip("/"), url=url, storage_options=options)


# ---------------------------------------------------------------------------------------------
# Local directories


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


class LocalDir:
    """A local directory (the behaviour every cache had before stores: os calls, nothing else)."""

    is_local = True

    def __init__(self, path: Path):
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LocalDir({str(self.path)!r})"

    @property
    def local_path(self) -> Path:
        return self.path

    def child(self, relative: str) -> LocalDir:
        return LocalDir(self.path / relative)

    def join(self, relative: str) -> Path:
        """What code that opens files itself is handed: a Path here, a URL for a store."""
        return self.path / relative

    def exists(self, relative: str = "") -> bool:
        path = self._at(relative)
        return path.exists() or path.is_symlink()

    def is_file(self, relative: str = "") -> bool:
        return self._at(relative).is_file()

    def is_dir(self, relative: str = "") -> bool:
        return self._at(relative).is_dir()

    def names(self, relative: str = "") -> list[str]:
        """Names directly under `relative`, sorted ([] if it is not a directory)."""
        path = self._at(relative)
        return sorted(p.name for p in path.iterdir()) if path.is_dir() else []

    def files(self, relative: str = "") -> list[tuple[str, int]]:
        """(posix path relative to `relative`, size) of every file under it, sorted; a file is
        [("", size)]."""
        path = self._at(relative)
        if path.is_file():
            return [("", path.stat().st_size)]
        found = []
        for root, _, names in os.walk(path):
            for name in names:
                full = Path(root) / name
                found.append((full.relative_to(path).as_posix(), full.stat().st_size))
        return sorted(found)

    def read_bytes(self, relative: str = "") -> bytes:
        return self._at(relative).read_bytes()

    def read_range(self, relative: str, offset: int, size: int) -> bytes:
        with open(self._at(relative), "rb") as f:
            return os.pread(f.fileno(), size, offset)

    def open(self, relative: str = "", mode: str = "rb") -> BinaryIO:
        return open(self._at(relative), mode)

    def make_dirs(self, relative: str = "") -> None:
        self._at(relative).mkdir(parents=True, exist_ok=True)

    def remove(self, relative: str = "") -> None:
        """Remove a file or tree, tolerating a writer that still changes it (remove_path_tolerant)."""
        remove_path_tolerant(self._at(relative))

    def remove_dir_if_empty(self, relative: str = "") -> None:
        path = self._at(relative)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()

    def local_copy(self) -> Path:
        """A local directory holding these files: this one."""
        return self.path

    def _at(self, relative: str) -> Path:
        return self.path / relative if relative else self.path


# ---------------------------------------------------------------------------------------------
# Object stores


class StorePrefix:
    """A prefix on an object store, through fsspec. Errors of the store's client that are not
    already OSError (an unreachable endpoint, bad credentials) become one OSError naming the URL."""

    is_local = False
    local_path = None

    def __init__(self, *, fs, root: str, url: str, storage_options: dict):
        self.fs, self.root, self.url, self.storage_options = fs, root, url, storage_options

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"StorePrefix({self.url!r})"

    def __reduce__(self):
        # fsspec clients are not fork-safe: a pickled location resolves its filesystem again.
        return resolve, (self.url,)

    def child(self, relative: str) -> StorePrefix:
        return StorePrefix(fs=self.fs, root=self._at(relative), url=self.join(relative), storage_options=self.storage_options)

    def join(self, relative: str) -> str:
        return f"{self.url}/{relative}" if relative else self.url

    def exists(self, relative: str = "") -> bool:
        return self._call(relative, lambda path: self.fs.exists(path))

    def is_file(self, relative: str = "") -> bool:
        return self._call(relative, lambda path: self.fs.isfile(path))

    def is_dir(self, relative: str = "") -> bool:
        """Whether objects exist under the prefix (a store has no empty directories)."""
        return self._call(relative, lambda path: self.fs.isdir(path))

    def names(self, relative: str = "") -> list[str]:
        def list_names(path: str) -> list[str]:
            try:
                entries = self.fs.ls(path, detail=True)  # one listing request
            except FileNotFoundError:
                return []
            if [entry["name"] for entry in entries] == [path] and entries[0]["type"] == "file":
                return []  # `relative` is an object, not a prefix
            return sorted(entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries)

        return self._call(relative, list_names)

    def _listed(self, relative: str) -> list[tuple[str, dict]]:
        """(posix path relative to `relative`, fsspec info) of every object under it, sorted, from
        one listing; an object itself is [("", info)]."""

        def list_objects(path: str) -> list[tuple[str, dict]]:
            found = self.fs.find(path, detail=True)
            if list(found) == [path]:  # the prefix is one object (a tar shard)
                return [("", found[path])]
            return sorted(((name[len(path) + 1 :], info) for name, info in found.items() if name != path), key=lambda x: x[0])

        return self._call(relative, list_objects)

    def files(self, relative: str = "") -> list[tuple[str, int]]:
        return [(name, int(info["size"])) for name, info in self._listed(relative)]

    def object_tags(self, relative: str = "") -> list[tuple[str, int, str]]:
        """(relative path, size, tag) of every object under `relative` (or of the object itself), from
        one listing: the tag is the store's version of the object's bytes (S3's ETag; another
        store's etag or generation, else fsspec's ukey), which a rewrite changes unless it writes
        the same bytes."""

        def tag(name: str, info: dict) -> str:
            found = info.get("ETag") or info.get("etag") or info.get("generation")
            return str(found or self._call(f"{relative}/{name}".strip("/"), lambda path: self.fs.ukey(path)))

        return [(name, int(info["size"]), tag(name, info)) for name, info in self._listed(relative)]

    def read_bytes(self, relative: str = "") -> bytes:
        return self._call(relative, lambda path: self.fs.cat_file(path))

    def read_range(self, relative: str, offset: int, size: int) -> bytes:
        """`size` bytes at `offset` (one ranged GET)."""
        return self._call(relative, lambda path: self.fs.cat_file(path, start=offset, end=offset + size))

    def open(self, relative: str = "", mode: str = "rb", **kwargs) -> BinaryIO:
        """A file object; one opened for writing creates its object only when it is closed."""
        return self._call(relative, lambda path: self.fs.open(path, mode, **kwargs))

    def write_bytes(self, relative: str, data: bytes) -> None:
        """One PUT: the object appears whole or not at all."""
        self._call(relative, lambda path: self.fs.pipe_file(path, data))

    def put_file(self, local: str | os.PathLike, relative: str) -> None:
        """Upload a local file as one object (multipart for large ones: still visible only once whole)."""
        self._call(relative, lambda path: self.fs.put_file(os.fspath(local), path))

    def download(self, relative: str, local: str | os.PathLike) -> None:
        """Copy one object to a local file (streamed, not held in memory)."""
        self._call(relative, lambda path: self.fs.get_file(path, os.fspath(local)))

    def upload_dir(self, local_dir: str | os.PathLike) -> None:
        """Upload every file under `local_dir` as one object each under this prefix, then remove the
        objects here that `local_dir` does not hold: each object is whole, the set is not atomic."""
        local_dir = Path(local_dir)
        written = {p.relative_to(local_dir).as_posix(): p for p in sorted(local_dir.rglob("*")) if p.is_file()}
        for relative, file in written.items():
            self.put_file(file, relative)
        for relative, _ in self.files():
            if relative not in written:
                self.remove(relative)

    def make_dirs(self, relative: str = "") -> None:
        """Nothing to do: a prefix exists once an object is under it."""

    def remove(self, relative: str = "") -> None:
        """Remove the object `relative` and every object under `relative/` (missing: nothing)."""

        def remove_tree(path: str) -> None:
            found = self.fs.find(path)
            if found:
                self.fs.rm(found)

        self._call(relative, remove_tree)

    def remove_dir_if_empty(self, relative: str = "") -> None:
        """Nothing to do: an empty prefix does not exist."""

    def local_copy(self) -> Path:
        """A node-local copy of every object under this prefix, downloaded once per content (named
        by the objects' tags, ETags on S3): the build's workers on one node share one
        copy of the tokenized corpus and memory-map it (docs/design.md, "Caches on object stores")."""
        keys = self.object_tags()  # one listing
        if not keys:
            raise ValueError(f"{self.url}: no objects there")
        digest = hashlib.sha256(json.dumps([self.url, keys]).encode()).hexdigest()[:32]
        copies = Path(tempfile.gettempdir()) / LOCAL_COPIES_DIR
        final = copies / digest
        if final.is_dir():
            return final
        copies.mkdir(parents=True, exist_ok=True)
        partial = copies / f".{digest}.{uuid.uuid4().hex}"
        try:
            for relative, _, _ in keys:
                (partial / relative).parent.mkdir(parents=True, exist_ok=True)
                self.download(relative, partial / relative)
            try:
                os.rename(partial, final)
            except OSError as error:  # another process on this node finished the same copy first
                if not final.is_dir():
                    raise error from None
        finally:
            remove_path(partial)
        return final

    def _at(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def _call(self, relative: str, operation):
        path = self._at(relative)
        try:
            return operation(path)
        except (OSError, ValueError):
            raise
        except Exception as error:  # the client's own errors (botocore, aiohttp): one line naming the object
            raise OSError(errno.EIO, f"{type(error).__name__}: {first_line(error)}", self.join(relative)) from None


Location = LocalDir | StorePrefix


def read_safetensors_header(location: Location, relative: str) -> dict:
    """The JSON header of a safetensors file (tensor dtypes, shapes, offsets and `__metadata__`),
    read without the tensors: two small reads, not the whole file (a target head is GBs)."""
    size = int.from_bytes(location.read_range(relative, 0, 8), "little")
    if not 2 <= size <= SAFETENSORS_HEADER_LIMIT:
        raise ValueError(f"{location.join(relative)}: not a safetensors file (header size {size})")
    try:
        header = json.loads(location.read_range(relative, 8, size))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{location.join(relative)}: not a safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{location.join(relative)}: not a safetensors file (header is not a JSON object)")
    return header
