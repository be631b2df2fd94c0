"""Caches on an object store (docs/design.md, "Caches on object stores"): the same shards, the
same guarantees as on a local disk, against a real S3 server (moto on 127.0.0.1, tests/s3_fixtures.py)
with real Zarr and tar objects.

The cache-level tests (a build, resume, verify, training, the CLI) need storage/manifest.py,
pipeline/cache_build/shard_builder.py and ray_jobs/cli.py to reach the cache through storage.location;
until those files take store URLs they are skipped, saying so.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

import storage.manifest
from storage.format import SHARD_DIR
from storage.location import read_safetensors_header, resolve
from storage.ownership import CacheOwnershipLost, check_out_dir, check_owner, claim_cache, foreign_files, remove_cache_files
from storage.reader import CacheReader
from storage.checksums import shard_checksum
from storage.errors import CorruptShardError
from storage.formats.wds import WdsShard
from storage.shards import ShardSize, ShardWriter, read_shard_records, write_shard
from storage.verify import size_problems
from test_storage import assert_record_equal, make_manifest, make_settings, make_shard_records

FORMATS = ("zarr", "wds")
SMALL = dict(layers=[0, 2], anchors=6, top_k=4, max_length=128, shard_size=4, num_slots=5)  # build settings


def _flip_byte(location_url: str, relative: str, offset: int) -> None:
    """Invert one byte of a stored object (what bit rot or a bad copy does)."""
    location = resolve(location_url)
    data = bytearray(location.read_bytes(relative))
    data[offset] ^= 0xFF
    location.write_bytes(relative, bytes(data))


def _corrupt_features(shard_url: str, storage_format: str) -> None:
    """Flip a byte inside the first `features` chunk (Zarr) or member (tar) of a shard."""
    if storage_format == "zarr":
        chunk = next(rel for rel, _ in resolve(shard_url).files() if rel.startswith("features/c/"))
        _flip_byte(shard_url, chunk, 10)  # a Zarr shard file starts with its first chunk
    else:
        offset, size, _ = WdsShard(shard_url).samples[0][1]["features"]
        _flip_byte(shard_url, "", offset + size // 2)


# ---------------------------------------------------------------------------------------------
# Shards on the store


@pytest.mark.parametrize("storage_format", FORMATS)
def test_a_shard_on_the_store_is_the_shard_on_disk(tmp_path, s3_prefix, storage_format):
    records, _ = make_shard_records(0, first_row=0, num=4, codec="bf16")
    local = write_shard(tmp_path, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16")
    stored = write_shard(s3_prefix, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16")
    assert stored.object_tags.startswith("sha256:") and local.object_tags is None  # (what a store resume checks)
    assert dataclasses.replace(stored, object_tags=None) == local  # name, counts, bytes and checksum
    url = f"{s3_prefix}/{SHARD_DIR}/{local.name}"
    assert resolve(url).files() == resolve(tmp_path / SHARD_DIR / local.name).files()  # same objects as files
    assert shard_checksum(url) == local.checksum
    for got, want in zip(read_shard_records(url, storage_format=storage_format), records, strict=True):
        assert_record_equal(got, want)


@pytest.mark.parametrize("storage_format", FORMATS)
def test_a_store_writer_clears_an_interrupted_write_and_an_aborted_one_leaves_nothing(tmp_path, s3_prefix, storage_format):
    records, _ = make_shard_records(1, first_row=0, num=3, codec="bf16")
    store = resolve(s3_prefix)
    name = "shard-00000.zarr" if storage_format == "zarr" else "shard-00000.tar"
    # What a killed writer leaves under the shard's prefix, and user objects beside it.
    store.write_bytes(f"{SHARD_DIR}/{name}" + ("/features/c/7" if storage_format == "zarr" else ""), b"half a shard")
    store.write_bytes(f"{SHARD_DIR}/{name}-notes.txt", b"mine")
    store.write_bytes(f"{SHARD_DIR}/notes.txt", b"mine")
    local = write_shard(tmp_path, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16")
    stored = write_shard(s3_prefix, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16")
    assert stored.checksum == local.checksum  # the leftover object is gone
    assert store.read_bytes(f"{SHARD_DIR}/{name}-notes.txt") == store.read_bytes(f"{SHARD_DIR}/notes.txt") == b"mine"

    size = ShardSize.of_records(records)
    with pytest.raises(ValueError, match=r"records hold .* planned"):
        with ShardWriter(s3_prefix, shard_index=1, size=size, storage_format=storage_format, feature_codec="bf16") as writer:
            writer.append(records[0])
            writer.publish()
    assert [n for n in store.names(SHARD_DIR) if n.startswith("shard-00001")] == []


@pytest.mark.parametrize("storage_format", FORMATS)
def test_a_writer_whose_build_lost_the_prefix_stops_and_leaves_the_claimants_shard(s3_prefix, storage_format):
    """The claim is one object, read before a shard starts and before each object a writer adds:
    a writer of a superseded build stops without touching the shard the claimant wrote."""
    records, _ = make_shard_records(2, first_row=0, num=3, codec="bf16")
    size = ShardSize.of_records(records)
    old_owner = claim_cache(resolve(s3_prefix))
    stale = ShardWriter(s3_prefix, shard_index=0, size=size, storage_format=storage_format, feature_codec="bf16", owner=old_owner)
    for record in records:
        stale.append(record)
    new_owner = claim_cache(resolve(s3_prefix))  # a second build on the same prefix
    with pytest.raises(CacheOwnershipLost, match=s3_prefix):
        check_owner(resolve(s3_prefix), old_owner)
    with pytest.raises(CacheOwnershipLost):
        ShardWriter(s3_prefix, shard_index=1, size=size, storage_format=storage_format, feature_codec="bf16", owner=old_owner)
    claimant = write_shard(
        s3_prefix, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16", owner=new_owner
    )
    with pytest.raises(CacheOwnershipLost) as lost:
        with stale:
            stale.publish()
    assert "\n" not in str(lost.value)
    assert shard_checksum(f"{s3_prefix}/{SHARD_DIR}/{claimant.name}") == claimant.checksum


def test_out_prefix_rules_and_cleanup_keep_user_objects(s3_prefix):
    store = resolve(s3_prefix)
    check_out_dir(s3_prefix)  # nothing there yet: fine
    store.write_bytes("mine.txt", b"user data")
    with pytest.raises(ValueError, match=rf"^--out {s3_prefix}: not empty and not a cache"):
        check_out_dir(s3_prefix)
    with pytest.raises(ValueError, match=r"exists and is not a prefix \(it is an object\)"):
        check_out_dir(f"{s3_prefix}/mine.txt")

    claim_cache(resolve(s3_prefix))
    check_out_dir(s3_prefix)  # a cache (its claim is there): fine
    records, _ = make_shard_records(3, first_row=0, num=2, codec="bf16")
    write_shard(s3_prefix, shard_index=0, records=records, storage_format="zarr", feature_codec="bf16")
    for name in ("manifest.json", "target_head.safetensors", "corpus/input_ids.npy", "corpus/mine.txt", "shards/mine.txt"):
        store.write_bytes(name, b"x")
    assert foreign_files(resolve(f"{s3_prefix}/corpus"), ["input_ids.npy"]) == ["mine.txt"]
    removed = remove_cache_files(resolve(s3_prefix), corpus_files=["input_ids.npy"], claim=True)
    own = {".build-owner", "manifest.json", "target_head.safetensors", "corpus/input_ids.npy", "shards/shard-00000.zarr"}
    assert set(removed) == own
    assert [rel for rel, _ in store.files()] == ["corpus/mine.txt", "mine.txt", "shards/mine.txt"]


def test_a_bad_out_is_refused_in_one_line_before_anything_is_written(toy_target, toy_corpus, s3_bucket, monkeypatch):
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    resolve(s3_bucket).write_bytes("user/notes.txt", b"mine")
    cases = {
        "s3://no-such-bucket/cache": "--out s3://no-such-bucket/cache: cannot write there (The specified bucket does not exist)",
        f"{s3_bucket}/user": (
            f"--out {s3_bucket}/user: not empty and not a cache (no manifest.json or .build-owner); use an empty or new prefix"
        ),
        f"{s3_bucket}/user/notes.txt": f"--out {s3_bucket}/user/notes.txt: exists and is not a prefix (it is an object)",
        "nosuchproto://bucket/cache": (
            "nosuchproto://bucket/cache: not a storage location fsspec can open (Protocol not known: nosuchproto)"
        ),
    }
    for out, message in cases.items():
        config = CacheBuildConfig.from_flags(target=str(toy_target), corpus=str(toy_corpus), out=out, **SMALL)
        with pytest.raises(ValueError) as refused:
            build_cache(config, run_shards=run_shards_here, progress=False, log=lambda line: None)
        assert str(refused.value) == message
    assert [rel for rel, _ in resolve(f"{s3_bucket}/user").files()] == ["notes.txt"]

    # An endpoint that does not answer: the client's error, in one line naming the object.
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(OSError) as unreachable:
            check_out_dir(f"{s3_bucket}/cache")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert unreachable.value.filename == f"{s3_bucket}/cache" and "EndpointConnectionError" in unreachable.value.strerror


# ---------------------------------------------------------------------------------------------
# Reading a cache from the store (the trainer's reader)


def _store_cache(prefix: str, storage_format: str):
    """Two shards written to the store and the manifest that lists them (held in memory)."""
    shards, records = [], []
    for index, num in enumerate((3, 2)):
        shard_records, _ = make_shard_records(10 + index, first_row=100 * index, num=num, codec="bf16")
        shards.append(write_shard(prefix, shard_index=index, records=shard_records, storage_format=storage_format, feature_codec="bf16"))
        records += shard_records
    manifest = make_manifest(make_settings(storage_format=storage_format), shards)
    return manifest, records


class _EncodedRecords(torch.utils.data.Dataset):
    """The reader's records as a DataLoader reads them in its workers."""

    def __init__(self, reader: CacheReader):
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> dict:
        return self.reader.read(index, decode_features=False)


