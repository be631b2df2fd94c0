"""The Ray side of `alrira-cache build`: a pool of target actors, each loading the target once
and writing whole shards itself. Only `ShardSpec`s go out and `ShardRecord` metadata comes back
(docs/design.md, "What crosses a process boundary"); the planning, resume and manifest are
`pipeline.cache_build.driver`'s.

Ownership: each build claims the directory (storage.ownership.claim_cache) before it touches it,
and its actors publish a shard only while that claim holds. An actor that outlives its killed
driver (Ray reaps orphans asynchronously) or a second build started on the same directory
therefore cannot overwrite the shards of the build that claimed it last; temp directories such
writers leave behind are removed when the build starts and again when it ends.

Orphans and resources: actors are named after the cache directory, so a build first stops the
actors another build on the same --out still runs, then waits (saying so) until the cluster has
the CPUs its pool needs: a killed driver's orphans hold theirs until their processes are gone, so
once they are free no orphan still writes the temp directories the driver is about to remove.
The pool is never larger than the cluster can place (refused up front, in one line) nor than the
shards still to assign (an actor with nothing left to do is released at once).

Nodes (docs/cluster.md): the pool is spread over the cluster's nodes (SPREAD, or --workers-per-node
pinning N actors to every node that can hold them), every actor writes its shards to --out itself
(passed through untouched: a shared filesystem or an object store), and the node that wrote each
shard is logged with it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm.auto import tqdm

from pipeline.cache_build import driver
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import BuildProgress, ShardSpec
from pipeline.cache_build.shard_builder import BuildTimes, ShardBuilder
from pipeline.target import target_hash
from ray_jobs.pool import (
    ACTOR_NAMESPACE,
    actor_factory,
    check_capacity,
    connect_ray,
    plain_error,
    plan_pool,
    remove_workers_copies,
    run_pool,
    stop_earlier_workers,
    target_problem,
    this_node,
    wait_for_resources,
    worker_problem,
)
from storage.format import shard_name
from storage.location import remove_local_copies
from storage.manifest import Manifest, ShardRecord
from storage.ownership import CacheOwnershipLost

BATCH_REPORT_S = 0.5  # how often the driver takes the workers' batch reports while shards run


@ray.remote
class CacheWorker:
    """A Ray actor around ShardBuilder: loads the target once, builds shards on request.

    `driver_target_hash`: the target as the driver hashed it. A node whose --target path is
    missing or holds other files builds nothing; its first shard fails with that one line (not as
    a worker death, which would be retried). `board`: the build's BatchBoard, told of each batch
    that reaches the shard's writer."""

    def __init__(self, config: CacheBuildConfig, driver_target_hash: str, board=None):
        node = this_node()
        self.problem = target_problem(config.target, driver_target_hash=driver_target_hash, node=node)
        self.builder = None
        if not self.problem:
            try:
                self.builder = ShardBuilder(config)
            except (OSError, ValueError) as error:  # e.g. a node without the store's credentials
                self.problem = worker_problem(error, node=node, paths=(config.out, config.corpus.path))
        self.board = board

    def build(self, spec: ShardSpec) -> tuple[ShardRecord, str, BuildTimes]:
        """The shard's record, the node that wrote it (this_node) and the builder's times."""
        if self.problem:
            raise ValueError(self.problem)

        def on_batch(sequences: int, tokens: int) -> None:
            if self.board is not None:
                self.board.report.remote(spec.index, sequences, tokens)  # not awaited: metadata only

        record = self.builder.build(
            shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner, on_batch=on_batch
        )
        return record, this_node(), self.builder.times

    def pid(self) -> int:
        return os.getpid()

    def remove_local_copies(self) -> int:
        """Remove the node-local store copies this actor made (storage.location.local_copy)."""
        return len(remove_local_copies())


@ray.remote(num_cpus=0)
class BatchBoard:
    """Where a build's workers report each batch that reached a shard's writer (shard index,
    sequences, tokens): the driver takes the reports to move its bar between shards. Needs no
    CPU, so it is placed even when the pool holds every core."""

    def __init__(self):
        self.reports: list[tuple[int, int, int]] = []

    def report(self, shard_index: int, sequences: int, tokens: int) -> None:
        self.reports.append((shard_index, sequences, tokens))

    def take(self) -> list[tuple[int, int, int]]:
        reports, self.reports = self.reports, []
        return reports


