"""The record schema: the arrays of one cached sequence, their dtypes and shapes, and the check
every writer runs on a record before it goes into a shard (storage/format.py names the arrays)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from storage.format import (
    ALL_GROUPS,
    ANCHOR_ARRAYS,
    ARRAY_DTYPES,
    FEATURE_DTYPES,
    TOKEN_ARRAYS,
    array_codecs,
    check_contents,
    check_ira_parents,
    num_parents,
    record_array_names,
)

# Record arrays by the axis they are concatenated along in a Zarr shard (fp8 scales included).
TOKEN_INDEXED_ARRAYS = TOKEN_ARRAYS + ("feature_scales",)
ANCHOR_INDEXED_ARRAYS = ANCHOR_ARRAYS + ("rollout_feature_scales",)


@dataclass(frozen=True, kw_only=True)
class RecordDims:
    """Sizes of one record: T tokens, A anchors, F feature dim, k = top_k, K slots.

    top_k is None when the record holds no top-k arrays (neither corpus top-k nor rollouts), and
    num_slots None when it holds no rollouts: nothing in it says what they were. num_parents: the
    rows of rollout features (P; 0 without them)."""

    num_tokens: int
    num_anchors: int
    feature_dim: int
    top_k: int | None
    num_slots: int | None
    num_parents: int = 0


def record_shapes(
    dims: RecordDims, *, feature_codec: str, contents=ALL_GROUPS, rollout_feature_codec: str | None = None
) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """Expected shape of every array of a record with sizes `dims` in a cache holding `contents`."""
    contents = check_contents(contents)
    codecs = array_codecs(feature_codec, rollout_feature_codec)
    P = dims.num_parents
    T, A, F, k, K = dims.num_tokens, dims.num_anchors, dims.feature_dim, dims.top_k, dims.num_slots
    shapes = {"source_row": (), "input_ids": (T,), "loss_mask": (T,), "features": (T, F), "anchor_pos": (A,)}
    if "corpus_topk" in contents:
        shapes.update(corpus_topk_ids=(T, k), corpus_topk_probs=(T, k), corpus_tail=(T,), corpus_next_prob=(T,))
    if "rollouts" in contents:
        shapes.update(
            rollout_tokens=(A, K + 1), rollout_topk_ids=(A, K, k), rollout_topk_probs=(A, K, k), rollout_tail=(A, K)
        )
    if "rollout_features" in contents:
        shapes["rollout_features"] = (P, K - 2, F)
        if codecs["rollout_features"] == "fp8":
            shapes["rollout_feature_scales"] = (P, K - 2)
    if codecs["features"] == "fp8":
        shapes["feature_scales"] = (T,)
    return shapes


def record_dtype(name: str, *, feature_codec: str, rollout_feature_codec: str | None = None) -> np.dtype:
    """Stored numpy dtype of record array `name` under these codecs."""
    if name in ("features", "rollout_features"):
        return np.dtype(FEATURE_DTYPES[array_codecs(feature_codec, rollout_feature_codec)[name]])
    return np.dtype(ARRAY_DTYPES[name])


def _ndim_size(record: dict, name: str, axis: int, ndim: int, where: str) -> int:
    arr = record[name]
    if not isinstance(arr, np.ndarray) or arr.ndim != ndim:
        shape = getattr(arr, "shape", type(arr).__name__)
        raise ValueError(f"{where}: array {name} must be a {ndim}-d numpy array, got {shape}")
    return arr.shape[axis]


def check_record(
    record: dict, *, feature_codec: str, where: str, like: RecordDims | None = None, contents=ALL_GROUPS,
    rollout_feature_codec: str | None = None, ira_parents: int | None = None,
) -> RecordDims:  # fmt: skip
    """Validate one record's array names, dtypes and shapes against the schema of a cache holding
    the array groups `contents` (rollout features for `ira_parents` anchors per sequence, None: all);
    return its dims.

    `like`: dims whose F, k and K the record must share (records of one shard, or the manifest's);
    a None in either side is not compared. Raises ValueError naming `where` and the offending array.
    """
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a dict of arrays, got {type(record).__name__}")
    contents = check_contents(contents)
    names = set(record_array_names(feature_codec, contents, rollout_feature_codec))
    schema = f"codec {feature_codec!r}, contents {list(contents)}"
    missing = sorted(names - set(record))
    if missing:
        raise ValueError(f"{where}: array {missing[0]} is missing ({schema})")
    extra = sorted(set(record) - names)
    if extra:
        raise ValueError(f"{where}: array {extra[0]} is not part of the schema ({schema})")
    source_row = record["source_row"]
    if not isinstance(source_row, (int, np.integer, np.ndarray)) or isinstance(source_row, bool) or (
        isinstance(source_row, np.ndarray) and (source_row.ndim != 0 or source_row.dtype.kind not in "iu")
    ):
        raise ValueError(f"{where}: array source_row must be an int or 0-d integer array, got {source_row!r}")
    if int(source_row) < 0:
        raise ValueError(f"{where}: array source_row must be >= 0, got {int(source_row)}")

    # k is read from the corpus top-k, or from the rollout labels when the corpus top-k are left out.
    top_k = num_slots = topk_source = None
    if "corpus_topk" in contents:
        topk_source = "corpus_topk_ids"
        top_k = _ndim_size(record, topk_source, 1, 2, where)
    elif "rollouts" in contents:
        topk_source = "rollout_topk_ids"
        top_k = _ndim_size(record, topk_source, 2, 3, where)
    if "rollouts" in contents:
        num_slots = _ndim_size(record, "rollout_tokens", 1, 2, where) - 1
    num_anchors = _ndim_size(record, "anchor_pos", 0, 1, where)
    dims = RecordDims(
        num_tokens=_ndim_size(record, "input_ids", 0, 1, where),
        num_anchors=num_anchors,
        feature_dim=_ndim_size(record, "features", 1, 2, where),
        top_k=top_k,
        num_slots=num_slots,
        num_parents=num_parents(num_anchors, check_ira_parents(ira_parents)) if "rollout_features" in contents else 0,
    )
    if dims.num_tokens < 1:
        raise ValueError(f"{where}: array input_ids is empty")
    if dims.num_slots is not None and dims.num_slots < 3:
        raise ValueError(f"{where}: array rollout_tokens must have K + 1 >= 4 columns, got {dims.num_slots + 1}")
    if like is not None:
        for field, name in (("feature_dim", "features"), ("top_k", topk_source), ("num_slots", "rollout_tokens")):
            got, want = getattr(dims, field), getattr(like, field)
            if got is not None and want is not None and got != want:
                raise ValueError(f"{where}: array {name} implies {field} {got}, expected {want}")
    shapes = record_shapes(dims, feature_codec=feature_codec, contents=contents, rollout_feature_codec=rollout_feature_codec)
    for name, shape in shapes.items():
        if name == "source_row":
            continue
        arr = record[name]
        dtype = record_dtype(name, feature_codec=feature_codec, rollout_feature_codec=rollout_feature_codec)
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{where}: array {name} must be a numpy array, got {type(arr).__name__}")
        if arr.dtype != dtype:
            raise ValueError(f"{where}: array {name} has dtype {arr.dtype}, expected {dtype}")
        if arr.shape != shape:
            raise ValueError(f"{where}: array {name} has shape {arr.shape}, expected {shape}")
    return dims
