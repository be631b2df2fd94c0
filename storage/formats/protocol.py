"""The one interface every shard format implements (storage/formats/__init__.py registers them).

Writing: storage.shards.ShardWriter validates records, plans the shard and publishes it; a
format's `ShardBody` only lays the records out: `start` (the shard's layout record), `append` each
record, `finish` (index arrays, metadata), `checksum` of what it wrote, `commit` (on a store: the
object appears), `close` (abort). Reading: `open` gives a `ShardHandle`: its sequences by local
index (`read` rows, `read_anchor_rows` for a few anchors' arrays), the layout the shard records
for itself (`layout`, checked against the manifest before a row is read: storage.layout), the
bytes per array (`array_bytes`), and the format's own structural checks for `verify`
(`structure_problems`). Nothing outside a format reaches into its handle.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from storage.format import num_parents

if TYPE_CHECKING:
    from storage.location import Location, StorePrefix
    from storage.manifest import Manifest, ShardRecord
    from storage.records import RecordDims


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


@dataclass(frozen=True, kw_only=True)
class BodySettings:
    """What a format's writer needs to lay out one shard (ShardWriter resolves it once)."""

    feature_codec: str
    rollout_feature_codec: str | None
    contents: tuple[str, ...]
    ira_parents: int | None
    compute: dict[str, str] | None
    chunk_checksums: bool


class ShardBody(Protocol):
    """The bytes of one shard being written, under `target` (a temp path, or a store prefix)."""

    def start(self, layout: dict) -> None:
        """Record the shard's layout (storage/layout.py), before the first record is appended."""

    def append(self, record: dict[str, np.ndarray], dims: RecordDims, *, names: list[str]) -> None: ...

    def finish(self, source_rows: np.ndarray, dims: list[RecordDims]) -> None: ...

    def checksum(self, final: Path | StorePrefix) -> str | None:
        """The published shard's checksum from what was written (None: read it back)."""

    def commit(self) -> None: ...

    def close(self) -> None: ...


class ShardHandle(Protocol):
    """Random access to the sequences of one published shard."""

    path: Path | str  # for messages: a Path, or the URL

    @property
    def num_sequences(self) -> int: ...

    @property
    def source_rows(self) -> np.ndarray:
        """int64 [n]: the records' source_row, in stored order (read at open)."""

    @property
    def array_names(self) -> set[str]:
        """Record arrays stored (source_row included)."""

    def read(self, local: int, arrays: set[str] | None = None) -> dict[str, np.ndarray]: ...

    def read_anchor_rows(self, local: int, name: str, rows: np.ndarray) -> np.ndarray: ...

    def layout(self) -> dict | None:
        """The layout the shard records for itself; None for a shard written before it did."""

    def array_bytes(self) -> dict[str, int]:
        """Bytes on disk per stored array name (anything else is the shard's index)."""

    def recorded_sizes(self) -> dict[str, int] | None:
        """{"tokens", "anchors"} the shard's own index gives without reading a row; None if none."""

    def structure_problems(self, manifest: Manifest, record: ShardRecord) -> list[str]:
        """`verify`'s format-specific checks (offsets, stored dtypes), one line each."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class ShardFormat:
    """One registered format: its name, how a shard is opened and how one is written."""

    name: str
    open: Callable[[str | os.PathLike | Location], ShardHandle]
    # (target, size, settings, writes, before_write) -> ShardBody
    body: Callable[..., ShardBody]
