"""`--loader stream`: a WebDataset cache read front to back through webdataset's own pipeline.

In epoch e, on rank r of R, in DataLoader worker w of W (docs/design.md, "A training step"):

    SimpleShardList(the complete shards in a permutation seeded (seed, e))
      -> split_by_node (shards r, r + R, ...) -> split_by_worker (every W-th of those)
      -> samples, only the members of the method's arrays (webdataset's tar_file_expander and
         group_by_keys, the tar opened by storage.formats.wds.open_tar: a local file, or for a cache on
         an object store the worker's local copy, downloaded ahead by storage.local_cache)
      -> shuffle buffer of --shuffle-buffer samples, seeded (seed, e, r, w)
      -> decode, labels (batching.example_from_record) -> micro-batches, a partial last one dropped

The DataLoader takes micro-batches from its workers in turn, passing over a worker once it is done.
Every count in this is known from the manifest's shard sizes, so each rank computes the same plan
without exchanging anything: an epoch has min over ranks of (the rank's micro-batches //
--grad-accum) steps, so every rank runs the same number of steps (DDP needs it); a rank's
micro-batches beyond that are not read. A sequence is seen at most once per epoch, and exactly
once when the shards divide evenly.

The position in the stream is a function of the step, like the map loader's: a resume at step s
rebuilds the epoch's pipeline and leaves out what the first s steps consumed. A worker yields a
`SkippedBatch` for each of its micro-batches consumed before the checkpoint (how many per worker
follows from the turn order), and the shuffle buffer is replayed exactly: webdataset's own
shuffle, run first over sample ids alone, says which shards were wholly consumed; their samples
are replaced by stubs that the real pipeline's buffer shuffles alike without reading the tar. So a
resumed run sees the same batches as an uninterrupted one and reads only the shards the buffer
still draws from.

From an object store each stream downloads its next `--prefetch-shards` tars to the node's disk
while it reads the current one (storage.local_cache.read_ahead), within its share of
`--local-cache-gib`: the node's budget split evenly over its ranks and their streams, so the
node never holds more. A copy is deleted once read (docs/design.md, "Caches on object stores").
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import random
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import islice

import numpy as np
import torch
import webdataset as wds

from pipeline.train.batching import ReadFailure, TrainBatch, collate, example_from_record
from pipeline.train.labels import ObjectiveConfig
from storage.errors import first_line
from storage.format import FP8_SCALE_ARRAYS
from storage.local_cache import CachedObject, LocalCache, read_ahead
from storage.location import is_url
from storage.reader import SWAPPED_HINT, CacheReader
from storage.formats.wds import decode_sample, member_selector, open_tar, stream_samples


@dataclass(frozen=True, kw_only=True)
class StreamShard:
    url: str  # the tar's path, or its URL on a store
    start: int  # global index of its first sequence (manifest order, as CacheReader numbers them)
    sequences: int
    bytes: int  # the tar's size (manifest)
    # The sorted corpus rows the build put in it (CacheReader.expected_source_rows): each sample's key
    # is checked against them as it is read, so a swapped tar stops at its first sample. None: unchecked.
    rows: np.ndarray | None = dataclasses.field(default=None, compare=False)
    # The layout its own record must say (CacheReader.layout, the manifest's): checked before its first sample.
    layout: dict | None = dataclasses.field(default=None, compare=False)


@dataclass(frozen=True, kw_only=True)
class ReadAhead:
    """Local copies of a store cache's tars, downloaded ahead of each stream's reader."""

    root: str  # the node-local directory (--local-cache-dir)
    budget: int  # bytes each stream may hold at once: its share of the node's --local-cache-gib
    shards_ahead: int  # --prefetch-shards


@dataclass(frozen=True, kw_only=True)
class StreamPlan:
    """What every rank and worker stream, from the manifest and the run's settings alone."""

    shards: tuple[StreamShard, ...]
    seed: int
    rank: int
    world_size: int
    num_workers: int  # DataLoader workers; 0 reads in the training process (one stream)
    micro_batch: int  # sequences per micro-batch on one rank
    grad_accum: int
    shuffle_buffer: int
    read_ahead: ReadAhead | None = None  # a cache on an object store with --local-cache-gib > 0
    # The cache's --ira-parents (None: every pool anchor keeps its rollout features) and pool size:
    # what alr_ira may draw as parents (batching.check_ira_parents_serve).
    ira_parents: int | None = None
    anchors_per_sequence: int = 0

    @property
    def num_streams(self) -> int:
        """Streams per rank: webdataset's split_by_worker sees one worker when there are none."""
        return max(1, self.num_workers)

    def epoch_order(self, epoch: int) -> list[StreamShard]:
        generator = torch.Generator().manual_seed(_seed(self.seed, epoch, 2))
        return [self.shards[i] for i in torch.randperm(len(self.shards), generator=generator).tolist()]

    def worker_shards(self, epoch: int, *, rank: int, worker: int) -> list[StreamShard]:
        """The shards split_by_node and split_by_worker give (rank, worker) in `epoch` (both islice)."""
        of_rank = islice(self.epoch_order(epoch), rank, None, self.world_size)
        return list(islice(of_rank, worker, None, self.num_streams))

    def worker_batches(self, epoch: int, *, rank: int) -> list[int]:
        """Micro-batches each worker of `rank` yields in `epoch` (a partial last one is dropped)."""
        return [
            sum(s.sequences for s in self.worker_shards(epoch, rank=rank, worker=w)) // self.micro_batch
            for w in range(self.num_streams)
        ]

    def epoch_steps(self, epoch: int) -> int:
        return min(sum(self.worker_batches(epoch, rank=r)) // self.grad_accum for r in range(self.world_size))

    def shuffle_seed(self, epoch: int, *, worker: int) -> int:
        return _seed(self.seed, epoch, 3, self.rank, worker)


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def turn_order(batch_counts: list[int]) -> list[int]:
    """The worker of each micro-batch in the order a DataLoader yields them: workers in turn, a
    worker passed over once its batches are done (torch's in-order iterable-dataset loader; the
    trainer checks every batch's worker against this)."""
    order = []
    for turn in range(max(batch_counts, default=0)):
        order += [worker for worker, count in enumerate(batch_counts) if turn < count]
    return order


def wholly_consumed_shards(shards: list[StreamShard], *, skip: int, bufsize: int, rng_seed: int) -> set[str]:
    """Shards all of whose samples are among the first `skip` out of the shuffle buffer: webdataset's
    shuffle replayed on (url, position) ids, the same filter with the same seed, so the same picks."""
    if skip == 0:
        return set()
    ids = ((shard.url, local) for shard in shards for local in range(shard.sequences))
    shuffled = wds.shuffle(bufsize, initial=bufsize, rng=random.Random(rng_seed))(ids)
    emitted = Counter(url for url, _ in islice(shuffled, skip))
    return {shard.url for shard in shards if emitted[shard.url] == shard.sequences}


class SkippedBatch:
    """Stands for a micro-batch consumed before the checkpoint a run resumed from."""


def _shard_samples(urls, *, expected: list[StreamShard], stubbed: set[str], select, ahead: ReadAhead | None) -> Iterator[dict]:
    """Samples of this worker's shards, each with its global sequence index; stubs for the shards
    a resume need not read."""
    urls = [item["url"] for item in urls]
    if urls != [shard.url for shard in expected]:
        raise RuntimeError(f"webdataset gave this worker shards {urls}, the plan {[s.url for s in expected]}")
    to_read = [shard for shard in expected if shard.url not in stubbed]
    if ahead is None:
        yield from _read_shards(iter([shard.url for shard in to_read]), expected=expected, stubbed=stubbed, select=select)
        return
    cache = LocalCache(ahead.root, budget=ahead.budget)
    copies = read_ahead(cache, [CachedObject(url=s.url, size=s.bytes) for s in to_read], ahead=ahead.shards_ahead)
    try:
        yield from _read_shards(_downloaded(to_read, copies), expected=expected, stubbed=stubbed, select=select)
    finally:
        copies.close()
        cache.close()


def _downloaded(shards: list[StreamShard], copies) -> Iterator[str]:
    for shard in shards:
        try:
            _, local = next(copies)
        except (OSError, ValueError) as error:
            reason = first_line(error).removeprefix(f"{shard.url}: ")
            raise ValueError(f"{shard.url}: could not copy it to the local cache ({reason})") from None
        yield str(local)


def _read_shards(sources: Iterator[str], *, expected: list[StreamShard], stubbed: set[str], select) -> Iterator[dict]:
    """The samples of `expected` in order, stubs for the stubbed ones; `sources` gives where to open
    each shard read, in order (its URL, or a local copy)."""
    for shard in expected:
        if shard.url in stubbed:
            yield from ({"__stub__": True, "__index__": shard.start + local} for local in range(shard.sequences))
            continue
        source = next(sources)
        count = 0
        try:
            with open_tar(source) as stream:  # webdataset's expander and grouping, our opener (stores)
                for sample in stream_samples(stream, url=shard.url, select=select, layout=shard.layout):
                    _check_key(shard, sample)
                    sample["__index__"] = shard.start + count
                    count += 1
                    yield sample
        except (OSError, EOFError, tarfile.TarError) as error:
            # webdataset appends its stream objects to the error's args: keep the first line only.
            reason = first_line(Exception(error.args[0])) if error.args else type(error).__name__
            raise ValueError(f"{shard.url}: corrupt tar shard ({reason})") from None
        if count != shard.sequences:
            raise ValueError(f"{shard.url}: holds {count} sequences, manifest says {shard.sequences}")


def _check_key(shard: StreamShard, sample: dict) -> None:
    """A sample whose corpus row is not one the build put in this shard: the tar was swapped."""
    if shard.rows is None:
        return
    key = sample.get("__key__", "")
    row = int(key) if key.isdigit() else -1
    at = int(np.searchsorted(shard.rows, row))
    if at == len(shard.rows) or shard.rows[at] != row:
        raise ValueError(
            f"{shard.url}: sample {key!r} is corpus row {row}, not one of the rows the build put in this shard "
            f"({shard.rows[:3].tolist()}...); {SWAPPED_HINT}"
        )


class StreamTrainDataset(torch.utils.data.IterableDataset):
    """This rank's micro-batches of one epoch, as (worker, TrainBatch | SkippedBatch | ReadFailure)."""

    def __init__(self, plan: StreamPlan, *, objective: ObjectiveConfig, feature_codec: str):
        self.plan, self.objective, self.feature_codec = plan, objective, feature_codec
        arrays = set(objective.cache_arrays)
        self.arrays = arrays | {FP8_SCALE_ARRAYS[n] for n in arrays if n in FP8_SCALE_ARRAYS}
        self.epoch, self.skip_batches = 0, [0] * plan.num_streams

    def start_epoch(self, epoch: int, *, skip_batches: list[int]) -> None:
        """Set before iterating: DataLoader workers get a copy of the dataset as it is then."""
        self.epoch, self.skip_batches = epoch, skip_batches

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        skip = self.skip_batches[worker]
        for _ in range(skip):
            yield worker, SkippedBatch()
        try:
            for batch in self._pipeline(worker, skip_samples=skip * self.plan.micro_batch):
                yield worker, batch
        except ValueError as error:  # a shard that does not read: one line for the trainer to stop with
            yield worker, ReadFailure(message=first_line(error))

    def _pipeline(self, worker: int, *, skip_samples: int) -> wds.DataPipeline:
        plan, epoch = self.plan, self.epoch
        mine = plan.worker_shards(epoch, rank=plan.rank, worker=worker)
        rng_seed = plan.shuffle_seed(epoch, worker=worker)
        stubbed = wholly_consumed_shards(mine, skip=skip_samples, bufsize=plan.shuffle_buffer, rng_seed=rng_seed)
        return wds.DataPipeline(
            wds.SimpleShardList([shard.url for shard in plan.epoch_order(epoch)]),
            wds.split_by_node,
            wds.split_by_worker,
            partial(_shard_samples, expected=mine, stubbed=stubbed, select=member_selector(self.arrays), ahead=plan.read_ahead),
            wds.shuffle(plan.shuffle_buffer, initial=plan.shuffle_buffer, rng=random.Random(rng_seed)),
            partial(self._examples, skip_samples=skip_samples),
            wds.batched(plan.micro_batch, collation_fn=collate, partial=False),
        )

    def _examples(self, samples, *, skip_samples: int):
        for position, sample in enumerate(samples):
            if position < skip_samples:
                continue  # consumed before the checkpoint
            if sample.get("__stub__"):
                raise RuntimeError(f"sample {sample['__index__']} was stubbed but is drawn after the resume point")
            yield self._example(sample)

    def _example(self, sample: dict):
        try:
            record = decode_sample(sample, arrays=self.arrays)  # features stay bits: decoded on the device
        except ValueError as error:
            return ReadFailure(message=str(error))
        rollout_features = record.get("rollout_features")  # [P, K-2, F]: the whole member came with the sample
        rollout_scales = record.get("rollout_feature_scales")  # [P, K-2], fp8 only
        # P < A: the cache keeps rollout features for only P of the pool's anchors (--ira-parents P).
        stored = None if rollout_features is None else len(rollout_features)
        ira_parents = stored if stored is not None and stored < len(record["anchor_pos"]) else None

        def parent_rows(rows):
            return rollout_features[rows], (None if rollout_scales is None else rollout_scales[rows])

        return example_from_record(
            record, epoch=self.epoch, index=sample["__index__"], objective=self.objective, seed=self.plan.seed,
            parent_rollout_features=parent_rows, ira_parents=ira_parents,
        )  # fmt: skip


def data_position(step: int, *, epoch_ends: list[int], plan) -> dict:
    """Where the data stands after `step` steps (stored in checkpoints, checked on resume)."""
    epoch = bisect.bisect_right(epoch_ends, step)
    done = step - (epoch_ends[epoch - 1] if epoch else 0)
    if plan is None or done == 0:  # (at an epoch's start no worker has delivered anything yet)
        return {"loader": "map" if plan is None else "stream", "epoch": epoch, "steps_into_epoch": done}
    # Rank 0's: the one every rank computes alike (each checks a resume against what rank 0 stored).
    return {"loader": "stream", **stream_position(plan, epoch=epoch, steps_done=done, rank=0)}


def plan_stream(config, reader: CacheReader, *, rank: int, world_size: int) -> StreamPlan:
    """--loader stream: which shards every rank and worker of a run (its TrainConfig) streams (a Zarr cache is refused)."""
    optim, loader = config.optim, config.loader
    return stream_plan(
        reader, seed=config.seed, rank=rank, world_size=world_size, num_workers=loader.num_workers,
        micro_batch=optim.batch_size // (world_size * optim.grad_accum), grad_accum=optim.grad_accum,
        shuffle_buffer=loader.shuffle_buffer, local_cache_gib=loader.local_cache_gib, local_cache_dir=loader.local_cache_root,
        ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), prefetch_shards=loader.prefetch_shards,
    )  # fmt: skip


