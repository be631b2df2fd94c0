"""WebDataset shards: one tar per shard, one sample per sequence, written with webdataset's own
`TarWriter` and read back by random access (`WdsShard`: the map-style loader, verify) or as a
stream through webdataset's pipeline (`decode_sample`: pipeline/train/streaming.py).

Layout (docs/design.md, "The cache contract"): samples keyed `{source_row:09d}`, in written
order; one member per record array, named `{key}.{array}.npy.blosc.crc32`, read right to left:

    crc32   numcodecs' CRC32 codec: 4 bytes, the little-endian CRC32 of what follows, checked on
            every read (TarWriter sets no PAX headers, so the checksum travels inside the member)
    blosc   numcodecs' Blosc frame (self-describing): zstd level 1 (older caches: 3), byte
            shuffle over the array's item size, as the Zarr shards' chunks (storage/formats/zarr/write.py), in
            256 KiB blocks
    npy     the array's np.save bytes, no pickle (the header is padded to 64 bytes, so the data
            stays aligned to its item size for the shuffle)

`chunk_checksums=False` leaves the CRC out (`.npy.blosc`). Tars written before compression hold
`{key}.{array}.npy` members, each with its CRC32 in a PAX header `ALRIRA.crc32`; they still read
(the stream reader cannot see PAX headers, so it reads such members unchecked).

Member metadata is fixed (mtime 0, uid/gid 0, empty user and group names, mode 0o644) and a
sample's members go out sorted by name, so a tar's bytes are a function of its records: the
build's resume rule compares shard checksums.
"""

from __future__ import annotations

import collections
import io
import json
import os
import tarfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import numcodecs.blosc
import webdataset
from numcodecs import CRC32, Blosc

from storage.background_writes import BackgroundWrites
from storage.checksums import CHECKSUM_STREAM, HashingWriter
from storage.errors import CorruptShardError, first_line
from storage.format import record_array_names
from storage.formats.protocol import BodySettings, ShardFormat, ShardSize
from storage.layout import layout_problem
from storage.location import Location, StorePrefix, resolve
from storage.paths import unsafe_name_reason
from storage.records import RecordDims

BLOSC_CNAME = "zstd"
BLOSC_CLEVEL = 1  # the Zarr shards' ZARR_CLEVEL: one codec for both formats (its reason: storage/formats/zarr/write.py)
# Blosc compresses a buffer in independent blocks. A member is one sequence's array (a Zarr chunk
# ~256 KiB of rows); 256 KiB blocks, the Zarr chunk's size, make bf16 features 7% smaller than
# Blosc's automatic choice (docs/benchmarks.md, "WebDataset shards").
BLOSC_BLOCK_BYTES = 256 << 10
NPY, NPY_BLOSC, NPY_BLOSC_CRC32 = "npy", "npy.blosc", "npy.blosc.crc32"
MEMBER_ENCODINGS = (NPY_BLOSC_CRC32, NPY_BLOSC, NPY)  # longest first: matched as name suffixes
LEGACY_CRC_HEADER = "ALRIRA.crc32"  # PAX header of an uncompressed `.npy` member: its CRC32 (hex)
MEMBER_MODE = 0o644
# The layout record (storage/layout.py) of a tar written since shards record it: a member of its
# first sample, `{key}.__layout__.json`, first by name; webdataset's samples carry it as a
# `__`-field, which decode_sample and plain webdataset pipelines pass over.
LAYOUT_FIELD = "__layout__.json"
MAX_LAYOUT_BYTES = 1 << 20
# Reading a tar's member headers from a store: each read past the buffer is one ranged GET.
STORE_TAR_INDEX_BLOCK = 1 << 20
VERIFY_HINT = "`alrira-cache verify` checks the whole cache"
# A tar being written is handed to BackgroundWrites.sync_soon every this many bytes.
SYNC_EVERY_BYTES = 64 << 20
TAR_BLOCK = 512

# Called from the main thread, numcodecs' Blosc compresses one buffer on several internal threads
# that place its blocks in the order they finish: the same array gave 6 different frames in 6 tries.
# Single-threaded calls are deterministic; parallelism comes from encoding members on several
# threads instead (storage.shards.ShardWriter).
numcodecs.blosc.use_threads = False
_CRC32 = CRC32(location="start")
_BLOSC_DECODER = Blosc()  # decoding reads codec, level and shuffle from each frame


