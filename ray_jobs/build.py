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
import hashlib
import itertools
import os
import time
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm.auto import tqdm

from pipeline.cache_build import driver
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import BuildProgress, ShardSpec
from pipeline.cache_build.shard_builder import BuildTimes, ShardBuilder
from pipeline.target import target_hash
from storage.errors import first_line
from storage.format import shard_name
from storage.location import is_url
from storage.manifest import Manifest, ShardRecord
from storage.ownership import CacheOwnershipLost

MAX_SHARD_ATTEMPTS = 3  # a shard whose worker died this many times stops the build
ACTOR_NAMESPACE = "alrira-cache"  # every build's actors are named in it, after their --out
RESOURCE_WAIT_S = 300.0  # how long a build waits for CPUs/GPUs held by others before it gives up
ACTOR_EXIT_WAIT_S = 60.0  # how long to wait for killed actors to be gone
BATCH_REPORT_S = 0.5  # how often the driver takes the workers' batch reports while shards run


@ray.remote
class CacheWorker:
    """A Ray actor around ShardBuilder: loads the target once, builds shards on request.

    `driver_target_hash`: the target as the driver hashed it. A node whose --target path is
    missing or holds other files builds nothing; its first shard fails with that one line (not as
    a worker death, which would be retried). `board`: the build's BatchBoard, told of each batch
    that reaches the shard's writer."""

    def __init__(self, config: CacheBuildConfig, driver_target_hash: str, board=None):
        self.problem = target_problem(config.target, driver_target_hash=driver_target_hash, node=this_node())
        self.builder = None if self.problem else ShardBuilder(config)
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


def target_problem(target: str, *, driver_target_hash: str, node: str) -> str | None:
    """Why `node` cannot compute with its copy of `target`, or None: every node needs the driver's
    target at the same path (docs/cluster.md, "The target on every node")."""
    if not (Path(target) / "config.json").is_file():
        return f"node {node}: --target {target}: no model directory there; every node needs the target at the same path"
    found = target_hash(target)
    if found != driver_target_hash:
        return (
            f"node {node}: --target {target} holds other files than the driver's (target hash "
            f"{found.removeprefix('sha256:')[:12]}, driver {driver_target_hash.removeprefix('sha256:')[:12]})"
        )
    return None


def this_node() -> str:
    """The Ray node this process runs on as `ray list nodes` shows it: IP / the first 8 hex digits of
    the node id (raylets sharing a machine share the IP)."""
    return f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"


def build_cache(config: CacheBuildConfig, *, progress: bool = True, log=print) -> Manifest:
    """Build or resume the cache described by `config` on a Ray cluster; returns the final manifest.
    --workers-per-node pins that many actors to every node instead of --workers (plan_pool)."""
    workers_per_node = config.compute.workers_per_node
    if not ray.is_initialized():
        # address None (no --ray-address) joins $RAY_ADDRESS when set, as under `ray job submit`.
        ray.init(address=config.compute.ray_address, logging_level="WARNING", include_dashboard=False)
    placements = plan_pool(config.compute, workers_per_node=workers_per_node)
    check_capacity(config.compute, len(placements))
    if workers_per_node is not None:
        num_nodes = len({p.node_id for p in placements})
        log(f"pool: {len(placements)} worker(s) on {num_nodes} node(s), at most {workers_per_node} per node")
    stop_earlier_workers(config.out, log=log)
    # Ray drops a killed driver's actors from its books at once but frees their CPUs only once
    # their processes are gone: until then they may still be writing temp files under shards/,
    # which the driver removes before it plans. Wait for the pool's resources first.
    _wait_for_resources(config.compute, len(placements), log=log)
    run_shards = functools.partial(run_shards_on_ray, placements=placements, log=log)
    return driver.build_cache(config, run_shards=run_shards, progress=progress, log=log)


