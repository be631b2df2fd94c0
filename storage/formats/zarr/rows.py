"""Rows of a local Zarr shard's arrays decoded straight from their chunk files (docs/cache-format.md).

zarr-python reads a slice through its asyncio pipeline, one inner chunk at a time with a thread
hand-off per codec: at real shapes that costs 2-3x the Blosc decode itself (benchmarks/speed/real_shapes.py,
"(b2)"), so the map loader ran far below its decompression floor. This reads the one layout the
cache writer produces (chunked along the first axis only; codecs bytes, blosc, crc32c; optionally
inside a `sharding_indexed` file with its index at the end, bytes + crc32c) with one read per run
of chunks stored back to back in a file (a sequence's rows of an array: one read per file) and one
Blosc call per chunk straight into the result, checking every crc32c as zarr does. An array laid
out any other way returns None from `ZarrRows.layout` and is read through zarr.

`ChunkFileEncoder` is the writing side of the same layout (storage.shards.ShardWriter): zarr-python
writes a shard file through its one event-loop thread, which fills, copies, checksums and joins
every chunk there, a quarter of the writer's CPU at real shapes and the same thread whatever the
number of writer threads (docs/benchmarks.md, "Real shapes" (e)). The encoder makes a file's bytes
on the calling thread, byte for byte what zarr writes (tests/test_writer_parallel.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np
from numcodecs import Blosc, blosc

_MISSING = 2**64 - 1  # a shard index entry of a chunk never written (zarr's fill value applies)


@dataclass(frozen=True, kw_only=True)
class ChunkLayout:
    """How one array's rows sit in its chunk files."""

    dtype: np.dtype
    row_shape: tuple[int, ...]
    chunk_rows: int  # rows per (inner) chunk
    file_rows: int  # rows per chunk file (a multiple of chunk_rows)
    sharded: bool  # chunk files are shard files with an index at the end
    fill_value: int | float


def _checked(data: bytes | np.ndarray, path: str, root: Path) -> bytes | np.ndarray:
    """`data` (bytes or a read-only uint8 view) less its trailing little-endian crc32c, which must
    match (`path` names the file); a view of `data`'s bytes for a view, a copy for bytes."""
    frame = data[:-4]  # (google_crc32c takes read-only buffers only: bytes or a read-only array)
    if len(data) < 4 or google_crc32c.value(frame) != int.from_bytes(bytes(data[-4:]), "little"):
        raise ValueError(f"{os.path.relpath(path, root.parent)}: crc32c checksum mismatch")
    return frame


def _plain_codecs(codecs: list[dict], *, itemsize: int) -> bool:
    names = [c["name"] for c in codecs]
    endian = (codecs[0].get("configuration") or {}).get("endian", "little") if codecs else None
    return names == ["bytes", "blosc", "crc32c"] and (endian == "little" or itemsize == 1)


def parse_layout(meta: dict) -> ChunkLayout | None:
    """The layout of an array from its zarr.json, or None if it is not one this module reads."""
    shape, grid = meta.get("shape"), meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
    encoding = meta.get("chunk_key_encoding", {})
    if not shape or not grid or encoding.get("name") != "default" or encoding.get("configuration", {}).get("separator", "/") != "/":
        return None
    try:
        dtype = np.dtype(meta["data_type"])
    except TypeError:
        return None
    codecs, sharded = meta["codecs"], meta["codecs"][0]["name"] == "sharding_indexed"
    chunk_shape = grid
    if sharded:
        config = codecs[0]["configuration"]
        index_names = [c["name"] for c in config["index_codecs"]]
        if len(codecs) != 1 or index_names != ["bytes", "crc32c"] or config.get("index_location", "end") != "end":
            return None
        codecs, chunk_shape = config["codecs"], config["chunk_shape"]
    if not _plain_codecs(codecs, itemsize=dtype.itemsize) or list(grid[1:]) != list(shape[1:]):
        return None
    if list(chunk_shape[1:]) != list(shape[1:]) or grid[0] % chunk_shape[0]:
        return None
    return ChunkLayout(dtype=dtype, row_shape=tuple(shape[1:]), chunk_rows=int(chunk_shape[0]), file_rows=int(grid[0]),
                       sharded=sharded, fill_value=meta.get("fill_value") or 0)  # fmt: skip


