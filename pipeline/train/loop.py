"""`alrira-train`: train a drafter of any family (drafter/families.py) from a stage-1 cache, never loading the target.

Every method (dflash, kd, erase, erase_hard, alr, alr_gate, alr_ira, slot_control) runs the same
loop; what differs is only `pipeline.train.labels.build_block_targets`, called in the data workers.
Data parallel under torchrun (gloo on CPU, nccl on GPU):

    torchrun --nproc-per-node 8 -m pipeline.train --cache CACHE --method alr_ira --out runs/x

The run reads top to bottom: `setup` resolves everything once (pipeline/train/setup.py), each step
is `train_step` (its math in pipeline/train/step.py, its data from pipeline/train/data.py), rank 0
logs, checkpoints (pipeline/train/checkpoints.py) and exports (pipeline/train/run_dir.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pipeline.outputs import output_lock
from pipeline.provenance import append_provenance
from pipeline.train.batching import ReadFailure, TrainBatch
from pipeline.train.checkpoints import save_checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.data import stop_map_loader_workers
from pipeline.train.eval_split import evaluate_split
from pipeline.train.preflight import check_run_dir
from pipeline.train.run_dir import RunLogs, save_drafter_to, summarize_history
from pipeline.train.setup import TrainState, setup
from pipeline.train.step import StepStats, all_reduce_on, forward_loss, lr_at
from storage.atomic import atomic_write_text
from storage.local_cache import sweep_orphans
from storage.location import is_url, resolve

PROVENANCE_FILE = "provenance.json"


@dataclass(kw_only=True)
class StepResult:
    """One step's figures, left on the device; only a logged step reads them (`step_record`)."""

    step: int  # 0-based
    lr: float
    totals: StepStats  # this rank's sums, detached
    grad_norm: torch.Tensor  # [] the clipped gradients' norm before clipping
    num_tokens: int  # this rank's corpus tokens


def train_step(s: TrainState, config: TrainConfig, step: int) -> StepResult:
    """One optimizer step over this rank's micro-batches. Nothing here waits on the device: the
    supervised slots' indices come with the batch and the metrics stay where they are."""
    micro_batches = [_next_batch(s) for _ in range(config.optim.grad_accum)]
    weight_total = all_reduce_on(sum(b.slot_weights.sum() for b in micro_batches).double(), device=s.device, world_size=s.world_size)
    lr = lr_at(step, total_steps=s.total_steps, peak_lr=config.optim.lr, warmup_frac=config.optim.warmup_frac)
    for param_group in s.optimizer.param_groups:
        param_group["lr"] = lr
    totals = None
    for i, batch in enumerate(micro_batches):
        sync = s.world_size == 1 or i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else s.model.no_sync():
            stats = forward_loss(
                s.model, batch, embed_tokens=s.embed_tokens, lm_head=s.lm_head, block_size=s.block_size,
                loss_chunk=config.optim.loss_chunk, autocast=s.autocast, attention=s.attention,
                options=s.family_options,
            )  # fmt: skip
            # DDP averages gradients over ranks; scaling by world_size makes that the global mean.
            (stats.loss_sum * (s.world_size / (weight_total.float() + 1e-6))).backward()
        totals = stats.detached() if totals is None else totals + stats.detached()
    grad_norm = torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), config.optim.grad_clip)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return StepResult(step=step, lr=lr, totals=totals, grad_norm=grad_norm.detach(), num_tokens=sum(b.num_tokens for b in micro_batches))


def is_logged(step: int, *, log_every: int, last_step: int) -> bool:
    """Whether 0-based `step` is read and logged: every log_every-th step and the run's last."""
    return (step + 1) % log_every == 0 or step + 1 == last_step


def is_evaluated(step: int, *, eval_every: int, last_step: int) -> bool:
    """Whether 0-based `step` is followed by a tau evaluation on the split: every eval_every-th and the run's last."""
    return (eval_every > 0 and (step + 1) % eval_every == 0) or step + 1 == last_step


def step_record(s: TrainState, window: list[StepResult], *, seconds: float) -> dict:
    """The metrics record of the last step of `window` (the steps since the previous logged one),
    summed over ranks, with the window's corpus tokens/s. Every rank calls it on the same steps
    (one collective); its one copy to the host is the only sync of the step."""
    last = window[-1]
    totals = last.totals.all_reduced(device=s.device, world_size=s.world_size)
    num_tokens = torch.tensor([float(sum(r.num_tokens for r in window))], dtype=torch.float64, device=s.device)
    num_tokens = all_reduce_on(num_tokens, device=s.device, world_size=s.world_size)
    loss = totals.loss_sum / (totals.weight_sum + 1e-6)
    flat = torch.cat([loss[None], last.grad_norm.double()[None], num_tokens, totals.slot_correct, totals.slot_count])
    loss, grad_norm, tokens, *counts = flat.tolist()  # the host sync
    correct, count = counts[: s.num_slots], counts[s.num_slots :]
    return {
        "step": last.step + 1,
        "epoch": s.epoch_of(last.step),
        "loss": loss,
        "lr": last.lr,
        "grad_norm": grad_norm,
        "slot_acc": [round(c / max(n, 1.0), 5) for c, n in zip(correct, count)],
        "supervised_slots": int(sum(count)),
        "tokens_per_s": tokens / max(seconds, 1e-9),
    }