def plan_pool(compute, *, workers_per_node: int | None) -> list:
    """One scheduling strategy per actor of the pool (docs/cluster.md, "Workers per node").

    Without `workers_per_node`: --workers actors, SPREAD over the nodes (Ray's default would first
    fill the driver's node up to half of its resources). With it: that many actors pinned to every alive node that can hold
    them (as many as fit on a smaller node, none on one without the CPUs/GPUs of a worker), the
    nodes interleaved so that a pool cut to the shards left stays spread. Soft affinity: a worker
    replaced after its node died goes elsewhere instead of waiting for the node forever."""
    if workers_per_node is None:
        return ["SPREAD"] * compute.workers
    if workers_per_node < 1:
        raise ValueError(f"--workers-per-node must be >= 1, got {workers_per_node}")
    per_worker = _per_worker(compute)
    by_node = []
    for node in sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"]):
        fits = min(int(node["Resources"].get(name, 0) // amount) for name, amount in per_worker.items())
        by_node.append([NodeAffinitySchedulingStrategy(node["NodeID"], soft=True)] * min(workers_per_node, fits))
    placements = [p for row in itertools.zip_longest(*by_node) for p in row if p is not None]
    if not placements:
        each = ", ".join(f"{amount:g} {name}" for name, amount in per_worker.items())
        raise ValueError(f"--workers-per-node {workers_per_node}: no node of the Ray cluster can hold a worker of {each}")
    return placements


def _actor_prefix(out) -> str:
    """Name prefix of the actors of every build on cache `out` (a path, or an object-store URL
    taken as it is)."""
    key = str(out) if is_url(out) else str(Path(out).resolve())
    return "cache-worker-" + hashlib.sha256(key.encode()).hexdigest()[:16] + "-"


def stop_earlier_workers(out, *, log=print) -> int:
    """Kill the actors an earlier build on `out` still runs (a killed driver's orphans, which Ray
    reaps only eventually) and wait until they are gone; returns how many there were."""
    prefix = _actor_prefix(out)
    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != ACTOR_NAMESPACE or not entry["name"].startswith(prefix):
            continue
        try:
            handles.append(ray.get_actor(entry["name"], namespace=ACTOR_NAMESPACE))
        except ValueError:  # gone meanwhile
            continue
    if handles:
        log(f"stopping {len(handles)} worker(s) of an earlier build on {out}")
        _kill_and_wait(handles)
    return len(handles)


def _kill_and_wait(handles: list, *, timeout: float = ACTOR_EXIT_WAIT_S) -> None:
    """ray.kill the actors and wait (bounded) until each is dead, so its CPUs are free again and it
    writes nothing more."""
    for handle in handles:
        ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout
    for handle in handles:
        try:
            ray.get(handle.pid.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            continue  # dead, as wanted
        except ray.exceptions.GetTimeoutError:
            return


def _per_worker(compute) -> dict[str, float]:
    """What one actor reserves: {"CPU": n} and, if it uses any, {"GPU": n}."""
    return {name: amount for name, amount in (("CPU", compute.cpus_per_worker), ("GPU", compute.gpus_per_worker)) if amount > 0}


def check_capacity(compute, num_workers: int) -> None:
    """Refuse, in one line, a pool larger than the whole cluster can place: its last actors would
    wait for resources forever."""
    per_worker = _per_worker(compute)
    total = ray.cluster_resources()
    fits = min((int(total.get(name, 0) // amount) for name, amount in per_worker.items()), default=num_workers)
    if fits >= num_workers:
        return
    cluster = ", ".join(f"{total.get(name, 0):g} {name}" for name in per_worker)
    each = ", ".join(f"{amount:g} {name}" for name, amount in per_worker.items())
    advice = f"pass --workers {fits} or fewer" if fits else "add resources or lower --cpus-per-worker / --gpus-per-worker"
    raise ValueError(f"--workers {num_workers}: the Ray cluster ({cluster}) can place {fits} worker(s) of {each}; {advice}")


def _wait_for_resources(compute, num_workers: int, *, log, timeout: float = RESOURCE_WAIT_S) -> None:
    """Wait, saying so every 10 s, while part of the pool's resources is held (by actors of a build
    that just ended, or by another job); give up with one line after `timeout`."""
    check_capacity(compute, num_workers)
    per_worker = _per_worker(compute)
    started = next_note = time.monotonic()
    while True:
        free = ray.available_resources()
        missing = {name: amount * num_workers - free.get(name, 0) for name, amount in per_worker.items()}
        short = ", ".join(f"{value:g} {name}" for name, value in missing.items() if value > 0)
        if not short:
            return
        now = time.monotonic()
        if now - started > timeout:
            raise ValueError(f"--workers {num_workers}: {short} still held by other work after {timeout:.0f}s; retry or pass fewer --workers")
        if now >= next_note:
            log(f"waiting for {short} held by other work (workers of an earlier build being released?)")
            next_note = now + 10
        time.sleep(0.2)


def run_shards_on_ray(
    config: CacheBuildConfig, pending: list[ShardSpec], publish, *, placements: list | None = None,
    progress: bool = True, log=print,
) -> BuildTimes:  # fmt: skip
    """Keep every actor busy with one shard; publish each finished shard in the manifest at once and
    log which node wrote it; the bar moves as the workers report batches. `placements`: one
    scheduling strategy per actor (plan_pool; default --workers actors, SPREAD). Returns the
    workers' times."""
    compute = config.compute
    if not ray.is_initialized():
        ray.init(address=compute.ray_address, logging_level="WARNING", include_dashboard=False)
    placements = (placements or plan_pool(compute, workers_per_node=None))[: len(pending)]
    _wait_for_resources(compute, len(placements), log=log)
    prefix, driver_target_hash = _actor_prefix(config.out), target_hash(config.target)
    options = dict(num_cpus=compute.cpus_per_worker, num_gpus=compute.gpus_per_worker, namespace=ACTOR_NAMESPACE)

    board = BatchBoard.options(namespace=ACTOR_NAMESPACE).remote()

    def new_worker(worker_index: int):
        # A replacement keeps its slot's placement: the same node under --workers-per-node.
        actor = CacheWorker.options(name=prefix + uuid.uuid4().hex, scheduling_strategy=placements[worker_index], **options)
        return actor.remote(config, driver_target_hash, board)

    workers = [new_worker(i) for i in range(len(placements))]
    queue = list(pending)
    attempts = {s.index: 0 for s in pending}
    running = {}  # future -> (worker index, spec)
    bar = BuildProgress(pending, enabled=progress)
    shards_by_node, released = collections.Counter(), []

    def submit(worker_index: int):
        spec = queue.pop(0)
        attempts[spec.index] += 1
        running[workers[worker_index].build.remote(spec)] = (worker_index, spec)

    def release(worker_index: int):
        # Nothing left to assign: free its CPUs now rather than at the end of the run.
        ray.kill(workers[worker_index], no_restart=True)
        released.append(workers[worker_index])
        workers[worker_index] = None

    try:
        for i in range(len(workers)):
            submit(i)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=BATCH_REPORT_S)
            for report in ray.get(board.take.remote()):
                bar.batch(*report)
            if not ready:
                continue
            [future] = ready
            worker_index, spec = running.pop(future)
            try:
                record, node, times = ray.get(future)
            except CacheOwnershipLost:
                # Ray re-raises the actor's error with its traceback; one line is what the user needs.
                raise CacheOwnershipLost(
                    f"{config.out}: another cache build claimed this directory while this one was running; stopped"
                ) from None
            except ray.exceptions.RayActorError:
                # The worker died (OOM, preemption, kill): nothing of its shard was published.
                if attempts[spec.index] >= MAX_SHARD_ATTEMPTS:
                    raise RuntimeError(f"{shard_name(spec.index, config.storage.storage_format)}: worker died {MAX_SHARD_ATTEMPTS} times")
                bar.shard_lost(spec.index)
                workers[worker_index] = new_worker(worker_index)
                queue.insert(0, spec)
                submit(worker_index)
                continue
            except ray.exceptions.RayTaskError as error:
                raise _plain_error(error) from None
            record = dataclasses.replace(record, node=node)
            publish(spec, record)
            shards_by_node[node] += 1
            with tqdm.external_write_mode():  # the line above the bar, not through it
                log(shard_line(record, node=node))
            bar.shard_published(record, times)
            if queue:
                submit(worker_index)
            else:
                release(worker_index)
    finally:
        bar.close()
        _kill_and_wait([*released, *(w for w in workers if w is not None)])
        ray.kill(board)  # holds no resources: nothing to wait for
    log("shards by node: " + ", ".join(f"{node} {count}" for node, count in sorted(shards_by_node.items())))
    return bar.times


def shard_line(record: ShardRecord, *, node: str) -> str:
    """The log line of a published shard: `shard-00003.zarr: 3 sequences, 412 tokens, node 10.0.0.5/1a2b3c4d`."""
    return f"{record.name}: {record.sequences} sequences, {record.tokens} tokens, node {node}"


def _plain_error(error: "ray.exceptions.RayTaskError") -> Exception:
    """The actor's own error without Ray's wrapping and remote traceback: an OSError (full disk,
    read-only filesystem) or ValueError stays what it is, in one line."""
    cause = error.cause
    if isinstance(cause, OSError):
        return OSError(cause.errno, cause.strerror, cause.filename) if cause.errno else OSError(str(cause))
    if isinstance(cause, ValueError):
        return ValueError(first_line(cause))
    return error
