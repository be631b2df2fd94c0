"""storage/formats/wds.py on real tar files: webdataset's TarWriter writes, the random-access reader and
webdataset's own pipeline read, bytes are deterministic, every member is checked, old tars read."""

from __future__ import annotations

import io
import tarfile
import tracemalloc
import zlib

import fsspec
import numpy as np
import pytest
import torch
import webdataset

from storage.codecs import encode_features
from storage.errors import CorruptShardError
from storage.format import ALL_GROUPS, record_array_names
from storage.formats.wds import (
    BLOSC_CLEVEL,
    LEGACY_CRC_HEADER,
    NPY_BLOSC,
    NPY_BLOSC_CRC32,
    WdsShard,
    WdsShardWriter,
    decode_sample,
    member_selector,
    npy_bytes,
)

F, TOP_K, K, VOCAB = 64, 4, 7, 500


def make_record(rng: np.random.Generator, *, source_row: int, codec: str = "bf16") -> dict[str, np.ndarray]:
    """A schema-valid encoded record of every array group (features with few distinct values, as
    real activations in bf16 have, so they compress)."""
    T, A = int(rng.integers(20, 50)), int(rng.integers(1, 5))

    def features(*shape):
        values = torch.from_numpy((np.round(rng.normal(size=shape) * 4.0) / 4.0).astype(np.float32))
        return encode_features(values, codec=codec)

    def labels(*shape):
        probs = -np.sort(-rng.dirichlet(np.ones(TOP_K + 2), size=shape)[..., :TOP_K], axis=-1).astype(np.float32)
        tail = np.maximum(0.0, 1.0 - probs.sum(-1)).astype(np.float32)
        return rng.integers(0, VOCAB, size=(*shape, TOP_K)).astype(np.int32), probs, tail

    input_ids = rng.integers(0, VOCAB, size=T).astype(np.int32)
    anchor_pos = np.sort(rng.choice(T - 1, size=A, replace=False)).astype(np.int32)
    corpus_ids, corpus_probs, corpus_tail = labels(T)
    rollout_ids, rollout_probs, rollout_tail = labels(A, K)
    rollout_tokens = rng.integers(0, VOCAB, size=(A, K + 1)).astype(np.int32)
    rollout_tokens[:, 0] = input_ids[anchor_pos]
    record = {
        "source_row": source_row, "input_ids": input_ids, "loss_mask": (rng.random(T) < 0.7).astype(np.uint8),
        "corpus_topk_ids": corpus_ids, "corpus_topk_probs": corpus_probs, "corpus_tail": corpus_tail,
        "corpus_next_prob": rng.random(T).astype(np.float32), "anchor_pos": anchor_pos, "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": rollout_ids, "rollout_topk_probs": rollout_probs, "rollout_tail": rollout_tail,
    }  # fmt: skip
    for name, scales_name, shape in (("features", "feature_scales", (T, F)), ("rollout_features", "rollout_feature_scales", (A, K - 2, F))):
        record[name], scales = features(*shape)
        if codec == "fp8":
            record[scales_name] = scales
    return record


