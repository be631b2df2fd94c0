"""A list of specs worked off by a pool of Ray actors: the cache build's shards (ray_jobs/build.py)
and regeneration's parts (ray_jobs/regenerate.py). Every actor is kept busy with one spec; a
finished spec goes to the caller at once; a spec whose actor died (OOM, preemption, kill: nothing
of it was published) goes to a fresh actor in the same slot, at most MAX_ATTEMPTS times; an actor
with nothing left to do is released at once; every actor is stopped when the pool ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

class WorkerDiedError(ValueError):
    """A spec whose workers died MAX_ATTEMPTS times: a ValueError, so the CLIs print its one line."""


MAX_ATTEMPTS = 3  # a spec whose worker died this many times stops the run
ACTOR_EXIT_WAIT_S = 60.0  # how long to wait for killed actors to be gone


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
    pending: list, *, new_worker: Callable[[int], object], num_workers: int, call: Callable, on_result: Callable,
    name_of: Callable[[object], str], translate_error: Callable[[Exception], Exception],
    before_kill: Callable[[list], None] | None = None, on_retry: Callable | None = None,
    on_wait: Callable[[], None] | None = None, wait_s: float | None = None,
) -> None:  # fmt: skip
    """Work off `pending` (specs with an `index`) on `num_workers` actors from `new_worker(slot)`.
    `call(actor, spec)` starts a spec and returns its object ref; `on_result(spec, result,
    num_done)` runs as each finishes; an actor's own error leaves as `translate_error(error)`, a
    spec whose workers died MAX_ATTEMPTS times as a WorkerDiedError naming `name_of(spec)`.
    `before_kill(actors)` runs on live actors before they are killed (a kill runs no cleanup of
    theirs: the build's workers remove their node-local store copies there). `on_retry(spec)` runs
    when a spec goes back to the queue after its actor died; `on_wait()` at least every `wait_s`
    seconds while specs run (the build takes its workers' batch reports there)."""
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
            on_result(spec, result, len(pending) - len(queue) - len(running))
            if queue:
                submit(slot)
            else:
                release(slot)
    finally:
        if before_kill is not None:
            before_kill([w for w in workers if w is not None])
        kill_and_wait([*released, *(w for w in workers if w is not None)])
