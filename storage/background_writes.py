"""A shard's pieces encoded and written on background threads, and fsynced on one more
(storage.shards.ShardWriter hands them over; each format's writer submits its own pieces)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from storage.atomic import fsync_path


class BackgroundWrites:
    """Pieces of a shard (a Zarr shard file's rows, a tar member) encoded and written on
    `num_threads` threads, at most 2 x `num_threads` unfinished: a submit beyond that waits until
    one finishes (any one: waiting for the oldest left a thread idle behind a large member while
    small ones were done), so memory stays bounded while the caller prepares the next record. The
    first error of a piece is raised by the submit or `wait` that collects it.

    `sync_soon` hands a written file to one more thread that fsyncs it: the disk takes a shard's
    bytes while the next pieces compress, instead of all at once in `publish`'s fsync (which still
    follows, and then finds those files clean). That thread waits on the disk, not the CPU."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self.pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="shard-encode")
        self.syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sync")
        self.in_flight: set[Future] = set()
        self.syncing: list[Future] = []
        self.sync_lock = threading.Lock()  # writer threads hand files over too

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        self._collect()
        while len(self.in_flight) >= 2 * self.num_threads:
            concurrent.futures.wait(self.in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            self._collect()
        future = self.pool.submit(fn, *args, **kwargs)
        self.in_flight.add(future)
        return future

    def sync_soon(self, path: Path) -> None:
        """Start putting the written file `path` on disk (fsync) on the sync thread; any thread."""
        with self.sync_lock:
            self.syncing.append(self.syncer.submit(fsync_path, path))

    def _collect(self) -> None:
        done = {future for future in self.in_flight if future.done()}
        self.in_flight -= done
        for future in done:
            future.result()

    def wait(self) -> None:
        concurrent.futures.wait(self.in_flight)
        self._collect()

    def wait_synced(self) -> None:
        """After `wait`: every file handed to `sync_soon` is on disk (its error raised here)."""
        with self.sync_lock:
            syncing, self.syncing = self.syncing, []
        for future in syncing:
            future.result()

    def close(self) -> None:
        """Wait for the pieces already running (their errors are the caller's to have seen) and
        stop the threads; a second call does nothing."""
        with self.sync_lock:
            syncing, self.syncing = self.syncing, []
        for future in [*self.in_flight, *syncing]:
            future.cancel()
        self.in_flight.clear()
        self.pool.shutdown(wait=True)
        self.syncer.shutdown(wait=True)