def progress_board():
    """A BatchBoard on the driver's own node: a worker node lost mid-build must not take the
    driver's progress reports with it (its next take() raised ActorUnavailableError, a traceback;
    docs/failure-modes.md, "a Ray node is lost mid-build")."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return BatchBoard.options(namespace=ACTOR_NAMESPACE, scheduling_strategy=here).remote()


def build_cache(config: CacheBuildConfig, *, progress: bool = True, log=print) -> Manifest:
    """Build or resume the cache described by `config` on a Ray cluster; returns the final manifest.
    --workers-per-node pins that many actors to every node instead of --workers (plan_pool)."""
    workers_per_node = config.compute.workers_per_node
    connect_ray(config.compute.ray_address)
    placements = plan_pool(config.compute, workers_per_node=workers_per_node)
    check_capacity(config.compute, len(placements))
    if workers_per_node is not None:
        num_nodes = len({p.node_id for p in placements})
        log(f"pool: {len(placements)} worker(s) on {num_nodes} node(s), at most {workers_per_node} per node")
    with driver.build_lock(config):  # a second build of this --out refuses here, before it stops the first one's actors
        stop_earlier_workers(config.out, log=log)
        # Ray drops a killed driver's actors from its books at once but frees their CPUs only once
        # their processes are gone: until then they may still be writing temp files under shards/,
        # which the driver removes before it plans. Wait for the pool's resources first.
        wait_for_resources(config.compute, len(placements), log=log)
        run_shards = functools.partial(run_shards_on_ray, placements=placements, log=log)
        try:
            return driver.build_unlocked(config, run_shards=run_shards, progress=progress, log=log)
        finally:
            remove_local_copies()  # the driver's node-local copies of the store corpus (its workers remove theirs)


def run_shards_on_ray(
    config: CacheBuildConfig, pending: list[ShardSpec], publish, *, placements: list | None = None,
    progress: bool = True, log=print,
) -> BuildTimes:  # fmt: skip
    """Keep every actor busy with one shard; publish each finished shard in the manifest at once and
    log which node wrote it; the bar moves as the workers report batches. `placements`: one
    scheduling strategy per actor (plan_pool; default --workers actors, SPREAD). Returns the
    workers' times."""
    compute = config.compute
    connect_ray(compute.ray_address)
    placements = (placements or plan_pool(compute, workers_per_node=None))[: len(pending)]
    wait_for_resources(compute, len(placements), log=log)
    board = progress_board()
    new_worker = actor_factory(
        CacheWorker, out=config.out, compute=compute, placements=placements, args=(config, target_hash(config.target), board)
    )
    bar = BuildProgress(pending, enabled=progress)
    shards_by_node = collections.Counter()

    def on_result(spec: ShardSpec, result: tuple[ShardRecord, str, BuildTimes], num_done: int) -> None:
        record, node, times = result
        record = dataclasses.replace(record, node=node)
        publish(spec, record)
        shards_by_node[node] += 1
        with tqdm.external_write_mode():  # the line above the bar, not through it
            log(shard_line(record, node=node))
        bar.shard_published(record, times)

    def take_reports() -> None:
        for report in ray.get(board.take.remote()):
            bar.batch(*report)

    try:
        run_pool(
            pending, new_worker=new_worker, num_workers=len(placements), call=lambda worker, spec: worker.build.remote(spec),
            on_result=on_result, name_of=lambda spec: shard_name(spec.index, config.storage.storage_format),
            translate_error=functools.partial(_build_error, out=config.out), before_kill=remove_workers_copies,
            on_retry=lambda spec: bar.shard_lost(spec.index), on_wait=take_reports, wait_s=BATCH_REPORT_S,
        )  # fmt: skip
    finally:
        bar.close()
        ray.kill(board)  # holds no resources: nothing to wait for
    log("shards by node: " + ", ".join(f"{node} {count}" for node, count in sorted(shards_by_node.items())))
    return bar.times


def shard_line(record: ShardRecord, *, node: str) -> str:
    """The log line of a published shard: `shard-00003.zarr: 3 sequences, 412 tokens, node 10.0.0.5/1a2b3c4d`."""
    return f"{record.name}: {record.sequences} sequences, {record.tokens} tokens, node {node}"


def _build_error(error: "ray.exceptions.RayTaskError", *, out) -> Exception:
    """A shard writer's error as the build reports it (Ray re-raises it as an instance of its own
    class, with the remote traceback; one line is what the user needs)."""
    if isinstance(error, CacheOwnershipLost):
        return CacheOwnershipLost(f"{out}: another cache build claimed this directory while this one was running; stopped")
    return plain_error(error)

