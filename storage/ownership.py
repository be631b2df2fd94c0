"""Which build owns a cache directory.

Each build claims the directory before it touches it (`.build-owner`, a fresh id), and its shard
writers publish only while that claim holds. A writer that outlives its killed driver (Ray reaps
orphaned actors asynchronously) or a second build started on the same directory therefore cannot
overwrite the shards of the build that claimed it last (docs/design.md, "A cache build").

Locally the check and the publish are one step: a writer checks the claim and renames its shard
into place holding `.build-owner.lock`, the driver checks it and writes the manifest holding it
(owned), and a new claim is written holding it too (owner_lock). A
writer that passed its check before the claim has renamed its shard before the claim returns; one
that checks after refuses. (Without the lock a writer of a killed build, starved between its check
and its rename, renamed its shard after the resumed build had claimed the directory and onto the
shard that build's own worker was publishing.)

A build deletes only what a build writes: `check_out_dir` refuses a non-empty directory that holds
neither a manifest nor a claim, and `remove_cache_files` (for --overwrite, and for a build that
fails before it published a shard) removes the cache's own names and never an unknown file.

The same rules hold on an object store (storage.location): the claim is one object, written with
one PUT, and is read again before a shard starts and before the manifest is written
(docs/design.md, "Caches on object stores").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator

from storage.eval_split import EVAL_SPLIT_FILE, EVAL_SPLIT_RECORD
from storage.format import (
    BUILD_PROVENANCE_FILE,
    BUILD_OWNER_FILE,
    BUILD_OWNER_LOCK_FILE,
    CORPUS_DIR,
    MANIFEST_FILE,
    OUTPUT_LOCK_FILE,
    PARTIAL_SHARD_PREFIX,
    SHARD_DIR,
    TARGET_HEAD_FILE,
)
from storage.atomic import atomic_write_text
from storage.location import Location, resolve

# Names a build writes: shards (storage.format.shard_name) and their temp directories under
# shards/; the temp names of storage.atomic's writes of the manifest, head, claim and corpus.
SHARD_NAME = re.compile(r"shard-\d{5,}\.(zarr|tar)")
PARTIAL_SHARD_NAME = re.compile(re.escape(PARTIAL_SHARD_PREFIX) + r"shard-\d{5,}\.(zarr|tar)-[0-9a-f]{32}")
TEMP_NAME = re.compile(
    r"\.(manifest\.json|target_head\.safetensors)\..+\.tmp"
    r"|\.?\.build-owner\..+\.tmp"
    r"|\.corpus\.(tmp|old)-[0-9a-f]{8}"
)


OWNER_LOCK_WAIT_S = 120.0  # how long a claim or a publish waits for the other to let go of the lock
NO_LOCKS_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # flock refused by the filesystem (some FUSE mounts)


class CacheOwnershipLost(ValueError):
    """A shard writer's build no longer owns the cache directory (another build claimed it):
    a user error (two builds on one --out), reported in one line like every bad input."""


def claim_cache(location: Location) -> str:
    """Make a new build the owner of `location` (created if needed); return its owner id.

    From now on write_shard(owner=<an older id>) refuses to publish there: a worker that outlives
    its killed driver, or a second build started on the same directory, cannot overwrite shards of
    the build that claimed it last.
    """
    owner = uuid.uuid4().hex
    if not location.is_local:  # one PUT replaces the claim whole
        location.write_bytes(BUILD_OWNER_FILE, (owner + "\n").encode())
        return owner
    location.local_path.mkdir(parents=True, exist_ok=True)
    with owner_lock(location):  # no writer is between its check and its rename meanwhile
        atomic_write_text(location.local_path / BUILD_OWNER_FILE, owner + "\n")
    return owner


@contextlib.contextmanager
def owner_lock(location: Location, *, timeout: float = OWNER_LOCK_WAIT_S) -> Iterator[None]:
    """Hold `.build-owner.lock` in the local cache directory `location` (an exclusive flock, which
    the kernel drops when its holder dies, SIGKILL included): claim_cache writes the claim under
    it, a shard writer checks the claim and renames its shard under it. A store has no such lock,
    nor a filesystem that refuses flock: both go on unlocked, as before the lock existed
    (docs/failure-modes.md). Waits at most `timeout` seconds, then a one-line ValueError naming
    the file."""
    if not location.is_local:
        yield
        return
    path = location.local_path / BUILD_OWNER_LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno in NO_LOCKS_ERRNOS:  # a filesystem without locks: unlocked, as on a store
                    break
                if not isinstance(error, BlockingIOError):
                    raise
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"{path}: held for over {timeout:.0f}s by another process (a shard writer or a build's claim); "
                        "is a stopped build's worker still alive?"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def owned(location: Location, owner: str) -> Iterator[None]:
    """The block runs while `owner` still holds `location`: its claim checked holding owner_lock,
    so a new claim waits for the block's write (the build's manifest) to end. For short writes
    only: a claim waits at most OWNER_LOCK_WAIT_S. Raises CacheOwnershipLost as check_owner."""
    with owner_lock(location):
        check_owner(location, owner)
        yield


def check_owner(location: Location, owner: str) -> None:
    """Raise CacheOwnershipLost unless `owner` is the build that last claimed `location`."""
    try:
        current = location.read_bytes(BUILD_OWNER_FILE).decode().strip()
    except FileNotFoundError:
        current = None
    if current != owner:
        raise CacheOwnershipLost(
            f"{location}: another cache build has claimed this directory (owner {current}, this writer {owner}); "
            "this writer stops without publishing"
        )


def is_cache_dir(location: Location) -> bool:
    """Whether a build wrote here: a manifest, or the claim of a build that has not written one yet."""
    return location.is_file(MANIFEST_FILE) or location.is_file(BUILD_OWNER_FILE)


def check_out_dir(cache_dir: str | os.PathLike | Location) -> None:
    """One-line ValueError unless `cache_dir` may hold a cache: missing, empty, or a cache already
    (on a store: a prefix with no objects under it, or a cache's)."""
    location = resolve(cache_dir)
    if location.exists() and not location.is_dir():
        what = "a directory" if location.is_local else "a prefix (it is an object)"
        raise ValueError(f"--out {location}: exists and is not {what}")
    names = [name for name in location.names() if name != OUTPUT_LOCK_FILE] if location.is_dir() else []  # the build's own lock
    if names and not is_cache_dir(location):
        raise ValueError(
            f"--out {location}: not empty and not a cache (no {MANIFEST_FILE} or {BUILD_OWNER_FILE}); "
            f"use an empty or new {'directory' if location.is_local else 'prefix'}"
        )


def foreign_files(directory: Location, own_names: Iterable[str]) -> list[str]:
    """Names in `directory` (if it exists) that are not among `own_names`, sorted."""
    own = set(own_names)
    return [name for name in directory.names() if name not in own]


def remove_cache_files(
    location: Location, *, corpus_files: Iterable[str], shard_names: Iterable[str] = (),
    claim: bool = False,
) -> list[str]:  # fmt: skip
    """Remove a cache's own files from `location`: the manifest, head, evaluation split, temp files of atomic writes,
    `shards/` entries named like shards (or listed in `shard_names`) and their temp directories,
    the tokenized corpus files `corpus_files`, and with `claim` the `.build-owner` claim.
    `shards/`, `corpus/` and `location` are removed only if that leaves them empty; anything else
    stays. Returns the removed names (relative to `location`)."""
    if not location.is_dir():
        return []
    listed = set(shard_names)
    removed = []

    def remove(relative: str) -> None:
        if location.exists(relative):
            location.remove(relative)
            removed.append(relative)

    for name in (MANIFEST_FILE, TARGET_HEAD_FILE, EVAL_SPLIT_RECORD, EVAL_SPLIT_FILE, BUILD_PROVENANCE_FILE,
                 *([BUILD_OWNER_FILE, BUILD_OWNER_LOCK_FILE] if claim else [])):  # fmt: skip
        remove(name)
    removed += remove_write_leftovers(location)
    for name in location.names(SHARD_DIR):
        if name in listed or SHARD_NAME.fullmatch(name) or PARTIAL_SHARD_NAME.fullmatch(name):
            remove(f"{SHARD_DIR}/{name}")
    for name in corpus_files:
        remove(f"{CORPUS_DIR}/{name}")
    for directory in (SHARD_DIR, CORPUS_DIR):
        location.remove_dir_if_empty(directory)
    return removed


def remove_write_leftovers(location: Location) -> list[str]:
    """Delete the temp files and directories of interrupted atomic writes of the manifest, head,
    claim and tokenized corpus (storage.atomic's names) in `location`; return their names. (A
    store has none: its atomic writes are single uploads.)"""
    removed = [name for name in location.names() if TEMP_NAME.fullmatch(name)]
    for name in removed:
        location.remove(name)
    return removed