def _first(batch: list) -> dict:
    return batch[0]


@pytest.mark.parametrize("storage_format", FORMATS)
def test_the_reader_reads_the_store_in_workers_and_names_a_flipped_byte(s3_prefix, storage_format):
    manifest, records = _store_cache(s3_prefix, storage_format)
    reader = CacheReader(s3_prefix, manifest)
    assert reader.shard_path(manifest.shards[0]) == f"{s3_prefix}/{SHARD_DIR}/{manifest.shards[0].name}"
    reader.read(0)  # this process's store client is in use when the workers fork: each opens its own
    loader = torch.utils.data.DataLoader(_EncodedRecords(reader), batch_size=1, num_workers=2, collate_fn=_first)
    got = list(loader)
    assert len(got) == len(records)
    for record, want in zip(got, records):
        assert_record_equal(record, want)

    shard_url = reader.shard_path(manifest.shards[1])
    _corrupt_features(shard_url, storage_format)
    assert size_problems(s3_prefix, manifest) == []  # same size: only a read (or verify) sees a flip
    assert shard_checksum(shard_url) != manifest.shards[1].checksum
    fresh = CacheReader(s3_prefix, manifest)
    with pytest.raises(CorruptShardError) as corrupt:
        fresh.read(3)  # the first sequence of shard 1
    message = str(corrupt.value)
    assert message.startswith(f"{shard_url}: array features") and "\n" not in message, message