def stream_epoch_steps(plan, num_epochs: int) -> list[int]:
    steps = [plan.epoch_steps(epoch) for epoch in range(num_epochs)]
    if min(steps) == 0:
        epoch = steps.index(0)
        raise ValueError(
            f"--loader stream: epoch {epoch} has no full step on some rank ({len(plan.shards)} shards split over "
            f"{plan.world_size} rank(s) x {plan.num_streams} stream(s), micro-batches of {plan.micro_batch}); "
            "use fewer --num-workers, a smaller --batch-size or more, smaller shards"
        )
    return steps


def stream_plan(reader: CacheReader, *, seed: int, rank: int, world_size: int, num_workers: int, micro_batch: int,
                grad_accum: int, shuffle_buffer: int, local_cache_gib: float = 0.0, local_cache_dir: str = "",
                ranks_per_node: int = 1, prefetch_shards: int = 1) -> StreamPlan:  # fmt: skip
    """The plan of a wds cache's complete shards; ValueError (one line) for a Zarr cache, or for a
    local-cache budget whose share per stream cannot hold the largest shard."""
    if reader.storage_format != "wds":
        raise ValueError(f"--loader stream needs a wds cache; {reader.cache_dir} is {reader.storage_format} (use --loader map)")
    starts = np.cumsum([0] + [s.sequences for s in reader.shards])
    shards = tuple(
        StreamShard(
            url=str(reader.shard_path(s)), start=int(start), sequences=s.sequences, bytes=s.bytes,
            rows=reader.expected_source_rows(s), layout=reader.layout,
        )  # fmt: skip
        for s, start in zip(reader.shards, starts)
    )
    plan = StreamPlan(
        shards=shards, seed=seed, rank=rank, world_size=world_size, num_workers=num_workers, micro_batch=micro_batch,
        grad_accum=grad_accum, shuffle_buffer=shuffle_buffer, ira_parents=reader.ira_parents,
        anchors_per_sequence=reader.manifest.settings.anchors_per_sequence,
    )  # fmt: skip
    local_cache_bytes = int(local_cache_gib * 2**30)
    if not is_url(reader.cache_dir) or local_cache_bytes == 0 or not shards:
        return plan
    streams = ranks_per_node * plan.num_streams
    largest = max(shards, key=lambda shard: shard.bytes)
    share = local_cache_bytes // streams
    if share < largest.bytes:
        raise ValueError(
            f"--local-cache-gib {local_cache_gib:g}: each of the node's {streams} streams "
            f"({ranks_per_node} rank(s) x {plan.num_streams}) may hold {share} bytes, less than the largest shard "
            f"({largest.url}, {largest.bytes} bytes); raise it, or 0 to read the tars straight from the store"
        )
    ahead = ReadAhead(root=local_cache_dir, budget=share, shards_ahead=prefetch_shards)
    return dataclasses.replace(plan, read_ahead=ahead)


