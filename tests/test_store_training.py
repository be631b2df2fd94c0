"""Training against an object store (docs/design.md, "Caches on object stores"): `--loader stream`
from a store through the node-local read-ahead cache (storage/local_cache.py), within its budget,
and a run directory (`--out`) on a store. A real S3 server (moto on 127.0.0.1, tests/s3_fixtures.py),
real tars, real checkpoints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from pipeline.train.config import TrainConfig
from pipeline.train.loop import train
from storage.local_cache import READER_PREFIX, CachedObject, LocalCache, read_ahead, sweep_orphans
from storage.location import resolve
from test_wds_stream import caches  # noqa: F401 (the module's wds caches: 4 shards of 2 sequences)
from tests.waits import wait_for

pytestmark = pytest.mark.usefixtures("one_thread")


def _upload(local: Path, url: str) -> str:
    store = resolve(url)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.put_file(path, path.relative_to(local).as_posix())
    return url


def _losses(run) -> list[float]:
    location = resolve(str(run))
    return [json.loads(line)["loss"] for line in location.read_bytes("metrics.jsonl").decode().splitlines()]


def _stream_config(cache: str, out: str, **overrides) -> TrainConfig:
    base = dict(cache=cache, out=out, method="alr_ira", epochs=2, batch_size=2, num_workers=0, progress=False,
                loader="stream", shuffle_buffer=3, save_dtype="float32", log_every=1)  # fmt: skip
    return TrainConfig.from_flags(**{**base, **overrides})


@pytest.fixture(scope="module")
def store_wds(caches, s3_bucket):  # noqa: F811
    return _upload(caches["wds-bf16"], f"{s3_bucket}/stream/wds-bf16")


# ---------------------------------------------------------------------------------------------
# The read-ahead cache on its own


def _objects(prefix: str, sizes: list[int]) -> list[CachedObject]:
    store = resolve(prefix)
    for i, size in enumerate(sizes):
        store.write_bytes(f"obj-{i}", bytes([i]) * size)
    return [CachedObject(url=f"{prefix}/obj-{i}", size=size) for i, size in enumerate(sizes)]


def _held_bytes(directory: Path) -> int:
    """Bytes of the files under `directory`, each inode once (a copy renamed from its .part name
    while the walk runs would otherwise count twice); files vanishing meanwhile count as gone."""
    sizes = {}
    for path in directory.rglob("*"):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        if path.is_file():
            sizes[stat.st_dev, stat.st_ino] = stat.st_size
    return sum(sizes.values())


def test_read_ahead_downloads_the_next_object_while_one_is_read_and_never_holds_more_than_the_budget(s3_prefix, tmp_path):
    items = _objects(s3_prefix, [3000, 2000, 3000, 1000, 3000])
    cache = LocalCache(tmp_path / "local", budget=6000)
    seen_on_disk = []
    for i, (item, local) in enumerate(read_ahead(cache, items, ahead=1)):
        assert local.read_bytes() == bytes([i]) * item.size and item is items[i]
        if i + 1 < len(items):  # the next one arrives while this one is still being read
            _wait_for_copy(cache, f"obj-{i + 1}")
        seen_on_disk.append(_held_bytes(cache.dir))
    assert max(seen_on_disk) <= 6000 and cache.peak <= 6000
    assert cache.held == 0 and _held_bytes(cache.dir) == 0  # each copy deleted once read
    cache.close()
    assert not cache.dir.exists()


def _wait_for_copy(cache: LocalCache, name: str) -> None:
    wait_for(lambda: any(p.name.endswith(name) for p in cache.dir.iterdir()), what=f"{name} downloaded ahead", poll_s=0.01)


def test_read_ahead_goes_no_further_than_asked_even_with_room(s3_prefix, tmp_path):
    items = _objects(s3_prefix, [100] * 4)
    cache = LocalCache(tmp_path / "local", budget=10_000)
    copies = read_ahead(cache, items, ahead=1)
    next(copies)
    _wait_for_copy(cache, "obj-1")
    time.sleep(0.5)  # room for everything, but one ahead was asked for
    assert not any(p.name.endswith(("obj-2", "obj-3")) for p in cache.dir.iterdir())
    assert [item.url for item, _ in copies] == [items[1].url, items[2].url, items[3].url]


def test_a_budget_of_one_object_still_reads_everything_in_order(s3_prefix, tmp_path):
    items = _objects(s3_prefix, [3000, 3000, 3000])
    cache = LocalCache(tmp_path / "local", budget=3000)
    got = [local.read_bytes()[0] for _, local in read_ahead(cache, items, ahead=2)]
    assert got == [0, 1, 2] and cache.peak == 3000


def test_an_object_larger_than_the_budget_or_of_the_wrong_size_is_refused_in_one_line(s3_prefix, tmp_path):
    (small, big), cache = _objects(s3_prefix, [100, 5000]), LocalCache(tmp_path / "local", budget=1000)
    with pytest.raises(ValueError, match=r"obj-1: 5000 bytes do not fit in the local cache budget of 1000 bytes$"):
        list(read_ahead(cache, [small, big], ahead=1))
    grown = CachedObject(url=small.url, size=99)
    with pytest.raises(ValueError, match=r"obj-0: larger on the store than the manifest's 99 bytes$"):
        list(read_ahead(cache, [grown], ahead=1))
    shrunk = CachedObject(url=small.url, size=101)
    with pytest.raises(ValueError, match=r"obj-0: 100 bytes on the store, the manifest says 101$"):
        list(read_ahead(cache, [shrunk], ahead=1))
    assert cache.held == 0 and list(cache.dir.iterdir()) == []


def test_a_reader_that_stops_early_leaves_nothing_and_a_dead_readers_directory_is_swept(s3_prefix, tmp_path):
    items = _objects(s3_prefix, [1000] * 4)
    cache = LocalCache(tmp_path / "local", budget=3000)
    copies = read_ahead(cache, items, ahead=2)
    next(copies)
    copies.close()  # the DataLoader stopped this worker's epoch
    assert cache.held == 0 and list(cache.dir.iterdir()) == []
    # A process killed before it closed its cache: its directory goes, a live one's and a user's stay.
    dead = tmp_path / "local" / f"{READER_PREFIX}999999999-deadbeef"
    dead.mkdir()
    (dead / "copy").write_bytes(b"x")
    (tmp_path / "local" / "users-file").write_bytes(b"mine")
    assert sweep_orphans(tmp_path / "local") == [dead]
    assert cache.dir.exists() and (tmp_path / "local" / "users-file").exists()


def test_a_download_that_fails_is_raised_in_the_reader(s3_prefix, tmp_path):
    items = _objects(s3_prefix, [100, 100])
    missing = CachedObject(url=f"{s3_prefix}/never-written", size=100)
    cache = LocalCache(tmp_path / "local", budget=1000)
    copies = read_ahead(cache, [items[0], missing], ahead=1)
    next(copies)
    with pytest.raises(OSError, match="never-written"):
        next(copies)
    assert cache.held == 0


# ---------------------------------------------------------------------------------------------
# --loader stream from the store


@pytest.fixture(scope="module")
def local_stream_losses(caches, tmp_path_factory):  # noqa: F811
    runs = tmp_path_factory.mktemp("stream-local")
    return {w: (train(_stream_config(str(caches["wds-bf16"]), str(runs / f"w{w}"), num_workers=w)), _losses(runs / f"w{w}"))[1]
            for w in (0, 2)}  # fmt: skip


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("local_cache_gib", [0.0, 0.01])
def test_streaming_from_the_store_equals_streaming_from_disk(store_wds, local_stream_losses, tmp_path, num_workers, local_cache_gib):
    local_dir = tmp_path / "local-cache"
    config = _stream_config(store_wds, str(tmp_path / "run"), num_workers=num_workers, local_cache_gib=local_cache_gib,
                            local_cache_dir=str(local_dir))  # fmt: skip
    train(config)
    assert _losses(tmp_path / "run") == local_stream_losses[num_workers]
    # Every copy was deleted once read (a worker stopped at an epoch's end leaves its directory,
    # swept by the next reader or at the end of the run).
    assert local_dir.is_dir() == (local_cache_gib > 0)  # 0: each tar read straight from the store
    assert not local_dir.exists() or _held_bytes(local_dir) == 0


def test_a_local_cache_too_small_for_a_shard_is_refused_in_one_line(store_wds, tmp_path):
    config = _stream_config(store_wds, str(tmp_path / "run"), num_workers=2, local_cache_gib=1e-7)
    with pytest.raises(ValueError) as small:
        train(config)
    message = str(small.value)
    assert message.startswith("--local-cache-gib 1e-07: each of the node's 2 streams (1 rank(s) x 2) may hold 53 bytes")
    assert "shard-0000" in message and "\n" not in message


def test_a_stream_from_the_store_resumes_mid_epoch_exactly(store_wds, local_stream_losses, tmp_path):
    flags = dict(num_workers=2, local_cache_gib=0.01, local_cache_dir=str(tmp_path / "local-cache"), save_every=1)
    train(_stream_config(store_wds, str(tmp_path / "run"), max_steps=3, **flags))
    train(_stream_config(store_wds, str(tmp_path / "run"), resume=True, **flags))
    assert _losses(tmp_path / "run") == local_stream_losses[2]


def test_a_shard_object_that_changed_stops_the_stream_in_one_line(caches, s3_bucket, tmp_path):  # noqa: F811
    url = _upload(caches["wds-bf16"], f"{s3_bucket}/stream/changed-shard")
    store, shard = resolve(url), "shards/shard-00002.tar"
    store.write_bytes(shard, store.read_bytes(shard)[:-512])  # truncated after the build listed it
    config = _stream_config(url, str(tmp_path / "run"), local_cache_gib=0.01, local_cache_dir=str(tmp_path / "lc"))
    with pytest.raises(ValueError) as changed:
        train(config)
    message = str(changed.value)
    assert message.startswith(f"{url}/{shard}: could not copy it to the local cache (") and "the manifest says" in message
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------
# A run directory on the store


def _map_config(cache, out, **overrides) -> TrainConfig:
    base = dict(cache=str(cache), out=str(out), method="alr", epochs=2, batch_size=2, num_workers=0, rollout_depth=4,
                progress=False, save_dtype="float32", save_every=2, log_every=1)  # fmt: skip
    return TrainConfig.from_flags(**{**base, **overrides})


def _run_files(run: str) -> dict[str, bytes]:
    """Every file of a run but its tensorboard events (named by host, time and pid) and its
    summary (which holds the run's own path and time)."""
    location = resolve(run)
    skip = ("tensorboard/", "summary.json")
    return {rel: location.read_bytes(rel) for rel, _ in location.files() if not rel.startswith(skip)}


def _metrics(data: bytes) -> list[dict]:
    """metrics.jsonl's records without their throughput (a timing)."""
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in data.decode().splitlines()]


