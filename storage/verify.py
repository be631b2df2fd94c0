"""Full consistency check of a cache: files, checksums, shapes, offsets and label values.

`verify_cache` reads every byte of every complete shard; each problem is one line naming the shard
(or file) it concerns. An empty list means the cache is good. A shard must hold exactly the arrays
of the manifest's `settings.contents`; array groups left out are not checked.
"""

from __future__ import annotations

import os

import numpy as np

from storage.format import (
    FP8_SCALE_ARRAYS,
    ROUNDED_CODECS,
    SHARD_DIR,
    TARGET_HEAD_FILE,
    MANIFEST_FILE,
)
from storage.eval_split import SplitFit, eval_split_problems
from storage.location import Location, read_safetensors_header, resolve
from storage.manifest import (
    TARGET_HEAD_HASH_KEY,
    TARGET_HEAD_KEYS,
    Manifest,
    ShardRecord,
    load_manifest,
    target_head_hash,
)
from storage.reader import CORPUS_SOURCE_ROWS, CacheReader
from storage.checksums import checksum_scheme, shard_bytes, shard_checksum
from storage.formats import open_shard
from storage.layout import expected_layout, layout_problem
from storage.records import RecordDims, check_record

PROB_TOLERANCE = 1e-3
MAX_PROBLEMS_PER_SHARD = 10


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".replace("\n", " ")


def _label_problems(prefix: str, probs: np.ndarray, tail: np.ndarray) -> list[str]:
    """Top-k probs [..., k] and tail [...]: in [0, 1], sorted descending, summing with tail to 1."""
    problems = []
    if not (np.isfinite(probs).all() and (probs >= 0).all() and (probs <= 1).all()):
        problems.append(f"{prefix}_topk_probs outside [0, 1]")
    if not (np.isfinite(tail).all() and (tail >= 0).all() and (tail <= 1).all()):
        problems.append(f"{prefix}_tail outside [0, 1]")
    if probs.shape[-1] > 1 and (np.diff(probs, axis=-1) > 0).any():
        problems.append(f"{prefix}_topk_probs not sorted descending")
    if probs.size:
        error = np.abs(probs.astype(np.float64).sum(-1) + tail - 1.0)
        if not (error <= PROB_TOLERANCE).all():
            worst = float(np.nanmax(np.where(np.isnan(error), np.inf, error)))
            problems.append(f"{prefix}_topk_probs + {prefix}_tail differ from 1 by up to {worst:.3g}")
    return problems


def _feature_nan(bits: np.ndarray) -> bool:
    if bits.dtype == np.uint16:  # bf16: exponent all ones is inf or NaN
        return bool(((bits & 0x7F80) == 0x7F80).any())
    return bool(((bits & 0x7F) == 0x7F).any())  # e4m3fn: S.1111.111 is NaN


def record_value_problems(record: dict[str, np.ndarray], *, vocab_size: int, codecs: dict[str, str] | None = None) -> list[str]:
    """Value-level problems of one encoded, schema-valid record (empty if none); only the array
    groups the record holds are checked. `codecs`: each feature array's (Manifest.settings.codecs),
    to check what an e8m codec leaves zero."""
    problems = []
    input_ids = record["input_ids"]
    T = len(input_ids)
    for name in ("input_ids", "corpus_topk_ids", "rollout_tokens", "rollout_topk_ids"):
        ids = record.get(name)
        if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            problems.append(f"{name} outside [0, vocab_size={vocab_size})")
    if not np.isin(record["loss_mask"], (0, 1)).all():
        problems.append("loss_mask has values other than 0 and 1")
    if "corpus_topk_probs" in record:
        problems += _label_problems("corpus", record["corpus_topk_probs"], record["corpus_tail"])
        next_prob = record["corpus_next_prob"]
        if not (np.isfinite(next_prob).all() and (next_prob >= 0).all() and (next_prob <= 1).all()):
            problems.append("corpus_next_prob outside [0, 1]")
        elif next_prob[-1] != 0:
            problems.append("corpus_next_prob is not 0 at the last position")
    if "rollout_topk_probs" in record:
        problems += _label_problems("rollout", record["rollout_topk_probs"], record["rollout_tail"])
    anchor_pos = record["anchor_pos"]
    if anchor_pos.size:
        if anchor_pos.min() < 0 or anchor_pos.max() >= T - 1:
            problems.append(f"anchor_pos outside [0, T-1={T - 1})")
        elif (np.diff(anchor_pos) <= 0).any():
            problems.append("anchor_pos not sorted and unique")
        elif "rollout_tokens" in record and (record["rollout_tokens"][:, 0] != input_ids[anchor_pos]).any():
            problems.append("rollout_tokens[:, 0] != input_ids[anchor_pos]")
    for name, scale_name in FP8_SCALE_ARRAYS.items():
        if name not in record:
            continue
        if _feature_nan(record[name]):
            problems.append(f"{name} contain NaN or infinite values")
        mantissa_bits = ROUNDED_CODECS.get((codecs or {}).get(name))
        if mantissa_bits is not None and (record[name] & ((1 << (7 - mantissa_bits)) - 1)).any():
            problems.append(f"{name} have mantissa bits a {codecs[name]} codec leaves zero")
        if scale_name in record:
            scales = record[scale_name]
            if not (np.isfinite(scales).all() and (scales > 0).all()):
                problems.append(f"{scale_name} not finite and positive")
    return problems


