"""Reading a Zarr shard (layout: storage/formats/zarr/write.py): random access by local sequence."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import zarr

from storage.errors import CorruptShardError, first_line
from storage.format import (
    PARENT_ARRAYS,
    ZARR_ANCHOR_OFFSETS,
    ZARR_INDEX_ARRAYS,
    ZARR_PARENT_OFFSETS,
    ZARR_SEQ_OFFSETS,
    ZARR_SOURCE_ROWS,
    record_array_names,
)
from storage.formats.zarr.rows import ZarrRows
from storage.formats.zarr.write import zarr_store
from storage.location import Location, resolve
from storage.manifest import Manifest, ShardRecord
from storage.records import ANCHOR_INDEXED_ARRAYS, record_dtype


class ZarrShard:
    """Random access to the sequences of one Zarr shard (arrays opened once, offsets cached), in a
    local directory or under a store URL (each chunk read is then a ranged GET)."""

    def __init__(self, path: str | os.PathLike | Location):
        location = resolve(path)
        self.path = location.local_path or location.url  # for messages: a Path, or the URL
        try:
            store = zarr_store(location.local_path or location, read_only=True)
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
        # A local shard's arrays whose layout storage.formats.zarr.rows knows are read straight from
        # their chunk files (the map loader's decode path); the rest, and a store's, through zarr.
        self.rows = ZarrRows(self.path) if isinstance(self.path, Path) else None

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
                fast = self.rows is not None and self.rows.layout(name)
                record[name] = self.rows.rows(name, start, stop) if fast else array[start:stop]
            except Exception as e:  # a failed checksum (ValueError) or a chunk that no longer decodes
                raise self._corrupt(name, e) from None
        return record

    def read_anchor_rows(self, local: int, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` (the sequence's own rows of the array: pool indices, or parent rows for the
        rollout features) of anchor array `name` of sequence `local`: only their chunks are read."""
        a0 = self.row_range(local, name)[0]
        array = self.arrays[name]
        try:
            if self.rows is not None and self.rows.layout(name):
                return self.rows.pick(name, a0 + np.asarray(rows, dtype=np.int64))
            # One slice per row: 3x faster than zarr's orthogonal indexing over one-anchor chunks
            # (benchmarks/speed/real_shapes.py).
            picked = [array[a0 + int(r) : a0 + int(r) + 1] for r in np.asarray(rows, dtype=np.int64)]
            return np.concatenate(picked) if picked else array[a0:a0]
        except Exception as e:
            raise self._corrupt(name, e) from None

    def layout(self) -> dict | None:
        """The recorded layout; for a shard written before layouts were, what its attributes and
        arrays' metadata say of it (every field but the array groups, which its arrays imply)."""
        if "layout" in self.attrs:
            return self.attrs["layout"]
        attrs = self.attrs
        layout = {
            "format": "zarr",
            "format_version": attrs.get("format_version"),
            "feature_codec": attrs.get("feature_codec"),
            "rollout_feature_codec": attrs.get("rollout_feature_codec", attrs.get("feature_codec")),
            "ira_parents": attrs.get("ira_parents"),
            "arrays": {
                name: {"dtype": np.dtype(array.dtype).str, "row_shape": list(array.shape[1:])}
                for name, array in self.arrays.items() if name not in ZARR_INDEX_ARRAYS
            },
        }  # fmt: skip
        if attrs.get("compute") is not None:
            layout["compute"] = attrs["compute"]
        return layout

    def array_bytes(self) -> dict[str, int]:
        """Bytes of the shard each array's files take (its directory; index arrays included)."""
        out: dict[str, int] = {}
        for rel, size in resolve(self.path).files():
            name = rel.split("/", 1)[0]
            out[name] = out.get(name, 0) + size
        return out

    def recorded_sizes(self) -> dict[str, int]:
        return {"tokens": self.attrs.get("num_tokens"), "anchors": self.attrs.get("num_anchors")}

    def _corrupt(self, name: str, error: Exception) -> CorruptShardError:
        return CorruptShardError(
            f"{self.path}: array {name}: corrupt chunk ({first_line(error)}); `alrira-cache verify` checks the whole cache"
        )

    def structure_problems(self, manifest: Manifest, record: ShardRecord) -> list[str]:
        """Flat-array problems of a Zarr shard: offsets, lengths, dtypes, attributes."""
        settings = manifest.settings
        codec, rollout_codec = settings.feature_codec, settings.rollout_feature_codec
        problems = []
        names = set(record_array_names(codec, settings.contents, rollout_codec)) - {"source_row"}
        stored = set(self.arrays) - set(ZARR_INDEX_ARRAYS)
        if stored != names:
            problems.append(f"arrays {sorted(stored ^ names)} missing or unexpected")
        if self.attrs.get("feature_codec") != codec:
            problems.append(f"attribute feature_codec {self.attrs.get('feature_codec')!r}, manifest says {codec!r}")
        computed = self.attrs.get("compute")  # absent in a shard built before it was recorded
        if manifest.compute is not None and computed is not None and computed != manifest.compute:
            problems.append(f"attribute compute {computed!r}: computed in another dtype than the cache's {manifest.compute!r}")
        if (settings.ira_parents is not None) != (ZARR_PARENT_OFFSETS in self.arrays):
            problems.append(f"index array {ZARR_PARENT_OFFSETS} {'missing' if settings.ira_parents else 'unexpected'}")
        elif settings.ira_parents is not None:
            expected = np.concatenate([[0], np.cumsum(np.minimum(np.diff(self.anchor_offsets), settings.ira_parents))])
            if not np.array_equal(self.parent_offsets, expected):
                problems.append(f"{ZARR_PARENT_OFFSETS} do not give min(ira_parents, anchors) rows per sequence")
        for offsets_name, offsets, arrays in (
            ("seq_offsets", self.seq_offsets, [n for n in stored if n not in ANCHOR_INDEXED_ARRAYS]),
            ("anchor_offsets", self.anchor_offsets, [n for n in stored if n in ANCHOR_INDEXED_ARRAYS and n not in PARENT_ARRAYS]),
            ("parent_offsets", self.parent_offsets, [n for n in stored if n in PARENT_ARRAYS]),
        ):
            if offsets.dtype != np.int64 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
                problems.append(f"{offsets_name} must be int64, start at 0 and not decrease")
                continue
            for name in sorted(arrays):
                array = self.arrays[name]
                if array.shape[0] != offsets[-1]:
                    problems.append(f"{name} has {array.shape[0]} rows, {offsets_name} ends at {offsets[-1]}")
                dtype = record_dtype(name, feature_codec=codec, rollout_feature_codec=rollout_codec)
                if array.dtype != dtype:
                    problems.append(f"{name} has dtype {array.dtype}, expected {dtype}")
        if self.seq_offsets[-1] != record.tokens:
            problems.append(f"holds {self.seq_offsets[-1]} tokens, manifest says {record.tokens}")
        if self.anchor_offsets[-1] != record.anchors:
            problems.append(f"holds {self.anchor_offsets[-1]} anchors, manifest says {record.anchors}")
        return problems

    def close(self) -> None:
        pass
