"""Writing and reading one cache shard, in Zarr v3 or WebDataset-tar form.

A shard is streamed under `shards/.tmp-<name>-<uuid>` as its records are computed (ShardWriter),
then fsynced and renamed to `shards/<name>`, so a published name always means a complete shard. The bytes are a function of
the records only (no timestamps, fixed member order), so a resumed build can be checked against
an uninterrupted one by checksum.

On an object store (storage.location) there is no rename: a shard is written under its final
prefix `shards/<name>` (after the objects an interrupted write left there are removed) and is
published by the manifest alone, which lists it only once it is whole (docs/design.md, "Caches on
object stores"). Its objects and bytes are those of the same shard on a local disk.

Zarr: one group per shard; every per-sequence array is concatenated over the shard's sequences
into one flat array (token arrays along tokens, anchor arrays along anchors), plus `seq_offsets`,
`anchor_offsets` (int64 [n+1]) and `source_rows` (int64 [n]). Blosc zstd with byte shuffle.

WebDataset: a tar written by storage/wds.py (webdataset's TarWriter), samples keyed
`{source_row:09d}`, one compressed, CRC32-framed member `{key}.{array}.npy.blosc.crc32` per record
array, sorted by name inside a sample; storage/wds.py also reads the uncompressed `.npy` tars of
older caches.

Either way a shard holds exactly the arrays of its cache's contents (storage.format.ARRAY_GROUPS).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import math
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from storage.format import (
    ALL_GROUPS,
    ANCHOR_ARRAYS,
    FEATURE_CODECS,
    FEATURE_DTYPES,
    FORMAT_NAME,
    PARENT_ARRAYS,
    PARTIAL_SHARD_PREFIX,
    SHARD_COMPLETE,
    SHARD_DIR,
    STORAGE_FORMATS,
    TOKEN_ARRAYS,
    ARRAY_DTYPES,
    ZARR_ANCHOR_OFFSETS,
    ZARR_INDEX_ARRAYS,
    ZARR_PARENT_OFFSETS,
    ZARR_SEQ_OFFSETS,
    ZARR_SOURCE_ROWS,
    array_codecs,
    check_contents,
    check_ira_parents,
    format_version_for,
    num_parents,
    record_array_names,
    shard_name,
)
from storage.atomic import fsync_path, fsync_tree
from storage.errors import CorruptShardError, first_line
from storage.location import Location, StorePrefix, remove_path, remove_path_tolerant, resolve
from storage.manifest import ShardRecord, check_compute
from storage.ownership import SHARD_NAME, CacheOwnershipLost, check_owner
from storage.wds import BLOSC_BLOCK_BYTES, WdsShard, WdsShardWriter, encode_member
from storage.zarr_rows import ChunkFileEncoder

# Record arrays by the axis they are concatenated along in a Zarr shard (fp8 scales included).
TOKEN_INDEXED_ARRAYS = TOKEN_ARRAYS + ("feature_scales",)
ANCHOR_INDEXED_ARRAYS = ANCHOR_ARRAYS + ("rollout_feature_scales",)

# A read touches whole chunks, and token chunks straddle sequences: small chunks keep a sequence's
# read close to its own bytes. A chunk holds at most ~256 KiB and at most a quarter of the shard's
# mean sequence's rows (and at least ~4 KiB), so reading one sequence of a small per-token array
# (ids, top-k, masks) decodes about 1.25 sequences' worth (a few where 4 KiB is more), not the ~30
# short ones a 256 KiB chunk spans
# (docs/benchmarks.md, "Real shapes" (f)). Chunks are grouped into Zarr shards (files) of ~16 MiB,
# so a cache is not millions of files; a chunk inside one is read by byte range, after the file's
# index (16 bytes a chunk, read whole by every read: hence at most 128 chunks a file).
ZARR_CHUNK_BYTES = 256 << 10  # ~256 KiB uncompressed per chunk, at most
ZARR_CHUNKS_PER_SEQUENCE = 4
ZARR_MAX_CHUNKS_PER_FILE = 128
# Below ~4 KiB a chunk's fixed costs (a 16-byte Blosc header, its CRC, its 16-byte index entry, a
# decode call) outweigh the bytes a smaller one saves a read: one alr epoch of (f) reads less with
# a 4 KiB floor than with 1 KiB, and a toy shard stays as small as before.
ZARR_FLOOR_CHUNK_BYTES = 4 << 10
ZARR_SHARD_BYTES = 16 << 20  # ~16 MiB uncompressed per file
# As few anchors per chunk as keeps a chunk >= 64 KiB (one anchor at real shapes: 13 x 12,800 bf16
# = 333 KB): the trainer reads the rollout features of a few parent anchors (IRA) only.
ANCHOR_ROW_CHUNK_ARRAYS = ("rollout_features", "rollout_feature_scales")
ZARR_MIN_CHUNK_BYTES = 64 << 10
# zstd level 1: at real shapes it compressed bf16 features as well as level 3 (1.44x vs 1.43x, in
# 256 KiB blocks) at 2.7x the speed, fp8 the same 1.22x at 1.5x (docs/benchmarks.md, "Cache
# settings" (h)): the writer's CPU per sequence is what a cache build pays for it.
ZARR_CLEVEL = 1
# Blosc compresses a chunk in independent blocks; left to itself it picks small ones (its "auto"),
# which at real shapes made bf16 features 5% larger than one block per 256 KiB chunk at the same
# speed (docs/benchmarks.md, "Cache settings" (h)): the tar writer's block size, for both formats.
ZARR_BLOSC_BLOCK_BYTES = BLOSC_BLOCK_BYTES
# A tar being written is handed to BackgroundWrites.sync_soon every this many bytes.
SYNC_EVERY_BYTES = 64 << 20


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Record schema


@dataclass(frozen=True, kw_only=True)
class RecordDims:
    """Sizes of one record: T tokens, A anchors, F feature dim, k = top_k, K slots.

    top_k is None when the record holds no top-k arrays (neither corpus top-k nor rollouts), and
    num_slots None when it holds no rollouts: nothing in it says what they were. num_parents: the
    rows of rollout features (P; 0 without them)."""

    num_tokens: int
    num_anchors: int
    feature_dim: int
    top_k: int | None
    num_slots: int | None
    num_parents: int = 0


def record_shapes(
    dims: RecordDims, *, feature_codec: str, contents=ALL_GROUPS, rollout_feature_codec: str | None = None
) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """Expected shape of every array of a record with sizes `dims` in a cache holding `contents`."""
    contents = check_contents(contents)
    codecs = array_codecs(feature_codec, rollout_feature_codec)
    P = dims.num_parents
    T, A, F, k, K = dims.num_tokens, dims.num_anchors, dims.feature_dim, dims.top_k, dims.num_slots
    shapes = {"source_row": (), "input_ids": (T,), "loss_mask": (T,), "features": (T, F), "anchor_pos": (A,)}
    if "corpus_topk" in contents:
        shapes.update(corpus_topk_ids=(T, k), corpus_topk_probs=(T, k), corpus_tail=(T,), corpus_next_prob=(T,))
    if "rollouts" in contents:
        shapes.update(
            rollout_tokens=(A, K + 1), rollout_topk_ids=(A, K, k), rollout_topk_probs=(A, K, k), rollout_tail=(A, K)
        )
    if "rollout_features" in contents:
        shapes["rollout_features"] = (P, K - 2, F)
        if codecs["rollout_features"] == "fp8":
            shapes["rollout_feature_scales"] = (P, K - 2)
    if codecs["features"] == "fp8":
        shapes["feature_scales"] = (T,)
    return shapes


def record_dtype(name: str, *, feature_codec: str, rollout_feature_codec: str | None = None) -> np.dtype:
    """Stored numpy dtype of record array `name` under these codecs."""
    if name in ("features", "rollout_features"):
        return np.dtype(FEATURE_DTYPES[array_codecs(feature_codec, rollout_feature_codec)[name]])
    return np.dtype(ARRAY_DTYPES[name])


def _ndim_size(record: dict, name: str, axis: int, ndim: int, where: str) -> int:
    arr = record[name]
    if not isinstance(arr, np.ndarray) or arr.ndim != ndim:
        shape = getattr(arr, "shape", type(arr).__name__)
        raise ValueError(f"{where}: array {name} must be a {ndim}-d numpy array, got {shape}")
    return arr.shape[axis]


def check_record(
    record: dict, *, feature_codec: str, where: str, like: RecordDims | None = None, contents=ALL_GROUPS,
    rollout_feature_codec: str | None = None, ira_parents: int | None = None,
) -> RecordDims:  # fmt: skip
    """Validate one record's array names, dtypes and shapes against the schema of a cache holding
    the array groups `contents` (rollout features for `ira_parents` anchors per sequence, None: all);
    return its dims.

    `like`: dims whose F, k and K the record must share (records of one shard, or the manifest's);
    a None in either side is not compared. Raises ValueError naming `where` and the offending array.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a dict of arrays, got {type(record).__name__}")
    contents = check_contents(contents)
    names = set(record_array_names(feature_codec, contents, rollout_feature_codec))
    schema = f"codec {feature_codec!r}, contents {list(contents)}"
    missing = sorted(names - set(record))
    if missing:
        raise ValueError(f"{where}: array {missing[0]} is missing ({schema})")
    extra = sorted(set(record) - names)
    if extra:
        raise ValueError(f"{where}: array {extra[0]} is not part of the schema ({schema})")
    source_row = record["source_row"]
    if not isinstance(source_row, (int, np.integer, np.ndarray)) or isinstance(source_row, bool) or (
        isinstance(source_row, np.ndarray) and (source_row.ndim != 0 or source_row.dtype.kind not in "iu")
    ):
        raise ValueError(f"{where}: array source_row must be an int or 0-d integer array, got {source_row!r}")
    if int(source_row) < 0:
        raise ValueError(f"{where}: array source_row must be >= 0, got {int(source_row)}")

    # k is read from the corpus top-k, or from the rollout labels when the corpus top-k are left out.
    top_k = num_slots = topk_source = None
    if "corpus_topk" in contents:
        topk_source = "corpus_topk_ids"
        top_k = _ndim_size(record, topk_source, 1, 2, where)
    elif "rollouts" in contents:
        topk_source = "rollout_topk_ids"
        top_k = _ndim_size(record, topk_source, 2, 3, where)
    if "rollouts" in contents:
        num_slots = _ndim_size(record, "rollout_tokens", 1, 2, where) - 1
    num_anchors = _ndim_size(record, "anchor_pos", 0, 1, where)
    dims = RecordDims(
        num_tokens=_ndim_size(record, "input_ids", 0, 1, where),
        num_anchors=num_anchors,
        feature_dim=_ndim_size(record, "features", 1, 2, where),
        top_k=top_k,
        num_slots=num_slots,
        num_parents=num_parents(num_anchors, check_ira_parents(ira_parents)) if "rollout_features" in contents else 0,
    )
    if dims.num_tokens < 1:
        raise ValueError(f"{where}: array input_ids is empty")
    if dims.num_slots is not None and dims.num_slots < 3:
        raise ValueError(f"{where}: array rollout_tokens must have K + 1 >= 4 columns, got {dims.num_slots + 1}")
    if like is not None:
        for field, name in (("feature_dim", "features"), ("top_k", topk_source), ("num_slots", "rollout_tokens")):
            got, want = getattr(dims, field), getattr(like, field)
            if got is not None and want is not None and got != want:
                raise ValueError(f"{where}: array {name} implies {field} {got}, expected {want}")
    shapes = record_shapes(dims, feature_codec=feature_codec, contents=contents, rollout_feature_codec=rollout_feature_codec)
    for name, shape in shapes.items():
        if name == "source_row":
            continue
        arr = record[name]
        dtype = record_dtype(name, feature_codec=feature_codec, rollout_feature_codec=rollout_feature_codec)
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{where}: array {name} must be a numpy array, got {type(arr).__name__}")
        if arr.dtype != dtype:
            raise ValueError(f"{where}: array {name} has dtype {arr.dtype}, expected {dtype}")
        if arr.shape != shape:
            raise ValueError(f"{where}: array {name} has shape {arr.shape}, expected {shape}")
    return dims


# ---------------------------------------------------------------------------------------------
# Paths, sizes, checksums


def shard_bytes(path: str | os.PathLike | Location) -> int:
    """Size on disk (or on the store) of a shard: the sum of its files (objects)."""
    return sum(size for _, size in resolve(path).files())


# A checksum names its scheme: "sha256:" hashes one stream, a tar's bytes (and, in Zarr shards of
# older caches, a Zarr directory's sorted relative paths, sizes and bytes); "sha256-files:" a
# Zarr directory's sorted relative paths, sizes and each file's own sha256, so the writer hashes a
# file on the thread that wrote it and nothing is read back (docs/design.md, "A cache build").
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


def clean_partial_shards(cache_dir: str | os.PathLike | Location, *, published: Iterable[str] = ()) -> list[str]:
    """Delete the leftovers of interrupted shard writes; return their names (sorted). Locally
    these are the `shards/.tmp-*` temp entries; a writer orphaned by a killed build may still be
    finishing, so entries vanishing or appearing while they are removed are tolerated
    (storage.location.remove_path_tolerant). On a store, where shards are written in place, they
    are the shard-named prefixes not among `published` (the names the manifest lists complete)."""
    location = resolve(cache_dir)
    published = set(published)
    removed = [
        name for name in location.names(SHARD_DIR)
        if name.startswith(PARTIAL_SHARD_PREFIX)
        or (not location.is_local and name not in published and SHARD_NAME.fullmatch(name))
    ]  # fmt: skip
    for name in removed:
        location.remove(f"{SHARD_DIR}/{name}")
    return removed


# ---------------------------------------------------------------------------------------------
# Writing


def set_codec_threads(num_threads: int) -> None:
    """Let Zarr compress and checksum chunks on `num_threads` threads in this process (its pool
    is process-wide, zarr.config "threading.max_workers"). Takes effect only before this process's
    first Zarr read or write: a build worker calls it as it starts (docs/design.md, "A cache build")."""
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    zarr.config.set({"threading.max_workers": num_threads})


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




@dataclass(frozen=True, kw_only=True)
class ShardSize:
    """What a shard will hold, known before its first record is computed (the tokenized corpus
    gives the lengths, storage-free `anchor_pool` the anchor counts): a Zarr array's chunk layout
    is chosen from its final row count, so a streamed shard is laid out like one written whole."""

    num_sequences: int
    num_tokens: int
    num_anchors: int
    num_parents: int | None = None  # rows of rollout features; None: num_anchors (every anchor a parent)

    @property
    def parent_rows(self) -> int:
        return self.num_anchors if self.num_parents is None else self.num_parents

    @classmethod
    def of_records(cls, records: list[dict], *, ira_parents: int | None = None) -> ShardSize:
        def rows(record, name: str) -> int:  # a malformed record is reported by ShardWriter.append
            array = record.get(name) if isinstance(record, dict) else None
            return len(array) if isinstance(array, np.ndarray) and array.ndim >= 1 else 0

        return cls(
            num_sequences=len(records),
            num_tokens=sum(rows(r, "input_ids") for r in records),
            num_anchors=sum(rows(r, "anchor_pos") for r in records),
            num_parents=None if ira_parents is None else sum(num_parents(rows(r, "anchor_pos"), ira_parents) for r in records),
        )


class ShardWriter:
    """One shard, written as its records are computed and published whole (docs/design.md,
    "A cache build").

    `append` validates a record and hands its rows to the shard under `shards/.tmp-<name>-<uuid>`;
    a Zarr array keeps at most one Zarr shard file of rows (~16 MiB) buffered, a tar gets the
    sample once its members are encoded, so memory does not grow with the shard's size. `publish` checks that exactly
    `size` arrived, fsyncs and renames to `shards/<name>`; `abort` (or leaving a `with` block by
    an exception) removes the temp entry. With `owner` (claim_cache's id) the shard is refused,
    when the writer opens and again just before the rename, once another build has claimed the
    directory. Bytes are a function of the appended records only.

    The compression and checksums run on `num_threads` background threads (Blosc, CRC and file
    writes release the GIL): `append` hands a Zarr shard file's rows or a tar sample's members to
    them and returns, keeping at most 2 x `num_threads` such pieces in flight, so the caller
    prepares the next record meanwhile; the arrays of an appended record must not change until
    `publish`. The bytes do not depend on `num_threads`. A local Zarr shard file is encoded on the
    writer thread itself (storage.zarr_rows.ChunkFileEncoder); on a store zarr compresses a file's
    chunks on its own process-wide pool, sized by `set_codec_threads`. Written files are fsynced
    by a sync thread as they come (BackgroundWrites.sync_soon) and a local tar is hashed as it is
    written, so `publish` waits for little more than the last pieces.

    On a store (`cache_dir` a URL) the shard is written in place under `shards/<name>`, after the
    objects an interrupted write left there are removed; the owner is checked also before each
    Zarr object write, and a tar's object appears only when `publish` closes it. `abort` removes
    what was written unless another build has claimed the prefix meanwhile (then it is that
    build's to clean up). The manifest, written after `publish`, is what publishes the shard."""

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        *,
        shard_index: int,
        size: ShardSize,
        storage_format: str,
        feature_codec: str,
        contents=ALL_GROUPS,
        owner: str | None = None,
        chunk_checksums: bool = True,
        num_threads: int = 1,
        rollout_feature_codec: str | None = None,
        ira_parents: int | None = None,
        compute: dict[str, str] | None = None,
    ):
        _check_choice("storage_format", storage_format, STORAGE_FORMATS)
        check_compute("compute", compute)
        self.compute = compute  # what the target computed the records in: the shard's metadata and record
        _check_choice("feature_codec", feature_codec, FEATURE_CODECS)
        array_codecs(feature_codec, rollout_feature_codec)
        self.rollout_feature_codec, self.ira_parents = rollout_feature_codec, check_ira_parents(ira_parents)
        if isinstance(shard_index, bool) or not isinstance(shard_index, int) or shard_index < 0:
            raise ValueError(f"shard_index must be an int >= 0, got {shard_index!r}")
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
        self.location, self.index, self.size, self.owner = resolve(cache_dir), shard_index, size, owner
        self.name = shard_name(shard_index, storage_format)
        if size.num_sequences < 1:
            raise ValueError(f"shard {self.name}: no records to write")
        self.feature_codec, self.contents = feature_codec, check_contents(contents)
        self.dims: list[RecordDims] = []
        self.source_rows: list[int] = []
        self.seen_rows: set[int] = set()
        if owner is not None:
            check_owner(self.location, owner)
        if self.location.is_local:
            self.shard_dir = self.location.local_path / SHARD_DIR
            self.shard_dir.mkdir(parents=True, exist_ok=True)
            self.tmp = self.target = self.shard_dir / f"{PARTIAL_SHARD_PREFIX}{self.name}-{uuid.uuid4().hex}"
            before_write = None
        else:
            self.target = self.location.child(f"{SHARD_DIR}/{self.name}")
            self.target.remove()  # what an interrupted write of this shard left
            before_write = self._check_owner
        self.writes = BackgroundWrites(num_threads)
        try:
            if storage_format == "zarr":
                self.body = _ZarrBody(
                    self.target, size, feature_codec=feature_codec, chunk_checksums=chunk_checksums,
                    before_write=before_write, writes=self.writes, rollout_feature_codec=rollout_feature_codec,
                    ira_parents=ira_parents, compute=compute,
                )  # fmt: skip
            else:
                self.body = _WdsBody(
                    self.target, feature_codec=feature_codec, contents=self.contents, chunk_checksums=chunk_checksums,
                    writes=self.writes, rollout_feature_codec=rollout_feature_codec,
                )  # fmt: skip
        except BaseException:
            self.writes.close()
            self._remove_written()
            raise
        self.names = [n for n in record_array_names(feature_codec, self.contents, rollout_feature_codec) if n != "source_row"]

    def append(self, record: dict[str, np.ndarray]) -> None:
        """Add the next record (already encoded, storage.codecs.encode_features)."""
        i = len(self.dims)
        where = f"shard {self.name} record {i}"
        if i == self.size.num_sequences:
            raise ValueError(f"{where}: the shard was planned for {i} records")
        dims = check_record(
            record, feature_codec=self.feature_codec, contents=self.contents, where=where,
            like=self.dims[0] if self.dims else None, rollout_feature_codec=self.rollout_feature_codec,
            ira_parents=self.ira_parents,
        )  # fmt: skip
        source_row = int(record["source_row"])
        if source_row in self.seen_rows:
            raise ValueError(f"shard {self.name}: source_row {source_row} appears in more than one record")
        self.body.append(record, dims, names=self.names)
        self.dims.append(dims)
        self.source_rows.append(source_row)
        self.seen_rows.add(source_row)

    def publish(self) -> ShardRecord:
        """Finish the shard and publish it under its name (a published shard of that name is
        replaced); returns its manifest record (status "complete")."""
        parents_kept = self.ira_parents is not None and "rollout_features" in self.contents
        got = ShardSize(
            num_sequences=len(self.dims),
            num_tokens=sum(d.num_tokens for d in self.dims),
            num_anchors=sum(d.num_anchors for d in self.dims),
            num_parents=sum(d.num_parents for d in self.dims) if parents_kept else self.size.num_parents,
        )
        if got != self.size:
            raise ValueError(f"shard {self.name}: records hold {got}, planned {self.size}")
        self.body.finish(np.array(self.source_rows, dtype=np.int64), self.dims)
        self.writes.wait_synced()  # what the sync thread took is on disk (an error of one raises here)
        self.writes.close()  # every piece is written (an error of one was raised by finish)
        if self.location.is_local:
            fsync_tree(self.tmp)
            self._check_owner()  # the shard took a while: still ours?
            final = self.shard_dir / self.name
            remove_path(final)
            os.rename(self.tmp, final)
            fsync_path(self.shard_dir)
        else:
            self._check_owner()
            self.body.commit()
            final = self.target
        tags = shard_object_tags(final)
        checksum = self.body.checksum(final) or shard_checksum(final)
        if shard_object_tags(final) != tags:  # rewritten while it was read back: not ours to publish
            raise ValueError(f"{final}: its objects changed while their checksum was computed")
        return ShardRecord(
            name=self.name,
            index=self.index,
            sequences=got.num_sequences,
            tokens=got.num_tokens,
            anchors=got.num_anchors,
            bytes=shard_bytes(final),
            checksum=checksum,
            status=SHARD_COMPLETE,
            object_tags=tags,
            parents=None if self.ira_parents is None else self.size.parent_rows,
            compute=self.compute,
        )

    def abort(self) -> None:
        self.writes.close()  # no thread writes into what is removed next
        self.body.close()
        self._remove_written()

    def _check_owner(self) -> None:
        if self.owner is not None:
            check_owner(self.location, self.owner)

    def _remove_written(self) -> None:
        if self.location.is_local:
            remove_path_tolerant(self.tmp)
            return
        try:
            self._check_owner()
        except CacheOwnershipLost:
            return  # the prefix is another build's now: its objects there may be that build's
        self.target.remove()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_shard(
    cache_dir: str | os.PathLike,
    *,
    shard_index: int,
    records: list[dict[str, np.ndarray]],
    storage_format: str,
    feature_codec: str,
    contents=ALL_GROUPS,
    owner: str | None = None,
    chunk_checksums: bool = True,
    num_threads: int = 1,
    rollout_feature_codec: str | None = None,
    ira_parents: int | None = None,
) -> ShardRecord:
    """Write and publish one shard of records already in memory (ShardWriter, for tests and
    benchmarks; the build streams)."""
    if not records:
        raise ValueError(f"shard {shard_name(shard_index, storage_format)}: no records to write")
    with ShardWriter(
        cache_dir, shard_index=shard_index, size=ShardSize.of_records(records, ira_parents=ira_parents),
        storage_format=storage_format, feature_codec=feature_codec, contents=contents, owner=owner,
        chunk_checksums=chunk_checksums, num_threads=num_threads, rollout_feature_codec=rollout_feature_codec,
        ira_parents=ira_parents,
    ) as writer:  # fmt: skip
        for record in records:
            writer.append(record)
        return writer.publish()


