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
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import BinaryIO

from storage.errors import first_line, has_userinfo, redact_url
from storage.paths import checked_join

LOCAL_COPIES_DIR = "alrira-store-copies"  # under the temp dir ($TMPDIR): node-local copies of store prefixes
COPY_LISTING_FILE = ".alrira-listing.json"  # in each local copy: the listing it was made from
SAFETENSORS_HEADER_LIMIT = 100 << 20  # safetensors refuses larger headers too
# One store request, its retries included, ends within this many seconds (a frozen endpoint that
# accepts connections and never answers included): docs/design.md, "Caches on object stores".
STORE_TIMEOUT_ENV = "ALRIRA_STORE_TIMEOUT_S"
DEFAULT_STORE_TIMEOUT_S = 60.0
S3FS_ATTEMPTS, BOTOCORE_ATTEMPTS = 3, 2  # s3fs retries a timed-out call, botocore each request


def env_seconds(name: str, default: float) -> float:
    """The number of seconds in environment variable `name` (`default` when unset); ValueError
    naming it when it is not a positive finite number."""
    text = os.environ.get(name, "")
    try:
        seconds = float(text) if text else default
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{name}={text}: expected a positive number of seconds")
    return seconds


def store_timeout_s() -> float:
    return env_seconds(STORE_TIMEOUT_ENV, DEFAULT_STORE_TIMEOUT_S)


def refuse_userinfo(url: str | os.PathLike, *, flag: str | None = None) -> None:
    """ValueError, the URL redacted, when a URL carries credentials: they belong in the environment
    (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), where they are never echoed or recorded."""
    if isinstance(url, str) and has_userinfo(url):
        named = f"{flag} {redact_url(url)}" if flag else redact_url(url)
        raise ValueError(
            f"{named}: credentials in a URL are refused; set them in the environment (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY) and pass the URL without them"
        )


def _store_options(protocol: str) -> dict:
    """fsspec options of a store: no listing cache (another process, a worker or a second build,
    changes the prefix meanwhile) and, on S3, connect/read timeouts and retries bounded so that a
    request ends within store_timeout_s()."""
    options: dict = {"use_listings_cache": False}
    if protocol in ("s3", "s3a"):
        each = store_timeout_s() / (S3FS_ATTEMPTS * BOTOCORE_ATTEMPTS)
        options["config_kwargs"] = {
            "connect_timeout": each, "read_timeout": each,
            "retries": {"total_max_attempts": BOTOCORE_ATTEMPTS, "mode": "standard"},
        }  # fmt: skip
    return options


# The store clients whose API this module relies on, and the oldest release tested (pyproject.toml
# declares the same bounds; tests/test_dependencies.py keeps the two equal). An older one can be
# picked by a resolver that has boto3 pinned: s3fs 0.4.2's session cannot even start.
STORE_CLIENTS = {"s3": "s3fs", "s3a": "s3fs"}
MIN_CLIENT_VERSIONS = {"fsspec": "2026.9.0", "s3fs": "2026.9.0"}


def _version_tuple(version: str) -> tuple[int, ...]:
    """(2026, 9, 0) from "2026.9.0" (or "2026.9.0.post1", "0.4.2"): enough to compare calendar versions."""
    numbers = []
    for part in version.split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if not digits:
            break
        numbers.append(int(part[:digits]))
        if digits < len(part):  # "0rc1": a pre-release of 0
            break
    return tuple(numbers)


