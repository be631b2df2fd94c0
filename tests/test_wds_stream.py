"""`--loader stream` on real caches: webdataset's pipeline with real tars, DataLoader workers and a
2-process gloo group; each sequence once per epoch, the map loader's examples, an exact resume."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter.checkpoint import load_drafter
from pipeline.train.batching import CacheTrainDataset, collate
from pipeline.train.config import TrainConfig
from pipeline.train.loop import train
from pipeline.train.plan import open_run, plan_training
from pipeline.train.setup import setup
from storage.format import SHARD_DIR, TARGET_HEAD_FILE, shard_name
from storage.manifest import ShardRecord, save_manifest
from storage.reader import open_cache
from storage.checksums import shard_bytes, shard_checksum
from storage.formats.wds import WdsShardWriter
from tests.waits import HANG_CAP_S

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_SEQUENCES = 8
SHARD_SIZES = [2, 2, 2, 2]  # 4 shards: one per (rank, worker) under 2 ranks x 2 workers


def _build(target: Path, corpus: Path, out: Path, **flags) -> Path:
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    config = CacheBuildConfig.from_flags(
        target=str(target), corpus=str(corpus), out=str(out), layers=[0, 2], anchors=8, top_k=4, max_length=128,
        **flags,
    )  # fmt: skip
    build_cache(config, run_shards=run_shards_here, progress=False, log=lambda m: None)
    return out


def rewrite_as_wds(source: Path, out: Path, *, shard_sizes: list[int]) -> Path:
    """The records of cache `source`, in its order, as compressed WebDataset shards of
    `shard_sizes` sequences written by WdsShardWriter, with a manifest saying so."""
    reader = open_cache(source)
    manifest, settings = reader.manifest, reader.manifest.settings
    assert sum(shard_sizes) == len(reader)
    (out / SHARD_DIR).mkdir(parents=True)
    shutil.copy(source / TARGET_HEAD_FILE, out / TARGET_HEAD_FILE)
    shards, first = [], 0
    for index, size in enumerate(shard_sizes):
        path = out / SHARD_DIR / shard_name(index, "wds")
        records = [reader.read(i, decode_features=False) for i in range(first, first + size)]
        with WdsShardWriter(path, feature_codec=settings.feature_codec, contents=tuple(settings.contents)) as writer:
            for record in records:
                writer.append(record)
        shards.append(ShardRecord(
            name=path.name, index=index, sequences=size, tokens=sum(len(r["input_ids"]) for r in records),
            anchors=sum(len(r["anchor_pos"]) for r in records), bytes=shard_bytes(path), checksum=shard_checksum(path),
            status="complete",
        ))  # fmt: skip
        first += size
    settings = dataclasses.replace(settings, storage_format="wds", shard_size=max(shard_sizes))
    save_manifest(out, dataclasses.replace(manifest, settings=settings, shards=shards, num_shards_planned=len(shards)))
    return out


@pytest.fixture(scope="module")
def caches(toy_target, tmp_path_factory) -> dict[str, Path]:
    """zarr/{bf16,fp8} built in-process; wds/{bf16,fp8}: their records as compressed tars;
    built-wds: the build's own --format wds."""
    from pipeline.demo.toy import toy_chat_rows

    root = tmp_path_factory.mktemp("stream")
    corpus = root / "chat.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in toy_chat_rows(NUM_SEQUENCES, seed=1, response_words=(30, 60))))
    out = {}
    for codec in ("bf16", "fp8"):
        out[f"zarr-{codec}"] = _build(toy_target, corpus, root / f"zarr-{codec}", feature_codec=codec, shard_size=4)
        assert len(open_cache(out[f"zarr-{codec}"])) == NUM_SEQUENCES
        out[f"wds-{codec}"] = rewrite_as_wds(out[f"zarr-{codec}"], root / f"wds-{codec}", shard_sizes=SHARD_SIZES)
    out["built-wds"] = _build(toy_target, corpus, root / "built-wds", storage_format="wds", shard_size=2)
    return out


