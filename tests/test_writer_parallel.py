"""Stage 1's writer in parallel (docs/design.md, "A cache build"): the bytes of a shard do not depend
on how many threads encode it, small arrays are chunked by the shard's sequences, the device checks
and encodes a batch before one copy to the host, and the build's bar moves per batch. Real Zarr and
tar files, a real tiny Qwen3 on a real local Ray cluster."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import storage.formats.wds
import storage.formats.zarr.write
from pipeline.cache_build import driver
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.rollouts import TargetOutputs
from pipeline.cache_build.shard_builder import outputs_to_record, outputs_to_records
from storage.format import SHARD_DIR
from storage.background_writes import BackgroundWrites
from storage.checksums import shard_checksum
from storage.formats.wds import encode_member
from storage.formats.zarr.rows import ChunkFileEncoder
from storage.shards import ShardSize, read_shard_records, write_shard
from test_storage import make_record, make_shard_records

# The tar of make_shard_records(7, first_row=0, num=6, codec=...) as the serial writer wrote it
# (storage/shards.py at 26e4228), with zstd level 1 (at level 3, before the writer's level changed:
# bf16 sha256:f04744c7..., fp8 sha256:76d1c347...), and the shard's layout record in its first
# sample (storage/layout.py; without it: bf16 sha256:ca68d518..., fp8 sha256:b54f7993...).
WDS_CHECKSUMS = {
    "bf16": "sha256:a4046de2f9030511ca831d4390a0ef18d50b5d359163e3d7785a0c9e41470d52",
    "fp8": "sha256:fef573b96fa60fe5c4bea4eee8a304ff338990dee612415406e123f8add189a8",
}
SMALL = dict(layers=[0, 2], anchors=6, top_k=4, max_length=128, shard_size=5, batch_tokens=128)


def _inline_submit(self, fn, *args, **kwargs) -> Future:
    """BackgroundWrites.submit as the writer was before it went parallel: the work, done at once
    on the caller's thread."""
    future = Future()
    future.set_result(fn(*args, **kwargs))
    return future