def sample_key(source_row: int) -> str:
    """WebDataset sample key of a record."""
    return f"{source_row:09d}"


def _blosc(itemsize: int) -> Blosc:
    # typesize: the shuffle groups the bytes of each item (np.save bytes would otherwise count as 1).
    return Blosc(cname=BLOSC_CNAME, clevel=BLOSC_CLEVEL, shuffle=Blosc.SHUFFLE, blocksize=BLOSC_BLOCK_BYTES, typesize=itemsize)


def npy_bytes(array: np.ndarray) -> bytes:
    return npy_buffer(array).tobytes()


def npy_buffer(array: np.ndarray) -> np.ndarray:
    """np.save's bytes of `array` (format 1.0, no pickle) as one uint8 array. The data is copied
    once, by numpy, which lets go of the GIL (np.save through a BytesIO copies it three times
    holding it): members are encoded on several threads at once (storage.shards.ShardWriter)."""
    # (np.ascontiguousarray would turn a 0-d source_row into shape [1])
    array = np.require(array, requirements="C")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    buffer = np.empty(header.tell() + array.nbytes, dtype=np.uint8)
    buffer[: header.tell()] = np.frombuffer(header.getvalue(), dtype=np.uint8)
    buffer[header.tell() :] = array.reshape(-1).view(np.uint8)
    return buffer


def encode_member(array: np.ndarray, *, chunk_checksums: bool) -> tuple[str, bytes]:
    """(encoding, member bytes) of one record array."""
    raw = npy_buffer(array)
    frame = _blosc(array.dtype.itemsize).encode(raw)
    if not chunk_checksums:
        return NPY_BLOSC, bytes(frame)
    return NPY_BLOSC_CRC32, _CRC32.encode(frame).tobytes()


def split_suffix(suffix: str) -> tuple[str, str] | None:
    """(array name, encoding) of a member name without its sample key, e.g.
    `features.npy.blosc.crc32` -> (`features`, `npy.blosc.crc32`); None for anything else."""
    for encoding in MEMBER_ENCODINGS:
        name = suffix.removesuffix(f".{encoding}")
        if name != suffix and name and "." not in name:
            return name, encoding
    return None


def decode_member(data: bytes, *, encoding: str, where: str, pax_crc32: str | None = None) -> np.ndarray:
    """The array of one member's bytes; CorruptShardError starting with `where` (shard, array and
    member) when its checksum fails or it does not decode."""
    if encoding == NPY_BLOSC_CRC32:
        try:
            data = _CRC32.decode(data)
        except (RuntimeError, ValueError):
            raise CorruptShardError(f"{where} fails its CRC32; {VERIFY_HINT}") from None
    elif encoding == NPY and pax_crc32 is not None and f"{zlib.crc32(data):08x}" != pax_crc32:
        raise CorruptShardError(f"{where} fails its CRC32; {VERIFY_HINT}")
    try:
        if encoding != NPY:
            data = _BLOSC_DECODER.decode(data)  # the frame records its own codec, level and shuffle
        return np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as error:  # numcodecs and numpy raise several types for bytes that do not decode
        raise CorruptShardError(f"{where} does not decode ({first_line(error)}); {VERIFY_HINT}") from None


def member_selector(arrays: set[str] | None) -> Callable[[str], bool] | None:
    """webdataset's `select_files` predicate keeping the members of `arrays` and source_row (all
    members when None); other members' bytes pass by in the stream without being kept."""
    if arrays is None:
        return None
    wanted = set(arrays) | {"source_row"}

    def selected(member_name: str) -> bool:
        parts = split_suffix(member_name.partition(".")[2])
        return parts is not None and parts[0] in wanted

    return selected


