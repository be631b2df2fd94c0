"""A list of specs worked off by a pool of Ray actors: the cache build's shards (ray_jobs/build.py)
and regeneration's parts (ray_jobs/regenerate.py). Every actor is kept busy with one spec; a
finished spec is yielded to the caller at once, which publishes it; a spec whose actor died (OOM,
preemption, kill: nothing of it was published) goes to a fresh actor in the same slot, at most
MAX_ATTEMPTS times; an actor with nothing left to do is released at once; every actor is stopped
when the pool ends.

Both stages also share what comes before the pool: joining the cluster (connect_ray), placing the
actors (plan_pool: SPREAD or --workers-per-node), stopping the orphans of an earlier run on the
same --out (stop_earlier_workers: actors are named after it), waiting for the resources they held
(wait_for_resources, which first refuses a pool the cluster cannot place: check_capacity), and
each node's checks of its copy of the target (target_problem).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.target import target_hash
from storage.errors import first_line
from storage.location import env_seconds, is_url

class WorkerDiedError(ValueError):
    """A spec whose workers died MAX_ATTEMPTS times: a ValueError, so the CLIs print its one line."""


MAX_ATTEMPTS = 3  # a spec whose worker died this many times stops the run
ACTOR_EXIT_WAIT_S = 60.0  # how long to wait for killed actors to be gone
ACTOR_NAMESPACE = "alrira-cache"  # every build's actors are named in it, after their --out
RESOURCE_WAIT_S = 300.0  # how long a run waits for CPUs/GPUs held by others before it gives up
# How long joining a Ray cluster may take before the build gives up in one line (ray.init itself
# retries an address where nothing answers for minutes).
RAY_CONNECT_TIMEOUT_ENV = "ALRIRA_RAY_CONNECT_TIMEOUT_S"
DEFAULT_RAY_CONNECT_TIMEOUT_S = 30.0
COPY_CLEANUP_WAIT_S = 10.0  # how long the end of a run waits for its workers to remove their copies


def kill_and_wait(handles: list, *, timeout: float = ACTOR_EXIT_WAIT_S) -> None:
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


def run_pool(
    pending: list, *, new_worker: Callable[[int], object], num_workers: int, call: Callable,
    name_of: Callable[[object], str], translate_error: Callable[[Exception], Exception],
    before_kill: Callable[[list], None] | None = None, on_retry: Callable | None = None,
    on_wait: Callable[[], None] | None = None, wait_s: float | None = None,
) -> Iterator[tuple[object, object]]:  # fmt: skip
    """Work off `pending` (specs with an `index`) on `num_workers` actors from `new_worker(slot)`,
    yielding (spec, result) as each spec finishes: the caller publishes it before the pool goes on.
    `call(actor, spec)` starts a spec and returns its object ref; an actor's own error leaves as
    `translate_error(error)`, a spec whose workers died MAX_ATTEMPTS times as a WorkerDiedError
    naming `name_of(spec)`. `before_kill(actors)` runs on live actors before they are killed (a
    kill runs no cleanup of theirs: the build's workers remove their node-local store copies
    there). `on_retry(spec)` runs when a spec goes back to the queue after its actor died;
    `on_wait()` at least every `wait_s` seconds while specs run (the build takes its workers'
    batch reports there). Every actor is stopped when the iteration ends or is closed."""
    workers = [new_worker(slot) for slot in range(min(num_workers, len(pending)))]
    queue, attempts, running, released = list(pending), {spec.index: 0 for spec in pending}, {}, []

    def submit(slot: int) -> None:
        spec = queue.pop(0)
        attempts[spec.index] += 1
        running[call(workers[slot], spec)] = (slot, spec)

    def release(slot: int) -> None:
        # Nothing left to assign: free its CPUs now rather than at the end of the run.
        if before_kill is not None:
            before_kill([workers[slot]])
        ray.kill(workers[slot], no_restart=True)
        released.append(workers[slot])
        workers[slot] = None

    try:
        for slot in range(len(workers)):
            submit(slot)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=wait_s)
            if on_wait is not None:
                on_wait()
            if not ready:
                continue
            [future] = ready
            slot, spec = running.pop(future)
            try:
                result = ray.get(future)
            except ray.exceptions.RayActorError:
                if attempts[spec.index] >= MAX_ATTEMPTS:
                    raise WorkerDiedError(f"{name_of(spec)}: worker died {MAX_ATTEMPTS} times (killed, or out of memory)") from None
                if on_retry is not None:
                    on_retry(spec)
                workers[slot] = new_worker(slot)
                queue.insert(0, spec)
                submit(slot)
                continue
            except ray.exceptions.RayTaskError as error:
                raise translate_error(error) from None
            yield spec, result
            if queue:
                submit(slot)
            else:
                release(slot)
    finally:
        if before_kill is not None:
            before_kill([w for w in workers if w is not None])
        kill_and_wait([*released, *(w for w in workers if w is not None)])


def worker_problem(error: Exception, *, node: str, paths: tuple[str, ...]) -> str:
    """The one line of a worker that could not start: the node and the real cause first, and when
    one of its `paths` (--out, --corpus) is on a store the usual reason (docs/cluster.md: every
    node needs the store's AWS_* environment)."""
    line = f"node {node}: {first_line(error)}"
    if isinstance(error, OSError) and any(is_url(where) for where in paths):
        line += "; every node needs the store's credentials and endpoint in its environment (AWS_ACCESS_KEY_ID, ...)"
    return line


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


def actor_prefix(out, *, stage: str) -> str:
    """Name prefix of the actors of every run of `stage` ("cache" builds, "regenerate") on `out` (a
    path, or an object-store URL taken as it is): the stage is in it, so one stage given the
    other's --out by mistake never stops the other's live actors."""
    key = str(out) if is_url(out) else str(Path(out).resolve())
    return f"{stage}-worker-" + hashlib.sha256(key.encode()).hexdigest()[:16] + "-"


def stop_earlier_workers(out, *, stage: str = "cache", log=print) -> int:
    """Kill the actors an earlier run of `stage` on `out` still runs (a killed driver's orphans,
    which Ray reaps only eventually) and wait until they are gone; returns how many there were."""
    prefix = actor_prefix(out, stage=stage)
    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != ACTOR_NAMESPACE or not entry["name"].startswith(prefix):
            continue
        try:
            handles.append(ray.get_actor(entry["name"], namespace=ACTOR_NAMESPACE))
        except ValueError:  # gone meanwhile
            continue
        except AssertionError:  # its job already cleaned up by Ray (its class is gone: Ray's ensure_str(None)); being reaped
            continue  # such an orphan cannot publish once this build has claimed --out (storage.ownership.owner_lock)
    if handles:
        log(f"stopping {len(handles)} worker(s) of an earlier {'build' if stage == 'cache' else stage} on {out}")
        kill_and_wait(handles)
    return len(handles)


def remove_workers_copies(handles: list, *, timeout: float = COPY_CLEANUP_WAIT_S) -> None:
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


def wait_for_resources(compute, num_workers: int, *, log, timeout: float = RESOURCE_WAIT_S) -> None:
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
    prefix = actor_prefix(out, stage=stage)
    options = dict(num_cpus=compute.cpus_per_worker, num_gpus=compute.gpus_per_worker, namespace=ACTOR_NAMESPACE)

    def new_worker(slot: int):
        return actor_class.options(name=prefix + uuid.uuid4().hex, scheduling_strategy=placements[slot], **options).remote(*args)

    return new_worker


def plain_error(error: "ray.exceptions.RayTaskError") -> Exception:
    """The actor's own error without Ray's wrapping and remote traceback: an OSError (full disk,
    read-only filesystem) or ValueError stays what it is, in one line."""
    cause = error.cause
    if isinstance(cause, OSError):
        return OSError(cause.errno, cause.strerror, cause.filename) if cause.errno else OSError(str(cause))
    if isinstance(cause, ValueError):
        return ValueError(first_line(cause))
    return error
