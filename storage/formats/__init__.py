"""Shard formats behind one interface (storage/formats/protocol.py): a format is a module or
folder here and one line in FORMATS. storage.shards.ShardWriter writes through a format's body;
the reader, verify and `info` open shards with `open_shard`."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from storage.format import STORAGE_FORMATS
from storage.formats import wds, zarr
from storage.formats.protocol import ShardFormat, ShardHandle
from storage.location import Location

FORMATS: dict[str, ShardFormat] = {format.name: format for format in (zarr.FORMAT, wds.FORMAT)}
assert tuple(FORMATS) == STORAGE_FORMATS, "storage.format.STORAGE_FORMATS names the registered formats"


def shard_format(storage_format: str) -> ShardFormat:
    if storage_format not in FORMATS:
        raise ValueError(f"storage_format must be one of {tuple(FORMATS)}, got {storage_format!r}")
    return FORMATS[storage_format]


def open_shard(path: str | os.PathLike | Location, *, storage_format: str) -> ShardHandle:
    """Open one shard for random access by local sequence index."""
    return shard_format(storage_format).open(path)


def read_shard_records(path: str | os.PathLike | Location, *, storage_format: str) -> Iterator[dict[str, np.ndarray]]:
    """The encoded records of one shard, in written order."""
    shard = open_shard(path, storage_format=storage_format)
    try:
        for local in range(shard.num_sequences):
            yield shard.read(local)
    finally:
        shard.close()
