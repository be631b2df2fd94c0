"""The one reader API the trainer uses, for Zarr and WebDataset caches alike.

Sequences are numbered globally over the manifest's complete shards, in manifest order. Shard
handles are opened lazily and re-opened when the process id changes, so one `CacheReader` can be
handed to torch DataLoader workers (forked or spawned) as is. A cache on an object store
(`s3://...`, storage.location) reads the same way: only the shards its manifest lists complete,
each chunk or tar member a ranged GET, the store's client opened again in each process.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from storage import codecs
from storage.errors import first_line
from storage.format import (
    ALL_GROUPS,
    CORPUS_DIR,
    FP8_SCALE_ARRAYS,
    SHARD_DIR,
    array_codecs,
    check_contents,
    ira_parent_rows,
    record_array_names,
)
from storage.location import Location, resolve
from storage.manifest import Manifest, ShardRecord, load_manifest
from storage.checksums import shard_bytes
from storage.formats import open_shard
from storage.formats.protocol import ShardHandle
from storage.layout import expected_layout, layout_problem

# The tokenized corpus's sequence -> corpus row map (pipeline/cache_build/corpus.py writes it): what
# rows each shard must hold, the build giving shard i sequences [i * shard_size, (i + 1) * shard_size).
CORPUS_SOURCE_ROWS = f"{CORPUS_DIR}/source_rows.npy"


def decode_record(
    record: dict[str, np.ndarray], *, feature_codec: str, rollout_feature_codec: str | None = None
) -> dict[str, np.ndarray]:  # fmt: skip
    """Record with `features`/`rollout_features` decoded to float32 and the fp8 scales dropped."""
    out = {name: array for name, array in record.items() if name not in FP8_SCALE_ARRAYS.values()}
    for name, codec in array_codecs(feature_codec, rollout_feature_codec).items():
        if name in record:
            out[name] = codecs.decode_features(record[name], record.get(FP8_SCALE_ARRAYS[name]), codec=codec)
    return out


SWAPPED_HINT = "it was replaced by another shard (or one of another cache): rerun the cache build to rebuild it"


class CacheReader:
    """Random and sequential access to the sequences of a cache's complete shards."""

    def __init__(self, cache_dir: str | os.PathLike | Location, manifest: Manifest):
        location = resolve(cache_dir)
        # A Path for a local cache; the URL for a store (fsspec clients are not fork-safe, so
        # each process resolves its own from the URL).
        self.cache_dir: Path | str = location.local_path or location.url
        self.manifest = manifest
        self.storage_format = manifest.settings.storage_format
        self.feature_codec = manifest.settings.feature_codec
        self.rollout_feature_codec = manifest.settings.codecs["rollout_features"]
        self.ira_parents = manifest.settings.ira_parents  # None: every pool anchor keeps its rollout features
        self.layout = expected_layout(manifest)  # what every shard's own layout record must say
        self._shards: list[ShardRecord] = manifest.complete_shards
        self._position = {shard.index: pos for pos, shard in enumerate(self._shards)}
        self._starts = np.cumsum([0] + [s.sequences for s in self._shards])  # [num_shards + 1]
        # One listing on a store instead of a request per shard.
        stored = None if location.is_local else set(location.names(SHARD_DIR))
        for shard in self._shards:
            if not (self.shard_path(shard).exists() if stored is None else shard.name in stored):
                raise ValueError(f"{self.shard_path(shard)}: shard {shard.name} listed as complete is missing")
        self._pid: int | None = None
        self._handles: dict[int, ShardHandle] = {}
        self._corpus_rows: np.ndarray | None | bool = False  # False: not read yet; None: the cache has none

    def shard_path(self, shard: ShardRecord) -> Path | str:
        """The shard's Path, or its URL on a store."""
        if isinstance(self.cache_dir, Path):
            return self.cache_dir / SHARD_DIR / shard.name
        return f"{self.cache_dir}/{SHARD_DIR}/{shard.name}"

    @property
    def shards(self) -> list[ShardRecord]:
        """The readable (complete) shards, in manifest order."""
        return list(self._shards)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self) -> dict[str, Any]:
        # Open files and zarr handles stay behind; the receiving process opens its own.
        state = self.__dict__.copy()
        state["_pid"] = None
        state["_handles"] = {}
        return state

    def _handle(self, pos: int) -> ShardHandle:
        if self._pid != os.getpid():
            # A forked child shares the parent's file offsets: never reuse its handles.
            self._handles = {}
            self._pid = os.getpid()
        handle = self._handles.get(pos)
        if handle is None:
            shard = self._shards[pos]
            handle = open_shard(self.shard_path(shard), storage_format=self.storage_format)
            if handle.num_sequences != shard.sequences:
                raise ValueError(
                    f"{self.shard_path(shard)}: holds {handle.num_sequences} sequences, manifest says {shard.sequences}"
                )
            problem = self.identity_problem(shard, handle)
            if problem is not None:
                handle.close()
                raise ValueError(problem)
            self._handles[pos] = handle
        return handle

    def expected_source_rows(self, shard: ShardRecord) -> np.ndarray | None:
        """The sorted corpus rows the build gave `shard` (its slice of the tokenized corpus); None
        for a cache without a tokenized corpus (assembled by hand), whose shards are not checked."""
        if self._corpus_rows is False:
            location = resolve(self.cache_dir)
            self._corpus_rows = None
            if location.is_file(CORPUS_SOURCE_ROWS):
                try:
                    self._corpus_rows = np.load(io.BytesIO(location.read_bytes(CORPUS_SOURCE_ROWS)), allow_pickle=False)
                except ValueError as error:
                    raise ValueError(f"{location.join(CORPUS_SOURCE_ROWS)}: unreadable ({first_line(error)})") from None
        if self._corpus_rows is None:
            return None
        size = self.manifest.settings.shard_size
        return np.sort(np.asarray(self._corpus_rows[shard.index * size : (shard.index + 1) * size], dtype=np.int64))

    def identity_problem(self, shard: ShardRecord, handle: ShardHandle) -> str | None:
        """Whether an opened shard is the one the manifest lists under its name: the layout it
        records is the manifest's (storage/layout.py), its records' source
        rows (the Zarr source_rows array, the tar's sample keys: read at open anyway) are the rows
        the build planned for it, and a Zarr shard's sizes are the manifest's. A valid shard of
        another index or another cache put in its place trains on wrong rows and passes every
        other cheap check (docs/design.md, "The cache contract")."""
        where = self.shard_path(shard)
        problem = layout_problem(handle.layout(), self.layout, where=str(where))
        if problem is not None:
            return problem
        for what, value in (handle.recorded_sizes() or {}).items():
            if value != getattr(shard, what):
                return f"{where}: holds {value} {what}, the manifest records {getattr(shard, what)} for {shard.name}; {SWAPPED_HINT}"
        expected = self.expected_source_rows(shard)
        if expected is None:
            return None
        rows = np.sort(np.asarray(handle.source_rows, dtype=np.int64))
        if not np.array_equal(rows, expected):
            first = [int(r) for r in rows[:3]]
            return (
                f"{where}: holds corpus rows {first}... where the build put rows {[int(r) for r in expected[:3]]}... "
                f"in {shard.name}; {SWAPPED_HINT}"
            )
        return None

    def _read_shard(self, pos: int, local: int, arrays: set[str] | None) -> dict[str, np.ndarray]:
        """The encoded record of sequence `local` of shard `pos`."""
        return self._handle(pos).read(local, arrays)

    def _read_anchor_rows(self, index: int, name: str, pool_rows) -> np.ndarray:
        shard_index, local = self.shard_of(index)
        return self._handle(self._position[shard_index]).read_anchor_rows(local, name, pool_rows)

    def shard_of(self, index: int) -> tuple[int, int]:
        """(shard index as in the manifest, sequence index within that shard) of global `index`."""
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"sequence index must be an int, got {type(index).__name__}")
        if not 0 <= index < len(self):
            raise IndexError(f"sequence index {index} out of range for a cache of {len(self)} sequences")
        pos = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self._shards[pos].index, int(index - self._starts[pos])

    def read(self, index: int, *, decode_features: bool = True, arrays: set[str] | None = None) -> dict[str, np.ndarray]:
        """Record of global sequence `index` (only `arrays` and source_row when given; fp8 scales
        follow their features); features decoded to float32 unless told otherwise."""
        shard_index, local = self.shard_of(index)
        if arrays is not None:
            arrays = set(arrays) | {FP8_SCALE_ARRAYS[n] for n in arrays if n in FP8_SCALE_ARRAYS}
        record = self._read_shard(self._position[shard_index], local, arrays)
        return self.decode(record) if decode_features else record

    def decode(self, record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """An encoded record of this cache with its features decoded to float32 (decode_record)."""
        return decode_record(record, feature_codec=self.feature_codec, rollout_feature_codec=self.rollout_feature_codec)

    def parent_rows(self, num_anchors: int) -> np.ndarray:
        """Pool indices [P] whose rollout features a sequence with a pool of `num_anchors` stores,
        in stored order (row i of its rollout_features is pool index parent_rows[i])."""
        return ira_parent_rows(num_anchors, self.ira_parents)

    def read_rollout_features(self, index: int, rows, *, decode_features: bool = True) -> np.ndarray:
        """`rollout_features` rows `rows` (stored rows: pool indices unless the cache keeps only some
        anchors' features, `parent_rows`) only: [len(rows), K-2, F], what an IRA secondary block
        sees of its parent's rollout."""
        bits = self._read_anchor_rows(index, "rollout_features", rows)
        if not decode_features:
            return bits
        scales = self.read_rollout_feature_scales(index, rows) if self.rollout_feature_codec == "fp8" else None
        return codecs.decode_features(bits, scales, codec=self.rollout_feature_codec)

    def read_rollout_feature_scales(self, index: int, rows) -> np.ndarray:
        """fp8 rollout features: the per-row scales [len(rows), K-2] of those stored rows."""
        return self._read_anchor_rows(index, "rollout_feature_scales", rows)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.read(index)

    def iter_shard(self, shard_index: int, *, decode_features: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """Records of one shard (by its manifest index), in order."""
        if shard_index not in self._position:
            raise ValueError(f"shard {shard_index} is not a complete shard of {self.cache_dir}")
        pos = self._position[shard_index]
        for local in range(self._shards[pos].sequences):
            record = self._handle(pos).read(local)
            yield self.decode(record) if decode_features else record

    def close(self) -> None:
        if self._pid == os.getpid():
            for handle in self._handles.values():
                handle.close()
        self._handles = {}


def open_cache(cache_dir: str | os.PathLike | Location) -> CacheReader:
    """Load and validate the manifest of `cache_dir` and return a reader over its complete shards."""
    return CacheReader(cache_dir, load_manifest(cache_dir))


def raw_bf16_bytes(
    *,
    num_sequences: int,
    num_tokens: int,
    num_anchors: int,
    feature_dim: int,
    top_k: int,
    num_slots: int,
    contents=ALL_GROUPS,
    num_parents: int | None = None,
) -> int:
    """Bytes the record arrays of a cache holding `contents` would take uncompressed with
    features stored as bf16 (rollout features for `num_parents` anchors; None: all of them)."""
    contents = check_contents(contents)
    F, k, K = feature_dim, top_k, num_slots
    per_token = 4 + 1 + 2 * F  # input_ids, loss_mask, features
    per_anchor = 4  # anchor_pos
    if "corpus_topk" in contents:  # corpus_topk_ids/probs, corpus_tail, corpus_next_prob
        per_token += 4 * k + 4 * k + 4 + 4
    if "rollouts" in contents:  # rollout_tokens, rollout_topk_ids/probs, rollout_tail
        per_anchor += 4 * (K + 1) + 8 * K * k + 4 * K
    parents = num_anchors if num_parents is None else num_parents
    per_parent = 2 * (K - 2) * F if "rollout_features" in contents else 0
    per_sequence = 8  # source_row
    return num_tokens * per_token + num_anchors * per_anchor + parents * per_parent + num_sequences * per_sequence


def cache_stats(reader: CacheReader) -> dict[str, float | int]:
    """Counts and size of the readable part of a cache, and how it compares to raw bf16 arrays."""
    m = reader.manifest
    bytes_on_disk = sum(shard_bytes(reader.shard_path(s)) for s in reader.shards)
    raw = raw_bf16_bytes(
        num_sequences=m.num_sequences,
        num_tokens=m.num_tokens,
        num_anchors=m.num_anchors,
        feature_dim=m.feature_dim,
        top_k=m.settings.top_k,
        num_slots=m.settings.num_slots,
        contents=m.settings.contents,
        num_parents=None if m.settings.ira_parents is None else sum(s.parents or 0 for s in reader.shards),
    )
    return {
        "sequences": m.num_sequences,
        "tokens": m.num_tokens,
        "anchors": m.num_anchors,
        "bytes_on_disk": bytes_on_disk,
        "raw_bf16_bytes": raw,
        "bytes_per_token": bytes_on_disk / m.num_tokens if m.num_tokens else 0.0,
        "compression_ratio_vs_raw_bf16": raw / bytes_on_disk if bytes_on_disk else 0.0,
    }


# What `info` and `--estimate` report bytes by: each array group and the arrays in it (the small
# per-sequence index arrays of a Zarr shard and its metadata count as "index").
BYTE_GROUPS = {
    "corpus_features": ("features", "feature_scales"),
    "corpus_tokens": ("input_ids", "loss_mask", "source_row", "anchor_pos"),
    "corpus_topk": ("corpus_topk_ids", "corpus_topk_probs", "corpus_tail", "corpus_next_prob"),
    "rollouts": ("rollout_tokens", "rollout_topk_ids", "rollout_topk_probs", "rollout_tail"),
    "rollout_features": ("rollout_features", "rollout_feature_scales"),
}
_GROUP_OF = {name: group for group, names in BYTE_GROUPS.items() for name in names}


def shard_group_bytes(reader: CacheReader, shard: ShardRecord) -> dict[str, int]:
    """On-disk bytes of one complete shard by BYTE_GROUPS group ("index": the rest: offsets,
    metadata, tar end blocks); they sum to the shard's bytes."""
    out = dict.fromkeys([*BYTE_GROUPS, "index"], 0)
    handle = open_shard(reader.shard_path(shard), storage_format=reader.storage_format)
    try:
        for name, size in handle.array_bytes().items():
            out[_GROUP_OF.get(name, "index")] += size
    finally:
        handle.close()
    out["index"] += shard_bytes(reader.shard_path(shard)) - sum(out.values())
    return out


def cache_group_bytes(reader: CacheReader) -> dict[str, int]:
    """cache_group_bytes summed over the complete shards."""
    out = dict.fromkeys([*BYTE_GROUPS, "index"], 0)
    for shard in reader.shards:
        for group, size in shard_group_bytes(reader, shard).items():
            out[group] += size
    return out


def available_arrays(reader: CacheReader) -> set[str]:
    """Names of the (encoded) record arrays the cache holds, read from its first complete shard;
    a cache without complete shards reports the names its codec and contents promise."""
    if not reader.shards:
        return set(record_array_names(reader.feature_codec, reader.manifest.settings.contents))
    return reader._handle(0).array_names