def _installed(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _client_versions(protocol: str) -> str:
    packages = ["fsspec", *([STORE_CLIENTS[protocol]] if protocol in STORE_CLIENTS else [])]
    return ", ".join(f"{p} {_installed(p) or 'not installed'}" for p in packages)


def check_store_client(protocol: str, *, where: str) -> None:
    """One-line ValueError naming the package and the version found when the client of `protocol`
    (and fsspec) is missing or older than the release tested."""
    problem = _client_problem(protocol)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")


@functools.cache
def _client_problem(protocol: str) -> str | None:
    """What is wrong with the installed client of `protocol`, looked up once per process."""
    for package in ("fsspec", *([STORE_CLIENTS[protocol]] if protocol in STORE_CLIENTS else [])):
        found, minimum = _installed(package), MIN_CLIENT_VERSIONS[package]
        if found is None:
            return f"needs the package {package} (>= {minimum}), which is not installed; pip install '{package}>={minimum}'"
        if _version_tuple(found) < _version_tuple(minimum):
            return f"needs {package} >= {minimum} (the oldest release tested), found {package} {found}; pip install -U '{package}>={minimum}'"
    return None


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
    refuse_userinfo(url)
    if url.startswith("file://"):
        return LocalDir(Path(url.removeprefix("file://")))
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    protocol = url.split("://", 1)[0]
    check_store_client(protocol, where=url)
    options = _store_options(protocol)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except (ValueError, ImportError) as error:
        raise ValueError(f"{url}: not a storage location fsspec can open ({first_line(error)})") from None
    except Exception as error:  # a client whose API is not the one tested (its constructor's arguments, say)
        raise ValueError(f"{url}: the store client failed to start ({_client_versions(protocol)}): {type(error).__name__}: {first_line(error)}") from None
    if isinstance(fs, LocalFileSystem):
        return LocalDir(Path(root))
    if "config_kwargs" in options:
        fs.retries = S3FS_ATTEMPTS  # a class attribute of s3fs, not an option
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
        return self._kind(relative) is not None

    def is_file(self, relative: str = "") -> bool:
        return self._kind(relative) == "file"

    def is_dir(self, relative: str = "") -> bool:
        """Whether objects exist under the prefix (a store has no empty directories)."""
        return self._kind(relative) == "directory"

    def _kind(self, relative: str) -> str | None:
        """"file", "directory", or None when nothing is there. fsspec's exists/isfile answer False
        for any error; here an unreachable endpoint or refused credentials are raised as what
        they are (one OSError naming the URL), not taken for a missing object."""

        def kind(path: str) -> str | None:
            try:
                return self.fs.info(path)["type"]
            except FileNotFoundError:
                return None

        return self._call(relative, kind)

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
        copy of the tokenized corpus and memory-map it (docs/design.md, "Caches on object stores").

        Every listed key is checked before it becomes a local path (storage.paths.checked_join). A
        copy already there is reused only if it holds exactly the listed files at their sizes, and
        was made from the same listing; another is replaced. The copies this process made are
        removed by remove_local_copies (the build does it when it ends, on the driver and workers).
        A URL naming one object (a corpus file) is copied under its own name: `copy / basename`."""
        keys = self.object_tags()  # one listing
        if not keys:
            raise ValueError(f"{self.url}: no objects there")
        if [name for name, _, _ in keys] == [""]:
            keys = [(self.url.rsplit("/", 1)[-1], keys[0][1], keys[0][2])]
            return self._copy_objects(keys, download=lambda relative, local: self.download("", local))
        return self._copy_objects(keys, download=self.download)

    def _copy_objects(self, keys: list[tuple[str, int, str]], *, download) -> Path:
        """local_copy's work: `keys` (relative path, size, tag) downloaded with `download(relative, local)`."""
        digest = hashlib.sha256(json.dumps([self.url, keys]).encode()).hexdigest()[:32]
        copies = _local_copies_dir()
        final = copies / digest
        listing = json.dumps({"url": self.url, "objects": keys})
        if _copy_matches(final, keys, listing):
            return final
        partial = copies / f".{digest}.{uuid.uuid4().hex}"
        try:
            partial.mkdir(mode=0o700)
            for relative, _, _ in keys:
                local = checked_join(partial, relative, source=f"{self.url} (listing)")
                local.parent.mkdir(parents=True, exist_ok=True)
                download(relative, local)
            (partial / COPY_LISTING_FILE).write_text(listing)
            if _copy_matches(final, keys, listing):  # another process on this node finished first
                return final
            if final.exists() or final.is_symlink():  # a copy that no longer matches: replaced
                remove_path(final)
            try:
                os.rename(partial, final)
            except OSError as error:  # another process on this node finished the same copy first
                if not _copy_matches(final, keys, listing):
                    raise error from None
            else:
                _COPIES_MADE.add(final)
        finally:
            remove_path(partial)
        return final

    def _at(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def _call(self, relative: str, operation):
        path = self._at(relative)
        try:
            return operation(path)
        except OSError as error:
            if error.filename is not None:
                raise
            # s3fs's read timeout, a missing bucket: the same error (a FileNotFoundError stays one), naming the object
            kind = type(error) if type(error).__module__ == "builtins" else OSError  # a client's own takes other arguments
            text = error.strerror or first_line(error)
            if "Timeout" in type(error).__name__ or isinstance(error, TimeoutError):
                text += f" (no answer within {STORE_TIMEOUT_ENV}={store_timeout_s():g}s, all retries included)"
            raise kind(error.errno or errno.EIO, text, self.join(relative)) from None
        except ValueError:
            raise
        except Exception as error:  # the client's own errors (botocore, aiohttp): one line naming the object
            raise OSError(errno.EIO, f"{type(error).__name__}: {first_line(error)}", self.join(relative)) from None


Location = LocalDir | StorePrefix

_COPIES_MADE: set[Path] = set()  # node-local copies this process downloaded (StorePrefix.local_copy)


def _local_copies_dir() -> Path:
    """$TMPDIR/alrira-store-copies, made private to this user; refused in one line when it is a
    symlink or another user's directory (the temp dir is shared: someone could plant either)."""
    copies = Path(tempfile.gettempdir()) / LOCAL_COPIES_DIR
    copies.mkdir(mode=0o700, exist_ok=True)
    if copies.is_symlink() or not copies.is_dir() or copies.stat().st_uid != os.getuid():
        raise ValueError(f"{copies}: not a directory of this user; remove it or set TMPDIR elsewhere")
    return copies


def _copy_matches(copy: Path, keys: list[tuple[str, int, str]], listing: str) -> bool:
    """Whether `copy` is a real directory made from `listing` holding exactly `keys` at their sizes."""
    if copy.is_symlink() or not copy.is_dir():
        return False
    try:
        if (copy / COPY_LISTING_FILE).read_text() != listing:
            return False
        found = LocalDir(copy).files()
    except OSError:
        return False
    return found == sorted([(COPY_LISTING_FILE, len(listing.encode()))] + [(name, size) for name, size, _ in keys])


def remove_local_copies() -> list[Path]:
    """Remove the node-local copies this process made (never another's); returns them."""
    removed = sorted(_COPIES_MADE)
    for copy in removed:
        remove_path_tolerant(copy)
    _COPIES_MADE.clear()
    return removed


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
