"""Shard checksums, one home for both schemes, and the sizes and store tags a manifest records.

A checksum names its scheme: "sha256:" hashes one stream, a tar's bytes (and, in older shards, a
Zarr directory's sorted relative paths, sizes and bytes); "sha256-files:" a Zarr directory's
sorted relative paths, sizes and each file's own sha256, so the writer hashes a file on the thread
that wrote it and nothing is read back (docs/design.md, "A cache build").
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from storage.format import SHARD_COMPLETE, SHARD_DIR
from storage.location import Location, resolve

if TYPE_CHECKING:
    from storage.manifest import ShardRecord


def shard_bytes(path: str | os.PathLike | Location) -> int:
    """Size on disk (or on the store) of a shard: the sum of its files (objects)."""
    return sum(size for _, size in resolve(path).files())


CHECKSUM_STREAM = "sha256"
CHECKSUM_FILES = "sha256-files"
CHECKSUM_SCHEMES = (CHECKSUM_STREAM, CHECKSUM_FILES)
_HASH_THREADS = 8  # hashlib releases the GIL: a local directory's files are read and hashed side by side


def checksum_scheme(checksum: str) -> str:
    """The scheme a recorded checksum ("<scheme>:<hex>") was computed with."""
    scheme = checksum.split(":", 1)[0]
    if scheme not in CHECKSUM_SCHEMES or ":" not in checksum:
        raise ValueError(f"checksum must look like '<{' or '.join(CHECKSUM_SCHEMES)}>:<hex>', got {checksum!r}")
    return scheme


def shard_checksum(
    path: str | os.PathLike | Location, *, scheme: str = CHECKSUM_FILES, known: dict[str, tuple[int, bytes]] | None = None
) -> str:  # fmt: skip
    """"<scheme>:<hex>" of a shard: a tar's bytes ("sha256:" whatever `scheme`), or a Zarr
    directory's sorted relative file paths and sizes (so renaming, adding or dropping a chunk
    changes it too) with, per `scheme`, each file's sha256 or the bytes themselves. `known`:
    relative path -> (size, sha256 digest) of files hashed as they were written; the others are
    read. On a store the same over its objects (every unknown byte is downloaded once)."""
    shard = resolve(path)
    if not shard.exists():
        raise ValueError(f"{shard}: shard does not exist")
    checksum_scheme(f"{scheme}:")
    files = shard.files()
    if len(files) == 1 and files[0][0] == "":  # a tar is one file, named ""
        return f"{CHECKSUM_STREAM}:{_hash_file(hashlib.sha256(), shard, '').hexdigest()}"
    digest = hashlib.sha256()
    if scheme == CHECKSUM_STREAM:
        for rel, size in files:
            digest.update(rel.encode("utf-8") + b"\0" + size.to_bytes(8, "little"))
            _hash_file(digest, shard, rel)
        return f"{CHECKSUM_STREAM}:{digest.hexdigest()}"
    known = known or {}
    unknown = [rel for rel, size in files if known.get(rel, (None,))[0] != size]
    threads = _HASH_THREADS if shard.is_local and len(unknown) > 1 else 1
    with ThreadPoolExecutor(threads) as pool:
        read = dict(zip(unknown, pool.map(lambda rel: _hash_file(hashlib.sha256(), shard, rel).digest(), unknown), strict=True))
    for rel, size in files:
        digest.update(rel.encode("utf-8") + b"\0" + size.to_bytes(8, "little") + (read[rel] if rel in read else known[rel][1]))
    return f"{CHECKSUM_FILES}:{digest.hexdigest()}"


def _hash_file(digest, shard: Location, rel: str):
    """`digest` updated with the bytes of `rel` under `shard`, read 1 MiB at a time; returned."""
    with shard.open(rel, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest


def shard_object_tags(path: str | os.PathLike | Location) -> str | None:
    """"sha256:<hex>" of a shard's objects' relative paths, sizes and store tags (one listing); None
    for a local shard. Equal tags mean the objects are the very ones a checksum was computed over:
    a resume on a store keeps a shard on this instead of downloading it (docs/design.md, "Caches
    on object stores")."""
    shard = resolve(path)
    if shard.is_local:
        return None
    listed = shard.object_tags()
    if not listed:
        raise ValueError(f"{shard}: shard does not exist")
    return "sha256:" + hashlib.sha256(json.dumps(listed).encode()).hexdigest()


class HashingWriter:
    """A binary file for writing that feeds every byte written through it to a sha256."""

    def __init__(self, file):
        self.file, self.digest, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def verified_shards(out: Location, shards: Iterable[ShardRecord]) -> tuple[dict[int, ShardRecord], list[str]]:
    """The resume rule (docs/design.md, "A cache build") over a previous manifest's `shards`: those
    listed complete whose checksum still verifies, by index, and the names of the others (missing or
    corrupt: rebuilt). On a store a shard whose record has object tags is kept when one listing
    gives the same tags (its objects are the checksummed ones) instead of downloading it; one
    without is downloaded once."""
    done, stale = {}, []
    for record in shards:
        path = out.child(f"{SHARD_DIR}/{record.name}")
        if record.status == SHARD_COMPLETE and path.exists() and _still_verifies(path, record):
            done[record.index] = record
        else:
            stale.append(record.name)
    return done, stale


def _still_verifies(path: Location, record: ShardRecord) -> bool:
    if not path.is_local and record.object_tags is not None:
        return shard_object_tags(path) == record.object_tags
    return shard_checksum(path, scheme=checksum_scheme(record.checksum)) == record.checksum
