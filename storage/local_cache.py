"""A node-local disk cache of whole store objects, filled ahead of their reader, within a byte budget.

A shard on an object store reads fastest as one object streamed front to back (docs/benchmarks.md,
"Object store": a store is bound by its requests, not its bytes). `LocalCache` downloads shards
into a directory on the node's disk and `read_ahead` keeps downloading the next ones on a thread
while the current one is read, so the reader waits on its disk, not on the store. What the cache
holds at any moment (files being downloaded included) never exceeds its budget: a download waits
for room, and an object larger than the whole budget is refused up front (docs/design.md, "Caches
on object stores").

Each reading process owns one subdirectory, `reader-<pid>-<id>`, under the cache root, removed when
it closes. A process killed before that (a DataLoader worker stopped at an epoch's end) leaves its
subdirectory behind; the next cache opened under the root, and `sweep_orphans`, remove those whose
process has exited.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from storage.atomic import move_into_place
from storage.errors import first_line
from storage.location import StorePrefix, remove_path, remove_path_tolerant, resolve
from storage.paths import checked_join

READER_PREFIX = "reader-"
COPY_CHUNK = 16 << 20  # bytes per ranged GET of a download; the reader's close waits at most one


@dataclass(frozen=True, kw_only=True)
class CachedObject:
    url: str  # the object on the store
    size: int  # its size in bytes (from the manifest): what it reserves of the budget


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def check_local_cache_root(root: str | os.PathLike, *, flag: str | None = None) -> Path:
    """`root` made (if missing) and checked to be a directory this process can write; ValueError
    naming it (and `flag`) otherwise: a file there, a read-only disk, no permission."""
    root = Path(root)
    named = f"{flag} {root}" if flag else str(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"{named}: exists and is not a directory; a local cache needs a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        raise ValueError(f"{named}: cannot write there ({error.strerror or first_line(error)})") from None
    return root


def sweep_orphans(root: str | os.PathLike) -> list[Path]:
    """Remove the reader subdirectories under `root` whose process has exited; returns them."""
    root, removed = Path(root), []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(READER_PREFIX):
            continue  # never delete what a cache did not write
        pid = entry.name.removeprefix(READER_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            try:  # every stream sweeps the same root when it starts: another may be removing it too
                remove_path_tolerant(entry)
            except OSError:
                continue
            removed.append(entry)
    return removed


class LocalCache:
    """Whole objects copied into this process's directory under `root`, at most `budget` bytes held."""

    def __init__(self, root: str | os.PathLike, *, budget: int):
        if budget < 1:
            raise ValueError(f"local cache budget must be >= 1 byte, got {budget}")
        self.root, self.budget = check_local_cache_root(root), budget
        sweep_orphans(self.root)
        self.dir = self.root / f"{READER_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()
        self.held = 0  # bytes reserved: downloaded or downloading
        self.peak = 0  # the most ever held at once
        self._room = threading.Condition()

    def reserve(self, item: CachedObject, *, stop: threading.Event | None = None) -> bool:
        """Wait until `item` fits in the budget and reserve its bytes; False if `stop` is set first."""
        if item.size > self.budget:
            raise ValueError(f"{item.url}: {item.size} bytes do not fit in the local cache budget of {self.budget} bytes")
        with self._room:
            while self.held + item.size > self.budget:
                if stop is not None and stop.is_set():
                    return False
                self._room.wait(timeout=0.1)
            self.held += item.size
            self.peak = max(self.peak, self.held)
        return True

    def download(self, item: CachedObject, *, stop: threading.Event | None = None) -> Path | None:
        """Copy a reserved object to a local file (under a temp name, then renamed) and return it;
        None if `stop` is set meanwhile (checked between chunks, so closing a reader does not wait
        for a whole shard). The copy must have the size the manifest gives, and never grows past
        it (the budget holds): anything else is refused in one line."""
        location = resolve(item.url)
        if not isinstance(location, StorePrefix):
            raise ValueError(f"{item.url}: not an object-store URL")
        local = checked_join(self.dir, f"{uuid.uuid4().hex}-{item.url.rsplit('/', 1)[-1]}", source=item.url)
        partial = local.with_name(f".{local.name}.part")
        copied = 0
        try:
            try:
                with location.open("", "rb", block_size=COPY_CHUNK, cache_type="none") as source, open(partial, "wb") as copy:
                    while chunk := source.read(COPY_CHUNK):  # one ranged GET each
                        if stop is not None and stop.is_set():
                            return None
                        copied += len(chunk)
                        if copied > item.size:
                            raise ValueError(f"{item.url}: larger on the store than the manifest's {item.size} bytes")
                        copy.write(chunk)
            except (OSError, ValueError) as error:
                if isinstance(error, ValueError) or str(error).startswith(item.url):
                    raise
                raise OSError(f"{item.url}: {first_line(error)}") from None  # a missing object's error may not name it
            except Exception as error:  # the store client's own (botocore, aiohttp)
                raise OSError(f"{item.url}: {type(error).__name__}: {first_line(error)}") from None
            if copied != item.size:
                raise ValueError(f"{item.url}: {copied} bytes on the store, the manifest says {item.size}")
            move_into_place(partial, local, sync=False)  # a node-local copy: a crash loses only the download
        finally:
            remove_path(partial)
        return local

    def release(self, item: CachedObject, local: Path | None) -> None:
        """Delete an object's local copy (if any) and give its bytes back to the budget."""
        if local is not None:
            remove_path(local)
        with self._room:
            self.held -= item.size
            self._room.notify_all()

    def close(self) -> None:
        remove_path_tolerant(self.dir)


