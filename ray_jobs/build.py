"""The Ray side of `alrira-cache build`: a pool of target actors, each loading the target once
and writing whole shards itself. Only `ShardSpec`s go out and `ShardRecord` metadata comes back
(docs/design.md, "What crosses a process boundary"); the planning, resume and manifest are
`pipeline.build.driver`'s.

Ownership: each build claims the directory (storage.ownership.claim_cache) before it touches it,
and its actors publish a shard only while that claim holds. An actor that outlives its killed
driver (Ray reaps orphans asynchronously) or a second build started on the same directory
therefore cannot overwrite the shards of the build that claimed it last; temp directories such
writers leave behind are removed when the build starts and again when it ends.
"""

from __future__ import annotations

import ray
from tqdm.auto import tqdm

from pipeline.build import driver
from pipeline.build.config import CacheBuildConfig
from pipeline.build.driver import ShardSpec
from pipeline.build.shard_builder import ShardBuilder
from storage.format import shard_name
from storage.manifest import Manifest, ShardRecord
from storage.ownership import CacheOwnershipLost

MAX_SHARD_ATTEMPTS = 3  # a shard whose worker died this many times stops the build


@ray.remote
class CacheWorker:
    """A Ray actor around ShardBuilder: loads the target once, builds shards on request."""

    def __init__(self, config: CacheBuildConfig):
        self.builder = ShardBuilder(config)

    def build(self, spec: ShardSpec) -> ShardRecord:
        return self.builder.build(shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner)

    def pid(self) -> int:
        return self.builder.pid()


def build_cache(config: CacheBuildConfig, *, progress: bool = True, log=print) -> Manifest:
    """Build or resume the cache described by `config` on a Ray cluster; returns the final manifest."""
    return driver.build_cache(config, run_shards=run_shards_on_ray, progress=progress, log=log)


def run_shards_on_ray(config: CacheBuildConfig, pending: list[ShardSpec], publish, *, progress: bool = True) -> None:
    """Keep every actor busy with one shard; publish each finished shard in the manifest at once."""
    compute = config.compute
    if not ray.is_initialized():
        ray.init(address=compute.ray_address, logging_level="WARNING", include_dashboard=False)
    options = dict(num_cpus=compute.cpus_per_worker, num_gpus=compute.gpus_per_worker)

    def new_worker():
        return CacheWorker.options(**options).remote(config)

    workers = [new_worker() for _ in range(min(compute.workers, len(pending)))]
    queue = list(pending)
    attempts = {s.index: 0 for s in pending}
    running = {}  # future -> (worker index, spec)
    bar = tqdm(
        total=sum(s.stop - s.start for s in pending), unit="seq", desc="cache build", disable=not progress, dynamic_ncols=True
    )
    tokens = 0

    def submit(worker_index: int):
        spec = queue.pop(0)
        attempts[spec.index] += 1
        running[workers[worker_index].build.remote(spec)] = (worker_index, spec)

    try:
        for i in range(len(workers)):
            if queue:
                submit(i)
        while running:
            [future], _ = ray.wait(list(running), num_returns=1)
            worker_index, spec = running.pop(future)
            try:
                record = ray.get(future)
            except CacheOwnershipLost:
                # Ray re-raises the actor's error with its traceback; one line is what the user needs.
                raise CacheOwnershipLost(
                    f"{config.out}: another cache build claimed this directory while this one was running; stopped"
                ) from None
            except ray.exceptions.RayActorError:
                # The worker died (OOM, preemption, kill): nothing of its shard was published.
                if attempts[spec.index] >= MAX_SHARD_ATTEMPTS:
                    raise RuntimeError(f"{shard_name(spec.index, config.storage.storage_format)}: worker died {MAX_SHARD_ATTEMPTS} times")
                workers[worker_index] = new_worker()
                queue.insert(0, spec)
                submit(worker_index)
                continue
            publish(spec, record)
            tokens += record.tokens
            bar.update(record.sequences)
            bar.set_postfix(tokens=tokens, shards=f"{len(pending) - len(queue) - len(running)}/{len(pending)}")
            if queue:
                submit(worker_index)
    finally:
        bar.close()
        for worker in workers:
            ray.kill(worker)
