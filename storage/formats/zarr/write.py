"""Writing a Zarr v3 shard: one group per shard; every per-sequence array is concatenated over the
shard's sequences into one flat array (token arrays along tokens, anchor arrays along anchors,
rollout features along their parent rows), plus `seq_offsets`, `anchor_offsets`
(int64 [n+1]), `source_rows` (int64 [n]) and, when only some anchors keep rollout features,
`parent_offsets`. Blosc zstd with byte shuffle, CRC32C per chunk; chunks grouped into Zarr shard
files. The group's attributes say what the shard is (format, codecs, sizes, compute, layout).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import zarr

from storage.background_writes import BackgroundWrites
from storage.checksums import shard_checksum
from storage.format import (
    FORMAT_NAME,
    PARENT_ARRAYS,
    ZARR_ANCHOR_OFFSETS,
    ZARR_PARENT_OFFSETS,
    ZARR_SEQ_OFFSETS,
    ZARR_SOURCE_ROWS,
    format_version_for,
    num_parents,
)
from storage.formats.protocol import BodySettings, ShardSize
from storage.formats.wds import BLOSC_BLOCK_BYTES
from storage.formats.zarr.rows import ChunkFileEncoder
from storage.location import StorePrefix
from storage.records import ANCHOR_INDEXED_ARRAYS, RecordDims, record_dtype


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


def set_codec_threads(num_threads: int) -> None:
    """Let Zarr compress and checksum chunks on `num_threads` threads in this process (its pool
    is process-wide, zarr.config "threading.max_workers"). Takes effect only before this process's
    first Zarr read or write: a build worker calls it as it starts (docs/design.md, "A cache build")."""
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    zarr.config.set({"threading.max_workers": num_threads})



def zarr_store(target: str | os.PathLike | StorePrefix, *, read_only: bool):
    """What zarr opens: a local directory's path, or an fsspec store over a store prefix (with the
    location's options: no listing cache, since other processes change the prefix)."""
    if isinstance(target, StorePrefix):
        return zarr.storage.FsspecStore.from_url(target.url, storage_options=target.storage_options, read_only=read_only)
    return str(target)



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
    (storage.formats.zarr.rows.ChunkFileEncoder: zarr would make them on its one event-loop thread); on a
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


class ZarrBody:
    """The Zarr group of a shard being written (layout: module docstring), in a local directory or
    under a store prefix; `before_write` runs before each write of array data (ShardWriter's
    owner check on a store)."""

    def __init__(
        self, target: Path | StorePrefix, size: ShardSize, settings: BodySettings, *, writes: BackgroundWrites,
        before_write=None,
    ):  # fmt: skip
        self.size, self.feature_codec, self.before_write, self.writes = size, settings.feature_codec, before_write, writes
        self.compute, self.layout = settings.compute, None
        self.rollout_feature_codec, self.ira_parents = settings.rollout_feature_codec, settings.ira_parents
        chunk_checksums = settings.chunk_checksums
        self.local_dir = None if isinstance(target, StorePrefix) else Path(target)
        self.group = zarr.open_group(store=zarr_store(target, read_only=False), mode="w-", zarr_format=3)
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

    def start(self, layout: dict) -> None:
        self.layout = layout  # written with the group's attributes by `finish`

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
        if self.layout is not None:  # absent in a shard written before shards recorded their layout
            attributes["layout"] = self.layout
        self.group.update_attributes(attributes)

    def checksum(self, final: Path | StorePrefix) -> str:
        """shard_checksum with the chunk files' digests taken as they were written (created here by
        exclusive open, written once, sizes checked); zarr's metadata files are read back."""
        return shard_checksum(final, known=self.written)

    def commit(self) -> None:
        pass  # every object is written already

    def close(self) -> None:
        pass