_DONE = object()


def _next_ready(ready: queue.Queue, fetcher: threading.Thread):
    """The fetcher's next entry; an error if it died without saying why (it always puts one)."""
    while True:
        try:
            return ready.get(timeout=1.0)
        except queue.Empty:
            if not fetcher.is_alive() and ready.empty():
                return RuntimeError("the read-ahead thread stopped without a result")


def read_ahead(cache: LocalCache, items: list[CachedObject], *, ahead: int) -> Iterator[tuple[CachedObject, Path]]:
    """(item, local copy) for each item in order, downloaded by a background thread at most
    `ahead` objects past the one being read (and within the cache's budget). A copy is deleted
    when the caller asks for the next one, so read it before that; a budget of one object still
    works, without overlap. A failed download is raised here, in the reader, as the OSError /
    ValueError it was. Closing the iterator stops the thread within one chunk (COPY_CHUNK)."""
    ready: queue.Queue = queue.Queue()
    slots = threading.Semaphore(max(1, ahead))  # objects downloaded or downloading, not yet handed over
    stop = threading.Event()

    def wait_for_slot() -> bool:
        while not stop.is_set():
            if slots.acquire(timeout=0.1):
                return True
        return False

    def fetch_all() -> None:
        for item in items:
            if not wait_for_slot():
                return
            try:
                if not cache.reserve(item, stop=stop):
                    return
            except BaseException as error:  # larger than the whole budget
                ready.put(error)
                return
            try:
                local = cache.download(item, stop=stop)
            except BaseException as error:
                cache.release(item, None)
                ready.put(error)
                return
            if local is None:  # stopped
                cache.release(item, None)
                return
            ready.put((item, local))
        ready.put(_DONE)

    fetcher = threading.Thread(target=fetch_all, name="alrira-read-ahead", daemon=True)
    fetcher.start()
    current = None
    try:
        while True:
            if current is not None:  # read: its room goes to the next download
                cache.release(*current)
                current = None
            entry = _next_ready(ready, fetcher)
            slots.release()
            if entry is _DONE:
                return
            if isinstance(entry, BaseException):
                if isinstance(entry, (OSError, ValueError)):
                    raise entry
                raise OSError(f"{type(entry).__name__}: {first_line(entry)}") from entry
            current = entry
            yield entry
    finally:
        stop.set()
        fetcher.join(timeout=5)
        if current is not None:
            cache.release(*current)
        while True:  # copies downloaded ahead that nobody will read
            try:
                entry = ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(entry, tuple):
                cache.release(*entry)
