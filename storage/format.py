"""Cache format v3: the contract between stage 1 (cache build) and stage 2 (trainer).

A cache is a directory:

    manifest.json              settings, target identity, per-shard name/counts/checksum/status
    target_head.safetensors    embed_tokens.weight [V, H], lm_head.weight [V, H]
    shards/shard-00000.zarr    one Zarr v3 group per shard   (format "zarr")
    shards/shard-00000.tar     or one WebDataset tar         (format "wds")

A shard holds whole sequences. In Zarr the per-sequence arrays are concatenated into flat arrays
with offsets (`seq_offsets` over tokens, `anchor_offsets` over anchors). In a WebDataset tar each
sequence is one sample whose members are `{key}.{array_name}.npy`, with the same array names and
per-sequence shapes as below.

Per-sequence record (what `storage.reader` returns), T tokens, A pool anchors, K slots, k = top_k,
F = n_taps * hidden_size:

    source_row          int64   []          row index in the corpus file
    input_ids           int32   [T]
    loss_mask           uint8   [T]         1 on assistant tokens incl. end-of-turn
    features            uint16  [T, F]      bf16 bits            (codec "bf16"; "e8m2".."e8m6": bf16 bits
                                                             with the mantissa rounded to 2..6 bits)
                        uint8   [T, F]      fp8-e4m3 bits        (codec "fp8")
    feature_scales      float32 [T]         per-token scale      (codec "fp8" only)
    corpus_topk_ids     int32   [T, k]      target top-k at t (predicting t+1)
    corpus_topk_probs   float32 [T, k]
    corpus_tail         float32 [T]         max(0, 1 - sum(topk_probs))
    corpus_next_prob    float32 [T]         p_T(x[t+1] | x[<=t]), 0 at the last position
    anchor_pos          int32   [A]         sorted positions of the anchor pool
    rollout_tokens      int32   [A, K+1]    slot 0 = x[a], slots 1..K = y*[1..K]
    rollout_topk_ids    int32   [A, K, k]   pi[a, 1..K]
    rollout_topk_probs  float32 [A, K, k]
    rollout_tail        float32 [A, K]
    rollout_features    uint16/uint8 [P, K-2, F]   features of y*[1..K-2] of the IRA parents
    rollout_feature_scales float32 [P, K-2]        (rollout codec "fp8" only)

P = A unless the cache keeps rollout features for only `ira_parents` anchors per sequence: then
P = min(ira_parents, A) and row i belongs to pool index `ira_parent_rows(A, ira_parents)[i]` (a
function of A alone, nothing stored). The rollout features may use their own codec
(`rollout_feature_codec`, default: the corpus features' codec).

Format versions: 2 added `ira_parents` and `rollout_feature_codec`; 3 added the rounded-mantissa
codecs "e8m2".."e8m6". A cache using none of them is laid out exactly as version 1 and says
version 1 (version 2 without an e8m codec), so older readers still open it.

Optional array groups: a cache may leave some out (its manifest's `settings.contents` lists the
groups it holds; a manifest without the key holds all of them). source_row, input_ids, loss_mask,
features (+ feature_scales) and anchor_pos are always stored.

    corpus_topk         corpus_topk_ids, corpus_topk_probs, corpus_tail, corpus_next_prob
    rollouts            rollout_tokens, rollout_topk_ids, rollout_topk_probs, rollout_tail
    rollout_features    rollout_features (+ rollout_feature_scales); requires "rollouts"
"""

from __future__ import annotations

FORMAT_NAME = "alrira-cache"
FORMAT_VERSION = 3  # the newest layout this code writes and reads
READABLE_FORMAT_VERSIONS = (1, 2, 3)


def is_readable_format_version(value) -> bool:
    """An int this code reads: JSON's `true` is a Python int equal to 1, and must not pass for version 1."""
    return type(value) is int and value in READABLE_FORMAT_VERSIONS

MANIFEST_FILE = "manifest.json"
TARGET_HEAD_FILE = "target_head.safetensors"
SHARD_DIR = "shards"
CORPUS_DIR = "corpus"  # the tokenized corpus (pipeline/cache_build/corpus.py), kept for resumes

STORAGE_FORMATS = ("zarr", "wds")
# "e8mM": bf16 bits whose mantissa is rounded to M bits (8 exponent bits, as bf16): lossy at
# 2^-(M+1) relative error with bf16's whole range, no scales, decoded exactly as bf16 (the low 7-M
# mantissa bits are zero, which Blosc's byte shuffle + zstd store in almost nothing;
# docs/cache-format.md, "Feature codecs").
ROUNDED_CODECS = {f"e8m{m}": m for m in range(2, 7)}
FEATURE_CODECS = ("bf16", "fp8", *ROUNDED_CODECS)