def _config(cache: Path, out: Path, **overrides) -> TrainConfig:
    base = dict(cache=str(cache), out=str(out), method="alr_ira", epochs=2, batch_size=2, num_workers=0, progress=False,
                loader="stream", shuffle_buffer=3, save_dtype="float32", log_every=1)  # fmt: skip
    return TrainConfig.from_flags(**{**base, **overrides})


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _set_up(config):
    """The run's plan and the state built from it (pipeline/train/plan.py, setup.py), as the loop holds them."""
    plan = plan_training(config, open_run(config))
    return plan, setup(plan)


def _epochs_seen(plan, s) -> list[list[int]]:
    """The sequence indices of each epoch's steps, in order, from a set-up run's batches."""
    epochs = [[] for _ in plan.epoch_ends]
    for step, batch in enumerate(s.batches):
        epochs[plan.epoch_of(step)] += batch.indices
    return epochs


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_sequence_is_seen_once_per_epoch(caches, tmp_path, num_workers):
    plan, s = _set_up(_config(caches["wds-bf16"], tmp_path / "run", epochs=3, num_workers=num_workers))
    assert list(plan.epoch_ends) == [4, 8, 12]  # 8 sequences, micro-batches of 2, every stream has whole batches
    epochs = _epochs_seen(plan, s)
    assert [sorted(seen) for seen in epochs] == [list(range(NUM_SEQUENCES))] * 3
    assert len({tuple(seen) for seen in epochs}) == 3  # a new shard order and shuffle every epoch


def test_stream_refuses_a_zarr_cache_in_one_line(caches, tmp_path):
    config = _config(caches["zarr-bf16"], tmp_path / "run")
    with pytest.raises(ValueError) as error:
        plan_training(config, open_run(config))
    assert str(error.value).startswith("--loader stream needs a wds cache;") and "\n" not in str(error.value)
    with pytest.raises(ValueError, match="--loader must be map or stream"):
        _config(caches["zarr-bf16"], tmp_path / "run", loader="iterable")


def _assert_stream_equals_map(stream_cache: Path, map_cache: Path, tmp_path: Path, *, method: str) -> None:
    """Each streamed batch equals the batch the map loader builds from `map_cache` for the same
    (epoch, sequence) keys; some IRA secondary saw its parent's rollout features."""
    plan, s = _set_up(_config(stream_cache, tmp_path / "stream", method=method, num_workers=2))
    map_config = _config(map_cache, tmp_path / "map", method=method, loader="map")
    reader = open_cache(map_cache)
    objective = map_config.objective.for_cache(
        num_slots=reader.manifest.settings.num_slots, mask_token_id=reader.manifest.mask_token_id,
        stop_token_ids=reader.manifest.stop_token_ids,
    )  # fmt: skip
    by_map = CacheTrainDataset(reader, objective=objective, seed=map_config.seed)
    seen, private_context = [], 0
    for step, batch in enumerate(s.batches):
        expected = collate([by_map[(plan.epoch_of(step), index)] for index in batch.indices])
        for field in dataclasses.fields(expected):
            got, want = getattr(batch, field.name), getattr(expected, field.name)
            assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, (step, field.name)
        seen += batch.indices
        private_context += int((batch.context_owner >= 0).sum())
    assert sorted(seen) == sorted(list(range(NUM_SEQUENCES)) * 2)
    assert private_context > 0 or method != "alr_ira"


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_stream_batches_equal_the_map_loaders_for_the_same_sequences(caches, tmp_path, codec):
    """The streamed compressed tars give, sequence by sequence, the TrainBatch the map loader builds
    from the Zarr cache holding the same records (anchors, IRA secondaries with their parents'
    rollout features, labels, weights): the loaders differ only in which sequences a step sees."""
    _assert_stream_equals_map(caches[f"wds-{codec}"], caches[f"zarr-{codec}"], tmp_path, method="alr_ira")