def _next_batch(s: TrainState) -> TrainBatch:
    batch = next(s.batches)
    if isinstance(batch, ReadFailure):
        raise ValueError(batch.message)
    return batch.to(s.device)


def train(config: TrainConfig) -> dict:
    """Train a drafter into --out. A local --cache is recorded resolved (train_config.json is read
    from other directories: `alrira-eval cost`); rank 0 holds --out's lock (pipeline/outputs.py)
    for the whole run, so a second process on the same --out refuses."""
    if not is_url(config.cache):
        config = replace(config, cache=str(Path(config.cache).resolve()))
    if int(os.environ.get("RANK", "0")) != 0 or is_url(config.out):
        return _train(config)
    if resolve(config.cache).is_file("manifest.json"):  # before the lock: never a lock file in a cache
        check_run_dir(resolve(config.out), cache=resolve(config.cache))
    with output_lock(config.out, command="alrira-train"):
        return _train(config)


def record_provenance(s: TrainState) -> None:
    """RUN/provenance.json: one entry per invocation of this run (a resume adds one) with the exact
    command, package versions, source revision and the resolved config, `auto` resolved (precision,
    attention kernel, loader workers) (pipeline/provenance.py). A new run starts the file afresh."""
    if not s.start_step and s.run.is_file(PROVENANCE_FILE):
        s.run.remove(PROVENANCE_FILE)
    append_provenance(s.run, PROVENANCE_FILE, {**s.settings, "attention_kernel": s.attention, "start_step": s.start_step})


def _train(config: TrainConfig) -> dict:
    s = setup(config)  # the map loader's workers run from here on: every exit below stops them (finally)
    settings, logs, method = s.settings, None, config.objective.method
    history, started = [], time.time()
    try:
        if s.rank == 0:  # first: what marks --out as a run (pipeline/train/preflight.py) for the other ranks' checks
            s.run.make_dirs()
            atomic_write_text(s.run.join("train_config.json"), json.dumps(settings, indent=2))
            record_provenance(s)
        logs = RunLogs.open(s.run, start_step=s.start_step) if s.rank == 0 else None
        bar = tqdm(total=s.last_step, initial=s.start_step, unit="step", desc=method, disable=s.rank != 0 or not config.progress)
        window, window_start = [], time.time()
        for step in range(s.start_step, s.last_step):
            window.append(train_step(s, config, step))
            evaluated = is_evaluated(step, eval_every=config.eval_every, last_step=s.last_step) and s.eval_split is not None
            if evaluated or is_logged(step, log_every=config.log_every, last_step=s.last_step):
                record = step_record(s, window, seconds=time.time() - window_start)
                if evaluated and s.rank == 0:  # the split is rank 0's; nothing collective in it
                    record["eval"] = evaluate_split(
                        s.drafter, s.eval_split, embed_tokens=s.head["embed_tokens.weight"], lm_head=s.head["lm_head.weight"],
                        device=s.device,
                    )  # fmt: skip
                window, window_start = [], time.time()
                history.append(record)
                if logs is not None:
                    logs.add(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", acc1=f"{record['slot_acc'][0]:.3f}")
            if s.rank != 0:
                continue
            bar.update(1)
            end_of_epoch = (step + 1) in s.epoch_ends
            if end_of_epoch or (config.checkpoint.save_every and (step + 1) % config.checkpoint.save_every == 0):
                logs.publish()  # on a store: the metrics up to this step, before the checkpoint commits
                save_checkpoint(
                    s.run, step=step + 1, model=s.drafter, optimizer=s.optimizer, settings=settings,
                    data_position=s.data_position(step + 1),
                )  # fmt: skip
        stop_map_loader_workers(s.batches)
        bar.close()
        summary = {"run": str(s.run), "method": method, "steps": s.last_step, "elapsed_s": time.time() - started}
        if logs is not None:
            logs.close()
            save_drafter_to(s.run, s.drafter, dtype=getattr(torch, config.checkpoint.save_dtype))
            summary.update(summarize_history(history, num_slots=s.num_slots))
            atomic_write_text(s.run.join("summary.json"), json.dumps(summary, indent=2))  # last: the run is done
    finally:
        if logs is not None:
            logs.discard()
        stop_map_loader_workers(s.batches)
        if config.loader.kind == "stream":
            with contextlib.suppress(Exception):  # never hides the run's own error
                getattr(s.batches, "close", lambda: None)()  # stops the last epoch's workers
            with contextlib.suppress(OSError):
                sweep_orphans(config.loader.local_cache_root)  # copies of workers stopped at an epoch's end
    if s.world_size > 1:
        dist.barrier()
    return summary
