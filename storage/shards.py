"""Writing one cache shard through its format (storage/formats/), and cleaning up after
interrupted writes.

A shard is streamed under `shards/.tmp-<name>-<uuid>` as its records are computed (ShardWriter),
then fsynced and renamed to `shards/<name>`, so a published name always means a complete shard. The bytes are a function of
the records only (no timestamps, fixed member order), so a resumed build can be checked against
an uninterrupted one by checksum.

On an object store (storage.location) there is no rename: a shard is written under its final
prefix `shards/<name>` (after the objects an interrupted write left there are removed) and is
published by the manifest alone, which lists it only once it is whole (docs/design.md, "Caches on
object stores"). Its objects and bytes are those of the same shard on a local disk.

The layouts: storage/formats/zarr/write.py (Zarr v3, one group per shard) and storage/formats/wds.py
(WebDataset tar, one sample per sequence). Either way a shard holds exactly the arrays of its
cache's contents (storage.format.ARRAY_GROUPS), validated by storage.records.check_record.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable

import numpy as np

from storage.atomic import fsync_path, fsync_tree, move_into_place
from storage.background_writes import BackgroundWrites
from storage.checksums import shard_bytes, shard_checksum, shard_object_tags
from storage.format import (
    ALL_GROUPS,
    FEATURE_CODECS,
    PARTIAL_SHARD_PREFIX,
    SHARD_COMPLETE,
    SHARD_DIR,
    array_codecs,
    check_contents,
    check_ira_parents,
    record_array_names,
    shard_name,
)
from storage.formats import open_shard, read_shard_records, shard_format
from storage.formats.protocol import BodySettings, ShardBody, ShardSize
from storage.location import Location, remove_path, remove_path_tolerant, resolve
from storage.manifest import ShardRecord, check_compute
from storage.ownership import SHARD_NAME, CacheOwnershipLost, check_owner, owned
from storage.layout import shard_layout
from storage.records import RecordDims, check_record

__all__ = [
    "ShardSize",
    "ShardWriter",
    "clean_partial_shards",
    "open_shard",
    "read_shard_records",
    "write_shard",
]


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
    writer thread itself (storage.formats.zarr.rows.ChunkFileEncoder); on a store zarr compresses a file's
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
        shard_format(storage_format)  # a known format
        self.storage_format = storage_format
        check_compute("compute", compute)
        self.compute = compute  # what the target computed the records in: the shard's metadata and record
        if feature_codec not in FEATURE_CODECS:
            raise ValueError(f"feature_codec must be one of {FEATURE_CODECS}, got {feature_codec!r}")
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
        settings = BodySettings(
            feature_codec=feature_codec, rollout_feature_codec=rollout_feature_codec, contents=self.contents,
            ira_parents=self.ira_parents, compute=compute, chunk_checksums=chunk_checksums,
        )  # fmt: skip
        try:
            self.body: ShardBody = shard_format(storage_format).body(
                self.target, size, settings, writes=self.writes, before_write=before_write
            )
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
        if i == 0:  # the first record gives F, k and K: the shard's layout record (storage/layout.py)
            self.body.start(shard_layout(
                storage_format=self.storage_format, feature_codec=self.feature_codec,
                rollout_feature_codec=self.rollout_feature_codec, contents=self.contents, ira_parents=self.ira_parents,
                compute=self.compute, feature_dim=dims.feature_dim, top_k=dims.top_k, num_slots=dims.num_slots,
            ))  # fmt: skip
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
            final = self.shard_dir / self.name
            # Check (the shard took a while: still ours?) and rename as one step: no new claim in between.
            claimed = owned(self.location, self.owner) if self.owner is not None else contextlib.nullcontext()
            with claimed:
                remove_path(final)
                move_into_place(self.tmp, final, sync=False)  # fsynced above, before the owner check
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
    cache_dir: str | os.PathLike, *, shard_index: int, records: list[dict[str, np.ndarray]], storage_format: str,
    ira_parents: int | None = None, **settings,
) -> ShardRecord:
    """Write and publish one shard of records already in memory (ShardWriter, for tests and
    benchmarks; the build streams). `settings`: ShardWriter's (feature_codec, contents, owner,
    compute as a build records it, ...)."""
    if not records:
        raise ValueError(f"shard {shard_name(shard_index, storage_format)}: no records to write")
    with ShardWriter(
        cache_dir, shard_index=shard_index, size=ShardSize.of_records(records, ira_parents=ira_parents),
        storage_format=storage_format, ira_parents=ira_parents, **settings,
    ) as writer:  # fmt: skip
        for record in records:
            writer.append(record)
        return writer.publish()