def test_the_builds_own_wds_shards_stream_as_the_map_loader_reads_them(caches, tmp_path):
    """Whatever tar members the build writes (uncompressed .npy members before storage/formats/wds.py
    became its writer, compressed after), stream and map loader agree on every batch."""
    _assert_stream_equals_map(caches["built-wds"], caches["built-wds"], tmp_path, method="alr_ira")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_continues_the_stream_exactly(caches, tmp_path, num_workers):
    """Killed after step 3 of epoch 0 (4 steps) and resumed: the losses and final weights of a
    straight run. The shards the shuffle buffer had drained before the kill are not read again:
    zeroed, they let the rest of epoch 0 run unchanged (reading one would stop the run: an empty
    tar holds fewer sequences than the manifest says)."""
    from pipeline.train.streaming import stream_plan, wholly_consumed_shards

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_config(caches["wds-bf16"], straight, num_workers=num_workers))
    cache = tmp_path / "cache"
    shutil.copytree(caches["wds-bf16"], cache)
    train(_config(cache, resumed, num_workers=num_workers, max_steps=3, save_every=3))
    state = torch.load(resumed / "checkpoints" / "step-00000003" / "state.pt", weights_only=True)
    worker_batches = {0: [3], 2: [2, 1]}[num_workers]  # turns w0, w1, w0 (| w1)
    assert state["data_position"] == {"loader": "stream", "epoch": 0, "steps_into_epoch": 3, "worker_batches": worker_batches}

    plan = stream_plan(open_cache(cache), seed=0, rank=0, world_size=1, num_workers=num_workers, micro_batch=2,
                       grad_accum=1, shuffle_buffer=3)  # fmt: skip
    drained = set()
    for worker, done in enumerate(worker_batches):
        shards = plan.worker_shards(0, rank=0, worker=worker)
        drained |= wholly_consumed_shards(shards, skip=2 * done, bufsize=3, rng_seed=plan.shuffle_seed(0, worker=worker))
    # (setup reads the array names from shard 0, so that one stays whatever happens to it)
    zeroed = sorted(drained - {str(cache / SHARD_DIR / shard_name(0, "wds"))})
    assert zeroed and len(drained) < len(SHARD_SIZES), drained
    for url in zeroed:
        Path(url).write_bytes(bytes(Path(url).stat().st_size))
    train(_config(cache, resumed, num_workers=num_workers, max_steps=4, resume=True))  # the rest of epoch 0
    assert _losses(resumed) == _losses(straight)[:4]

    shutil.rmtree(cache)
    shutil.copytree(caches["wds-bf16"], cache)
    train(_config(cache, resumed, num_workers=num_workers, resume=True))  # epoch 1 reads every shard
    assert _losses(resumed) == _losses(straight)
    a, b = (load_drafter(run / "drafter", dtype=torch.float32).state_dict() for run in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_what_changes_a_stream_but_not_what_the_map_loader_ignores(caches, tmp_path):
    run = tmp_path / "run"
    train(_config(caches["wds-bf16"], run, epochs=1, num_workers=0))
    with pytest.raises(ValueError, match="--num-workers was 0, now 2") as error:
        train(_config(caches["wds-bf16"], run, epochs=2, num_workers=2, resume=True))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="--shuffle-buffer was 3, now 5"):
        train(_config(caches["wds-bf16"], run, epochs=2, shuffle_buffer=5, resume=True))
    train(_config(caches["wds-bf16"], run, epochs=2, resume=True))
    assert len(_losses(run)) == 8
    mapped = tmp_path / "map"
    train(_config(caches["zarr-bf16"], mapped, epochs=1, loader="map"))
    train(_config(caches["zarr-bf16"], mapped, epochs=2, loader="map", num_workers=2, shuffle_buffer=7, resume=True))
    assert len(_losses(mapped)) == 8
    with pytest.raises(ValueError, match="--loader was 'map', now 'stream'"):
        train(_config(caches["wds-bf16"], mapped, epochs=3, resume=True))