def decode_sample(sample: dict, *, arrays: set[str] | None = None) -> dict[str, np.ndarray]:
    """The encoded record of one sample as webdataset's `tarfile_to_samples` yields it
    ({"__key__", "__url__", "features.npy.blosc.crc32": bytes, ...}); only `arrays` and
    source_row when given."""
    record = {}
    for suffix, data in sample.items():
        if suffix.startswith("__"):
            continue
        parts = split_suffix(suffix)
        if parts is None:
            raise ValueError(f"{sample.get('__url__')}: unexpected tar member {sample['__key__']}.{suffix}")
        name, encoding = parts
        if arrays is None or name in arrays or name == "source_row":
            where = f"{sample.get('__url__')}: array {name}: member {sample['__key__']}.{suffix}"
            record[name] = decode_member(data, encoding=encoding, where=where)
    return record


def stream_samples(stream: BinaryIO, *, url: str, select: Callable[[str], bool] | None, layout: dict | None) -> Iterator[dict]:
    """The samples of a tar read front to back by webdataset's expander and grouping (`select`:
    member_selector's predicate), as `decode_sample` takes them. The tar's layout record, in its
    first sample when it has one, is checked against `layout` (the manifest's,
    storage.layout.expected_layout) before that sample is yielded."""
    keep = None if select is None else (lambda name: name.endswith(f".{LAYOUT_FIELD}") or select(name))
    files = webdataset.tariterators.tar_file_expander([{"url": url, "stream": stream}], select_files=keep)
    for sample in webdataset.tariterators.group_by_keys(files):
        recorded = sample.pop(LAYOUT_FIELD, None)
        if recorded is not None and layout is not None:
            try:
                found = json.loads(recorded)
            except (ValueError, UnicodeError) as error:
                raise ValueError(f"{url}: layout member unreadable ({first_line(error)}); {VERIFY_HINT}") from None
            problem = layout_problem(found, layout, where=url)
            if problem is not None:
                raise ValueError(problem)
        yield sample


# ---------------------------------------------------------------------------------------------
# Writing


class WdsShardWriter:
    """One shard's tar, written sample by sample with webdataset's TarWriter as records arrive.

    `file_obj_or_path`: a path (created; an existing file is an error) or a binary file object
    opened for writing (a local file, an fsspec/S3 file), which the writer does not close.
    Records must already be validated and encoded (storage.records.check_record,
    storage.codecs.encode_features) and hold exactly the arrays of `feature_codec` and `contents`.
    Memory does not grow with the number of records: each sample goes out on `append`."""

    def __init__(
        self, file_obj_or_path: str | os.PathLike | BinaryIO, *, feature_codec: str, contents: tuple[str, ...],
        chunk_checksums: bool = True, rollout_feature_codec: str | None = None,
    ):  # fmt: skip
        self.names = sorted(record_array_names(feature_codec, contents, rollout_feature_codec))
        self.chunk_checksums = chunk_checksums
        self.num_records = 0
        self.layout: dict | None = None  # the shard's layout record, written with the first sample
        self._owned = isinstance(file_obj_or_path, (str, os.PathLike))
        self._file = open(file_obj_or_path, "xb") if self._owned else file_obj_or_path
        try:
            # encoder=False: members are given as bytes. Fixed metadata: bytes depend on records only.
            self._tar = webdataset.TarWriter(self._file, user="", group="", mode=MEMBER_MODE, mtime=0, encoder=False, keep_meta=True)
        except BaseException:
            if self._owned:
                self._file.close()
            raise

    def member_arrays(self, record: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The arrays of a record's members, in member order (sorted by name, TarWriter's order)."""
        source_row = int(record["source_row"])
        return [np.asarray(source_row, dtype=np.int64) if name == "source_row" else record[name] for name in self.names]

    def append(self, record: dict[str, np.ndarray]) -> None:
        """Write one record's sample."""
        members = [encode_member(array, chunk_checksums=self.chunk_checksums) for array in self.member_arrays(record)]
        self.append_encoded(int(record["source_row"]), members)

    def append_encoded(self, source_row: int, members: list[tuple[str, bytes]]) -> None:
        """Write the sample of a record whose members (encode_member of each of `member_arrays`)
        are encoded already."""
        sample = {"__key__": sample_key(source_row)}
        if self.layout is not None and self.num_records == 0:
            sample[LAYOUT_FIELD] = json.dumps(self.layout, sort_keys=True).encode()
        for name, (encoding, data) in zip(self.names, members, strict=True):
            sample[f"{name}.{encoding}"] = data
        self._tar.write(sample)
        # tarfile keeps a TarInfo per member it wrote; nothing here reads them back, so drop them
        # (webdataset's reader does the same, tariterators.tar_file_iterator) to keep memory flat.
        self._tar.tarstream.members = []
        self.num_records += 1

    def close(self) -> None:
        """End the tar (its end-of-archive blocks) and close the file if the writer opened it;
        a second call does nothing."""
        if self._tar is None:
            return
        tar, self._tar = self._tar, None
        try:
            tar.close()
        finally:
            if self._owned:
                self._file.close()

    def __enter__(self) -> WdsShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Writing one shard of a cache