def make_records(num: int, *, codec: str = "bf16", seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [make_record(rng, source_row=5 + 3 * i, codec=codec) for i in range(num)]


def write(target, records, *, codec="bf16", contents=ALL_GROUPS, chunk_checksums=True):
    with WdsShardWriter(target, feature_codec=codec, contents=contents, chunk_checksums=chunk_checksums) as writer:
        for record in records:
            writer.append(record)
    return target


def assert_same_record(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == np.asarray(value).dtype or name == "source_row", name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_round_trip_by_random_access_and_through_webdataset(tmp_path, codec):
    records = make_records(4, codec=codec)
    path = write(tmp_path / "shard.tar", records, codec=codec)
    shard = WdsShard(path)
    assert shard.num_sequences == 4 and shard.array_names == set(record_array_names(codec))
    np.testing.assert_array_equal(shard.source_rows, [5, 8, 11, 14])
    for local, record in enumerate(records):
        assert_same_record(shard.read(local), record)
        part = shard.read(local, {"input_ids", "rollout_features"})
        assert set(part) == {"source_row", "input_ids", "rollout_features"}
        rows = np.array([len(record["anchor_pos"]) - 1, 0])
        np.testing.assert_array_equal(shard.read_anchor_rows(local, "rollout_features", rows), record["rollout_features"][rows])
    shard.close()
    # webdataset's own reader sees one sample per record, members named by array and encoding.
    samples = list(webdataset.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["000000005", "000000008", "000000011", "000000014"]
    assert set(samples[0]) - {"__key__", "__url__", "__local_path__"} == {
        f"{n}.{NPY_BLOSC_CRC32}" for n in record_array_names(codec)
    }
    for sample, record in zip(samples, records, strict=True):
        assert_same_record(decode_sample(sample), record)
        assert set(decode_sample(sample, arrays={"features"})) == {"source_row", "features"}


def test_only_the_selected_members_come_out_of_the_stream(tmp_path):
    path = write(tmp_path / "shard.tar", make_records(2))
    selected = webdataset.DataPipeline(
        webdataset.SimpleShardList([str(path)]), webdataset.tarfile_to_samples(select_files=member_selector({"features"}))
    )
    assert [sorted(k for k in s if not k.startswith("__")) for s in selected] == [
        [f"features.{NPY_BLOSC_CRC32}", f"source_row.{NPY_BLOSC_CRC32}"]
    ] * 2


def test_bytes_depend_only_on_the_records_and_any_binary_file_takes_them(tmp_path):
    records = make_records(3)
    a = write(tmp_path / "a.tar", records).read_bytes()
    assert write(tmp_path / "b.tar", records).read_bytes() == a
    assert write(io.BytesIO(), records).getvalue() == a
    with fsspec.open("memory://alrira-test/shard.tar", "wb") as f:  # what an S3 file looks like to the writer
        write(f, records)
    with fsspec.open("memory://alrira-test/shard.tar", "rb") as f:
        assert f.read() == a
    with tarfile.open(tmp_path / "a.tar") as tar:
        members = tar.getmembers()
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.pax_headers.get("mtime")) for m in members} == {
        (0, 0, 0, "", "", 0o644, None)
    }
    names = [m.name for m in members]
    assert names[: len(record_array_names("bf16"))] == sorted(f"000000005.{n}.{NPY_BLOSC_CRC32}" for n in record_array_names("bf16"))
    records[2]["loss_mask"][0] ^= 1
    assert write(tmp_path / "c.tar", records).read_bytes() != a
    with pytest.raises(FileExistsError):
        write(tmp_path / "a.tar", records)  # a path is created, never overwritten


def test_members_are_blosc_zstd_with_byte_shuffle_and_smaller_than_npy(tmp_path):
    from numcodecs import Blosc

    from storage.formats.zarr.write import ZARR_CLEVEL

    assert BLOSC_CLEVEL == ZARR_CLEVEL  # one codec for both formats
    records = make_records(2)
    shard = WdsShard(write(tmp_path / "shard.tar", records, chunk_checksums=False))
    member = shard.samples[0][1]["features"]
    assert member.codec.encoding == NPY_BLOSC
    frame = tmp_path.joinpath("shard.tar").read_bytes()[member.offset : member.offset + member.size]
    # Blosc header: flags bit 0 = byte shuffle, typesize = 2 (bf16 bits), compressor code 4 = zstd (flags >> 5).
    flags, typesize = frame[2], frame[3]
    assert flags & 0x1 and typesize == 2 and flags >> 5 == 4
    assert member.size < 0.8 * len(npy_bytes(records[0]["features"]))
    assert Blosc().decode(frame) == npy_bytes(records[0]["features"])
    assert_same_record(shard.read(1), records[1])


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_fails_the_members_crc_in_both_readers(tmp_path):
    path = write(tmp_path / "shard-00003.tar", make_records(3))
    shard = WdsShard(path)
    member = shard.samples[1][1]["rollout_topk_probs"]
    shard.close()
    _flip(path, member.offset + member.size - 3)
    shard = WdsShard(path)
    shard.read(0)
    shard.read(1, {"features"})  # only the arrays read are checked, so these still read
    with pytest.raises(CorruptShardError) as error:
        shard.read(1)
    message = str(error.value)
    assert "\n" not in message and "shard-00003.tar" in message and "rollout_topk_probs" in message and "CRC32" in message
    sample = list(webdataset.WebDataset(str(path), shardshuffle=False))[1]
    member_name = "000000008.rollout_topk_probs.npy.blosc.crc32"
    with pytest.raises(CorruptShardError, match=f"array rollout_topk_probs: member {member_name} fails its CRC32"):
        decode_sample(sample)


def _legacy_tar(path, records, *, codec="bf16"):
    """A tar as the writer before compression made it: `.npy` members, CRC32 in a PAX header."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for record in records:
            for name in sorted(record_array_names(codec)):
                value = np.asarray(record[name], dtype=np.int64) if name == "source_row" else record[name]
                data = npy_bytes(value)
                info = tarfile.TarInfo(f"{int(record['source_row']):09d}.{name}.npy")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.pax_headers = {LEGACY_CRC_HEADER: f"{zlib.crc32(data):08x}"}
                tar.addfile(info, io.BytesIO(data))
    return path


def test_uncompressed_tars_of_before_still_read_and_are_checked(tmp_path):
    records = make_records(3, codec="fp8")
    path = _legacy_tar(tmp_path / "old.tar", records, codec="fp8")
    shard = WdsShard(path)
    assert shard.array_names == set(record_array_names("fp8"))
    for local, record in enumerate(records):
        assert_same_record(shard.read(local), record)
    samples = list(webdataset.WebDataset(str(path), shardshuffle=False))
    assert_same_record(decode_sample(samples[2]), records[2])  # the stream reads them (PAX CRC unseen)
    member = shard.samples[2][1]["features"]
    shard.close()
    _flip(path, member.offset + member.size - 1)
    with pytest.raises(CorruptShardError, match="array features: member 000000011.features.npy fails its CRC32"):
        WdsShard(path).read(2)


def test_memory_does_not_grow_with_the_number_of_records(tmp_path):
    record = make_records(1)[0]
    with open(tmp_path / "shard.tar", "xb") as f:
        writer = WdsShardWriter(f, feature_codec="bf16", contents=ALL_GROUPS)
        for row in range(5):
            writer.append({**record, "source_row": row})  # warm-up: codecs, buffers
        tracemalloc.start()
        for row in range(5, 25):
            writer.append({**record, "source_row": row})
        after_20 = tracemalloc.get_traced_memory()[0]
        for row in range(25, 225):
            writer.append({**record, "source_row": row})
        after_220 = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        writer.close()
    assert writer.num_records == 225
    # 200 more samples (~1 MB of members) leave no more than a few KB behind.
    assert after_220 - after_20 < 16 << 10, (after_20, after_220)
    assert WdsShard(tmp_path / "shard.tar").num_sequences == 225


def test_a_torn_tar_is_one_line(tmp_path):
    path = write(tmp_path / "shard.tar", make_records(2))
    data = path.read_bytes()
    path.write_bytes(data[:700])  # the first member's header and part of its data
    with pytest.raises(ValueError) as error:
        WdsShard(path).read(0)
    assert "\n" not in str(error.value) and "shard.tar" in str(error.value)


def test_a_tar_on_a_store_reads_by_range_and_streams(tmp_path):
    """fsspec's in-memory store stands in for S3: the writer takes the store's file, the random
    reader fetches members by range, and the stream opens it through fsspec (open_tar)."""
    from storage.formats.wds import open_tar

    records = make_records(3)
    url = "memory://alrira-store-test/shards/shard-00000.tar"
    with fsspec.open(url, "wb") as f:
        write(f, records)
    shard = WdsShard(url)
    assert shard.path == url and shard.num_sequences == 3
    assert_same_record(shard.read(2), records[2])
    np.testing.assert_array_equal(shard.read(1, {"features"})["features"], records[1]["features"])
    with open_tar(url) as stream:
        files = webdataset.tariterators.tar_file_expander([{"url": url, "stream": stream}])
        samples = list(webdataset.tariterators.group_by_keys(files))
    for sample, record in zip(samples, records, strict=True):
        assert_same_record(decode_sample(sample), record)