@pytest.fixture(scope="module")
def local_run(caches, tmp_path_factory) -> str:  # noqa: F811
    run = tmp_path_factory.mktemp("run-local") / "run"
    train(_map_config(caches["zarr-bf16"], run))
    return str(run)


def _checkpoint_files(files: dict[str, bytes]) -> dict[str, dict]:
    """state.pt files loaded: torch.save's bytes carry nothing run-specific, but compare values."""
    import io

    return {rel: torch.load(io.BytesIO(data), weights_only=True) for rel, data in files.items() if rel.endswith("state.pt")}


def test_a_run_on_the_store_writes_what_a_local_run_writes(caches, local_run, s3_prefix):  # noqa: F811
    run = f"{s3_prefix}/run"
    summary = train(_map_config(caches["zarr-bf16"], run))
    stored, local = _run_files(run), _run_files(local_run)
    assert sorted(stored) == sorted(local)
    assert "checkpoints/step-00000008/state.pt" in stored and stored["checkpoints/latest"] == b"step-00000008"
    for rel in ("drafter/model.safetensors", "drafter/config.json"):
        assert stored[rel] == local[rel], rel
    stored_settings, local_settings = (json.loads(files["train_config.json"]) for files in (stored, local))
    assert stored_settings.pop("out") == run and {**stored_settings, "out": local_run} == local_settings
    assert _metrics(stored["metrics.jsonl"]) == _metrics(local["metrics.jsonl"])
    states, local_states = _checkpoint_files(stored), _checkpoint_files(local)
    for rel, state in states.items():
        for name, tensor in state["model"].items():
            assert torch.equal(tensor, local_states[rel]["model"][name]), (rel, name)
    assert any(rel.startswith("tensorboard/") for rel, _ in resolve(run).files()) == any(
        rel.startswith("tensorboard/") for rel, _ in resolve(local_run).files()
    )
    assert json.loads(resolve(run).read_bytes("summary.json"))["run"] == run == summary["run"]