def test_a_listed_shard_missing_from_the_store_is_refused_when_opened(s3_prefix):
    manifest, _ = _store_cache(s3_prefix, "zarr")
    resolve(s3_prefix).remove(f"{SHARD_DIR}/{manifest.shards[1].name}")
    with pytest.raises(ValueError, match=r"shard-00001.zarr: shard shard-00001.zarr listed as complete is missing"):
        CacheReader(s3_prefix, manifest)
    assert size_problems(s3_prefix, manifest) == [
        f"shard-00001.zarr: listed in manifest as complete but missing on disk ({s3_prefix}/shards/shard-00001.zarr)"
    ]


# ---------------------------------------------------------------------------------------------
# Whole caches: build, resume, verify, train


def _pipeline_reaches_stores() -> bool:
    """Whether storage/manifest.py, pipeline/cache_build/shard_builder.py and ray_jobs/cli.py go through
    storage.location; before that they make local paths of every --out and
    --cache."""
    import pipeline.cache_build.shard_builder
    import ray_jobs.cli

    modules = (storage.manifest, pipeline.cache_build.shard_builder)
    return all(hasattr(module, "resolve") for module in modules) and hasattr(ray_jobs.cli, "is_url")


needs_store_pipeline = pytest.mark.skipif(
    not _pipeline_reaches_stores(),
    reason="storage/manifest.py, pipeline/cache_build/shard_builder.py, ray_jobs/cli.py do not take store URLs yet (issue 14)",
)


