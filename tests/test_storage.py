"""storage/: codecs, manifest, shard writers/readers (real Zarr and tar files), reader, verify."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.codecs import FP8_E4M3FN_TABLE, decode_features, encode_features
from storage.format import (
    ALL_GROUPS,
    FORMAT_VERSION,
    MANIFEST_FILE,
    SHARD_DIR,
    check_contents,
    record_array_names,
    shard_name,
)
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
from storage.reader import available_arrays, cache_stats, open_cache
from storage.location import resolve
from storage.ownership import CacheOwnershipLost, check_owner, claim_cache, owned
from storage.checksums import shard_checksum
from storage.layout import REBUILD_HINT
from storage.formats.wds import WdsShard
from storage.shards import clean_partial_shards, read_shard_records, write_shard
from storage.verify import verify_cache

F, TOP_K, K = 64, 4, 15
VOCAB, HIDDEN = 1000, 32  # F = 2 taps * HIDDEN
LAYER_IDS = [1, 3]
FORMATS = ("zarr", "wds")
CODECS = ("bf16", "fp8", "e8m3")


# ---------------------------------------------------------------------------------------------
# Fabricated, schema-valid records


def _labels(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k ids, probs sorted descending, and tail, for distributions of `shape`."""
    dist = rng.dirichlet(np.ones(TOP_K + 2), size=shape)  # [..., k + 2]
    probs = -np.sort(-dist[..., :TOP_K], axis=-1)
    probs = probs.astype(np.float32)
    tail = np.maximum(0.0, 1.0 - probs.sum(-1, dtype=np.float64)).astype(np.float32)
    ids = rng.integers(0, VOCAB, size=(*shape, TOP_K)).astype(np.int32)
    return ids, probs, tail


def _features(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # Quarter steps: realistic magnitudes but few distinct values, so the data compresses.
    return (np.round(rng.normal(size=shape) * 4.0) / 4.0).astype(np.float32)


def make_record(rng: np.random.Generator, *, source_row: int, T: int, A: int, codec: str) -> tuple[dict, dict]:
    """(encoded record, float features {"features", "rollout_features"}) of one sequence."""
    input_ids = rng.integers(0, VOCAB, size=T).astype(np.int32)
    anchor_pos = np.sort(rng.choice(T - 1, size=A, replace=False)).astype(np.int32)
    rollout_tokens = rng.integers(0, VOCAB, size=(A, K + 1)).astype(np.int32)
    rollout_tokens[:, 0] = input_ids[anchor_pos]
    corpus_ids, corpus_probs, corpus_tail = _labels(rng, (T,))
    rollout_ids, rollout_probs, rollout_tail = _labels(rng, (A, K))
    next_prob = rng.random(T).astype(np.float32)
    next_prob[-1] = 0.0
    floats = {"features": _features(rng, (T, F)), "rollout_features": _features(rng, (A, K - 2, F))}
    record = {
        "source_row": source_row,
        "input_ids": input_ids,
        "loss_mask": (rng.random(T) < 0.7).astype(np.uint8),
        "corpus_topk_ids": corpus_ids,
        "corpus_topk_probs": corpus_probs,
        "corpus_tail": corpus_tail,
        "corpus_next_prob": next_prob,
        "anchor_pos": anchor_pos,
        "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": rollout_ids,
        "rollout_topk_probs": rollout_probs,
        "rollout_tail": rollout_tail,
    }
    scale_names = {"features": "feature_scales", "rollout_features": "rollout_feature_scales"}
    for name, values in floats.items():
        bits, scales = encode_features(torch.from_numpy(values), codec=codec)
        record[name] = bits
        if codec == "fp8":
            record[scale_names[name]] = scales
    return record, floats


def make_shard_records(
    seed: int, *, first_row: int, num: int, codec: str, contents=ALL_GROUPS
) -> tuple[list[dict], list[dict]]:
    """Records holding the arrays of `contents` (the same values as a full cache's, minus the rest)."""
    rng = np.random.default_rng(seed)
    names = set(record_array_names(codec, contents))
    records, floats = [], []
    for i in range(num):
        T = int(rng.integers(20, 60))
        A = 0 if i == 1 else int(rng.integers(1, 6))  # one sequence without anchors
        record, f = make_record(rng, source_row=first_row + 3 * i, T=T, A=A, codec=codec)
        records.append({name: value for name, value in record.items() if name in names})
        floats.append({name: value for name, value in f.items() if name in names})
    return records, floats


def make_settings(**overrides) -> CacheSettings:
    values = dict(
        target_hash="sha256:abc",
        layer_ids=list(LAYER_IDS),
        num_slots=K,
        top_k=TOP_K,
        anchors_per_sequence=8,
        seed=0,
        max_length=64,
        min_supervised_tokens=4,
        feature_codec="bf16",
        storage_format="zarr",
        shard_size=4,
        corpus_hash="sha256:def",
        skip_bad_rows=False,
    )
    values.update(overrides)
    return CacheSettings(**values)


def make_manifest(settings: CacheSettings, shards: list[ShardRecord], num_shards_planned: int | None = None) -> Manifest:
    return Manifest(
        settings=settings,
        target_path="/models/tiny",
        target_config={"model_type": "qwen3", "hidden_size": HIDDEN, "num_hidden_layers": 4},
        num_target_layers=4,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        stop_token_ids=[2, 3],
        mask_token_id=999,
        corpus_path="/data/corpus.jsonl",
        corpus_stats={"rows": 10, "sequences": 7, "dropped": {"too_short": 3}},
        shards=shards,
        num_shards_planned=len(shards) if num_shards_planned is None else num_shards_planned,
    )


def build_cache(cache_dir: Path, *, storage_format: str, codec: str, sizes=(4, 3), seed: int = 0, contents=ALL_GROUPS):
    """Cache of len(sizes) shards holding `contents`; returns (records, floats) flattened in global order."""
    all_records, all_floats, shards = [], [], []
    for index, num in enumerate(sizes):
        records, floats = make_shard_records(seed + index, first_row=100 * index, num=num, codec=codec, contents=contents)
        shards.append(
            write_shard(
                cache_dir, shard_index=index, records=records, storage_format=storage_format, feature_codec=codec,
                contents=contents,
            )
        )  # fmt: skip
        all_records += records
        all_floats += floats
    settings = make_settings(feature_codec=codec, storage_format=storage_format, contents=list(contents))
    save_manifest(cache_dir, make_manifest(settings, shards))
    head = torch.randn(VOCAB, HIDDEN)
    save_target_head(cache_dir, embed_tokens=head, lm_head=head, target_hash=settings.target_hash)  # tied, as in small targets
    return all_records, all_floats


def assert_record_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        value = np.asarray(value)
        assert got[name].dtype == (np.int64 if name == "source_row" else value.dtype), name
        assert got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Codecs


def test_bf16_codec_is_bit_exact_and_keeps_leading_dims():
    x = torch.randn(2, 3, 5, F) * 100
    bits, scales = encode_features(x, codec="bf16")
    assert scales is None and bits.dtype == np.uint16 and bits.shape == (2, 3, 5, F)
    decoded = decode_features(bits, None, codec="bf16")
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, x.to(torch.bfloat16).float().numpy())
    # bf16 input goes through unchanged
    bits_bf16, _ = encode_features(x.to(torch.bfloat16), codec="bf16")
    np.testing.assert_array_equal(bits_bf16, bits)