class WdsBody:
    """The tar of a shard being written (WdsShardWriter: webdataset's TarWriter, compressed
    members): each record's members are encoded on the writer's threads as it is appended, and
    its sample goes into the tar, in append order, once they are done. On a store the tar is one
    object, created only when `commit` closes its file (an upload that is never committed leaves
    no object)."""

    def __init__(
        self, target: Path | StorePrefix, size: ShardSize, settings: BodySettings, *, writes: BackgroundWrites,
        before_write=None,
    ):  # fmt: skip
        chunk_checksums = settings.chunk_checksums
        self.on_store = isinstance(target, StorePrefix)
        self.file = target.open("", "wb") if self.on_store else open(target, "xb")
        # A local tar is hashed as it is written (`checksum`): publish need not read it back.
        self.hashed = None if self.on_store else HashingWriter(self.file)
        self.writer = WdsShardWriter(
            self.hashed or self.file, feature_codec=settings.feature_codec, contents=settings.contents,
            chunk_checksums=chunk_checksums, rollout_feature_codec=settings.rollout_feature_codec,
        )  # fmt: skip
        self.writes, self.chunk_checksums, self.target = writes, chunk_checksums, target
        self.unsynced = 0  # bytes written since the last sync_soon
        self.encoding: collections.deque[tuple[int, list[Future]]] = collections.deque()  # in append order

    def start(self, layout: dict) -> None:
        self.writer.layout = layout  # goes into the first sample

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
# Random access


@dataclass(frozen=True)
class MemberCodec:
    """How one member's bytes turn into an array: its encoding, and for an uncompressed `.npy`
    member of an older tar the CRC32 of its PAX header (None: unchecked)."""

    encoding: str
    pax_crc32: str | None = None


class Member(NamedTuple):
    offset: int  # of the member's data in the tar
    size: int
    codec: MemberCodec


def open_tar(url: str | os.PathLike | Location) -> BinaryIO:
    """A tar for reading front to back: a local file, or a store object through fsspec, read
    ahead in large blocks (webdataset's own opener knows no s3://)."""
    location = resolve(url)
    if location.is_local:
        return open(location.local_path, "rb")
    return location.open("", "rb", block_size=STORE_TAR_INDEX_BLOCK, cache_type="readahead")


