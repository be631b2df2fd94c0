"""Where the data of a step comes from and where it stands: both loaders behind one interface.
`make_batches` gives this rank's micro-batches from a start step on (the map loader: a seeded
sampler of (epoch, index) keys over any cache; the stream: webdataset's pipeline over a wds
cache), `release_loader` the end of the loader's workers (docs/design.md, "A training step");
where the data stands after a step is streaming.py's `data_position`.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from pipeline.train.batching import CacheTrainDataset, StepSampler, collate
from pipeline.train.config import LoaderConfig
from pipeline.train.streaming import StreamTrainDataset, stream_batches
from storage.local_cache import sweep_orphans


def make_batches(plan):
    """This rank's micro-batches from the plan's start step on (pipeline/train/plan.py), an iterable
    whose workers start when it is iterated: the map loader (a sampler of (epoch, index) keys) or the
    stream (one webdataset pipeline per epoch), as --loader says."""
    config, reader, ranks = plan.config, plan.reader, plan.ranks
    loader = partial(data_loader, loader=config.loader, device=ranks.device)
    if plan.stream is not None:
        dataset = StreamTrainDataset(plan.stream, objective=plan.objective, feature_codec=reader.feature_codec)
        return stream_batches(dataset, epoch_steps=plan.epoch_steps, start_step=plan.start_step,
                              make_loader=partial(loader, batch_size=None, collate_fn=_as_is))  # fmt: skip
    optim = config.optim
    sampler = StepSampler(
        len(reader), batch_size=optim.batch_size, grad_accum=optim.grad_accum, epochs=optim.epochs,
        seed=config.seed, rank=ranks.rank, world_size=ranks.world_size, start_step=plan.start_step,
    )  # fmt: skip
    dataset = CacheTrainDataset(reader, objective=plan.objective, seed=config.seed)
    return loader(dataset, batch_sampler=sampler, collate_fn=collate)


def data_loader(dataset, *, loader: LoaderConfig, device: torch.device, **kwargs) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch if loader.num_workers else None,
        pin_memory=device.type == "cuda",
        worker_init_fn=single_threaded_worker,
        **kwargs,
    )


def release_loader(batches, *, loader: LoaderConfig) -> None:
    """End the loader's workers once the run's last step has its batches (or the run failed).
    The map loader's would live on until the interpreter exits, and one that dies then (killed, out
    of memory) makes torch's SIGCHLD handler raise wherever the main thread is: in the final save,
    or in an atexit hook as a traceback after the run ended (found by benchmarks/harness/chaos.py;
    docs/failure-modes.md); stopped, their pids are no longer watched. The stream's last epoch's
    workers are stopped too, and the local copies of workers stopped at an epoch's end swept."""
    with contextlib.suppress(Exception):  # never hides the run's own error
        getattr(batches, "_shutdown_workers", lambda: None)()
    if loader.kind == "stream":
        with contextlib.suppress(Exception):
            getattr(batches, "close", lambda: None)()
        with contextlib.suppress(OSError):
            sweep_orphans(loader.local_cache_root)


def _as_is(item):
    return item


def single_threaded_worker(worker_id: int) -> None:
    # Data workers build labels with small tensor ops and decode Blosc chunks; several
    # multi-threaded workers next to the training process would oversubscribe the cores (the
    # default --num-workers already takes one per core) and stall the training step.
    from numcodecs import blosc

    torch.set_num_threads(1)
    blosc.set_nthreads(1)