def test_a_store_run_resumes_past_a_corrupt_newest_checkpoint_to_the_uninterrupted_result(caches, local_run, s3_prefix):  # noqa: F811
    run = f"{s3_prefix}/run"
    train(_map_config(caches["zarr-bf16"], run, save_every=1, max_steps=3))
    store = resolve(run)
    assert len(_losses(run)) == 3 and store.read_bytes("checkpoints/latest") == b"step-00000003"
    store.write_bytes("checkpoints/step-00000003/state.pt", b"not a checkpoint")  # a bad object on the store
    logged = []
    from pipeline.train import checkpoints

    state = checkpoints.load_latest_checkpoint(store, log=logged.append)
    assert state["step"] == 2 and logged[0].startswith(f"{run}/checkpoints/step-00000003/state.pt: unreadable checkpoint")
    train(_map_config(caches["zarr-bf16"], run, save_every=1, resume=True))
    assert _losses(run) == _losses(local_run)  # step 3's metrics line was dropped with its checkpoint, then redone
    assert store.read_bytes("drafter/model.safetensors") == resolve(local_run).read_bytes("drafter/model.safetensors")


def test_alrira_train_runs_from_a_store_cache_into_a_store_run(caches, store_wds, s3_prefix):  # noqa: F811
    from click.testing import CliRunner

    from pipeline.cli import train_cli

    run = f"{s3_prefix}/cli-run"
    args = ["--cache", store_wds, "--out", run, "--loader", "stream", "--method", "alr", "--epochs", "1", "--batch-size", "2",
            "--num-workers", "0", "--no-progress", "--local-cache-gib", "0.01"]  # fmt: skip
    result = CliRunner().invoke(train_cli, args)
    assert result.exit_code == 0, result.output
    assert f"drafter    {run}/drafter" in result.output
    assert resolve(run).is_file("summary.json") and resolve(run).is_file("drafter/model.safetensors")