def test_fp8_table_matches_torch():
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(FP8_E4M3FN_TABLE, torch_values)  # NaN positions included


def test_fp8_codec_relative_error_zero_rows_and_shapes():
    x = torch.randn(3, 7, F) * torch.logspace(-3, 3, 7)[None, :, None]
    x[1, 2] = 0.0  # an all-zero row
    bits, scales = encode_features(x, codec="fp8")
    assert bits.dtype == np.uint8 and bits.shape == (3, 7, F)
    assert scales.dtype == np.float32 and scales.shape == (3, 7)
    assert scales[1, 2] == 1.0
    np.testing.assert_allclose(scales, x.abs().amax(-1).numpy() / 448.0 + (x.abs().amax(-1) == 0).numpy(), rtol=1e-6)
    decoded = decode_features(bits, scales, codec="fp8")
    assert decoded.shape == x.shape and decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded[1, 2], 0.0)
    xs = x.numpy()
    normal = np.abs(xs) >= scales[..., None] * 2.0**-6  # e4m3 normal range (3 mantissa bits)
    assert normal.mean() > 0.9
    rel = np.abs(decoded - xs)[normal] / np.abs(xs)[normal]
    assert rel.max() <= 2.0**-4 * (1 + 1e-5)
    # the row maximum maps to +-448 and comes back (almost) exactly
    row_max = np.abs(xs).max(-1)
    np.testing.assert_allclose(np.abs(decoded).max(-1), row_max, rtol=1e-6)


def test_codecs_reject_bad_input():
    with pytest.raises(ValueError, match="codec"):
        encode_features(torch.zeros(2, 4), codec="int8")
    with pytest.raises(ValueError, match="NaN"):
        encode_features(torch.tensor([[1.0, float("nan")]]), codec="fp8")
    with pytest.raises(ValueError, match="scales"):
        decode_features(np.zeros((2, 4), np.uint8), None, codec="fp8")
    with pytest.raises(ValueError, match="uint16"):
        decode_features(np.zeros((2, 4), np.uint8), None, codec="bf16")


# ---------------------------------------------------------------------------------------------
# Shards and reader


@pytest.mark.parametrize("storage_format", FORMATS)
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip(tmp_path, storage_format, codec):
    records, floats = build_cache(tmp_path, storage_format=storage_format, codec=codec)
    reader = open_cache(tmp_path)
    assert len(reader) == len(records) == 7
    assert available_arrays(reader) == set(record_array_names(codec))
    for i, (record, f) in enumerate(zip(records, floats)):
        assert_record_equal(reader.read(i, decode_features=False), record)
        decoded = reader.read(i)
        assert "feature_scales" not in decoded and "rollout_feature_scales" not in decoded
        for name in ("features", "rollout_features"):
            assert decoded[name].dtype == np.float32 and decoded[name].shape == f[name].shape
            if codec == "bf16":  # bit-exact bf16 of the original floats
                want = torch.from_numpy(f[name]).to(torch.bfloat16).float().numpy()
                np.testing.assert_array_equal(decoded[name], want)
            else:
                np.testing.assert_allclose(decoded[name], f[name], rtol=2.0**-4, atol=1e-6)
        assert decoded["input_ids"].dtype == np.int32
        np.testing.assert_array_equal(decoded["corpus_topk_probs"], record["corpus_topk_probs"])
    # read_shard_records gives the encoded records of one shard in written order
    path = tmp_path / SHARD_DIR / shard_name(1, storage_format)
    for got, want in zip(read_shard_records(path, storage_format=storage_format), records[4:], strict=True):
        assert_record_equal(got, want)


@pytest.mark.parametrize("storage_format", FORMATS)
def test_random_access_matches_sequential(tmp_path, storage_format):
    build_cache(tmp_path, storage_format=storage_format, codec="fp8")
    reader = open_cache(tmp_path)
    sequential = [r for shard in reader.shards for r in reader.iter_shard(shard.index)]
    assert len(sequential) == len(reader)
    assert [reader.shard_of(i) for i in (0, 3, 4, 6)] == [(0, 0), (0, 3), (1, 0), (1, 2)]
    for i in np.random.default_rng(1).permutation(len(reader)):
        assert_record_equal(reader.read(int(i)), sequential[i])
    with pytest.raises(IndexError):
        reader.read(len(reader))
    with pytest.raises(IndexError):
        reader.read(-1)


@pytest.mark.parametrize("storage_format", FORMATS)
def test_shards_are_byte_identical_when_rewritten(tmp_path, storage_format):
    records, _ = make_shard_records(5, first_row=0, num=3, codec="bf16")
    a = write_shard(tmp_path / "a", shard_index=2, records=records, storage_format=storage_format, feature_codec="bf16")
    b = write_shard(tmp_path / "b", shard_index=2, records=records, storage_format=storage_format, feature_codec="bf16")
    assert a == b
    assert a.name == shard_name(2, storage_format) and a.sequences == 3 and a.status == "complete"
    assert a.tokens == sum(len(r["input_ids"]) for r in records)
    assert a.anchors == sum(len(r["anchor_pos"]) for r in records)
    assert a.checksum == shard_checksum(tmp_path / "a" / SHARD_DIR / a.name)
    # one changed value changes the checksum
    records[2]["loss_mask"][0] ^= 1
    c = write_shard(tmp_path / "c", shard_index=2, records=records, storage_format=storage_format, feature_codec="bf16")
    assert c.checksum != a.checksum


