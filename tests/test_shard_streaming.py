"""Stage 1 streams (docs/design.md, "A cache build"): records reach the shard as they are
computed, a writer's memory does not grow with the shard, writing overlaps the next batch, and
batches are packed longest first. A real tiny Qwen3, real Zarr and tar files."""

from __future__ import annotations

import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import storage.formats.zarr.write
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache
from pipeline.cache_build.shard_builder import ShardBuilder, plan_batches
from storage.format import SHARD_DIR
from storage.manifest import load_manifest
from storage.checksums import shard_checksum
from storage.shards import ShardSize, ShardWriter, read_shard_records, write_shard
from test_storage import make_record, make_shard_records
from tests.waits import HANG_CAP_S

SMALL = dict(layers=[0, 2], anchors=6, top_k=4, max_length=128, shard_size=5)


def _padding(lengths: list[int], batches: list[list[int]]) -> float:
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths) / padded


def test_plan_batches_packs_longest_first_within_the_budget():
    assert plan_batches([5, 30, 10, 30, 8], batch_tokens=64) == [[1, 3], [2, 4, 0]]
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(100, 1024, size=256)]
    batches = plan_batches(lengths, batch_tokens=8192)
    assert sorted(i for b in batches for i in b) == list(range(256))  # each sequence once
    assert all(max(lengths[i] for i in b) * len(b) <= 8192 for b in batches)
    assert batches == plan_batches(list(lengths), batch_tokens=8192)  # a function of the lengths
    in_order = []  # the old plan: consecutive sequences, same budget
    for i, n in enumerate(lengths):
        if in_order and max(max(lengths[j] for j in in_order[-1]), n) * (len(in_order[-1]) + 1) <= 8192:
            in_order[-1].append(i)
        else:
            in_order.append([i])
    assert _padding(lengths, batches) < 0.05 < 0.25 < _padding(lengths, in_order)


def _traced_peak_of_streaming(cache: Path, num_records: int) -> tuple[int, int]:
    """(traced peak bytes while num_records ~1 MB records are streamed into one Zarr shard,
    total bytes of the records): each record is made, appended and dropped."""
    rng = np.random.default_rng(0)
    size = ShardSize(num_sequences=num_records, num_tokens=200 * num_records, num_anchors=20 * num_records)
    total = 0
    tracemalloc.start()
    try:
        with ShardWriter(cache, shard_index=0, size=size, storage_format="zarr", feature_codec="bf16") as writer:
            for i in range(num_records):
                record, _ = make_record(rng, source_row=i, T=200, A=20, codec="bf16")
                total += sum(a.nbytes for a in record.values() if isinstance(a, np.ndarray))
                writer.append(record)
                del record
            writer.publish()
        return tracemalloc.get_traced_memory()[1], total
    finally:
        tracemalloc.stop()


def test_a_shard_writer_holds_at_most_one_shard_file_per_array(tmp_path, monkeypatch):
    import test_storage

    monkeypatch.setattr(test_storage, "F", 2048)  # ~0.8 MB of features per record
    monkeypatch.setattr(storage.formats.zarr.write, "ZARR_SHARD_BYTES", 1 << 20)  # 1 MiB Zarr shard files
    peak_small, total_small = _traced_peak_of_streaming(tmp_path / "small", 8)
    peak_large, total_large = _traced_peak_of_streaming(tmp_path / "large", 48)
    assert total_large == 6 * total_small > 80e6
    # Flat in the shard's size: < 1 MiB buffered per array, the record in hand (and its float
    # source), one write's encode buffers. Measured: 17.6 MB for 8 records, 18.7 MB for 48.
    assert peak_large < 1.25 * peak_small + (1 << 20)
    assert peak_large < total_large / 4


def test_a_shard_streamed_record_by_record_equals_one_written_whole(tmp_path):
    records, _ = make_shard_records(0, first_row=0, num=5, codec="bf16")
    for storage_format in ("zarr", "wds"):
        whole = write_shard(tmp_path / "a", shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16")
        with ShardWriter(
            tmp_path / "b", shard_index=0, size=ShardSize.of_records(records), storage_format=storage_format,
            feature_codec="bf16",
        ) as writer:  # fmt: skip
            for record in records:
                writer.append(record)
            streamed = writer.publish()
        assert streamed.checksum == whole.checksum


def test_a_shard_writer_refuses_other_than_planned_and_leaves_nothing(tmp_path):
    records, _ = make_shard_records(0, first_row=0, num=3, codec="bf16")
    size = ShardSize.of_records(records)
    with pytest.raises(ValueError, match=r"shard-00000.zarr: records hold .* planned"):
        with ShardWriter(tmp_path, shard_index=0, size=size, storage_format="zarr", feature_codec="bf16") as writer:
            writer.append(records[0])
            writer.publish()
    with pytest.raises(ValueError, match=r"shard-00000.tar record 3: the shard was planned for 3 records"):
        with ShardWriter(tmp_path, shard_index=0, size=size, storage_format="wds", feature_codec="bf16") as writer:
            for record in [*records, records[0]]:
                writer.append(record)
    assert list((tmp_path / SHARD_DIR).iterdir()) == []  # no temp entry, nothing published


def test_the_builder_writes_a_batch_while_the_next_one_computes(toy_target, toy_corpus, tmp_path, monkeypatch):
    """The first batch's records are not written until the second batch's target pass has started:
    a serial builder would wait here forever (the wait below fails after tests/waits.py's cap instead)."""
    second_batch_started = threading.Event()
    append = ShardWriter.append
    batch_threads = []

    def slow_append(writer, record):
        if not second_batch_started.wait(timeout=HANG_CAP_S):
            raise AssertionError("the first batch was written before the second batch started")
        return append(writer, record)

    def run_shards(plan, pending, *, progress):
        builder = ShardBuilder(plan.config)
        run_batch = builder.run_batch

        def traced_run_batch(sequences, **kwargs):
            batch_threads.append(threading.current_thread().name)
            if len(batch_threads) == 2:
                second_batch_started.set()
            return run_batch(sequences, **kwargs)

        builder.run_batch = traced_run_batch
        for spec in pending:
            yield builder.build(shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner), None

    monkeypatch.setattr(ShardWriter, "append", slow_append)
    config = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(toy_corpus), out=str(tmp_path / "cache"), **SMALL, batch_tokens=128
    )
    manifest = build_cache(config, run_shards=run_shards, progress=False, log=lambda m: None)
    assert len(batch_threads) > manifest.num_shards_planned  # several batches per shard
    assert set(batch_threads) == {threading.main_thread().name}  # the target runs on the caller's thread

    # The streamed cache holds each shard's sequences once, longest first, and its shards equal
    # the same records written whole.
    corpus_lengths = {}
    for shard in manifest.shards:
        path = tmp_path / "cache" / SHARD_DIR / shard.name
        records = list(read_shard_records(path, storage_format="zarr"))
        lengths = [len(r["input_ids"]) for r in records]
        assert lengths == sorted(lengths, reverse=True)
        corpus_lengths.update({int(r["source_row"]): n for r, n in zip(records, lengths)})
        rewritten = write_shard(tmp_path / "whole", shard_index=shard.index, records=records, storage_format="zarr", feature_codec="bf16",
                                compute=manifest.compute)  # fmt: skip
        assert rewritten.checksum == shard.checksum == shard_checksum(path)
    assert len(corpus_lengths) == load_manifest(tmp_path / "cache").num_sequences