# Arrays indexed by token (flat over a shard in Zarr, sliced by seq_offsets).
TOKEN_ARRAYS = (
    "input_ids",
    "loss_mask",
    "features",
    "corpus_topk_ids",
    "corpus_topk_probs",
    "corpus_tail",
    "corpus_next_prob",
)
# Arrays indexed by anchor (flat over a shard in Zarr, sliced by anchor_offsets).
ANCHOR_ARRAYS = (
    "anchor_pos",
    "rollout_tokens",
    "rollout_topk_ids",
    "rollout_topk_probs",
    "rollout_tail",
    "rollout_features",
)
FP8_SCALE_ARRAYS = {"features": "feature_scales", "rollout_features": "rollout_feature_scales"}
# Arrays whose rows are the IRA parents' (P per sequence, P = A unless `ira_parents` is set).
PARENT_ARRAYS = ("rollout_features", "rollout_feature_scales")

# dtypes as numpy dtype strings; the feature arrays depend on the codec.
ARRAY_DTYPES = {
    "source_row": "int64",
    "input_ids": "int32",
    "loss_mask": "uint8",
    "corpus_topk_ids": "int32",
    "corpus_topk_probs": "float32",
    "corpus_tail": "float32",
    "corpus_next_prob": "float32",
    "anchor_pos": "int32",
    "rollout_tokens": "int32",
    "rollout_topk_ids": "int32",
    "rollout_topk_probs": "float32",
    "rollout_tail": "float32",
    "feature_scales": "float32",
    "rollout_feature_scales": "float32",
}
FEATURE_DTYPES = {"bf16": "uint16", "fp8": "uint8", **dict.fromkeys(ROUNDED_CODECS, "uint16")}


# Optional array groups (fp8 scale arrays follow their feature array). Every other array is
# stored in every cache.
ARRAY_GROUPS = {
    "corpus_topk": ("corpus_topk_ids", "corpus_topk_probs", "corpus_tail", "corpus_next_prob"),
    "rollouts": ("rollout_tokens", "rollout_topk_ids", "rollout_topk_probs", "rollout_tail"),
    "rollout_features": ("rollout_features",),
}
ALL_GROUPS = tuple(sorted(ARRAY_GROUPS))
# Rollout features are the features of the rollout tokens: meaningless without the rollouts.
GROUP_REQUIRES = {"rollout_features": "rollouts"}


def check_contents(contents) -> tuple[str, ...]:
    """Validated array groups of a cache, sorted; ValueError naming `contents` otherwise."""
    if not isinstance(contents, (list, tuple)) or not all(isinstance(g, str) for g in contents):
        raise ValueError(f"contents must be a list of group names from {ALL_GROUPS}, got {contents!r}")
    unknown = sorted(set(contents) - set(ALL_GROUPS))
    if unknown:
        raise ValueError(f"contents: unknown array group {unknown[0]!r} (groups: {', '.join(ALL_GROUPS)})")
    if len(set(contents)) != len(contents):
        raise ValueError(f"contents must not repeat a group, got {list(contents)}")
    for group, needed in GROUP_REQUIRES.items():
        if group in contents and needed not in contents:
            raise ValueError(f"contents: group {group!r} requires group {needed!r}")
    return tuple(sorted(contents))


def check_codec(codec, *, name: str = "feature_codec") -> str:
    if codec not in FEATURE_CODECS:
        raise ValueError(f"{name} must be one of {FEATURE_CODECS}, got {codec!r}")
    return codec


def array_codecs(feature_codec: str, rollout_feature_codec: str | None = None) -> dict[str, str]:
    """The codec of each feature array: {"features": ..., "rollout_features": ...}; the rollout
    features' defaults to the corpus features' (every version-1 cache)."""
    check_codec(feature_codec)
    rollout = check_codec(rollout_feature_codec or feature_codec, name="rollout_feature_codec")
    return {"features": feature_codec, "rollout_features": rollout}


def record_array_names(feature_codec: str, contents=ALL_GROUPS, rollout_feature_codec: str | None = None) -> tuple[str, ...]:
    """Every array name a per-sequence record holds under these codecs in a cache holding the
    array groups `contents` (source_row included)."""
    codecs = array_codecs(feature_codec, rollout_feature_codec)
    contents = check_contents(contents)
    left_out = {name for group in ALL_GROUPS if group not in contents for name in ARRAY_GROUPS[group]}
    names = ("source_row",) + TOKEN_ARRAYS + ANCHOR_ARRAYS
    names += tuple(scale for name, scale in FP8_SCALE_ARRAYS.items() if codecs[name] == "fp8")
    left_out |= {scale for name, scale in FP8_SCALE_ARRAYS.items() if name in left_out}
    return tuple(name for name in names if name not in left_out)