def test_two_ranks_stream_from_the_store_into_a_store_run_as_from_disk(caches, store_wds, s3_prefix, tmp_path):  # noqa: F811
    """torchrun, gloo, one DataLoader worker per rank: the node's budget is split over both ranks'
    streams, only rank 0 writes the run, and the losses are those of the same run on local disks."""
    from test_wds_stream import _torchrun

    flags = dict(method="alr_ira", epochs=2, batch_size=4, num_workers=1, progress=False, loader="stream", shuffle_buffer=3,
                 save_every=1, log_every=1, local_cache_gib=0.01, local_cache_dir=str(tmp_path / "local-cache"))  # fmt: skip
    _torchrun(tmp_path, {**flags, "cache": str(caches["wds-bf16"]), "out": str(tmp_path / "local-run")})
    run = f"{s3_prefix}/ddp-run"
    _torchrun(tmp_path, {**flags, "cache": store_wds, "out": run})
    assert _losses(run) == _losses(tmp_path / "local-run") and len(_losses(run)) == 4
    assert resolve(run).read_bytes("checkpoints/latest") == b"step-00000004"
    assert (tmp_path / "local-cache").is_dir() and _held_bytes(tmp_path / "local-cache") == 0


def test_metrics_hold_this_runs_steps_once_on_a_rerun_and_after_a_crash_past_the_checkpoint(caches, local_run, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    train(_map_config(caches["zarr-bf16"], run, max_steps=3))
    train(_map_config(caches["zarr-bf16"], run, save_every=1, max_steps=3, overwrite=True))  # a new run into the same --out
    assert [r["step"] for r in _metrics((run / "metrics.jsonl").read_bytes())] == [1, 2, 3]
    with open(run / "metrics.jsonl", "a") as f:  # steps logged after the last checkpoint, then a torn line
        f.write(json.dumps({"step": 4, "loss": 0.0}) + "\n" + '{"step": 5, "lo')
    train(_map_config(caches["zarr-bf16"], run, resume=True))
    assert _losses(run) == _losses(local_run)