def _files(shard: Path) -> dict[str, bytes]:
    if shard.is_file():
        return {"": shard.read_bytes()}
    return {str(p.relative_to(shard)): p.read_bytes() for p in sorted(shard.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["a chunk a file", "sharded"])
def test_shard_bytes_do_not_depend_on_the_writer_threads(tmp_path, monkeypatch, codec, layout):
    records, _ = make_shard_records(7, first_row=0, num=6, codec=codec)
    # 2 KiB Zarr shard files: every array is several files, so several writes are in flight at once.
    monkeypatch.setattr(storage.formats.zarr.write, "ZARR_SHARD_BYTES", 2 << 10)
    monkeypatch.setattr(storage.formats.wds, "SYNC_EVERY_BYTES", 1)  # a tar is synced early after every sample
    if layout == "sharded":  # 2-16 chunks a file, last files partial, chunks past the array's end missing
        monkeypatch.setattr(storage.formats.zarr.write, "ZARR_SHARD_BYTES", 4 << 10)
        monkeypatch.setattr(storage.formats.zarr.write, "ZARR_FLOOR_CHUNK_BYTES", 256)
    for storage_format in ("zarr", "wds"):
        written = {}
        for threads in (1, 3, "inline", "zarr-encodes"):
            out = tmp_path / f"{storage_format}-{threads}"
            with monkeypatch.context() as patch:
                if threads == "inline":
                    patch.setattr(BackgroundWrites, "submit", _inline_submit)
                if threads == "zarr-encodes":  # zarr-python makes the chunk files, as before ChunkFileEncoder
                    patch.setattr(ChunkFileEncoder, "encoder_of", classmethod(lambda cls, meta, num_rows: None))
                shard = write_shard(
                    out, shard_index=0, records=records, storage_format=storage_format, feature_codec=codec,
                    num_threads=threads if isinstance(threads, int) else 1,
                )  # fmt: skip
            written[threads] = (shard.checksum, _files(out / SHARD_DIR / shard.name))
        assert written[1] == written[3] == written["inline"] == written["zarr-encodes"], storage_format
        # A tar's checksum is hashed as it is written: the same as reading the shard back.
        assert written[1][0] == shard_checksum(out / SHARD_DIR / shard.name)
        if storage_format == "zarr":
            assert len(written[1][1]) > 40  # many files: the parallel writes really overlapped
        else:
            assert written[1][0] == WDS_CHECKSUMS[codec]  # today's bytes, to the byte


def test_a_member_encodes_to_the_same_bytes_on_any_thread():
    """numcodecs' Blosc on the main thread used to compress one buffer on internal threads that
    placed its blocks in finishing order: one array, several different frames."""
    array = np.random.default_rng(0).standard_normal(2_000_000).astype(np.float32)  # 8 MB: 31 Blosc blocks
    frames = {encode_member(array, chunk_checksums=True)[1] for _ in range(4)}
    on_thread = []
    thread = threading.Thread(target=lambda: on_thread.append(encode_member(array, chunk_checksums=True)[1]))
    thread.start()
    thread.join()
    assert frames == set(on_thread)


def test_small_arrays_are_chunked_by_the_shards_mean_sequence(tmp_path):
    rng = np.random.default_rng(0)
    records = [make_record(rng, source_row=i, T=int(rng.integers(2000, 3000)), A=40, codec="bf16")[0] for i in range(8)]
    shard = write_shard(tmp_path, shard_index=0, records=records, storage_format="zarr", feature_codec="bf16")
    group = zarr.open_group(tmp_path / SHARD_DIR / shard.name, mode="r")
    mean_tokens = shard.tokens / shard.sequences
    # topk rows are 16 bytes (k = 4): a 256 KiB chunk held 16384 rows, ~6.5 of these sequences.
    assert group["corpus_topk_ids"].chunks[0] == int(np.ceil(mean_tokens / 4))
    assert group["input_ids"].chunks[0] == 1024  # 4 KiB of int32 rows, the floor
    # A quarter of a sequence's 40 anchors is 10 rows of 240 bytes (K = 15 x k = 4 int32): raised to 4 KiB.
    assert group["rollout_topk_ids"].chunks[0] == (4 << 10) // 240 == 17
    assert [r["input_ids"].tolist() for r in read_shard_records(tmp_path / SHARD_DIR / shard.name, storage_format="zarr")] == [
        r["input_ids"].tolist() for r in records
    ]


def _outputs(rng: np.random.Generator, source_row: int) -> TargetOutputs:
    T, A, F, k, K = 12, 3, 8, 4, 5
    floats = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    ints = lambda *shape: torch.from_numpy(rng.integers(0, 50, size=shape).astype(np.int32))  # noqa: E731
    return TargetOutputs(
        source_row=source_row, input_ids=ints(T), loss_mask=torch.ones(T, dtype=torch.uint8), features=floats(T, F),
        corpus_topk_ids=ints(T, k), corpus_topk_probs=floats(T, k).abs(), corpus_tail=floats(T).abs(),
        corpus_next_prob=floats(T).abs(), anchor_pos=ints(A), rollout_tokens=ints(A, K + 1),
        rollout_topk_ids=ints(A, K, k), rollout_topk_probs=floats(A, K, k).abs(), rollout_tail=floats(A, K).abs(),
        rollout_features=floats(A, K - 2, F),
    )  # fmt: skip


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_a_batch_is_encoded_as_each_record_alone_and_refused_if_not_finite(codec):
    rng = np.random.default_rng(0)
    outputs = [_outputs(rng, source_row=i) for i in range(3)]
    batch = outputs_to_records(outputs, feature_codec=codec)
    for one, record in zip(outputs, batch, strict=True):
        alone = outputs_to_record(one, feature_codec=codec)
        assert sorted(alone) == sorted(record)
        assert all(np.array_equal(alone[name], record[name]) and alone[name].dtype == record[name].dtype for name in alone)
    outputs[2].rollout_features[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="features contain NaN or infinite values"):
        outputs_to_records(outputs, feature_codec=codec)


def _spy_on_progress(monkeypatch) -> list[int]:
    """The sequences the driver's bar shows after each batch report."""
    shown = []
    batch = driver.BuildProgress.batch

    def spy(self, shard_index: int, sequences: int, tokens: int) -> None:
        batch(self, shard_index, sequences, tokens)
        shown.append(self.done)

    monkeypatch.setattr(driver.BuildProgress, "batch", spy)
    return shown


@pytest.mark.parametrize("where", ["ray", "here"])
def test_the_bar_moves_per_batch_and_the_summary_says_what_the_build_waits_on(
    ray_address, toy_target, toy_corpus, tmp_path, monkeypatch, where
):  # fmt: skip
    shown, lines = _spy_on_progress(monkeypatch), []
    config = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(toy_corpus), out=str(tmp_path / "cache"), **SMALL, workers=1
    )
    if where == "ray":
        from ray_jobs.build import build_cache

        manifest = build_cache(config, progress=False, log=lines.append)
    else:
        manifest = driver.build_cache(config, run_shards=driver.run_shards_here, progress=False, log=lines.append)
    shard_ends = {5 * i for i in range(manifest.num_shards_planned + 1)} | {manifest.num_sequences}
    # Every batch moved the bar (several per shard), some of them to a count between two shards'.
    assert len(shown) > 2 * manifest.num_shards_planned and set(shown) - shard_ends, shown
    assert shown == sorted(shown) and shown[-1] <= manifest.num_sequences
    summary = lines[-1]
    assert summary.startswith("cache: ") and "; workers: compute " in summary and "% waiting on the writer " in summary.replace(",", ""), summary
    compute, wait = (float(part.split()[-1].rstrip("%")) for part in summary.split("; workers: ")[1].split(", "))
    assert 0 < compute <= 100 and 0 <= wait <= 100 and compute + wait <= 101