def check_ira_parents(ira_parents, *, name: str = "ira_parents") -> int | None:
    """None (every pool anchor keeps its rollout features) or an int >= 1."""
    if ira_parents is not None and (isinstance(ira_parents, bool) or not isinstance(ira_parents, int) or ira_parents < 1):
        raise ValueError(f"{name} must be an int >= 1 or unset, got {ira_parents!r}")
    return ira_parents


def num_parents(num_anchors: int, ira_parents: int | None) -> int:
    """P, the rows of rollout features a sequence with a pool of `num_anchors` stores."""
    return num_anchors if ira_parents is None else min(int(num_anchors), ira_parents)


def ira_parent_rows(num_anchors: int, ira_parents: int | None):
    """Pool indices (sorted int64 [P]) of the anchors whose rollout features a sequence stores:
    P evenly spaced rows of its sorted pool (the middle of P equal strata), so the parents spread
    over the whole sequence like the pool does; all of them when `ira_parents` is None or >= A."""
    import numpy as np

    count = num_parents(num_anchors, ira_parents)
    if count == num_anchors:
        return np.arange(num_anchors, dtype=np.int64)
    return ((2 * np.arange(count, dtype=np.int64) + 1) * num_anchors) // (2 * count)


def format_version_for(*, ira_parents: int | None, feature_codec: str, rollout_feature_codec: str | None) -> int:
    """The oldest format version that describes a cache with these settings (1: version 1's layout)."""
    if feature_codec in ROUNDED_CODECS or rollout_feature_codec in ROUNDED_CODECS:
        return 3  # older readers do not know the codec's name (its bits they would read as bf16)
    mixed = rollout_feature_codec is not None and rollout_feature_codec != feature_codec
    return 2 if ira_parents is not None or mixed else 1


# K, predicted slots per block. Rollouts have depth K - 1 and store the features of y*[1..K-2];
# IRA offsets j ~ U{2..K-1} need K >= 3 (docs/design.md, "Anchors and blocks").
MIN_NUM_SLOTS = 3


def check_num_slots(num_slots, *, name: str = "num_slots") -> int:
    """The one validation of K; ValueError naming `name` (a field or a flag) otherwise."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < MIN_NUM_SLOTS:
        raise ValueError(f"{name} must be an int >= {MIN_NUM_SLOTS}, got {num_slots!r}")
    return num_slots


def shard_name(index: int, storage_format: str) -> str:
    """File name of shard `index` under `shards/`."""
    suffix = {"zarr": "zarr", "wds": "tar"}[storage_format]
    return f"shard-{index:05d}.{suffix}"


# Status of a shard in the manifest; only "complete" shards are readable.
SHARD_COMPLETE = "complete"
SHARD_STATUSES = ("pending", "complete", "failed")

# Zarr-only index arrays of a shard group (not part of a per-sequence record).
ZARR_SEQ_OFFSETS = "seq_offsets"  # int64 [n+1], token offsets of each sequence
ZARR_ANCHOR_OFFSETS = "anchor_offsets"  # int64 [n+1], anchor offsets of each sequence
ZARR_SOURCE_ROWS = "source_rows"  # int64 [n], the records' source_row
ZARR_PARENT_OFFSETS = "parent_offsets"  # int64 [n+1], rollout-feature row offsets (caches with ira_parents)
ZARR_INDEX_ARRAYS = (ZARR_SEQ_OFFSETS, ZARR_ANCHOR_OFFSETS, ZARR_SOURCE_ROWS, ZARR_PARENT_OFFSETS)

# Prefix of a shard being written; it is renamed to its final name once complete.
PARTIAL_SHARD_PREFIX = ".tmp-"

# The build that currently owns a cache directory writes its id here (storage.ownership.claim_cache);
# a shard writer holding another id (a worker orphaned by a killed driver, a second concurrent
# build) must not publish into it.
BUILD_OWNER_FILE = ".build-owner"
# Held (flock) while a local claim is written and while a local shard is checked against the claim
# and renamed into place, so that the two never interleave (storage.ownership.owner_lock).
BUILD_OWNER_LOCK_FILE = ".build-owner.lock"
BUILD_PROVENANCE_FILE = "build_provenance.json"  # what produced the cache, one entry per build (pipeline/provenance.py)
# The lock a running command holds on its local --out (pid and host; pipeline/outputs.py): a build
# holds it on the cache directory while it runs, so a second build on the same --out refuses.
OUTPUT_LOCK_FILE = ".alrira-lock"
