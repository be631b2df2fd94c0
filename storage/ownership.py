"""Which build owns a cache directory.

Each build claims the directory before it touches it (`.build-owner`, a fresh id), and its shard
writers publish only while that claim holds. A writer that outlives its killed driver (Ray reaps
orphaned actors asynchronously) or a second build started on the same directory therefore cannot
overwrite the shards of the build that claimed it last (docs/design.md, "A cache build").

A build deletes only what a build writes: `check_out_dir` refuses a non-empty directory that holds
neither a manifest nor a claim, and `remove_cache_files` (for --overwrite, and for a build that
fails before it published a shard) removes the cache's own names and never an unknown file.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path

from storage.atomic import remove_path_tolerant
from storage.format import (
    BUILD_OWNER_FILE,
    CORPUS_DIR,
    MANIFEST_FILE,
    PARTIAL_SHARD_PREFIX,
    SHARD_DIR,
    TARGET_HEAD_FILE,
)

# Names a build writes: shards (storage.format.shard_name) and their temp directories under
# shards/; the temp names of storage.atomic's writes of the manifest, head, claim and corpus.
SHARD_NAME = re.compile(r"shard-\d{5,}\.(zarr|tar)")
PARTIAL_SHARD_NAME = re.compile(re.escape(PARTIAL_SHARD_PREFIX) + r"shard-\d{5,}\.(zarr|tar)-[0-9a-f]{32}")
TEMP_NAME = re.compile(
    r"\.(manifest\.json|target_head\.safetensors)\..+\.tmp"
    r"|\.build-owner\.[0-9a-f]{32}\.tmp"
    r"|\.corpus\.(tmp|old)-[0-9a-f]{8}"
)


class CacheOwnershipLost(ValueError):
    """A shard writer's build no longer owns the cache directory (another build claimed it):
    a user error (two builds on one --out), reported in one line like every bad input."""


def claim_cache(cache_dir: str | os.PathLike) -> str:
    """Make a new build the owner of `cache_dir` (created if needed); return its owner id.

    From now on write_shard(owner=<an older id>) refuses to publish there: a worker that outlives
    its killed driver, or a second build started on the same directory, cannot overwrite shards of
    the build that claimed it last.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    owner = uuid.uuid4().hex
    tmp = cache_dir / f"{BUILD_OWNER_FILE}.{owner}.tmp"
    tmp.write_text(owner + "\n")
    os.replace(tmp, cache_dir / BUILD_OWNER_FILE)
    return owner


def check_owner(cache_dir: str | os.PathLike, owner: str) -> None:
    """Raise CacheOwnershipLost unless `owner` is the build that last claimed `cache_dir`."""
    path = Path(cache_dir) / BUILD_OWNER_FILE
    try:
        current = path.read_text().strip()
    except FileNotFoundError:
        current = None
    if current != owner:
        raise CacheOwnershipLost(
            f"{cache_dir}: another cache build has claimed this directory (owner {current}, this writer {owner}); "
            "this writer stops without publishing"
        )


def is_cache_dir(cache_dir: str | os.PathLike) -> bool:
    """Whether a build wrote here: a manifest, or the claim of a build that has not written one yet."""
    cache_dir = Path(cache_dir)
    return (cache_dir / MANIFEST_FILE).is_file() or (cache_dir / BUILD_OWNER_FILE).is_file()


def check_out_dir(cache_dir: str | os.PathLike) -> None:
    """One-line ValueError unless `cache_dir` may hold a cache: missing, empty, or a cache already."""
    cache_dir = Path(cache_dir)
    if cache_dir.exists() and not cache_dir.is_dir():
        raise ValueError(f"--out {cache_dir}: exists and is not a directory")
    if cache_dir.is_dir() and not is_cache_dir(cache_dir) and any(cache_dir.iterdir()):
        raise ValueError(
            f"--out {cache_dir}: not empty and not a cache (no {MANIFEST_FILE} or {BUILD_OWNER_FILE}); "
            "use an empty or new directory"
        )


def foreign_files(directory: str | os.PathLike, own_names: Iterable[str]) -> list[str]:
    """Names in `directory` (if it exists) that are not among `own_names`, sorted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    own = set(own_names)
    return sorted(p.name for p in directory.iterdir() if p.name not in own)


def remove_cache_files(
    cache_dir: str | os.PathLike, *, corpus_files: Iterable[str], shard_names: Iterable[str] = (), claim: bool = False
) -> list[str]:
    """Remove a cache's own files from `cache_dir`: the manifest, head, temp files of atomic writes,
    `shards/` entries named like shards (or listed in `shard_names`) and their temp directories,
    the tokenized corpus files `corpus_files`, and with `claim` the `.build-owner` claim.
    `shards/`, `corpus/` and `cache_dir` are removed only if that leaves them empty; anything else
    stays. Returns the removed names (relative to `cache_dir`)."""
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        return []
    listed = set(shard_names)
    removed = []

    def remove(relative: str) -> None:
        path = cache_dir / relative
        if path.exists() or path.is_symlink():
            remove_path_tolerant(path)
            removed.append(relative)

    for name in (MANIFEST_FILE, TARGET_HEAD_FILE, *([BUILD_OWNER_FILE] if claim else [])):
        remove(name)
    removed += remove_write_leftovers(cache_dir)
    shard_dir = cache_dir / SHARD_DIR
    if shard_dir.is_dir():
        for entry in sorted(shard_dir.iterdir()):
            name = entry.name
            if name in listed or SHARD_NAME.fullmatch(name) or PARTIAL_SHARD_NAME.fullmatch(name):
                remove(f"{SHARD_DIR}/{name}")
    for name in corpus_files:
        remove(f"{CORPUS_DIR}/{name}")
    for directory in (shard_dir, cache_dir / CORPUS_DIR):
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
    return removed


def remove_write_leftovers(cache_dir: str | os.PathLike) -> list[str]:
    """Delete the temp files and directories of interrupted atomic writes of the manifest, head,
    claim and tokenized corpus (storage.atomic's names) in `cache_dir`; return their names."""
    cache_dir = Path(cache_dir)
    removed = sorted(p.name for p in cache_dir.iterdir() if TEMP_NAME.fullmatch(p.name)) if cache_dir.is_dir() else []
    for name in removed:
        remove_path_tolerant(cache_dir / name)
    return removed