def test_the_plan_every_rank_computes_alike():
    """Pure planning, no data: the DataLoader's turn order, epochs of uneven shards sized by the
    slowest rank, and a checkpoint's data position that does not depend on the rank computing it."""
    from pipeline.train.streaming import data_position as _data_position
    from pipeline.train.streaming import StreamPlan, StreamShard, stream_position, turn_order, wholly_consumed_shards

    assert turn_order([3, 1, 2]) == [0, 1, 2, 0, 2, 0]
    shards = tuple(StreamShard(url=f"s{i}", start=10 * i, sequences=n, bytes=1000 * n) for i, n in enumerate([6, 6, 2, 4, 2, 6]))
    plans = [StreamPlan(shards=shards, seed=0, rank=r, world_size=2, num_workers=2, micro_batch=2, grad_accum=1,
                        shuffle_buffer=3) for r in range(2)]  # fmt: skip
    for epoch in range(3):
        per_rank = [sum(p.worker_batches(epoch, rank=p.rank)) for p in plans]
        assert plans[0].epoch_steps(epoch) == plans[1].epoch_steps(epoch) == min(per_rank)
        split = [s.url for p in plans for w in range(2) for s in p.worker_shards(epoch, rank=p.rank, worker=w)]
        assert sorted(split) == sorted(s.url for s in shards)  # every shard to exactly one (rank, worker)
    epoch_ends = [plans[0].epoch_steps(0), plans[0].epoch_steps(0) + plans[0].epoch_steps(1)]
    positions = [[_data_position(step, epoch_ends=epoch_ends, plan=p) for step in range(epoch_ends[-1] + 1)] for p in plans]
    assert positions[0] == positions[1]
    # (the ranks' own positions differ inside epoch 0: rank 0's workers give 3 + 3 micro-batches, rank 1's 6 + 1)
    assert stream_position(plans[1], epoch=0, steps_done=4, rank=1) != stream_position(plans[1], epoch=0, steps_done=4, rank=0)
    # 6 samples through a buffer of 3: after 2 are out, no shard of 2+ samples can be drained yet.
    assert wholly_consumed_shards([shards[0]], skip=2, bufsize=3, rng_seed=1) == set()
    assert wholly_consumed_shards([shards[0]], skip=6, bufsize=3, rng_seed=1) == {"s0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROBE = """
import json, os, sys
from pipeline.train import TrainConfig, train
from pipeline.train.plan import open_run, plan_training
from pipeline.train.setup import setup

config = TrainConfig.from_flags(**json.loads(sys.argv[1]))
if len(sys.argv) > 2:  # record each rank's batches first
    plan = plan_training(config, open_run(config))
    seen = [list(batch.indices) for batch in setup(plan).batches]
    with open(os.path.join(sys.argv[2], f"rank{plan.ranks.rank}.json"), "w") as f:
        json.dump({"epoch_ends": list(plan.epoch_ends), "steps": seen}, f)
train(config)
"""


def _torchrun(tmp_path: Path, flags: dict, *probe_args: str) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
            str(probe), json.dumps(flags), *probe_args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=HANG_CAP_S)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_rank_ddp_streams_each_sequence_once_per_epoch(caches, tmp_path, num_workers):
    """torchrun, gloo: the ranks split the shards (webdataset's split_by_node, then split_by_worker),
    run the same number of steps and together see every sequence once per epoch; they train, and a
    run killed after step 1 and resumed (both ranks) gives the same losses."""
    flags = dict(cache=str(caches["wds-bf16"]), out=str(tmp_path / "ddp"), method="alr_ira", epochs=2, batch_size=4,
                 num_workers=num_workers, progress=False, loader="stream", shuffle_buffer=3, log_every=1)  # fmt: skip
    _torchrun(tmp_path, flags, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["epoch_ends"] == ranks[1]["epoch_ends"] == [2, 4]
    for epoch in range(2):
        per_rank = [sorted(i for step in rank["steps"][2 * epoch : 2 * epoch + 2] for i in step) for rank in ranks]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == list(range(NUM_SEQUENCES))
    assert len(_losses(tmp_path / "ddp")) == 4
    if num_workers == 0:
        return
    resumed = {**flags, "out": str(tmp_path / "resumed")}
    _torchrun(tmp_path, {**resumed, "max_steps": 1, "save_every": 1})
    _torchrun(tmp_path, {**resumed, "resume": True})
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "ddp")