def _chunk_layout(
    name: str, row_shape: tuple[int, ...], itemsize: int, num_rows: int, *, rows_per_sequence: int | None = None
) -> tuple[int, int]:
    """(rows per chunk, rows per shard file) of a Zarr array: shard a multiple of the chunk.
    `rows_per_sequence` (the shard's mean sequence's rows of the array) caps the chunk at a
    ZARR_CHUNKS_PER_SEQUENCE-th of it (not below ~4 KiB): one sequence's read then decodes about
    1 + 1/ZARR_CHUNKS_PER_SEQUENCE sequences' rows; None for the index arrays, read whole."""
    row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * itemsize)
    num_rows = max(num_rows, 1)
    target = ZARR_MIN_CHUNK_BYTES if name in ANCHOR_ROW_CHUNK_ARRAYS else ZARR_CHUNK_BYTES
    per_sequence = -(-(rows_per_sequence or num_rows) // ZARR_CHUNKS_PER_SEQUENCE)
    per_sequence = max(per_sequence, ZARR_FLOOR_CHUNK_BYTES // row_bytes)
    chunk_rows = int(max(1, min(num_rows, target // row_bytes, per_sequence)))
    chunks_per_shard = max(1, min(ZARR_SHARD_BYTES // (chunk_rows * row_bytes), ZARR_MAX_CHUNKS_PER_FILE))
    num_chunks = -(-num_rows // chunk_rows)
    return chunk_rows, chunk_rows * int(min(chunks_per_shard, num_chunks))


class _ZarrColumn:
    """One Zarr array filled front to back: rows are buffered until a whole Zarr shard file's worth
    is there, so every write covers whole files (no read-modify-write) and the buffer stays under
    one file (~ZARR_SHARD_BYTES) plus the last record. In a local directory (`local_dir`, the
    shard's) a file's bytes are made on the writer thread that writes it
    (storage.zarr_rows.ChunkFileEncoder: zarr would make them on its one event-loop thread); on a
    store, and for a layout the encoder does not know, zarr writes them (the same bytes)."""

    def __init__(
        self, group, name: str, *, row_shape: tuple, dtype: np.dtype, num_rows: int, compressors: list,
        writes: BackgroundWrites, written: dict[str, tuple[int, bytes]], rows_per_sequence: int | None = None,
        before_write=None, local_dir: Path | None = None,
    ):  # fmt: skip
        self.chunk_rows, self.shard_rows = _chunk_layout(
            name, row_shape, dtype.itemsize, num_rows, rows_per_sequence=rows_per_sequence
        )
        self.before_write, self.writes = before_write, writes
        self.array = group.create_array(
            name,
            shape=(num_rows, *row_shape),
            dtype=dtype,
            chunks=(self.chunk_rows, *row_shape),
            # A one-chunk array needs no shard file (its index and metadata would be pure overhead).
            shards=(self.shard_rows, *row_shape) if self.shard_rows > self.chunk_rows else None,
            compressors=compressors,
            fill_value=0,
            # Every chunk gets a file, so the file set depends only on the shapes.
            config={"write_empty_chunks": True},
        )
        self.num_rows, self.written_rows = num_rows, 0
        self.written = written  # shard-relative path -> (size, sha256) of each file written here
        self.dir = self.encoder = None
        if local_dir is not None:
            self.dir = local_dir / name
            meta = json.loads((self.dir / "zarr.json").read_text())
            self.encoder = ChunkFileEncoder.encoder_of(meta, num_rows=num_rows)
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0

    def append(self, rows: np.ndarray) -> None:
        if self.written_rows + self.pending_rows + len(rows) > self.num_rows:
            raise ValueError(f"array {self.array.basename}: more rows than the {self.num_rows} planned")
        self.pending.append(rows)
        self.pending_rows += len(rows)
        if self.pending_rows >= self.shard_rows:
            self._flush(self.pending_rows - self.pending_rows % self.shard_rows)

    def finish(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)

    def _flush(self, num_rows: int) -> None:
        if self.before_write is not None:
            self.before_write()
        # The flush point lies in the last piece: before it, fewer than a file's rows were pending.
        last, rest_rows = self.pending[-1], self.pending_rows - num_rows
        pieces = [*self.pending[:-1], last[: len(last) - rest_rows]]
        # Whole Zarr shard files, so writes in flight together never touch the same file.
        self.writes.submit(self._write, self.written_rows, pieces)
        self.written_rows += num_rows
        self.pending = [last[len(last) - rest_rows :]] if rest_rows else []
        self.pending_rows = rest_rows

    def _write(self, first_row: int, pieces: list[np.ndarray]) -> None:
        """On a writer thread: rows [first_row, ...) of `pieces`, whole files."""
        data = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
        if self.encoder is None:
            self.array[first_row : first_row + len(data)] = data
            return
        for rel, parts in self.encoder.files(first_row, data):
            path = self.dir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()
            for part in parts:
                digest.update(part)
            with open(path, "xb") as f:
                f.writelines(parts)
            self.written[f"{self.array.basename}/{rel}"] = (sum(len(part) for part in parts), digest.digest())
            self.writes.sync_soon(path)


class _ZarrBody:
    """The Zarr group of a shard being written (layout: module docstring), in a local directory or
    under a store prefix; `before_write` runs before each write of array data (ShardWriter's
    owner check on a store)."""

    def __init__(
        self, target: Path | StorePrefix, size: ShardSize, *, feature_codec: str, chunk_checksums: bool,
        writes: BackgroundWrites, before_write=None, rollout_feature_codec: str | None = None, ira_parents: int | None = None,
        compute: dict[str, str] | None = None,
    ):  # fmt: skip
        self.size, self.feature_codec, self.before_write, self.writes = size, feature_codec, before_write, writes
        self.compute = compute
        self.rollout_feature_codec, self.ira_parents = rollout_feature_codec, ira_parents
        self.local_dir = None if isinstance(target, StorePrefix) else Path(target)
        self.group = zarr.open_group(store=_zarr_store(target, read_only=False), mode="w-", zarr_format=3)
        # CRC32C after compression: every chunk read is checked, so a flipped byte is an error naming
        # the shard and array instead of a silently different value (docs/benchmarks.md: its cost).
        self.compressors = [
            zarr.codecs.BloscCodec(cname="zstd", clevel=ZARR_CLEVEL, shuffle="shuffle", blocksize=ZARR_BLOSC_BLOCK_BYTES)
        ]
        if chunk_checksums:
            self.compressors.append(zarr.codecs.Crc32cCodec())
        self.columns: dict[str, _ZarrColumn] = {}  # created with the first record (it gives F, k, K)
        self.written: dict[str, tuple[int, bytes]] = {}  # the files the columns wrote, hashed as written

    def _column(
        self, name: str, num_rows: int, row_shape: tuple, dtype: np.dtype, rows_per_sequence: int | None = None
    ) -> _ZarrColumn:  # fmt: skip
        if name not in self.columns:
            if self.before_write is not None:  # creating an array writes its metadata object
                self.before_write()
            self.columns[name] = _ZarrColumn(
                self.group, name, row_shape=row_shape, dtype=dtype, num_rows=num_rows, compressors=self.compressors,
                writes=self.writes, written=self.written, rows_per_sequence=rows_per_sequence, before_write=self.before_write,
                local_dir=self.local_dir,
            )  # fmt: skip
        return self.columns[name]

    def append(self, record: dict, dims: RecordDims, *, names: list[str]) -> None:
        for name in names:
            rows = record[name]
            num_rows = self.size.num_anchors if name in ANCHOR_INDEXED_ARRAYS else self.size.num_tokens
            if name in PARENT_ARRAYS:
                num_rows = self.size.parent_rows
            per_sequence = math.ceil(num_rows / self.size.num_sequences)
            dtype = record_dtype(name, feature_codec=self.feature_codec, rollout_feature_codec=self.rollout_feature_codec)
            self._column(name, num_rows, rows.shape[1:], dtype, per_sequence).append(rows)

    def finish(self, source_rows: np.ndarray, dims: list[RecordDims]) -> None:
        for column in self.columns.values():
            column.finish()
        seq_offsets = np.zeros(len(dims) + 1, dtype=np.int64)  # [n+1]
        seq_offsets[1:] = np.cumsum([d.num_tokens for d in dims])
        anchor_offsets = np.zeros(len(dims) + 1, dtype=np.int64)  # [n+1]
        anchor_offsets[1:] = np.cumsum([d.num_anchors for d in dims])
        index_arrays = {ZARR_SEQ_OFFSETS: seq_offsets, ZARR_ANCHOR_OFFSETS: anchor_offsets, ZARR_SOURCE_ROWS: source_rows}
        if self.ira_parents is not None:  # rollout-feature rows: P = min(ira_parents, A) per sequence
            parent_offsets = np.zeros(len(dims) + 1, dtype=np.int64)  # [n+1]
            parent_offsets[1:] = np.cumsum([num_parents(d.num_anchors, self.ira_parents) for d in dims])
            index_arrays[ZARR_PARENT_OFFSETS] = parent_offsets
        for name, data in index_arrays.items():
            column = self._column(name, len(data), (), data.dtype)
            column.append(data)
            column.finish()
        self.writes.wait()  # every array's data is on disk (an error of a write raises here)
        d0 = dims[0]
        version = format_version_for(
            ira_parents=self.ira_parents, feature_codec=self.feature_codec, rollout_feature_codec=self.rollout_feature_codec
        )  # fmt: skip
        attributes = {
            "format": FORMAT_NAME,
            "format_version": version,
            "feature_codec": self.feature_codec,
            "num_sequences": len(dims),
            "num_tokens": int(seq_offsets[-1]),
            "num_anchors": int(anchor_offsets[-1]),
            "feature_dim": d0.feature_dim,
            "top_k": d0.top_k,
            "num_slots": d0.num_slots,
        }
        if version >= 2:  # absent in a version-1 layout: such a shard is byte for byte as before
            attributes["rollout_feature_codec"] = self.rollout_feature_codec or self.feature_codec
            attributes["ira_parents"] = self.ira_parents
        if self.compute is not None:  # absent in a shard built before it was recorded
            attributes["compute"] = self.compute
        self.group.update_attributes(attributes)

    def checksum(self, final: Path | StorePrefix) -> str:
        """shard_checksum with the chunk files' digests taken as they were written (created here by
        exclusive open, written once, sizes checked); zarr's metadata files are read back."""
        return shard_checksum(final, known=self.written)

    def commit(self) -> None:
        pass  # every object is written already

    def close(self) -> None:
        pass


class _HashingWriter:
    """A binary file for writing that feeds every byte written through it to a sha256."""

    def __init__(self, file):
        self.file, self.digest, self.size = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _zarr_store(target: str | os.PathLike | StorePrefix, *, read_only: bool):
    """What zarr opens: a local directory's path, or an fsspec store over a store prefix (with the
    location's options: no listing cache, since other processes change the prefix)."""
    if isinstance(target, StorePrefix):
        return zarr.storage.FsspecStore.from_url(target.url, storage_options=target.storage_options, read_only=read_only)
    return str(target)


class _WdsBody:
    """The tar of a shard being written (storage/wds.py: webdataset's TarWriter, compressed
    members): each record's members are encoded on the writer's threads as it is appended, and
    its sample goes into the tar, in append order, once they are done. On a store the tar is one
    object, created only when `commit` closes its file (an upload that is never committed leaves
    no object)."""

    def __init__(
        self, target: Path | StorePrefix, *, feature_codec: str, contents: tuple[str, ...], chunk_checksums: bool,
        writes: BackgroundWrites, rollout_feature_codec: str | None = None,
    ):  # fmt: skip
        self.on_store = isinstance(target, StorePrefix)
        self.file = target.open("", "wb") if self.on_store else open(target, "xb")
        # A local tar is hashed as it is written (`checksum`): publish need not read it back.
        self.hashed = None if self.on_store else _HashingWriter(self.file)
        self.writer = WdsShardWriter(
            self.hashed or self.file, feature_codec=feature_codec, contents=contents, chunk_checksums=chunk_checksums,
            rollout_feature_codec=rollout_feature_codec,
        )  # fmt: skip
        self.writes, self.chunk_checksums, self.target = writes, chunk_checksums, target
        self.unsynced = 0  # bytes written since the last sync_soon
        self.encoding: collections.deque[tuple[int, list[Future]]] = collections.deque()  # in append order

    def append(self, record: dict, dims: RecordDims, *, names: list[str]) -> None:
        arrays = self.writer.member_arrays(record)
        members = [self.writes.submit(encode_member, array, chunk_checksums=self.chunk_checksums) for array in arrays]
        self.encoding.append((int(record["source_row"]), members))
        # Samples whose members are done go out; beyond a record per thread waiting, the oldest is awaited.
        while self.encoding and (len(self.encoding) > self.writes.num_threads or all(m.done() for m in self.encoding[0][1])):
            self._write_oldest()

    def _write_oldest(self) -> None:
        source_row, members = self.encoding.popleft()
        encoded = [member.result() for member in members]
        self.writer.append_encoded(source_row, encoded)
        self.unsynced += sum(len(data) for _, data in encoded)
        if self.hashed is not None and self.unsynced >= SYNC_EVERY_BYTES:
            self.file.flush()
            self.writes.sync_soon(self.target)
            self.unsynced = 0

    def checksum(self, final: Path | StorePrefix) -> str | None:
        """shard_checksum of the published tar, from the bytes as they were written (None on a
        store: there it is read back). The tar was created here (exclusive open), written only
        through `hashed`, closed and renamed, so those bytes are the file's; its size is checked."""
        if self.hashed is None:
            return None
        if os.path.getsize(final) != self.hashed.size:
            raise ValueError(f"{final}: {os.path.getsize(final)} bytes on disk, {self.hashed.size} written")
        return f"{CHECKSUM_STREAM}:{self.hashed.digest.hexdigest()}"

    def finish(self, source_rows: np.ndarray, dims: list[RecordDims]) -> None:
        while self.encoding:
            self._write_oldest()
        self.writer.close()  # the end-of-archive blocks; the file stays the body's
        if not self.on_store:
            self.file.close()  # on a store it stays open until commit

    def commit(self) -> None:
        if not self.file.closed:
            self.file.close()

    def close(self) -> None:
        if self.file.closed:
            return
        if self.on_store:
            # End the tar into the upload's buffer first (else its stream flushes into a closed file
            # when collected), then abort the upload: no object appears.
            try:
                self.writer.close()
            finally:
                self.file.discard()
                self.file.closed = True
        else:
            self.writer.close()
            self.file.close()


# ---------------------------------------------------------------------------------------------
# Reading one shard


class ZarrShard:
    """Random access to the sequences of one Zarr shard (arrays opened once, offsets cached), in a
    local directory or under a store URL (each chunk read is then a ranged GET)."""

    def __init__(self, path: str | os.PathLike | Location):
        location = resolve(path)
        self.path = location.local_path or location.url  # for messages: a Path, or the URL
        try:
            store = _zarr_store(location.local_path or location, read_only=True)
            self.group = zarr.open_group(store=store, mode="r", zarr_format=3)
        except Exception as e:  # zarr raises several error types for a missing/broken group
            raise ValueError(f"{self.path}: cannot open Zarr shard ({type(e).__name__}: {e})") from None
        self.attrs = dict(self.group.attrs)
        self.arrays = {name: array for name, array in self.group.arrays()}
        missing = [n for n in ZARR_INDEX_ARRAYS if n not in self.arrays and n != ZARR_PARENT_OFFSETS]
        if missing:
            raise ValueError(f"{self.path}: Zarr shard lacks index array {missing[0]}")
        self.seq_offsets = self.arrays[ZARR_SEQ_OFFSETS][:]  # [n+1]
        self.anchor_offsets = self.arrays[ZARR_ANCHOR_OFFSETS][:]  # [n+1]
        self.source_rows = self.arrays[ZARR_SOURCE_ROWS][:]  # [n]
        # Rollout-feature rows per sequence: their own offsets when only some anchors keep them.
        self.parent_offsets = self.arrays[ZARR_PARENT_OFFSETS][:] if ZARR_PARENT_OFFSETS in self.arrays else self.anchor_offsets
        n = len(self.source_rows)
        if len(self.seq_offsets) != n + 1 or len(self.anchor_offsets) != n + 1 or len(self.parent_offsets) != n + 1:
            raise ValueError(
                f"{self.path}: offsets have {len(self.seq_offsets)} / {len(self.anchor_offsets)} entries for {n} sequences"
            )

    @property
    def num_sequences(self) -> int:
        return len(self.source_rows)

    @property
    def array_names(self) -> set[str]:
        """Record arrays stored (source_row included, index arrays excluded)."""
        return {"source_row"} | (set(self.arrays) - set(ZARR_INDEX_ARRAYS))

    def row_range(self, local: int, name: str) -> tuple[int, int]:
        """Rows [start, stop) of array `name` holding sequence `local`'s."""
        offsets = self.seq_offsets
        if name in PARENT_ARRAYS:
            offsets = self.parent_offsets
        elif name in ANCHOR_INDEXED_ARRAYS:
            offsets = self.anchor_offsets
        return int(offsets[local]), int(offsets[local + 1])

    def read(self, local: int, arrays: set[str] | None = None) -> dict[str, np.ndarray]:
        """Encoded record of sequence `local` of this shard (only `arrays`, when given)."""
        record = {"source_row": np.asarray(self.source_rows[local], dtype=np.int64)}
        for name, array in self.arrays.items():
            if name in ZARR_INDEX_ARRAYS or (arrays is not None and name not in arrays):
                continue
            try:
                start, stop = self.row_range(local, name)
                record[name] = array[start:stop]
            except Exception as e:  # a failed checksum (ValueError) or a chunk that no longer decodes
                raise self._corrupt(name, e) from None
        return record

    def read_anchor_rows(self, local: int, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` (the sequence's own rows of the array: pool indices, or parent rows for the
        rollout features) of anchor array `name` of sequence `local`: only their chunks are read."""
        a0 = self.row_range(local, name)[0]
        array = self.arrays[name]
        try:
            # One slice per row: 3x faster than zarr's orthogonal indexing over one-anchor chunks
            # (benchmarks/real_shapes.py).
            picked = [array[a0 + int(r) : a0 + int(r) + 1] for r in np.asarray(rows, dtype=np.int64)]
            return np.concatenate(picked) if picked else array[a0:a0]
        except Exception as e:
            raise self._corrupt(name, e) from None

    def _corrupt(self, name: str, error: Exception) -> CorruptShardError:
        return CorruptShardError(
            f"{self.path}: array {name}: corrupt chunk ({first_line(error)}); `alrira-cache verify` checks the whole cache"
        )

    def close(self) -> None:
        pass


def open_shard(path: str | os.PathLike | Location, *, storage_format: str) -> ZarrShard | WdsShard:
    """Open one shard for random access by local sequence index."""
    _check_choice("storage_format", storage_format, STORAGE_FORMATS)
    return ZarrShard(path) if storage_format == "zarr" else WdsShard(path)


def read_shard_records(path: str | os.PathLike | Location, *, storage_format: str) -> Iterator[dict[str, np.ndarray]]:
    """The encoded records of one shard, in written order."""
    shard = open_shard(path, storage_format=storage_format)
    try:
        for local in range(shard.num_sequences):
            yield shard.read(local)
    finally:
        shard.close()