def stream_position(plan: StreamPlan, *, epoch: int, steps_done: int, rank: int) -> dict:
    """Where `rank` stands after `steps_done` steps of `epoch`: the micro-batches each of its
    workers has delivered (what a resume leaves out)."""
    consumed = turn_order(plan.worker_batches(epoch, rank=rank))[: steps_done * plan.grad_accum]
    worker_batches = [consumed.count(w) for w in range(plan.num_streams)]
    return {"epoch": epoch, "steps_into_epoch": steps_done, "worker_batches": worker_batches}


def stream_batches(
    dataset: StreamTrainDataset, *, epoch_steps: list[int], start_step: int, make_loader: Callable
) -> Iterator[TrainBatch | ReadFailure]:
    """This rank's micro-batches from `start_step` to the end of training, one DataLoader per epoch
    (stopped once the epoch's steps are served), checking each batch's worker against the plan."""
    plan, first_step = dataset.plan, 0
    for epoch, steps in enumerate(epoch_steps):
        if first_step + steps <= start_step:
            first_step += steps
            continue
        done = max(0, start_step - first_step)
        position = stream_position(plan, epoch=epoch, steps_done=done, rank=plan.rank)
        dataset.start_epoch(epoch, skip_batches=position["worker_batches"])
        order = turn_order(plan.worker_batches(epoch, rank=plan.rank))[: steps * plan.grad_accum]
        batches = iter(make_loader(dataset))
        for at, expected_worker in enumerate(order):
            worker, batch = next(batches, (None, None))
            if isinstance(batch, ReadFailure):
                yield batch
                return
            if worker != expected_worker or isinstance(batch, SkippedBatch) != (at < done * plan.grad_accum):
                raise RuntimeError(
                    f"epoch {epoch} micro-batch {at}: worker {worker} gave {type(batch).__name__}, the plan says "
                    f"worker {expected_worker}"
                )
            if at >= done * plan.grad_accum:
                yield batch
        del batches  # stops this epoch's workers
        first_step += steps