def _shard_problems(cache: Location, manifest: Manifest, record: ShardRecord) -> list[str]:
    path = cache.child(f"{SHARD_DIR}/{record.name}")
    if not path.exists():
        return [f"listed in manifest as {record.status} but missing on disk ({path})"]
    problems = []
    checksum = shard_checksum(path, scheme=checksum_scheme(record.checksum))
    if checksum != record.checksum:
        problems.append(f"checksum mismatch: manifest {record.checksum}, on disk {checksum}")
    size = shard_bytes(path)
    if size != record.bytes:
        problems.append(f"size mismatch: manifest {record.bytes} bytes, on disk {size}")

    codec = manifest.settings.feature_codec
    settings = manifest.settings
    # Only F, k and K are compared against each record.
    dims = RecordDims(
        num_tokens=0, num_anchors=0, feature_dim=manifest.feature_dim, top_k=settings.top_k, num_slots=settings.num_slots
    )
    try:
        shard = open_shard(path, storage_format=manifest.settings.storage_format)
    except Exception as e:  # a broken shard can fail in zarr, tarfile or numpy
        return problems + [f"unreadable ({_one_line(e)})"]
    layout = layout_problem(shard.layout(), expected_layout(manifest), where="shard")
    if layout is not None:  # another cache's or build's shard: its rows are not read
        shard.close()
        return problems + [layout.removeprefix("shard: ")]
    try:
        if shard.num_sequences != record.sequences:
            problems.append(f"holds {shard.num_sequences} sequences, manifest says {record.sequences}")
        problems += shard.structure_problems(manifest, record)
        num_tokens = num_anchors = 0
        for local in range(shard.num_sequences):
            if len(problems) > MAX_PROBLEMS_PER_SHARD:
                break
            try:
                seq = shard.read(local)
                where = f"sequence {local}" + (f" (source row {int(seq['source_row'])})" if "source_row" in seq else "")
                seq_dims = check_record(
                    seq, feature_codec=codec, contents=settings.contents, where=where, like=dims,
                    rollout_feature_codec=settings.rollout_feature_codec, ira_parents=settings.ira_parents,
                )  # fmt: skip
            except Exception as e:
                problems.append(f"sequence {local}: {_one_line(e)}" if not isinstance(e, ValueError) else str(e))
                continue
            num_tokens += seq_dims.num_tokens
            num_anchors += seq_dims.num_anchors
            problems += [f"{where}: {p}" for p in record_value_problems(seq, vocab_size=manifest.vocab_size, codecs=settings.codecs)]
        else:
            if shard.recorded_sizes() is None and (num_tokens, num_anchors) != (record.tokens, record.anchors):
                problems.append(
                    f"holds {num_tokens} tokens / {num_anchors} anchors, manifest says {record.tokens} / {record.anchors}"
                )
    finally:
        shard.close()
    if len(problems) > MAX_PROBLEMS_PER_SHARD:
        problems = problems[:MAX_PROBLEMS_PER_SHARD] + [f"more problems not listed (stopped after {MAX_PROBLEMS_PER_SHARD})"]
    return problems