@pytest.mark.parametrize("storage_format", ["zarr", "wds"])
def test_a_writer_of_a_superseded_build_cannot_publish(tmp_path, storage_format, monkeypatch):
    """claim_cache hands the directory to a new build: a writer holding the old id is refused
    (before writing, and after writing but before the rename), leaves no temp files, and the
    shard the new owner published stays byte for byte."""
    records, _ = make_shard_records(0, first_row=0, num=2, codec="bf16")
    other, _ = make_shard_records(5, first_row=20, num=2, codec="bf16")
    old_owner = claim_cache(resolve(tmp_path))
    write_shard(tmp_path, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16", owner=old_owner)
    new_owner = claim_cache(resolve(tmp_path))
    assert new_owner != old_owner
    published = write_shard(tmp_path, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16", owner=new_owner)
    with pytest.raises(CacheOwnershipLost, match=str(tmp_path)):
        write_shard(tmp_path, shard_index=0, records=other, storage_format=storage_format, feature_codec="bf16", owner=old_owner)

    # The owner changes while a writer is writing: its rename is refused and its temp removed.
    import storage.shards as shards

    real_fsync_tree = shards.fsync_tree

    def fsync_then_lose_the_claim(path):
        real_fsync_tree(path)
        claim_cache(resolve(tmp_path))

    monkeypatch.setattr(shards, "fsync_tree", fsync_then_lose_the_claim)
    with pytest.raises(CacheOwnershipLost):
        write_shard(tmp_path, shard_index=0, records=other, storage_format=storage_format, feature_codec="bf16", owner=new_owner)
    shard_dir = tmp_path / SHARD_DIR
    assert sorted(os.listdir(shard_dir)) == [published.name]
    assert shard_checksum(shard_dir / published.name) == published.checksum


def test_a_claim_waits_for_a_manifest_write_under_the_old_claim(tmp_path):
    """The driver's twin of the writer's race: a driver of a killed build, starved between its
    owner check and its manifest write, must not write after a new build has claimed the
    directory. `owned` holds the lock over both; the claim waits; afterwards the old owner is refused."""
    import threading

    location = resolve(tmp_path)
    old_owner = claim_cache(location)
    inside, go_on, results = threading.Event(), threading.Event(), {}

    def write_under_old_claim():
        with owned(location, old_owner):
            inside.set()
            assert go_on.wait(60)
            (tmp_path / "written").write_text("old")

    writer = threading.Thread(target=write_under_old_claim)
    writer.start()
    assert inside.wait(60)
    claimer = threading.Thread(target=lambda: results.setdefault("new_owner", claim_cache(location)))
    claimer.start()
    claimer.join(0.5)
    assert claimer.is_alive(), "the claim was written while a manifest write under the old claim was in progress"
    go_on.set()
    writer.join(60)
    claimer.join(60)
    assert not writer.is_alive() and not claimer.is_alive() and (tmp_path / "written").read_text() == "old"
    with pytest.raises(CacheOwnershipLost), owned(location, old_owner):
        raise AssertionError("the old owner's block ran after the new claim")
    check_owner(location, results["new_owner"])


@pytest.mark.parametrize("storage_format", FORMATS)
def test_a_claim_waits_for_a_writer_between_its_check_and_its_rename(tmp_path, storage_format, monkeypatch):
    """A writer of a killed build, starved after its owner check, must not rename its shard after a
    new build has claimed the directory (it did, onto the shard the new build's own worker was
    publishing: the kill test's failure under load). The claim waits for the rename; a writer of
    the old claim that checks afterwards is refused; the new owner's shard replaces the old one."""
    import threading

    import storage.shards as shards

    records, _ = make_shard_records(0, first_row=0, num=2, codec="bf16")
    other, _ = make_shard_records(5, first_row=20, num=2, codec="bf16")
    old_owner = claim_cache(resolve(tmp_path))
    inside, go_on = threading.Event(), threading.Event()
    real_move = shards.move_into_place

    def starved_move(src, dst, **kwargs):  # the writer stalls after its check, before its rename
        inside.set()
        assert go_on.wait(60)
        real_move(src, dst, **kwargs)

    monkeypatch.setattr(shards, "move_into_place", starved_move)
    results = {}

    def write_old():
        results["old"] = write_shard(tmp_path, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16", owner=old_owner)

    writer = threading.Thread(target=write_old)
    writer.start()
    assert inside.wait(60)
    claimer = threading.Thread(target=lambda: results.setdefault("new_owner", claim_cache(resolve(tmp_path))))
    claimer.start()
    claimer.join(0.5)
    assert claimer.is_alive(), "the claim was written while a writer was between its check and its rename"
    go_on.set()
    writer.join(60)
    claimer.join(60)
    assert not writer.is_alive() and not claimer.is_alive()
    monkeypatch.setattr(shards, "move_into_place", real_move)
    shard_dir = tmp_path / SHARD_DIR
    assert sorted(os.listdir(shard_dir)) == [results["old"].name]  # renamed before the claim returned
    with pytest.raises(CacheOwnershipLost):
        write_shard(tmp_path, shard_index=0, records=other, storage_format=storage_format, feature_codec="bf16", owner=old_owner)
    published = write_shard(tmp_path, shard_index=0, records=other, storage_format=storage_format, feature_codec="bf16", owner=results["new_owner"])
    assert sorted(os.listdir(shard_dir)) == [published.name]
    assert shard_checksum(shard_dir / published.name) == published.checksum != results["old"].checksum


def test_a_filesystem_without_locks_publishes_unlocked(tmp_path, monkeypatch):
    """A filesystem that refuses flock (ENOLCK, as some FUSE mounts) claims and publishes as it did
    before the owner lock existed; a lock another process holds is waited for, then named."""
    import errno
    import fcntl

    import storage.ownership as ownership

    records, _ = make_shard_records(0, first_row=0, num=2, codec="bf16")
    real_flock = fcntl.flock

    def refused(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(ownership.fcntl, "flock", refused)
    owner = claim_cache(resolve(tmp_path))
    published = write_shard(tmp_path, shard_index=0, records=records, storage_format="zarr", feature_codec="bf16", owner=owner)
    assert shard_checksum(tmp_path / SHARD_DIR / published.name) == published.checksum
    monkeypatch.setattr(ownership.fcntl, "flock", real_flock)
    holder = os.open(tmp_path / ".build-owner.lock", os.O_RDWR)
    try:
        real_flock(holder, fcntl.LOCK_EX)  # another open file description: excludes this process's own too
        wait_s = 0.2
        with pytest.raises(ValueError, match=r"\.build-owner\.lock: held for over 0s by another process"):
            with ownership.owner_lock(resolve(tmp_path), timeout=wait_s):
                pass
    finally:
        os.close(holder)


@pytest.mark.parametrize("storage_format", FORMATS)
def test_atomic_publish_replace_and_cleanup(tmp_path, storage_format):
    records, _ = make_shard_records(0, first_row=0, num=2, codec="bf16")
    write_shard(tmp_path, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16")
    shard_dir = tmp_path / SHARD_DIR
    assert sorted(os.listdir(shard_dir)) == [shard_name(0, storage_format)]
    # a redone shard replaces the published one
    new_records, _ = make_shard_records(9, first_row=50, num=3, codec="bf16")
    rec = write_shard(tmp_path, shard_index=0, records=new_records, storage_format=storage_format, feature_codec="bf16")
    assert sorted(os.listdir(shard_dir)) == [rec.name]
    got = list(read_shard_records(shard_dir / rec.name, storage_format=storage_format))
    assert [int(r["source_row"]) for r in got] == [50, 53, 56]
    # leftovers of an interrupted write are removed; the published shard is untouched
    (shard_dir / ".tmp-shard-00001.zarr-dead").mkdir()
    (shard_dir / ".tmp-shard-00001.zarr-dead" / "zarr.json").write_text("{}")
    (shard_dir / ".tmp-shard-00002.tar-beef").write_bytes(b"partial")
    assert clean_partial_shards(tmp_path) == [".tmp-shard-00001.zarr-dead", ".tmp-shard-00002.tar-beef"]
    assert sorted(os.listdir(shard_dir)) == [rec.name]
    assert shard_checksum(shard_dir / rec.name) == rec.checksum
    assert clean_partial_shards(tmp_path) == []


def test_write_shard_rejects_bad_records(tmp_path):
    records, _ = make_shard_records(0, first_row=0, num=3, codec="bf16")
    bad = [dict(r) for r in records]
    bad[1]["input_ids"] = bad[1]["input_ids"].astype(np.int64)
    with pytest.raises(ValueError, match=r"shard shard-00000.zarr record 1: array input_ids has dtype int64"):
        write_shard(tmp_path, shard_index=0, records=bad, storage_format="zarr", feature_codec="bf16")
    bad = [dict(r) for r in records]
    bad[2]["corpus_tail"] = bad[2]["corpus_tail"][:-1]
    with pytest.raises(ValueError, match=r"record 2: array corpus_tail has shape"):
        write_shard(tmp_path, shard_index=0, records=bad, storage_format="wds", feature_codec="bf16")
    with pytest.raises(ValueError, match=r"record 0: array feature_scales is missing"):
        write_shard(tmp_path, shard_index=0, records=records, storage_format="zarr", feature_codec="fp8")
    bad = [dict(r) for r in records]
    bad[0]["extra"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"record 0: array extra is not part of the schema"):
        write_shard(tmp_path, shard_index=0, records=bad, storage_format="zarr", feature_codec="bf16")
    bad = [dict(r) for r in records]
    bad[2]["features"] = np.zeros((len(bad[2]["input_ids"]), F + 1), np.uint16)
    with pytest.raises(ValueError, match=r"record 2: array features implies feature_dim 65, expected 64"):
        write_shard(tmp_path, shard_index=0, records=bad, storage_format="zarr", feature_codec="bf16")
    bad = [dict(r) for r in records]
    bad[2]["source_row"] = records[0]["source_row"]
    with pytest.raises(ValueError, match=r"source_row 0 appears in more than one record"):
        write_shard(tmp_path, shard_index=0, records=bad, storage_format="wds", feature_codec="bf16")
    assert not (tmp_path / SHARD_DIR).exists() or os.listdir(tmp_path / SHARD_DIR) == []


def test_wds_shard_is_readable_by_webdataset(tmp_path):
    import webdataset

    from storage.formats.wds import decode_sample

    records, _ = make_shard_records(0, first_row=7, num=3, codec="bf16")
    rec = write_shard(tmp_path, shard_index=0, records=records, storage_format="wds", feature_codec="bf16")
    samples = list(webdataset.WebDataset(str(tmp_path / SHARD_DIR / rec.name), shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["000000007", "000000010", "000000013"]
    for sample, record in zip(samples, records, strict=True):
        decoded = decode_sample(sample)  # members are compressed: {array}.npy.blosc.crc32
        np.testing.assert_array_equal(decoded["input_ids"], record["input_ids"])
        np.testing.assert_array_equal(decoded["rollout_features"], record["rollout_features"])
        assert int(decoded["source_row"]) == record["source_row"]


def _collate_list(batch):
    return batch


@pytest.mark.parametrize("storage_format", FORMATS)
def test_dataloader_workers_read_the_same_arrays(tmp_path, storage_format):
    build_cache(tmp_path, storage_format=storage_format, codec="bf16")
    reader = open_cache(tmp_path)
    expected = [reader.read(i) for i in range(len(reader))]  # parent opens handles before forking
    loader = torch.utils.data.DataLoader(reader, batch_size=2, num_workers=2, collate_fn=_collate_list)
    got = [record for batch in loader for record in batch]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert_record_equal(g, e)
    # a pickled reader (spawned workers) carries no open handles and reads the same
    clone = pickle.loads(pickle.dumps(reader))
    assert clone._handles == {}
    assert_record_equal(clone.read(5), expected[5])


def test_only_complete_shards_are_readable(tmp_path):
    build_cache(tmp_path, storage_format="zarr", codec="bf16")
    manifest = load_manifest(tmp_path)
    manifest.shards[1].status = "pending"
    save_manifest(tmp_path, manifest)
    reader = open_cache(tmp_path)
    assert len(reader) == 4 and [s.index for s in reader.shards] == [0]
    assert not reader.manifest.is_complete and reader.manifest.num_sequences == 4
    with pytest.raises(ValueError, match="shard 1 is not a complete shard"):
        list(reader.iter_shard(1))
    # a complete shard whose files are gone cannot be opened
    manifest.shards[1].status = "complete"
    save_manifest(tmp_path, manifest)
    import shutil

    shutil.rmtree(tmp_path / SHARD_DIR / "shard-00001.zarr")
    with pytest.raises(ValueError, match="shard-00001.zarr listed as complete is missing"):
        open_cache(tmp_path)


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("contents", [ALL_GROUPS, ("corpus_topk", "rollouts"), ()], ids=["all", "no-rf", "none"])
def test_cache_stats(tmp_path, codec, contents):
    records, _ = build_cache(tmp_path, storage_format="zarr", codec=codec, sizes=(6,), contents=contents)
    stats = cache_stats(open_cache(tmp_path))
    tokens = sum(len(r["input_ids"]) for r in records)
    anchors = sum(len(r["anchor_pos"]) for r in records)
    # hand computation: every record array at its stored size, features as 2-byte bf16, no scales
    raw = 0
    for r in records:
        for name, value in r.items():
            if name in ("feature_scales", "rollout_feature_scales"):
                continue
            value = np.asarray(value, dtype=np.int64) if name == "source_row" else value
            raw += value.size * 2 if name in ("features", "rollout_features") else value.nbytes
    assert stats["sequences"] == 6 and stats["tokens"] == tokens and stats["anchors"] == anchors
    assert stats["raw_bf16_bytes"] == raw
    assert stats["bytes_on_disk"] == _disk_bytes(tmp_path / SHARD_DIR)
    assert stats["bytes_per_token"] == pytest.approx(stats["bytes_on_disk"] / tokens)
    assert stats["compression_ratio_vs_raw_bf16"] == pytest.approx(raw / stats["bytes_on_disk"])
    assert stats["compression_ratio_vs_raw_bf16"] > (1.5 if codec == "fp8" and "rollout_features" in contents else 1.0)


# ---------------------------------------------------------------------------------------------
# Manifest and target head


def test_manifest_round_trip_and_properties(tmp_path):
    shards = [
        ShardRecord(name="shard-00000.zarr", index=0, sequences=4, tokens=100, anchors=9, bytes=10, checksum="sha256:0", status="complete"),
        ShardRecord(name="shard-00001.zarr", index=1, sequences=3, tokens=50, anchors=5, bytes=10, checksum="sha256:1", status="pending"),
    ]
    manifest = make_manifest(make_settings(), shards, num_shards_planned=3)
    save_manifest(tmp_path, manifest)
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_FILE]  # no temp file left behind
    loaded = load_manifest(tmp_path)
    assert loaded == manifest
    assert json.loads((tmp_path / MANIFEST_FILE).read_text()) == manifest.to_dict()
    assert (loaded.num_sequences, loaded.num_tokens, loaded.num_anchors) == (4, 100, 9)
    assert not loaded.is_complete
    loaded.shards[1].status = "complete"
    loaded.shards.append(ShardRecord(**{**shards[0].to_dict(), "index": 2, "name": "shard-00002.zarr"}))
    assert loaded.is_complete and loaded.num_sequences == 11


def _write_manifest_dict(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / MANIFEST_FILE
    path.write_text(json.dumps(data))
    return path


def test_manifest_rejects_unknown_keys_and_versions(tmp_path):
    data = make_manifest(make_settings(), []).to_dict()
    path = _write_manifest_dict(tmp_path, {**data, "colour": "blue"})
    with pytest.raises(ValueError, match=r"manifest.json.*unknown key 'colour'"):
        load_manifest(tmp_path)
    with pytest.raises(ValueError, match=r"unknown key 'beam_width' in CacheSettings"):
        CacheSettings.from_dict({**make_settings().to_dict(), "beam_width": 4})
    with pytest.raises(ValueError, match=r"missing key 'top_k'"):
        CacheSettings.from_dict({k: v for k, v in make_settings().to_dict().items() if k != "top_k"})
    _write_manifest_dict(tmp_path, {**data, "format_version": FORMAT_VERSION + 1})
    with pytest.raises(ValueError, match=rf"{path}: unsupported format_version {FORMAT_VERSION + 1} \(this code reads versions 1, 2"):
        load_manifest(tmp_path)
    _write_manifest_dict(tmp_path, {**data, "format": "something-else"})
    with pytest.raises(ValueError, match=rf"{path}: not an alrira-cache manifest"):
        load_manifest(tmp_path)
    path.write_text("{ not json")
    with pytest.raises(ValueError, match=rf"{path}: corrupt manifest"):
        load_manifest(tmp_path)
    path.unlink()
    with pytest.raises(ValueError, match=rf"{path}: no cache manifest"):
        load_manifest(tmp_path)


@pytest.mark.parametrize("version", [True, 1.0, "1", [1]])
def test_manifest_format_version_must_be_an_int(tmp_path, version):
    """JSON's `true` is a Python int equal to 1 (and 1.0 == 1): a version that is not an int is refused."""
    data = make_manifest(make_settings(), []).to_dict()
    path = _write_manifest_dict(tmp_path, {**data, "format_version": version})
    with pytest.raises(ValueError, match=rf"{path}: unsupported format_version"):
        load_manifest(tmp_path)
    with pytest.raises(ValueError, match=r"format_version .* is not supported"):
        Manifest.from_dict({**data, "format_version": version})


def test_settings_validation_and_diff():
    with pytest.raises(ValueError, match="num_slots"):
        make_settings(num_slots=2)
    with pytest.raises(ValueError, match="feature_codec"):
        make_settings(feature_codec="fp4")
    with pytest.raises(ValueError, match="storage_format"):
        make_settings(storage_format="parquet")
    with pytest.raises(ValueError, match="top_k"):
        make_settings(top_k=0)
    with pytest.raises(ValueError, match="layer_ids"):
        make_settings(layer_ids=[])
    with pytest.raises(ValueError, match="layer_ids"):
        make_manifest(make_settings(layer_ids=[1, 7]), [])  # target has 4 layers
    with pytest.raises(ValueError, match="expected 'shard-00000.tar'"):
        shard = ShardRecord(name="shard-00000.zarr", index=0, sequences=1, tokens=1, anchors=0, bytes=1, checksum="sha256:0", status="complete")
        make_manifest(make_settings(storage_format="wds"), [shard])
    old = make_settings()
    assert settings_diff(old, make_settings()) == []
    new = make_settings(top_k=8, feature_codec="fp8", layer_ids=[1, 2])
    assert settings_diff(old, new) == ["layer_ids: [1, 3] -> [1, 2]", "top_k: 4 -> 8", "feature_codec: 'bf16' -> 'fp8'"]


def test_target_head_round_trip(tmp_path):
    embed, lm_head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    save_target_head(tmp_path, embed_tokens=embed, lm_head=lm_head)
    head = load_target_head(tmp_path)
    assert set(head) == {"embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(head["embed_tokens.weight"], embed)
    assert head["lm_head.weight"].dtype == torch.bfloat16 and torch.equal(head["lm_head.weight"], lm_head)
    with pytest.raises(ValueError, match="missing target head"):
        load_target_head(tmp_path / "elsewhere")


def test_target_head_is_tied_to_its_target(tmp_path):
    """A head written for one target never passes for another's: the loader and verify say so."""
    build_cache(tmp_path, storage_format="zarr", codec="bf16")
    assert verify_cache(tmp_path) == []
    manifest = load_manifest(tmp_path)
    assert load_target_head(tmp_path, target_hash=manifest.settings.target_hash)
    head = torch.randn(VOCAB, HIDDEN)
    save_target_head(tmp_path, embed_tokens=head, lm_head=head, target_hash="sha256:another-target")
    with pytest.raises(ValueError, match="written for target sha256:another-target"):
        load_target_head(tmp_path, target_hash=manifest.settings.target_hash)
    assert verify_cache(tmp_path) == [
        f"{tmp_path / 'target_head.safetensors'}: written for target sha256:another-target, "
        f"the manifest's target is {manifest.settings.target_hash}"
    ]
    save_target_head(tmp_path, embed_tokens=head, lm_head=head)  # untagged
    with pytest.raises(ValueError, match="unknown"):
        load_target_head(tmp_path, target_hash=manifest.settings.target_hash)


def _flip_a_byte(path: Path, *, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("storage_format", FORMATS)
def test_reader_refuses_a_flipped_byte_naming_shard_and_array(tmp_path, storage_format):
    """One flipped bit in the stored rollout_topk_probs is an error on read, not a different value."""
    build_cache(tmp_path, storage_format=storage_format, codec="bf16")
    if storage_format == "zarr":
        chunks = sorted((tmp_path / SHARD_DIR / "shard-00001.zarr" / "rollout_topk_probs").rglob("c/*/*/*"))
        _flip_a_byte(chunks[0])
    else:
        # The first sample's rollout_topk_probs member: flip a byte of its data, not of the tar header.
        tar = tmp_path / SHARD_DIR / "shard-00001.tar"
        opened = WdsShard(tar)
        offset, size, _ = opened.samples[0][1]["rollout_topk_probs"]
        opened.close()
        data = bytearray(tar.read_bytes())
        data[offset + size - 3] ^= 0x01
        tar.write_bytes(bytes(data))
    reader = open_cache(tmp_path)
    with pytest.raises(ValueError) as error:
        for index in range(len(reader)):
            reader.read(index)
    message = str(error.value)
    assert "\n" not in message and "shard-00001" in message and "rollout_topk_probs" in message
    assert verify_cache(tmp_path)  # the full check still reports it


# ---------------------------------------------------------------------------------------------
# Verify


@pytest.mark.parametrize("storage_format", FORMATS)
def test_verify_passes_on_good_cache(tmp_path, storage_format):
    build_cache(tmp_path, storage_format=storage_format, codec="fp8")
    assert verify_cache(tmp_path) == []


def test_verify_catches_flipped_byte_in_zarr_chunk(tmp_path):
    build_cache(tmp_path, storage_format="zarr", codec="bf16")
    chunk = tmp_path / SHARD_DIR / "shard-00001.zarr" / "features" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    problems = verify_cache(tmp_path)
    assert problems and all(p.startswith("shard-00001.zarr: ") for p in problems)
    assert any("checksum mismatch" in p for p in problems)


def test_checksum_schemes_new_shards_and_old_ones_verify(tmp_path):
    """A Zarr shard's checksum is "sha256-files:" (each file's digest, taken as written), equal to a
    read-back; a manifest written before records "sha256:" (one stream of paths, sizes and bytes),
    which verify still checks by that scheme; a flipped byte fails either."""
    build_cache(tmp_path, storage_format="zarr", codec="bf16")
    manifest = load_manifest(tmp_path)
    shard = tmp_path / SHARD_DIR / manifest.shards[1].name
    assert manifest.shards[1].checksum.startswith("sha256-files:")
    assert manifest.shards[1].checksum == shard_checksum(shard)  # the writer's digests = the bytes on disk
    stream = shard_checksum(shard, scheme="sha256")
    assert stream.startswith("sha256:") and stream != manifest.shards[1].checksum
    old = make_manifest(manifest.settings, [dataclasses.replace(manifest.shards[0], checksum=shard_checksum(
        tmp_path / SHARD_DIR / manifest.shards[0].name, scheme="sha256")), dataclasses.replace(manifest.shards[1], checksum=stream)])  # fmt: skip
    save_manifest(tmp_path, old)
    assert verify_cache(tmp_path) == []
    _flip_a_byte(next(p for p in sorted(shard.rglob("*")) if p.is_file() and p.name != "zarr.json"))
    assert shard_checksum(shard, scheme="sha256") != stream
    assert any("checksum mismatch" in p for p in verify_cache(tmp_path))
    with pytest.raises(ValueError, match="sha256-files"):
        shard_checksum(shard, scheme="md5")


def test_verify_catches_missing_shard(tmp_path):
    build_cache(tmp_path, storage_format="wds", codec="bf16")
    (tmp_path / SHARD_DIR / "shard-00000.tar").unlink()
    problems = verify_cache(tmp_path)
    assert len(problems) == 1
    assert problems[0].startswith("shard-00000.tar: ") and "missing" in problems[0]


def test_verify_catches_bad_values(tmp_path):
    records, _ = make_shard_records(0, first_row=0, num=3, codec="bf16")
    records[1]["corpus_tail"] = records[1]["corpus_tail"] + np.float32(0.1)
    records[2]["rollout_tokens"][0, 0] += 1
    shard = write_shard(tmp_path, shard_index=0, records=records, storage_format="zarr", feature_codec="bf16")
    settings = make_settings()
    save_manifest(tmp_path, make_manifest(settings, [shard]))
    zeros = torch.zeros(VOCAB, HIDDEN)
    save_target_head(tmp_path, embed_tokens=zeros, lm_head=zeros, target_hash=settings.target_hash)
    problems = verify_cache(tmp_path)
    assert problems == [
        "shard-00000.zarr: sequence 1 (source row 3): corpus_topk_probs + corpus_tail differ from 1 by up to 0.1",
        "shard-00000.zarr: sequence 2 (source row 6): rollout_tokens[:, 0] != input_ids[anchor_pos]",
    ]


# ---------------------------------------------------------------------------------------------
# Array groups: caches that leave some out


PARTIAL_CONTENTS = [("corpus_topk", "rollouts"), ("corpus_topk",), ("rollouts",), ()]


def test_record_array_names_follow_contents():
    assert ALL_GROUPS == ("corpus_topk", "rollout_features", "rollouts")
    assert record_array_names("fp8") == record_array_names("fp8", ALL_GROUPS)
    assert record_array_names("bf16", []) == ("source_row", "input_ids", "loss_mask", "features", "anchor_pos")
    assert record_array_names("fp8", ["corpus_topk"]) == (
        "source_row", "input_ids", "loss_mask", "features", "corpus_topk_ids", "corpus_topk_probs", "corpus_tail",
        "corpus_next_prob", "anchor_pos", "feature_scales",
    )  # fmt: skip
    full = set(record_array_names("fp8"))
    no_features = set(record_array_names("fp8", ["rollouts", "corpus_topk"]))
    assert full - no_features == {"rollout_features", "rollout_feature_scales"}
    assert check_contents(["rollouts", "rollout_features"]) == ("rollout_features", "rollouts")
    with pytest.raises(ValueError, match="contents: group 'rollout_features' requires group 'rollouts'"):
        record_array_names("bf16", ["rollout_features"])
    with pytest.raises(ValueError, match="unknown array group 'logits'"):
        check_contents(["corpus_topk", "logits"])
    with pytest.raises(ValueError, match="must not repeat"):
        check_contents(["rollouts", "rollouts"])
    with pytest.raises(ValueError, match="list of group names"):
        check_contents("rollouts")


def test_settings_contents_default_validation_and_diff():
    # A manifest written before array groups existed holds every group.
    old = {k: v for k, v in make_settings().to_dict().items() if k != "contents"}
    assert CacheSettings.from_dict(old).contents == list(ALL_GROUPS)
    settings = make_settings(contents=["rollouts", "corpus_topk"])
    assert settings.contents == ["corpus_topk", "rollouts"]  # stored sorted
    assert CacheSettings.from_dict(settings.to_dict()) == settings
    assert settings_diff(make_settings(), settings) == [
        "contents: ['corpus_topk', 'rollout_features', 'rollouts'] -> ['corpus_topk', 'rollouts']"
    ]
    with pytest.raises(ValueError, match="contents"):
        make_settings(contents=["rollout_features"])
    with pytest.raises(ValueError, match="contents"):
        make_settings(contents=("rollouts",))


@pytest.mark.parametrize("storage_format", FORMATS)
@pytest.mark.parametrize("contents", PARTIAL_CONTENTS, ids=lambda c: "+".join(c) or "none")
def test_partial_cache_round_trip_and_verify(tmp_path, storage_format, contents):
    full_records, _ = build_cache(tmp_path / "full", storage_format=storage_format, codec="fp8")
    records, floats = build_cache(tmp_path / "part", storage_format=storage_format, codec="fp8", contents=contents)
    reader = open_cache(tmp_path / "part")
    names = set(record_array_names("fp8", contents))
    assert reader.manifest.settings.contents == list(contents)
    assert available_arrays(reader) == names
    for i, (record, full) in enumerate(zip(records, full_records, strict=True)):
        got = reader.read(i, decode_features=False)
        assert set(got) == names
        assert_record_equal(got, {name: full[name] for name in names})  # the same values as the full cache
        decoded = reader.read(i)
        assert ("rollout_features" in decoded) == ("rollout_features" in contents)
        np.testing.assert_allclose(decoded["features"], floats[i]["features"], rtol=2.0**-4, atol=1e-6)
    assert verify_cache(tmp_path / "part") == []
    part_bytes = cache_stats(reader)["bytes_on_disk"]
    assert part_bytes < cache_stats(open_cache(tmp_path / "full"))["bytes_on_disk"]


def test_old_manifest_without_contents_opens_as_a_full_cache(tmp_path):
    build_cache(tmp_path, storage_format="wds", codec="bf16")
    path = tmp_path / MANIFEST_FILE
    data = json.loads(path.read_text())
    del data["settings"]["contents"]
    path.write_text(json.dumps(data))
    reader = open_cache(tmp_path)
    assert reader.manifest.settings.contents == list(ALL_GROUPS)
    assert available_arrays(reader) == set(record_array_names("bf16"))
    assert verify_cache(tmp_path) == []


def test_write_shard_holds_exactly_the_contents(tmp_path):
    def write(records, *, codec, contents=ALL_GROUPS, storage_format="zarr"):
        write_shard(
            tmp_path, shard_index=0, records=records, storage_format=storage_format, feature_codec=codec, contents=contents
        )

    records, _ = make_shard_records(0, first_row=0, num=3, codec="fp8")
    schema = r"\(codec 'fp8', contents \['corpus_topk'\]\)"
    with pytest.raises(ValueError, match=rf"record 0: array rollout_feature_scales is not part of the schema {schema}"):
        write(records, codec="fp8", contents=["corpus_topk"])
    partial, _ = make_shard_records(0, first_row=0, num=3, codec="fp8", contents=["corpus_topk", "rollouts"])
    with pytest.raises(ValueError, match=r"record 0: array rollout_feature_scales is missing"):
        write(partial, codec="fp8", storage_format="wds")
    with pytest.raises(ValueError, match="requires group 'rollouts'"):
        write(partial, codec="fp8", contents=["rollout_features"])
    # Without corpus top-k, k is read from the rollout labels (and still checked across records).
    rollouts_only, _ = make_shard_records(0, first_row=0, num=3, codec="bf16", contents=["rollouts"])
    rollouts_only[2]["rollout_topk_ids"] = rollouts_only[2]["rollout_topk_ids"][:, :, :-1]
    rollouts_only[2]["rollout_topk_probs"] = rollouts_only[2]["rollout_topk_probs"][:, :, :-1]
    with pytest.raises(ValueError, match=r"record 2: array rollout_topk_ids implies top_k 3, expected 4"):
        write(rollouts_only, codec="bf16", contents=["rollouts"])
    assert not (tmp_path / SHARD_DIR).exists() or os.listdir(tmp_path / SHARD_DIR) == []


@pytest.mark.parametrize("storage_format", FORMATS)
def test_verify_catches_arrays_the_manifest_does_not_list(tmp_path, storage_format):
    build_cache(tmp_path, storage_format=storage_format, codec="bf16")  # full shards
    manifest = load_manifest(tmp_path)
    manifest.settings.contents = ["corpus_topk", "rollouts"]
    save_manifest(tmp_path, manifest)
    problems = verify_cache(tmp_path)
    assert problems and all(p.startswith(("shard-00000", "shard-00001")) for p in problems)
    assert any("rollout_features" in p for p in problems)
    # The shard's own layout record names the difference before a row is read.
    name = "shard-00000.zarr" if storage_format == "zarr" else "shard-00000.tar"
    assert f"{name}: written with contents ['corpus_topk', 'rollout_features', 'rollouts'], this cache's manifest says ['corpus_topk', 'rollouts']; {REBUILD_HINT}" in problems


def test_info_fails_on_a_truncated_chunk(tmp_path):
    """`alrira-cache info` reads no data, but a shard whose size no longer matches is an error."""
    from click.testing import CliRunner

    from ray_jobs.cli import cache_cli

    build_cache(tmp_path, storage_format="zarr", codec="bf16")
    assert CliRunner().invoke(cache_cli, ["info", str(tmp_path)]).exit_code == 0
    chunk = tmp_path / SHARD_DIR / "shard-00001.zarr" / "features" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    result = CliRunner().invoke(cache_cli, ["info", str(tmp_path)])
    assert result.exit_code == 1
    assert "shard-00001.zarr: size mismatch" in result.output and "alrira-cache verify" in result.output


@pytest.mark.parametrize("storage_format", FORMATS)
@pytest.mark.parametrize("codec", CODECS)
def test_selective_reads_equal_the_whole_record(tmp_path, storage_format, codec):
    """read(arrays=...) holds just those arrays (fp8 scales follow their features), and the rollout
    features of a few pool anchors equal those rows of the whole record."""
    build_cache(tmp_path, storage_format=storage_format, codec=codec)
    reader = open_cache(tmp_path)
    for index in range(len(reader)):
        whole = reader.read(index)
        part = reader.read(index, arrays={"input_ids", "features"})
        assert set(part) == {"source_row", "input_ids", "features"}
        np.testing.assert_array_equal(part["features"], whole["features"])
        if len(whole["anchor_pos"]) == 0:
            continue
        rows = np.array([0, len(whole["anchor_pos"]) - 1])
        np.testing.assert_array_equal(reader.read_rollout_features(index, rows), whole["rollout_features"][rows])
        raw = reader.read(index, decode_features=False)
        np.testing.assert_array_equal(reader.read_rollout_features(index, rows, decode_features=False), raw["rollout_features"][rows])


def test_rollout_features_are_chunked_by_anchor_at_real_row_sizes():
    from storage.formats.zarr.write import _chunk_layout

    row = (13, 12_800)  # K - 2 rollout features of Qwen3-4B's 5 taps, bf16: 333 KB per anchor
    assert _chunk_layout("rollout_features", row, 2, num_rows=32_768)[0] == 1
    chunk_rows, shard_rows = _chunk_layout("features", (12_800,), 2, num_rows=180_000)
    assert chunk_rows * 12_800 * 2 <= 256 << 10 and shard_rows % chunk_rows == 0 and shard_rows > chunk_rows


# ---------------------------------------------------------------------------------------------
# The map loader's decode path (storage/formats/zarr/rows.py)


def test_zarr_rows_reads_what_zarr_reads_sharded_or_not_and_refuses_a_flipped_byte(tmp_path):
    """Row ranges that start and end inside chunks, span shard files, rows picked in any order with
    repeats, a one-row-chunk array decoded in place, chunks never written between stored ones: all
    equal zarr's own reads. A layout it does not read (chunks across the second axis) is left to
    zarr; a flipped byte is a crc32c error, a truncated file an error too."""
    import zarr

    from storage.formats.zarr.rows import ZarrRows

    root = tmp_path / "shard-00000.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    codecs = [zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle="shuffle"), zarr.codecs.Crc32cCodec()]
    rng = np.random.default_rng(0)
    data = {"sharded": rng.standard_normal((100, 3)).astype(np.float32), "plain": rng.integers(0, 9, (10, 2, 2)).astype(np.int32),
            "rows": rng.integers(0, 2**16, (9, 4)).astype(np.uint16), "split": rng.random((8, 6)).astype(np.float32)}  # fmt: skip
    layouts = {"sharded": ((7, 3), (21, 3)), "plain": ((10, 2, 2), None), "rows": ((1, 4), (3, 4)), "split": ((4, 3), None)}
    for name, (chunks, shards) in layouts.items():
        array = group.create_array(name, shape=data[name].shape, dtype=data[name].dtype, chunks=chunks, shards=shards,
                                   compressors=codecs, fill_value=0)  # fmt: skip
        array[:] = data[name]
    rows = ZarrRows(root)
    assert rows.layout("split") is None and rows.layout("sharded").sharded and not rows.layout("plain").sharded
    for start, stop in [(0, 100), (3, 5), (6, 29), (20, 22), (99, 100), (42, 42)]:
        np.testing.assert_array_equal(rows.rows("sharded", start, stop), data["sharded"][start:stop])
    np.testing.assert_array_equal(rows.rows("plain", 2, 9), data["plain"][2:9])
    picked = np.array([8, 0, 4, 4, 5])
    for name in ("sharded", "rows"):
        np.testing.assert_array_equal(rows.pick(name, picked), data[name][picked])
    # Chunks of fill values only are never written: holes between a shard file's stored chunks.
    holes = rng.integers(1, 9, (24, 2)).astype(np.int32)
    holes[2:6] = holes[14:16] = 0
    group.create_array("holes", shape=holes.shape, dtype=holes.dtype, chunks=(2, 2), shards=(8, 2), compressors=codecs,
                       fill_value=0)[:] = holes  # fmt: skip
    for start, stop in [(0, 24), (1, 11), (3, 5), (13, 17)]:
        np.testing.assert_array_equal(rows.rows("holes", start, stop), holes[start:stop])
    np.testing.assert_array_equal(rows.pick("holes", picked + 7), holes[picked + 7])
    _flip_a_byte(root / "sharded" / "c" / "1" / "0", at=0.3)
    with pytest.raises(ValueError, match=r"shard-00000.zarr/sharded/c/1/0: crc32c checksum mismatch"):
        ZarrRows(root).rows("sharded", 21, 42)
    (root / "sharded" / "c" / "0" / "0").write_bytes((root / "sharded" / "c" / "0" / "0").read_bytes()[-52:])
    with pytest.raises(ValueError, match=r"shard-00000.zarr/sharded/c/0/0: chunks at 0 truncated"):
        ZarrRows(root).rows("sharded", 0, 21)