class WdsShard:
    """Random access to the samples of one WebDataset tar, a local file or a store object: member
    offsets are indexed once, then each read fetches just the members it needs (pread, or one
    ranged GET each on a store), so reading a few arrays costs only their bytes."""

    def __init__(self, path: str | os.PathLike | Location):
        self.location = resolve(path)
        self.path = self.location.local_path or self.location.url  # for messages: a Path, or the URL
        self.file = open_tar(self.location)
        self._layout: dict | None = None  # the shard's layout record (its first member); None: none
        try:
            self.samples = self._index()
        except BaseException:
            self.file.close()
            raise
        if not self.location.is_local:
            self.file.close()  # members are read by range from here on

    def _index(self) -> list[tuple[str, dict[str, Member]]]:
        samples: list[tuple[str, dict[str, Member]]] = []
        seen: set[str] = set()
        try:
            with tarfile.open(fileobj=self.file, mode="r:") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    # A sample's members are plain names (`{key}.{array}.npy...`): one that is a
                    # path (`../x`, `/etc/x`) is crafted, never extracted, and refused.
                    if unsafe_name_reason(info.name) or "/" in info.name:
                        raise ValueError(f"{self.path}: refused tar member {info.name!r} (not a plain member name)")
                    key, _, suffix = info.name.partition(".")
                    if suffix == LAYOUT_FIELD and not samples and self._layout is None:
                        self._layout = self._read_layout(tar, info)
                        continue
                    parts = split_suffix(suffix)
                    if parts is None:
                        raise ValueError(f"{self.path}: unexpected tar member {info.name!r}")
                    if not samples or samples[-1][0] != key:
                        if key in seen:
                            raise ValueError(f"{self.path}: members of sample {key} are not contiguous")
                        seen.add(key)
                        samples.append((key, {}))
                    name, encoding = parts
                    codec = MemberCodec(encoding, info.pax_headers.get(LEGACY_CRC_HEADER) if encoding == NPY else None)
                    samples[-1][1][name] = Member(info.offset_data, info.size, codec)
        except (tarfile.TarError, EOFError, OverflowError, UnicodeError) as e:  # a corrupt or crafted header
            raise ValueError(f"{self.path}: corrupt tar shard ({first_line(e)}); {VERIFY_HINT}") from None
        return samples

    def _read_layout(self, tar: tarfile.TarFile, info: tarfile.TarInfo) -> dict:
        if info.size > MAX_LAYOUT_BYTES:
            raise ValueError(f"{self.path}: corrupt tar shard (layout member {info.name} of {info.size} bytes); {VERIFY_HINT}")
        try:
            layout = json.loads(tar.extractfile(info).read())
        except (ValueError, UnicodeError) as error:
            raise ValueError(f"{self.path}: corrupt tar shard (layout member {info.name}: {first_line(error)}); {VERIFY_HINT}") from None
        if not isinstance(layout, dict):
            raise ValueError(f"{self.path}: corrupt tar shard (layout member {info.name} is not a JSON object); {VERIFY_HINT}")
        return layout

    @property
    def num_sequences(self) -> int:
        return len(self.samples)

    @property
    def array_names(self) -> set[str]:
        """Record arrays stored (source_row included), read from the first sample."""
        return set(self.samples[0][1]) if self.samples else set()

    @property
    def source_rows(self) -> np.ndarray:
        """int64 [n]: the records' source_row, from the sample keys."""
        return np.array([int(key) for key, _ in self.samples], dtype=np.int64)

    def read(self, local: int, arrays: set[str] | None = None) -> dict[str, np.ndarray]:
        """Encoded record of sample `local` of this tar (only `arrays` and source_row, when given)."""
        key, members = self.samples[local]
        record = {}
        for name, member in members.items():
            if arrays is not None and name not in arrays and name != "source_row":
                continue
            # pread (or a ranged GET) leaves the shared file offset alone: concurrent readers cannot interfere.
            if self.location.is_local:
                data = os.pread(self.file.fileno(), member.size, member.offset)
            else:
                data = self.location.read_range("", member.offset, member.size)
            where = f"{self.path}: array {name}: member {key}.{name}.{member.codec.encoding}"
            if len(data) != member.size:
                raise CorruptShardError(f"{where} is truncated; {VERIFY_HINT}")
            record[name] = decode_member(data, encoding=member.codec.encoding, where=where, pax_crc32=member.codec.pax_crc32)
        return record

    def read_anchor_rows(self, local: int, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` of anchor array `name` (a tar member is read whole, and checked)."""
        return self.read(local, {name})[name][np.asarray(rows, dtype=np.int64)]

    def layout(self) -> dict | None:
        """The recorded layout; for a tar written before layouts were, the arrays its first sample holds."""
        if self._layout is None and self.samples:
            return {"format": "wds", "array_names": sorted(set(self.samples[0][1]) - {"source_row"})}
        return self._layout

    def array_bytes(self) -> dict[str, int]:
        """Bytes of the tar each record array takes (member headers and padding included)."""
        out: dict[str, int] = {}
        for _, members in self.samples:
            for name, member in members.items():
                out[name] = out.get(name, 0) + TAR_BLOCK + -(-member.size // TAR_BLOCK) * TAR_BLOCK
        return out

    def recorded_sizes(self) -> None:
        return None  # a tar has no index: its sizes are the sum of its records'

    def structure_problems(self, manifest, record) -> list[str]:
        return []

    def close(self) -> None:
        self.file.close()


FORMAT = ShardFormat("wds", open=WdsShard, body=WdsBody)
