"""The Ray side of `alrira-cache regenerate`: the build's actor pool (ray_jobs/build.py: the same
--workers / --gpus-per-worker / --workers-per-node placement, capacity check, resource wait and
orphan stop), each actor loading the target once and writing whole parts itself. Only `PartSpec`s
go out and part records come back; planning, resume and the manifest are
`pipeline.regenerate.driver`'s (docs/design.md, "Regeneration").
"""

from __future__ import annotations

import functools
import os
import uuid

import ray
from tqdm.auto import tqdm

from pipeline.regenerate import driver
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.parts import PartSpec, PartWriter, part_name
from pipeline.target import target_hash
from ray_jobs.build import (
    ACTOR_NAMESPACE,
    MAX_SHARD_ATTEMPTS,
    _actor_prefix,
    _kill_and_wait,
    _plain_error,
    _wait_for_resources,
    check_capacity,
    plan_pool,
    stop_earlier_workers,
    target_problem,
    this_node,
)


@ray.remote
class RegenerateWorker:
    """A Ray actor around PartWriter. A node whose --target differs from the driver's writes
    nothing: its first part fails with that one line (as in the build's CacheWorker)."""

    def __init__(self, config: RegenerateConfig, driver_target_hash: str):
        self.problem = target_problem(config.target, driver_target_hash=driver_target_hash, node=this_node())
        self.writer = None if self.problem else PartWriter(config)

    def write(self, spec: PartSpec) -> tuple[dict, str]:
        if self.problem:
            raise ValueError(self.problem)
        return self.writer.write(spec), this_node()

    def pid(self) -> int:
        return os.getpid()


def regenerate_corpus(config: RegenerateConfig, *, progress: bool = True, log=print) -> dict:
    """Regenerate or resume `config.corpus` into `config.out` on a Ray cluster; the final manifest."""
    compute = config.compute
    if not ray.is_initialized():
        ray.init(address=compute.ray_address, logging_level="WARNING", include_dashboard=False)
    placements = plan_pool(compute, workers_per_node=compute.workers_per_node)
    check_capacity(compute, len(placements))
    stop_earlier_workers(config.out, log=log)  # a killed run's actors must not write while this one starts
    _wait_for_resources(compute, len(placements), log=log)
    run_parts = functools.partial(run_parts_on_ray, placements=placements, progress=progress, log=log)
    return driver.regenerate_corpus(config, run_parts=run_parts, log=log)


def run_parts_on_ray(
    config: RegenerateConfig, pending: list[PartSpec], publish, *, placements: list, progress: bool = True, log=print
) -> None:
    """Keep every actor busy with one part; publish each finished part at once. A part whose actor
    died is given to a fresh actor (at most MAX_SHARD_ATTEMPTS times)."""
    compute = config.compute
    placements = placements[: len(pending)]
    prefix, driver_target_hash = _actor_prefix(config.out), target_hash(config.target)
    options = dict(num_cpus=compute.cpus_per_worker, num_gpus=compute.gpus_per_worker, namespace=ACTOR_NAMESPACE)

    def new_worker(slot: int):
        actor = RegenerateWorker.options(name=prefix + uuid.uuid4().hex, scheduling_strategy=placements[slot], **options)
        return actor.remote(config, driver_target_hash)

    workers = [new_worker(slot) for slot in range(len(placements))]
    queue, attempts, running = list(pending), {spec.index: 0 for spec in pending}, {}
    bar = tqdm(total=sum(s.stop - s.start for s in pending), unit="row", desc="regenerate", disable=not progress)

    def submit(slot: int) -> None:
        spec = queue.pop(0)
        attempts[spec.index] += 1
        running[workers[slot].write.remote(spec)] = (slot, spec)

    try:
        for slot in range(len(workers)):
            submit(slot)
        while running:
            [future], _ = ray.wait(list(running), num_returns=1)
            slot, spec = running.pop(future)
            try:
                record, node = ray.get(future)
            except ray.exceptions.RayActorError:
                if attempts[spec.index] >= MAX_SHARD_ATTEMPTS:
                    raise RuntimeError(f"{part_name(spec.index)}: worker died {MAX_SHARD_ATTEMPTS} times") from None
                workers[slot] = new_worker(slot)
                queue.insert(0, spec)
                submit(slot)
                continue
            except ray.exceptions.RayTaskError as error:
                raise _plain_error(error) from None
            publish({**record, "node": node})
            bar.update(spec.stop - spec.start)
            if queue:
                submit(slot)
    finally:
        bar.close()
        _kill_and_wait(workers)
