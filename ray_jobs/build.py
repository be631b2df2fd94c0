"""The Ray side of `alrira-cache build`: a pool of target actors, each loading the target once
and writing whole shards itself. Only `ShardSpec`s go out and `ShardRecord` metadata comes back
(docs/design.md, "What crosses a process boundary"); the planning, resume and manifest are
`pipeline.build.driver`'s.

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
"""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
from pathlib import Path

import ray
from tqdm.auto import tqdm

from pipeline.build import driver
from pipeline.build.config import CacheBuildConfig
from pipeline.build.driver import ShardSpec
from pipeline.build.shard_builder import ShardBuilder
from storage.errors import first_line
from storage.format import shard_name
from storage.manifest import Manifest, ShardRecord
from storage.ownership import CacheOwnershipLost

MAX_SHARD_ATTEMPTS = 3  # a shard whose worker died this many times stops the build
ACTOR_NAMESPACE = "alrira-cache"  # every build's actors are named in it, after their --out
RESOURCE_WAIT_S = 300.0  # how long a build waits for CPUs/GPUs held by others before it gives up
ACTOR_EXIT_WAIT_S = 60.0  # how long to wait for killed actors to be gone


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
    if not ray.is_initialized():
        ray.init(address=config.compute.ray_address, logging_level="WARNING", include_dashboard=False)
    check_capacity(config.compute, config.compute.workers)
    stop_earlier_workers(config.out, log=log)
    # Ray drops a killed driver's actors from its books at once but frees their CPUs only once
    # their processes are gone: until then they may still be writing temp files under shards/,
    # which the driver removes before it plans. Wait for the pool's resources first.
    _wait_for_resources(config.compute, config.compute.workers, log=log)
    run_shards = functools.partial(run_shards_on_ray, log=log)
    return driver.build_cache(config, run_shards=run_shards, progress=progress, log=log)


def _actor_prefix(out) -> str:
    """Name prefix of the actors of every build on cache directory `out`."""
    return "cache-worker-" + hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:16] + "-"


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
    config: CacheBuildConfig, pending: list[ShardSpec], publish, *, progress: bool = True, log=print
) -> None:
    """Keep every actor busy with one shard; publish each finished shard in the manifest at once."""
    compute = config.compute
    if not ray.is_initialized():
        ray.init(address=compute.ray_address, logging_level="WARNING", include_dashboard=False)
    num_workers = min(compute.workers, len(pending))
    _wait_for_resources(compute, num_workers, log=log)
    prefix = _actor_prefix(config.out)
    options = dict(num_cpus=compute.cpus_per_worker, num_gpus=compute.gpus_per_worker, namespace=ACTOR_NAMESPACE)

    def new_worker():
        return CacheWorker.options(name=prefix + uuid.uuid4().hex, **options).remote(config)

    workers = [new_worker() for _ in range(num_workers)]
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

    released = []

    def release(worker_index: int):
        # Nothing left to assign: free its CPUs now rather than at the end of the run.
        ray.kill(workers[worker_index], no_restart=True)
        released.append(workers[worker_index])
        workers[worker_index] = None

    try:
        for i in range(len(workers)):
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
            except ray.exceptions.RayTaskError as error:
                raise _plain_error(error) from None
            publish(spec, record)
            tokens += record.tokens
            bar.update(record.sequences)
            bar.set_postfix(tokens=tokens, shards=f"{len(pending) - len(queue) - len(running)}/{len(pending)}")
            if queue:
                submit(worker_index)
            else:
                release(worker_index)
    finally:
        bar.close()
        _kill_and_wait([*released, *(w for w in workers if w is not None)])


def _plain_error(error: "ray.exceptions.RayTaskError") -> Exception:
    """The actor's own error without Ray's wrapping and remote traceback: an OSError (full disk,
    read-only filesystem) or ValueError stays what it is, in one line."""
    cause = error.cause
    if isinstance(cause, OSError):
        return OSError(cause.errno, cause.strerror, cause.filename) if cause.errno else OSError(str(cause))
    if isinstance(cause, ValueError):
        return ValueError(first_line(cause))
    return error
