"""The Zarr v3 shard format: write.py lays a shard out, read.py reads it, rows.py decodes (and
encodes) its chunk files without zarr's pipeline on a local disk."""

from storage.formats.protocol import ShardFormat
from storage.formats.zarr.read import ZarrShard
from storage.formats.zarr.write import ZarrBody

FORMAT = ShardFormat("zarr", open=ZarrShard, body=ZarrBody)
