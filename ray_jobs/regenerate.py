"""The Ray side of `alrira-cache regenerate`: the build's actor pool (ray_jobs/pool.py: the same
--workers / --gpus-per-worker / --workers-per-node placement, capacity check, resource wait and
orphan stop), each actor loading the target once and writing whole parts itself. Only `PartSpec`s
go out and part records come back; planning, resume and the manifest are
`pipeline.regenerate.driver`'s (docs/design.md, "Regeneration").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ray
from tqdm.auto import tqdm

from pipeline.corpus_source import file_sha256, remove_pins
from pipeline.regenerate import driver
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.driver import RegeneratePlan
from pipeline.regenerate.parts import PartSpec, PartWriter, part_name
from ray_jobs.pool import (
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
from storage.errors import first_line
from storage.location import is_url, remove_local_copies

STAGE = "regenerate"  # its actors' name prefix (ray_jobs/pool.py actor_prefix): a build's never match


@ray.remote
class RegenerateWorker:
    """A Ray actor around PartWriter. A node whose --target or --corpus differs from the driver's writes
    nothing: its first part fails with that one line, as does one whose PartWriter cannot start
    (as in the build's CacheWorker)."""

    def __init__(self, config: RegenerateConfig, driver_target_hash: str, driver_corpus_hash: str):
        node = this_node()
        self.problem = target_problem(config.target, driver_target_hash=driver_target_hash, node=node)
        self.problem = self.problem or corpus_problem(config.corpus, driver_corpus_hash=driver_corpus_hash, node=node)
        self.writer = None
        if not self.problem:
            try:  # a failing load is this node's one line, not a worker death retried MAX_ATTEMPTS times
                self.writer = PartWriter(config)
            except Exception as error:  # any failure to start (a damaged file, a library's error): its own first line
                self.problem = worker_problem(error, node=node, paths=(config.out, config.corpus))

    def write(self, spec: PartSpec) -> tuple[dict, str]:
        if self.problem:
            raise ValueError(self.problem)
        return self.writer.write(spec), this_node()

    def pid(self) -> int:
        return os.getpid()

    def remove_local_copies(self) -> int:
        """Remove the node-local copies of a store corpus this actor made and its own links to them
        (pipeline/corpus_source.py pinned_local_corpus)."""
        return len(remove_local_copies()) + len(remove_pins())


def corpus_problem(corpus: str, *, driver_corpus_hash: str, node: str) -> str | None:
    """Why `node` cannot read the driver's rows from its copy of `corpus`, or None: every node reads
    the corpus itself, at the same path (docs/cluster.md, "The target on every node")."""
    try:
        found = file_sha256(corpus)  # a store corpus: of this node's copy
    except (OSError, ValueError) as error:
        if is_url(corpus):
            return f"node {node}: --corpus {corpus}: {first_line(error)}"
        return f"node {node}: --corpus {corpus}: not found there; every node needs the corpus at the same path"
    if found != driver_corpus_hash:
        return (
            f"node {node}: --corpus {corpus} holds other rows than the driver's (corpus hash "
            f"{found.removeprefix('sha256:')[:12]}, driver {driver_corpus_hash.removeprefix('sha256:')[:12]})"
        )
    return None


def regenerate_corpus(config: RegenerateConfig, *, progress: bool = True, log=print) -> dict:
    """Regenerate or resume `config.corpus` into `config.out` on a Ray cluster; the final manifest.
    The run is planned (plan_regenerate: a mistyped --out is refused there) before any actor of an
    earlier run on --out is stopped; the pool's parts are published as they come back."""
    compute = config.compute
    connect_ray(compute.ray_address)
    placements = plan_pool(compute, workers_per_node=compute.workers_per_node)
    with driver.regenerate_lock(config):  # a second run on this --out refuses here, before it stops the first one's actors
        try:
            plan = driver.plan_regenerate(config)
            stop_earlier_workers(config.out, stage=STAGE, log=log)  # a killed run's actors must not write while this one starts
            wait_for_resources(compute, len(placements), log=log)
            book = driver.started_parts(plan, log=log)
            if plan.pending:  # closed when the block ends: a failed publish stops the pool first
                records = run_parts_on_ray(plan, plan.pending, placements=placements, progress=progress)
                with contextlib.closing(records):
                    for record in records:
                        book.publish(record)
            return book.finish()
        finally:
            remove_local_copies()  # the driver's node-local copies of a store corpus (its workers remove theirs)
            remove_pins()


def run_parts_on_ray(plan: RegeneratePlan, pending: list[PartSpec], *, placements: list, progress: bool = True) -> Iterator[dict]:
    """Keep every actor busy with one part (ray_jobs/pool.py), yielding each finished part's record
    (with the node that wrote it) as it comes back."""
    config = plan.config
    placements = placements[: len(pending)]
    new_worker = actor_factory(
        RegenerateWorker, out=config.out, compute=config.compute, placements=placements,
        args=(config, plan.provenance["target_hash"], plan.provenance["corpus_hash"]), stage=STAGE,
    )  # fmt: skip
    bar = tqdm(total=sum(s.stop - s.start for s in pending), unit="row", desc="regenerate", disable=not progress)
    results = run_pool(
        pending, new_worker=new_worker, num_workers=len(placements), call=lambda worker, spec: worker.write.remote(spec),
        name_of=lambda spec: part_name(spec.index), translate_error=plain_error, before_kill=remove_workers_copies,
    )  # fmt: skip
    try:
        with contextlib.closing(results):
            for spec, (record, node) in results:
                yield {**record, "node": node}
                bar.update(spec.stop - spec.start)
    finally:
        bar.close()
