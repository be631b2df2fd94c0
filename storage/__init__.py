"""Cache format v3 (reads v1, v2): manifest, feature codecs, shard writers and the reader (see storage/format.py)."""

from storage.codecs import decode_features, encode_features
from storage.format import FORMAT_NAME, FORMAT_VERSION
from storage.manifest import (
    CacheSettings,
    Manifest,
    ShardRecord,
    load_manifest,
    load_target_head,
    save_manifest,
    save_target_head,
    settings_diff,
)
from storage.reader import CacheReader, available_arrays, cache_stats, open_cache
from storage.ownership import CacheOwnershipLost, check_owner, claim_cache
from storage.checksums import shard_checksum
from storage.shards import clean_partial_shards, read_shard_records, write_shard
from storage.verify import verify_cache

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CacheOwnershipLost",
    "CacheReader",
    "CacheSettings",
    "Manifest",
    "ShardRecord",
    "available_arrays",
    "cache_stats",
    "check_owner",
    "claim_cache",
    "clean_partial_shards",
    "decode_features",
    "encode_features",
    "load_manifest",
    "load_target_head",
    "open_cache",
    "read_shard_records",
    "save_manifest",
    "save_target_head",
    "settings_diff",
    "shard_checksum",
    "verify_cache",
    "write_shard",
]