class ZarrRows:
    """Row ranges of the arrays of one local Zarr shard directory. Chunk files are opened afresh
    by each read, once per file (nothing to re-open after a fork); shard indexes are cached (a
    complete shard never changes)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._layouts: dict[str, ChunkLayout | None] = {}
        self._indexes: dict[str, np.ndarray] = {}
        self._paths: dict[tuple[str, int], str] = {}

    def layout(self, name: str) -> ChunkLayout | None:
        if name not in self._layouts:
            meta_path = self.root / name / "zarr.json"
            self._layouts[name] = parse_layout(json.loads(meta_path.read_text())) if meta_path.is_file() else None
        return self._layouts[name]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of array `name` (its layout must be readable here). A chunk wholly
        inside the range is decoded straight into the result."""
        layout = self.layout(name)
        out = np.empty((stop - start, *layout.row_shape), dtype=layout.dtype)
        size = layout.chunk_rows
        for chunk, frame in self._frames(name, layout, range(start // size, -(-stop // size))):
            lo, hi = max(start, chunk * size), min(stop, (chunk + 1) * size)
            if (lo, hi) == (chunk * size, (chunk + 1) * size):
                self._decode(layout, frame, into=out[lo - start : hi - start])
            else:
                out[lo - start : hi - start] = self._decode(layout, frame)[lo - chunk * size : hi - chunk * size]
        return out

    def pick(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` (any order, repeats allowed) of array `name`; each chunk is decoded once."""
        layout = self.layout(name)
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), *layout.row_shape), dtype=layout.dtype)
        chunks = rows // layout.chunk_rows
        wanted = np.unique(chunks).tolist()
        if layout.chunk_rows == 1:  # rollout_features: a chunk per anchor row, decoded in place
            first = {row: i for i, row in reversed(list(enumerate(rows.tolist())))}
            for row, frame in self._frames(name, layout, wanted):
                self._decode(layout, frame, into=out[first[row] : first[row] + 1])
            for i, row in enumerate(rows.tolist()):
                if first[row] != i:
                    out[i] = out[first[row]]
            return out
        for chunk, frame in self._frames(name, layout, wanted):
            decoded = self._decode(layout, frame)  # [chunk_rows, *row_shape]
            mine = np.nonzero(chunks == chunk)[0]
            out[mine] = decoded[rows[mine] - chunk * layout.chunk_rows]
        return out

    def frame(self, name: str, chunk: int) -> bytes | None:
        """The Blosc frame of chunk `chunk` of array `name`, its crc32c checked; None for a chunk
        never written (the fill value applies)."""
        layout = self.layout(name)
        file_index, first = divmod(chunk * layout.chunk_rows, layout.file_rows)
        path = self._file_path(name, file_index, len(layout.row_shape))
        if layout.sharded:
            offset, length = (int(x) for x in self._index(path, layout)[first // layout.chunk_rows])
            if offset == _MISSING and length == _MISSING:
                return None
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
            if len(data) != length:
                raise ValueError(f"{self._name(path)}: chunk at {offset} truncated ({len(data)} of {length} bytes)")
        else:
            with open(path, "rb") as f:
                data = f.read()
        return _checked(data, path, self.root)

    def _frames(self, name: str, layout: ChunkLayout, chunks) -> Iterator[tuple[int, np.ndarray | bytes | None]]:
        """(chunk, its Blosc frame, crc32c checked; None for a chunk never written) of the ascending
        `chunks` of array `name`: one open per chunk file, and in a shard file one read per run of
        chunks stored back to back (the writer stores a file's chunks in order, so a sequence's
        rows of an array are one read per file)."""
        by_file: dict[int, list[tuple[int, int]]] = {}
        for chunk in chunks:
            file_index, first = divmod(chunk * layout.chunk_rows, layout.file_rows)
            by_file.setdefault(file_index, []).append((chunk, first // layout.chunk_rows))
        for file_index, members in by_file.items():
            path = self._file_path(name, file_index, len(layout.row_shape))
            if not layout.sharded:  # a file per chunk
                with open(path, "rb") as f:
                    yield members[0][0], _checked(f.read(), path, self.root)
                continue
            index = self._index(path, layout)  # [chunks per file, (offset, length)]
            runs: list[list[tuple[int, int, int]]] = []  # (chunk, offset, length) stored back to back
            for chunk, inner in members:
                offset, length = (int(x) for x in index[inner])
                if offset == _MISSING and length == _MISSING:
                    runs.append([(chunk, -1, 0)])
                elif runs and runs[-1][-1][1] >= 0 and sum(runs[-1][-1][1:]) == offset:
                    runs[-1].append((chunk, offset, length))
                else:
                    runs.append([(chunk, offset, length)])
            with open(path, "rb") as f:
                for run in runs:
                    if run[0][1] < 0:
                        yield run[0][0], None
                        continue
                    begin, end = run[0][1], sum(run[-1][1:])
                    data = os.pread(f.fileno(), end - begin, begin)
                    if len(data) != end - begin:
                        raise ValueError(f"{self._name(path)}: chunks at {begin} truncated ({len(data)} of {end - begin} bytes)")
                    view = np.frombuffer(data, dtype=np.uint8)  # read-only: frames are views, not copies
                    for chunk, offset, length in run:
                        yield chunk, _checked(view[offset - begin : offset - begin + length], path, self.root)

    def _decode(self, layout: ChunkLayout, frame, *, into: np.ndarray | None = None) -> np.ndarray:
        """A chunk's frame (None: never written) decoded: [chunk_rows, *row_shape], written into
        `into` (a contiguous view of that shape) when given."""
        if frame is None:
            if into is None:
                return np.full((layout.chunk_rows, *layout.row_shape), layout.fill_value, dtype=layout.dtype)
            into[...] = layout.fill_value
            return into
        if into is not None:
            blosc.decompress(frame, into)
            return into
        return np.frombuffer(blosc.decompress(frame), dtype=layout.dtype).reshape(layout.chunk_rows, *layout.row_shape)

    def _file_path(self, name: str, file_index: int, trailing: int) -> str:
        key = (name, file_index)
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = os.path.join(self.root, name, "c", str(file_index), *["0"] * trailing)
        return path

    def _name(self, path: str) -> str:
        """A chunk file as messages name it: shard-NNNNN.zarr/array/c/..."""
        return os.path.relpath(path, self.root.parent)

    def _index(self, path: str, layout: ChunkLayout) -> np.ndarray:
        index = self._indexes.get(path)
        if index is None:
            num_chunks = layout.file_rows // layout.chunk_rows
            size = 16 * num_chunks + 4
            with open(path, "rb") as f:
                end = os.fstat(f.fileno()).st_size
                if end < size:
                    raise ValueError(f"{self._name(path)}: shard file of {end} bytes is shorter than its index")
                data = os.pread(f.fileno(), size, end - size)
            index = np.frombuffer(_checked(data, path, self.root), dtype="<u8").reshape(num_chunks, 2)
            self._indexes[path] = index
        return index


class ChunkFileEncoder:
    """The bytes of an array's chunk files from its rows, as zarr-python writes them for the layout
    `parse_layout` reads: each chunk (the last one padded with the fill value) through Blosc with
    the array's settings and a trailing crc32c; a shard file is its chunks in order, then the index
    (offset and length of each chunk, uint64 little-endian, MISSING for chunks past the array's end)
    and its crc32c. `encoder_of` gives None for any other layout (zarr writes those)."""

    def __init__(self, layout: ChunkLayout, codec: Blosc, *, num_rows: int):
        self.layout, self.codec, self.num_rows = layout, codec, num_rows

    @classmethod
    def encoder_of(cls, meta: dict, *, num_rows: int) -> ChunkFileEncoder | None:
        layout = parse_layout(meta)
        if layout is None:
            return None
        codecs = meta["codecs"][0]["configuration"]["codecs"] if layout.sharded else meta["codecs"]
        config = codecs[1].get("configuration", {})
        shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
        try:
            codec = Blosc(
                cname=config["cname"], clevel=config["clevel"], shuffle=shuffle[config["shuffle"]],
                blocksize=config.get("blocksize", 0), typesize=config["typesize"],
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None
        return cls(layout, codec, num_rows=num_rows)

    def files(self, first_row: int, rows: np.ndarray) -> list[tuple[str, list[bytes]]]:
        """(path under the array's directory, the file's bytes in parts) of the chunk files holding
        rows [first_row, first_row + len(rows)): whole files, `first_row` on a file boundary and the
        rows reaching a file's end or the array's."""
        layout = self.layout
        if first_row % layout.file_rows or (len(rows) % layout.file_rows and first_row + len(rows) != self.num_rows):
            raise ValueError(f"rows [{first_row}, {first_row + len(rows)}) are not whole chunk files")
        out = []
        trailing = ["0"] * len(layout.row_shape)
        for start in range(0, len(rows), layout.file_rows):
            stop = min(start + layout.file_rows, len(rows))
            chunks = [self._chunk(rows[c : min(c + layout.chunk_rows, stop)]) for c in range(start, stop, layout.chunk_rows)]
            path = "/".join(["c", str((first_row + start) // layout.file_rows), *trailing])
            if not layout.sharded:  # a file per chunk: file_rows == chunk_rows
                out.append((path, chunks[0]))
                continue
            lengths = np.array([sum(len(part) for part in chunk) for chunk in chunks], dtype=np.uint64)
            index = np.full((layout.file_rows // layout.chunk_rows, 2), _MISSING, dtype="<u8")  # [chunks, (offset, length)]
            index[: len(chunks), 0] = np.cumsum(lengths) - lengths
            index[: len(chunks), 1] = lengths
            out.append((path, [part for chunk in chunks for part in chunk] + _with_crc32c(index.tobytes())))
        return out

    def _chunk(self, rows: np.ndarray) -> list[bytes]:
        layout = self.layout
        if len(rows) < layout.chunk_rows:
            padded = np.full((layout.chunk_rows, *layout.row_shape), layout.fill_value, dtype=layout.dtype)
            padded[: len(rows)] = rows
            rows = padded
        return _with_crc32c(self.codec.encode(np.ascontiguousarray(rows, dtype=layout.dtype)))


def _with_crc32c(data: bytes) -> list[bytes]:
    """`data` and its crc32c (little-endian), zarr's crc32c codec, as two parts of a file."""
    return [data, google_crc32c.value(data).to_bytes(4, "little")]