def _head_shapes_and_hash(cache: Location) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """The head's tensor shapes and the target hash it was written for. On a store only its
    safetensors header is read (the tensors are GBs)."""
    if not cache.is_local:
        header = read_safetensors_header(cache, TARGET_HEAD_FILE)
        shapes = {key: tuple(info["shape"]) for key, info in header.items() if key != "__metadata__"}
        return shapes, (header.get("__metadata__") or {}).get(TARGET_HEAD_HASH_KEY)
    from safetensors import safe_open

    with safe_open(cache.join(TARGET_HEAD_FILE), framework="numpy") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    return shapes, target_head_hash(cache.local_path)


def _target_head_problems(cache: Location, manifest: Manifest) -> list[str]:
    path = cache.join(TARGET_HEAD_FILE)
    if not cache.is_file(TARGET_HEAD_FILE):
        return [f"{path}: missing target head file"]
    try:
        shapes, written_for = _head_shapes_and_hash(cache)
    except Exception as e:
        return [f"{path}: unreadable ({_one_line(e)})"]
    problems = []
    for key in TARGET_HEAD_KEYS:
        if key not in shapes:
            problems.append(f"{path}: missing tensor {key}")
        elif shapes[key] != (manifest.vocab_size, manifest.hidden_size):
            problems.append(f"{path}: {key} has shape {shapes[key]}, expected ({manifest.vocab_size}, {manifest.hidden_size})")
    if written_for != manifest.settings.target_hash:
        problems.append(
            f"{path}: written for target {written_for or 'unknown (untagged)'}, the manifest's target is {manifest.settings.target_hash}"
        )
    return problems


def size_problems(cache_dir: str | os.PathLike | Location, manifest: Manifest) -> list[str]:
    """The cheap check (`alrira-cache info`): every complete shard exists with the byte size the
    manifest records. It reads no data (on a store: listings only), so it catches a truncated or
    missing file, not a flip."""
    problems = []
    for record in manifest.complete_shards:
        path = resolve(cache_dir).child(f"{SHARD_DIR}/{record.name}")
        if not path.exists():
            problems.append(f"{record.name}: listed in manifest as {record.status} but missing on disk ({path})")
        elif (size := shard_bytes(path)) != record.bytes:
            problems.append(f"{record.name}: size mismatch: manifest {record.bytes} bytes, on disk {size}")
    return problems


def identity_problems(reader) -> list[str]:
    """`alrira-cache info`'s check that every complete shard is the one its manifest record names
    (storage.reader.CacheReader.identity_problem: the rows read at open, no data). A cache without
    a tokenized corpus gets only the Zarr size check (`identity_note` says so)."""
    problems = []
    for record in reader.shards:
        try:
            shard = open_shard(reader.shard_path(record), storage_format=reader.storage_format)
        except ValueError as error:
            problems.append(f"{record.name}: {_one_line(error)}")
            continue
        try:
            problem = reader.identity_problem(record, shard)
        finally:
            shard.close()
        if problem is not None:
            problems.append(f"{record.name}: {problem}")
    return problems


def identity_note(reader) -> str | None:
    if reader.shards and reader.expected_source_rows(reader.shards[0]) is None:
        return f"note: {reader.cache_dir} has no {CORPUS_SOURCE_ROWS}: which rows its shards hold is not checked"
    return None


def verify_cache(cache_dir: str | os.PathLike | Location) -> list[str]:
    """Every problem found in the cache at `cache_dir` (a directory or a store URL), one line
    each; empty if it is good. On a store every shard object is downloaded once."""
    cache = resolve(cache_dir)
    try:
        manifest = load_manifest(cache)
    except ValueError as e:
        return [str(e)]
    problems = []
    if not manifest.is_complete:
        problems.append(
            f"{cache.join(MANIFEST_FILE)}: {len(manifest.complete_shards)} of {manifest.num_shards_planned} planned shards are complete"
        )
    problems += _target_head_problems(cache, manifest)
    problems += eval_split_problems(cache, SplitFit.of(manifest))  # checked like a shard: record, counts, token ids, widths
    for record in manifest.complete_shards:
        problems += [f"{record.name}: {p}" for p in _shard_problems(cache, manifest, record)]
    if not problems:  # every shard whole: is each the one its record names (rows, not only bytes)?
        problems += identity_problems(CacheReader(cache, manifest))
    return problems
