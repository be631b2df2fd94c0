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
import socket
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
from ray_jobs.pool import kill_and_wait, run_pool
from storage.errors import first_line
from storage.format import shard_name
from storage.location import env_seconds, is_url, remove_local_copies
from storage.manifest import Manifest, ShardRecord
from storage.ownership import CacheOwnershipLost

ACTOR_NAMESPACE = "alrira-cache"  # every build's actors are named in it, after their --out
RESOURCE_WAIT_S = 300.0  # how long a build waits for CPUs/GPUs held by others before it gives up
# How long joining a Ray cluster may take before the build gives up in one line (ray.init itself
# retries an address where nothing answers for minutes).
RAY_CONNECT_TIMEOUT_ENV = "ALRIRA_RAY_CONNECT_TIMEOUT_S"
DEFAULT_RAY_CONNECT_TIMEOUT_S = 30.0
COPY_CLEANUP_WAIT_S = 10.0  # how long the end of a build waits for its workers to remove their copies
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


def worker_problem(error: Exception, *, node: str, paths: tuple[str, ...]) -> str:
    """The one line of a worker that could not start: the node and the real cause first, and when
    one of its `paths` (--out, --corpus) is on a store the usual reason (docs/cluster.md: every
    node needs the store's AWS_* environment)."""
    line = f"node {node}: {first_line(error)}"
    if isinstance(error, OSError) and any(is_url(where) for where in paths):
        line += "; every node needs the store's credentials and endpoint in its environment (AWS_ACCESS_KEY_ID, ...)"
    return line


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
    connect_ray(config.compute.ray_address)
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
    try:
        return driver.build_cache(config, run_shards=run_shards, progress=progress, log=log)
    finally:
        remove_local_copies()  # the driver's node-local copies of the store corpus (its workers remove theirs)


def connect_ray(address: str | None) -> None:
    """Join the cluster at `address` (None: $RAY_ADDRESS when set, as under `ray job submit`, else a
    new local one), after probe_ray_address: ray.init retries an address where nothing answers
    for minutes."""
    if ray.is_initialized():
        return
    flag = "--ray-address" if address else "$RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        probe_ray_address(address, flag=flag, timeout=env_seconds(RAY_CONNECT_TIMEOUT_ENV, DEFAULT_RAY_CONNECT_TIMEOUT_S))
    ray.init(address=address, logging_level="WARNING", include_dashboard=False)


def probe_ray_address(address: str, *, flag: str, timeout: float) -> None:
    """ValueError in one line when no process accepts a TCP connection at a `host:port` (or
    `ray://host:port`) address within `timeout` seconds; `auto` is left to ray.init."""
    host, _, port = address.removeprefix("ray://").rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        if isinstance(error, TimeoutError):
            reason = f"within {timeout:g}s; a longer wait: ${RAY_CONNECT_TIMEOUT_ENV}"
        else:
            reason = error.strerror or first_line(error)
        raise ValueError(
            f"{flag} {address}: no Ray cluster answers there ({reason}); start one (`ray start --head`) or fix the address"
        ) from None


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


def _actor_prefix(out, *, stage: str) -> str:
    """Name prefix of the actors of every run of `stage` ("cache" builds, "regenerate") on `out` (a
    path, or an object-store URL taken as it is): the stage is in it, so one stage given the
    other's --out by mistake never stops the other's live actors."""
    key = str(out) if is_url(out) else str(Path(out).resolve())
    return f"{stage}-worker-" + hashlib.sha256(key.encode()).hexdigest()[:16] + "-"


def stop_earlier_workers(out, *, stage: str = "cache", log=print) -> int:
    """Kill the actors an earlier run of `stage` on `out` still runs (a killed driver's orphans,
    which Ray reaps only eventually) and wait until they are gone; returns how many there were."""
    prefix = _actor_prefix(out, stage=stage)
    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != ACTOR_NAMESPACE or not entry["name"].startswith(prefix):
            continue
        try:
            handles.append(ray.get_actor(entry["name"], namespace=ACTOR_NAMESPACE))
        except ValueError:  # gone meanwhile
            continue
    if handles:
        log(f"stopping {len(handles)} worker(s) of an earlier {'build' if stage == 'cache' else stage} on {out}")
        kill_and_wait(handles)
    return len(handles)


def _remove_workers_copies(handles: list, *, timeout: float = COPY_CLEANUP_WAIT_S) -> None:
    """Ask each live actor to remove the node-local store copies it made before it is killed (a
    kill runs no cleanup). Another worker of the node still reading a removed copy keeps its
    memory map (an unlinked file lives while mapped); a dead actor's copies stay where they are:
    nothing else knows they were its own. Bounded: an actor still busy (the build failed) is
    killed without."""
    refs = [handle.remove_local_copies.remote() for handle in handles]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)


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


def actor_factory(actor_class, *, out, compute, placements: list, args: tuple, stage: str = "cache"):
    """new_worker(slot) -> a fresh `actor_class` actor (constructed with `args`) for pool slot
    `slot`, named after `out` so that stop_earlier_workers finds it; a replacement keeps its slot's
    placement (the same node under --workers-per-node)."""
    prefix = _actor_prefix(out, stage=stage)
    options = dict(num_cpus=compute.cpus_per_worker, num_gpus=compute.gpus_per_worker, namespace=ACTOR_NAMESPACE)

    def new_worker(slot: int):
        return actor_class.options(name=prefix + uuid.uuid4().hex, scheduling_strategy=placements[slot], **options).remote(*args)

    return new_worker


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
    _wait_for_resources(compute, len(placements), log=log)
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
            translate_error=functools.partial(_build_error, out=config.out), before_kill=_remove_workers_copies,
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
    return _plain_error(error)


def _plain_error(error: "ray.exceptions.RayTaskError") -> Exception:
    """The actor's own error without Ray's wrapping and remote traceback: an OSError (full disk,
    read-only filesystem) or ValueError stays what it is, in one line."""
    cause = error.cause
    if isinstance(cause, OSError):
        return OSError(cause.errno, cause.strerror, cause.filename) if cause.errno else OSError(str(cause))
    if isinstance(cause, ValueError):
        return ValueError(first_line(cause))
    return error