def _build_here(target, corpus, out, *, run_shards=None, log=lambda line: None):
    """The driver with shards computed in this process (pipeline.cache_build.driver.run_shards_here)."""
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    config = CacheBuildConfig.from_flags(target=str(target), corpus=str(corpus), out=str(out), **SMALL)
    return build_cache(config, run_shards=run_shards or run_shards_here, progress=False, log=log)


def _shards(manifest) -> list[tuple[str, int, str]]:
    return [(s.name, s.bytes, s.checksum) for s in manifest.shards]


@pytest.fixture(scope="module")
def local_cache(toy_target, toy_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "cache"
    return out, _build_here(toy_target, toy_corpus, out)


@pytest.fixture(scope="module")
def store_cache(toy_target, toy_corpus, s3_bucket):
    out = f"{s3_bucket}/built/cache"
    return out, _build_here(toy_target, toy_corpus, out)


@needs_store_pipeline
def test_a_cache_built_on_the_store_equals_one_built_on_disk(local_cache, store_cache):
    from ray_jobs.cli import cache_cli
    from storage.verify import verify_cache

    (local, local_manifest), (url, manifest) = local_cache, store_cache
    assert manifest.is_complete and _shards(manifest) == _shards(local_manifest)
    store = resolve(url)
    # The same head (safetensors writes its metadata keys in no fixed order: compare them parsed).
    local_head, stored_head = (local / "target_head.safetensors").read_bytes(), store.read_bytes("target_head.safetensors")
    header_end = 8 + int.from_bytes(local_head[:8], "little")
    assert read_safetensors_header(store, "target_head.safetensors") == json.loads(local_head[8:header_end])
    assert stored_head[header_end:] == local_head[header_end:]
    # The same manifest, but for the store's object tags (what a resume on the store checks) and
    # the target's seconds per part (timings, docs/design.md "A cache build").
    stored_manifest, local_manifest_json = json.loads(store.read_bytes("manifest.json")), json.loads((local / "manifest.json").read_text())
    assert all(shard.pop("object_tags").startswith("sha256:") for shard in stored_manifest["shards"])
    for shard in (*stored_manifest["shards"], *local_manifest_json["shards"]):
        assert set(shard.pop("build_seconds")) == {"corpus", "rollouts"}
    assert stored_manifest == local_manifest_json
    assert [rel for rel, _ in store.files("corpus")] == sorted(p.name for p in (local / "corpus").iterdir())
    assert verify_cache(url) == []
    for command in ("info", "verify"):
        result = CliRunner().invoke(cache_cli, [command, url])
        assert result.exit_code == 0, result.output


@needs_store_pipeline
def test_an_interrupted_store_build_resumes_to_the_same_cache(toy_target, toy_corpus, local_cache, s3_prefix, monkeypatch):
    """The build stops after its first shard with half of the second on the store (a killed
    writer's objects); the same command removes them, keeps the first, builds the rest."""
    from pipeline.cache_build.shard_builder import ShardBuilder

    def run_one_shard_then_die(plan, pending, *, progress):
        builder = ShardBuilder(plan.config)
        spec = pending[0]
        yield builder.build(shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner), None
        plan.out.write_bytes(f"{SHARD_DIR}/shard-00001.zarr/features/c/0", b"half a shard")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        _build_here(toy_target, toy_corpus, s3_prefix, run_shards=run_one_shard_then_die)
    import storage.checksums

    logs = []
    with monkeypatch.context() as patch:  # the kept shard is checked by one listing, not downloaded
        patch.setattr(storage.checksums, "shard_checksum", _no_download)
        resumed = _build_here(toy_target, toy_corpus, s3_prefix, log=logs.append)
    assert any(line.startswith("removed 1 partial shard(s)") for line in logs), logs
    assert any(line.startswith("resuming: 1 of") for line in logs), logs
    assert _shards(resumed) == _shards(local_cache[1])


def _no_download(path):
    raise AssertionError(f"{path}: downloaded to check its checksum")


@needs_store_pipeline
def test_a_store_resume_rebuilds_a_shard_whose_objects_changed_since_it_was_listed(toy_target, toy_corpus, local_cache, s3_prefix):
    """Another writer's object under a listed shard (same size, other bytes) gets another ETag:
    the resume's listing sees it, and the shard is rebuilt to the clean build's checksum."""
    built = _build_here(toy_target, toy_corpus, s3_prefix)
    store, shard = resolve(s3_prefix), built.shards[0].name
    relative = next(rel for rel, size in store.files(f"{SHARD_DIR}/{shard}") if size > 64)
    data = bytearray(store.read_bytes(f"{SHARD_DIR}/{shard}/{relative}"))
    data[-1] ^= 0xFF
    store.write_bytes(f"{SHARD_DIR}/{shard}/{relative}", bytes(data))
    logs = []
    resumed = _build_here(toy_target, toy_corpus, s3_prefix, log=logs.append)
    assert f"{shard}: missing or checksum mismatch, rebuilding" in logs, logs
    assert _shards(resumed) == _shards(local_cache[1])


@needs_store_pipeline
def test_a_second_build_on_the_prefix_stops_the_first(toy_target, toy_corpus, local_cache, s3_prefix):
    from pipeline.cache_build.shard_builder import ShardBuilder

    def run_shards_then_claimed(plan, pending, *, progress):
        builder = ShardBuilder(plan.config)
        for i, spec in enumerate(pending):
            if i == 1:
                claim_cache(plan.out)  # another build claims the prefix
            yield builder.build(shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner), None

    with pytest.raises(CacheOwnershipLost) as lost:
        _build_here(toy_target, toy_corpus, s3_prefix, run_shards=run_shards_then_claimed)
    assert str(lost.value).startswith(f"{s3_prefix}: another cache build has claimed") and "\n" not in str(lost.value)
    assert len(storage.manifest.load_manifest(s3_prefix).shards) == 1
    assert _shards(_build_here(toy_target, toy_corpus, s3_prefix)) == _shards(local_cache[1])


def _train(cache, run, *, num_workers: int) -> list[float]:
    from pipeline.train import TrainConfig, train

    train(TrainConfig.from_flags(
        cache=str(cache), out=str(run), method="alr", epochs=1, batch_size=2, num_workers=num_workers, rollout_depth=4,
        max_steps=3, progress=False, save_dtype="float32", log_every=1,
    ))  # fmt: skip
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_losses(local_cache, tmp_path_factory):
    return _train(local_cache[0], tmp_path_factory.mktemp("run-local"), num_workers=0)


@needs_store_pipeline
@pytest.mark.parametrize("num_workers", [0, 2])
def test_training_from_the_store_equals_training_from_disk(store_cache, local_losses, tmp_path, num_workers):
    losses = _train(store_cache[0], tmp_path / "run", num_workers=num_workers)
    assert len(losses) == 3 and losses == local_losses


@needs_store_pipeline
def test_a_flipped_byte_on_the_store_is_caught_by_verify_and_by_training(store_cache, s3_prefix, tmp_path):
    from storage.verify import verify_cache

    url, manifest = store_cache
    store = resolve(url)
    copy = resolve(s3_prefix)
    for relative, _ in store.files():
        copy.write_bytes(relative, store.read_bytes(relative))
    shard = manifest.shards[0].name
    _corrupt_features(f"{s3_prefix}/{SHARD_DIR}/{shard}", "zarr")
    problems = verify_cache(s3_prefix)
    assert any(p.startswith(f"{shard}: checksum mismatch") for p in problems), problems
    with pytest.raises(ValueError) as corrupt:
        _train(s3_prefix, tmp_path / "run", num_workers=0)
    message = str(corrupt.value)
    assert message.startswith(f"{s3_prefix}/{SHARD_DIR}/{shard}: array features: corrupt chunk") and "\n" not in message
