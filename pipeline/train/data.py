"""Where the data of a step comes from and where it stands: both loaders behind one interface.
`make_batches` gives this rank's micro-batches from a start step on (the map loader: a seeded
sampler of (epoch, index) keys over any cache; the stream: webdataset's pipeline over a wds
cache), `data_position` where the data stands after a step (stored in checkpoints, checked on
resume), `stop_map_loader_workers` the end of the map loader's workers (docs/design.md, "A
training step").
"""

from __future__ import annotations

import bisect
import contextlib
from functools import partial

import torch

from pipeline.train.batching import CacheTrainDataset, StepSampler, collate
from pipeline.train.config import TrainConfig
from pipeline.train.streaming import StreamTrainDataset, stream_batches, stream_position


def make_batches(config: TrainConfig, reader, objective, *, plan, epoch_steps: list[int], start_step: int, rank: int,
             world_size: int, device: torch.device):  # fmt: skip
    """Iterator over this rank's micro-batches from `start_step` on: the map loader (a sampler of
    (epoch, index) keys) or the stream (one webdataset pipeline per epoch), as --loader says."""
    optim = config.optim
    if plan is not None:
        dataset = StreamTrainDataset(plan, objective=objective, feature_codec=reader.feature_codec)
        make_loader = partial(data_loader, config=config, device=device, batch_size=None, collate_fn=_as_is)
        return stream_batches(dataset, epoch_steps=epoch_steps, start_step=start_step, make_loader=make_loader)
    sampler = StepSampler(
        len(reader), batch_size=optim.batch_size, grad_accum=optim.grad_accum, epochs=optim.epochs,
        seed=config.seed, rank=rank, world_size=world_size, start_step=start_step,
    )  # fmt: skip
    dataset = CacheTrainDataset(reader, objective=objective, seed=config.seed)
    return iter(data_loader(dataset, config=config, device=device, batch_sampler=sampler, collate_fn=collate))


def data_position(step: int, *, epoch_ends: list[int], plan) -> dict:
    """Where the data stands after `step` steps (stored in checkpoints, checked on resume)."""
    epoch = bisect.bisect_right(epoch_ends, step)
    done = step - (epoch_ends[epoch - 1] if epoch else 0)
    if plan is None or done == 0:  # (at an epoch's start no worker has delivered anything yet)
        return {"loader": "map" if plan is None else "stream", "epoch": epoch, "steps_into_epoch": done}
    # Rank 0's: the one every rank computes alike (each checks a resume against what rank 0 stored).
    return {"loader": "stream", **stream_position(plan, epoch=epoch, steps_done=done, rank=0)}


def stream_epoch_steps(plan, num_epochs: int) -> list[int]:
    steps = [plan.epoch_steps(epoch) for epoch in range(num_epochs)]
    if min(steps) == 0:
        epoch = steps.index(0)
        raise ValueError(
            f"--loader stream: epoch {epoch} has no full step on some rank ({len(plan.shards)} shards split over "
            f"{plan.world_size} rank(s) x {plan.num_streams} stream(s), micro-batches of {plan.micro_batch}); "
            "use fewer --num-workers, a smaller --batch-size or more, smaller shards"
        )
    return steps


def data_loader(dataset, *, config: TrainConfig, device: torch.device, **kwargs) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        num_workers=config.loader.num_workers,
        prefetch_factor=config.loader.prefetch if config.loader.num_workers else None,
        pin_memory=device.type == "cuda",
        worker_init_fn=single_threaded_worker,
        **kwargs,
    )


def stop_map_loader_workers(batches) -> None:
    """Stop the map loader's DataLoader workers once the last step has its batches. They would live
    on until the interpreter exits, and one that dies then (killed, out of memory) makes torch's
    SIGCHLD handler raise wherever the main thread is: in the final save, or in an atexit hook as a
    traceback after the run ended (found by benchmarks/harness/chaos.py; docs/failure-modes.md). Stopped,
    their pids are no longer watched. The stream loader stops its own (`close`)."""
    with contextlib.suppress(Exception):  # never hides the run's own error
        getattr(batches, "_shutdown_workers", lambda: None)()


def _as_is(item):
    return item


def single_threaded_worker(worker_id: int) -> None:
    # Data workers build labels with small tensor ops and decode Blosc chunks; several
    # multi-threaded workers next to the training process would oversubscribe the cores (the
    # default --num-workers already takes one per core) and stall the training step.
    from numcodecs import blosc

    torch.set_num_threads(1)
    blosc.set_nthreads(1)
