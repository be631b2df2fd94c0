"""The Ray side of `alrira-cache build`: a pool of target actors, each loading the target once
and writing whole shards itself. Only `ShardSpec`s go out and `ShardRecord` metadata comes back
(docs/design.md, "What crosses a process boundary"). The plan is `pipeline.cache_build.plan`'s,
the claim, resume and manifest `pipeline.cache_build.driver`'s: the pool only yields the shards'
records, and the build publishes them.

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
import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm.auto import tqdm

from pipeline.cache_build import driver
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import BuildProgress, ShardSpec
from pipeline.cache_build.plan import BuildPlan, plan_build
from pipeline.cache_build.shard_builder import BuildTimes, ShardBuilder
from ray_jobs.pool import (
    ACTOR_NAMESPACE,
    actor_factory,
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
    The pool is placed (plan_pool: --workers SPREAD, or --workers-per-node), the earlier build's
    orphans stopped, the build planned once (plan_build), then the pool's shards are published as
    they come back (pipeline.cache_build.driver's started_build)."""
    compute = config.compute
    connect_ray(compute.ray_address)
    placements = plan_pool(compute, workers_per_node=compute.workers_per_node)
    if compute.workers_per_node is not None:
        num_nodes = len({p.node_id for p in placements})
        log(f"pool: {len(placements)} worker(s) on {num_nodes} node(s), at most {compute.workers_per_node} per node")
    with driver.build_lock(config):  # a second build of this --out refuses here, before it stops the first one's actors
        stop_earlier_workers(config.out, log=log)
        # Ray drops a killed driver's actors from its books at once but frees their CPUs only once
        # their processes are gone: until then they may still be writing temp files under shards/,
        # which the build removes once it has planned. Wait for the pool's resources first.
        wait_for_resources(compute, len(placements), log=log)
        try:
            plan = plan_build(config, log=log)
            with driver.started_build(plan, progress=progress, log=log) as book:
                if book.pending:  # closed when the block ends: a failed publish stops the pool first
                    shards = run_shards_on_ray(plan, book.pending, placements=placements, progress=progress, log=log)
                    with contextlib.closing(shards):
                        for record, times in shards:
                            book.publish(record, times=times)
                return book.finish()
        finally:
            remove_local_copies()  # the driver's node-local copies of the store corpus (its workers remove theirs)


def run_shards_on_ray(
    plan: BuildPlan, pending: list[ShardSpec], *, placements: list, progress: bool = True, log=print
) -> Iterator[tuple[ShardRecord, BuildTimes]]:
    """Keep every actor busy with one shard, yielding each finished shard's record (with the node
    that wrote it) and the worker's times as it comes back; the caller publishes it, then its node
    is logged; the bar moves as the workers report batches. `placements`: one scheduling strategy
    per actor (plan_pool), cut to the shards to build."""
    config = plan.config
    placements = placements[: len(pending)]
    board = progress_board()
    new_worker = actor_factory(
        CacheWorker, out=config.out, compute=config.compute, placements=placements, args=(config, plan.settings.target_hash, board)
    )
    bar = BuildProgress(pending, enabled=progress)
    shards_by_node = collections.Counter()

    def take_reports() -> None:
        for report in ray.get(board.take.remote()):
            bar.batch(*report)

    results = run_pool(
        pending, new_worker=new_worker, num_workers=len(placements), call=lambda worker, spec: worker.build.remote(spec),
        name_of=lambda spec: shard_name(spec.index, config.storage.storage_format),
        translate_error=functools.partial(_build_error, out=config.out), before_kill=remove_workers_copies,
        on_retry=lambda spec: bar.shard_lost(spec.index), on_wait=take_reports, wait_s=BATCH_REPORT_S,
    )  # fmt: skip
    try:
        with contextlib.closing(results):
            for _spec, (record, node, times) in results:
                record = dataclasses.replace(record, node=node)
                yield record, times  # published by the caller before the line below says so
                shards_by_node[node] += 1
                with tqdm.external_write_mode():  # the line above the bar, not through it
                    log(shard_line(record, node=node))
                bar.shard_published(record)
    finally:
        bar.close()
        ray.kill(board)  # holds no resources: nothing to wait for
    log("shards by node: " + ", ".join(f"{node} {count}" for node, count in sorted(shards_by_node.items())))


def shard_line(record: ShardRecord, *, node: str) -> str:
    """The log line of a published shard: `shard-00003.zarr: 3 sequences, 412 tokens, node 10.0.0.5/1a2b3c4d`."""
    return f"{record.name}: {record.sequences} sequences, {record.tokens} tokens, node {node}"


def _build_error(error: "ray.exceptions.RayTaskError", *, out) -> Exception:
    """A shard writer's error as the build reports it (Ray re-raises it as an instance of its own
    class, with the remote traceback; one line is what the user needs)."""
    if isinstance(error, CacheOwnershipLost):
        return CacheOwnershipLost(f"{out}: another cache build claimed this directory while this one was running; stopped")
    return plain_error(error)

