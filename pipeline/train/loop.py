"""`alrira-train`: train a drafter of any family (drafter/families.py) from a stage-1 cache, never loading the target.

Every method (dflash, kd, erase, erase_hard, alr, alr_gate, alr_ira, slot_control) runs the same
loop; what differs is only `pipeline.train.labels.build_block_targets`, called in the data workers.
Data parallel under torchrun (gloo on CPU, nccl on GPU):

    torchrun --nproc-per-node 8 -m pipeline.train --cache CACHE --method alr_ira --out runs/x

The run reads top to bottom: `plan_training` resolves and checks everything once into a frozen plan
(pipeline/train/plan.py), `setup` builds the drafter, optimizer and batches from it
(pipeline/train/setup.py), each step is `train_step` (its math in pipeline/train/step.py, its data
from pipeline/train/data.py), rank 0 logs, checkpoints (pipeline/train/checkpoints.py) and exports
(pipeline/train/run_dir.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pipeline.outputs import output_lock
from pipeline.train.batching import ReadFailure, TrainBatch
from pipeline.train.checkpoints import save_checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.data import release_loader
from pipeline.train.eval_split import evaluate_split
from pipeline.train.run_dir import RunLogs
from pipeline.train.plan import TrainPlan, open_run, plan_training
from pipeline.train.setup import TrainState, setup
from pipeline.train.step import StepStats, all_reduce_on, forward_loss, lr_at
from storage.location import is_url


@dataclass(kw_only=True)
class StepResult:
    """One step's figures, left on the device; only a logged step reads them (`step_record`)."""

    step: int  # 0-based
    lr: float
    totals: StepStats  # this rank's sums, detached
    grad_norm: torch.Tensor  # [] the clipped gradients' norm before clipping
    num_tokens: int  # this rank's corpus tokens


def train_step(plan: TrainPlan, s: TrainState, step: int) -> StepResult:
    """One optimizer step over this rank's micro-batches. Nothing here waits on the device: the
    supervised slots' indices come with the batch and the metrics stay where they are."""
    optim, ranks = plan.config.optim, plan.ranks
    micro_batches = [_next_batch(s, device=ranks.device) for _ in range(optim.grad_accum)]
    weight_total = all_reduce_on(sum(b.slot_weights.sum() for b in micro_batches).double(), device=ranks.device, world_size=ranks.world_size)
    lr = lr_at(step, total_steps=plan.total_steps, peak_lr=optim.lr, warmup_frac=optim.warmup_frac)
    for param_group in s.optimizer.param_groups:
        param_group["lr"] = lr
    totals = None
    for i, batch in enumerate(micro_batches):
        sync = ranks.world_size == 1 or i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else s.model.no_sync():
            stats = forward_loss(
                s.model, batch, embed_tokens=s.embed_tokens, lm_head=s.lm_head, block_size=plan.block_size,
                loss_chunk=optim.loss_chunk, autocast=s.autocast, attention=plan.attention, options=plan.drafter.options,
            )  # fmt: skip
            # DDP averages gradients over ranks; scaling by world_size makes that the global mean.
            (stats.loss_sum * (ranks.world_size / (weight_total.float() + 1e-6))).backward()
        totals = stats.detached() if totals is None else totals + stats.detached()
    grad_norm = torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), optim.grad_clip)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return StepResult(step=step, lr=lr, totals=totals, grad_norm=grad_norm.detach(), num_tokens=sum(b.num_tokens for b in micro_batches))


def is_logged(step: int, *, log_every: int, last_step: int) -> bool:
    """Whether 0-based `step` is read and logged: every log_every-th step and the run's last."""
    return (step + 1) % log_every == 0 or step + 1 == last_step


def is_evaluated(step: int, *, eval_every: int, last_step: int) -> bool:
    """Whether 0-based `step` is followed by a tau evaluation on the split: every eval_every-th and the run's last."""
    return (eval_every > 0 and (step + 1) % eval_every == 0) or step + 1 == last_step


def step_record(plan: TrainPlan, window: list[StepResult], *, seconds: float) -> dict:
    """The metrics record of the last step of `window` (the steps since the previous logged one),
    summed over ranks, with the window's corpus tokens/s. Every rank calls it on the same steps
    (one collective); its one copy to the host is the only sync of the step."""
    last, ranks = window[-1], plan.ranks
    totals = last.totals.all_reduced(device=ranks.device, world_size=ranks.world_size)
    num_tokens = torch.tensor([float(sum(r.num_tokens for r in window))], dtype=torch.float64, device=ranks.device)
    num_tokens = all_reduce_on(num_tokens, device=ranks.device, world_size=ranks.world_size)
    loss = totals.loss_sum / (totals.weight_sum + 1e-6)
    flat = torch.cat([loss[None], last.grad_norm.double()[None], num_tokens, totals.slot_correct, totals.slot_count])
    loss, grad_norm, tokens, *counts = flat.tolist()  # the host sync
    correct, count = counts[: plan.num_slots], counts[plan.num_slots :]
    return {
        "step": last.step + 1,
        "epoch": plan.epoch_of(last.step),
        "loss": loss,
        "lr": last.lr,
        "grad_norm": grad_norm,
        "slot_acc": [round(c / max(n, 1.0), 5) for c, n in zip(correct, count)],
        "supervised_slots": int(sum(count)),
        "tokens_per_s": tokens / max(seconds, 1e-9),
    }


def _next_batch(s: TrainState, *, device: torch.device) -> TrainBatch:
    batch = next(s.batches)
    if isinstance(batch, ReadFailure):
        raise ValueError(batch.message)
    return batch.to(device)


def train(config: TrainConfig) -> dict:
    """Train a drafter into --out. A local --cache is recorded resolved (train_config.json is read
    from other directories: `alrira-eval cost`); rank 0 holds --out's lock (pipeline/outputs.py)
    for the whole run, planning included, so a second process on the same --out refuses."""
    if not is_url(config.cache):
        config = replace(config, cache=str(Path(config.cache).resolve()))
    places = open_run(config)  # before the lock: never a lock file in a cache or a stranger's folder
    locked = int(os.environ.get("RANK", "0")) == 0 and places.run.is_local
    with output_lock(config.out, command="alrira-train") if locked else contextlib.nullcontext():
        plan = plan_training(config, places=places)
        return run_training(plan)


def run_training(plan: TrainPlan) -> dict:
    """Build the run from its plan and step it to the end (the module docstring)."""
    s = setup(plan)  # the map loader's workers run from here on: every exit below stops them (finally)
    config, main = plan.config, plan.ranks.rank == 0
    history, started, logs, finished = [], time.time(), None, False
    try:
        logs = RunLogs.start(plan) if main else None  # first: what marks --out as a run, for the other ranks' checks
        bar = tqdm(total=plan.last_step, initial=plan.start_step, unit="step", desc=config.objective.method,
                   disable=not main or not config.progress)  # fmt: skip
        window, window_start = [], time.time()
        for step in range(plan.start_step, plan.last_step):
            window.append(train_step(plan, s, step))
            evaluated = is_evaluated(step, eval_every=config.eval_every, last_step=plan.last_step) and plan.eval_split is not None
            if evaluated or is_logged(step, log_every=config.log_every, last_step=plan.last_step):
                record = step_record(plan, window, seconds=time.time() - window_start)
                if evaluated and main:  # the split is rank 0's; nothing collective in it
                    record["eval"] = evaluate_split(
                        s.drafter, plan.eval_split, embed_tokens=s.head["embed_tokens.weight"], lm_head=s.head["lm_head.weight"],
                        device=plan.ranks.device, weights_dtype=getattr(torch, config.checkpoint.save_dtype),
                    )  # fmt: skip
                window, window_start = [], time.time()
                history.append(record)
                if logs is not None:
                    logs.add(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", acc1=f"{record['slot_acc'][0]:.3f}")
            if main:
                bar.update(1)
                if (step + 1) in plan.epoch_ends or (config.checkpoint.save_every and (step + 1) % config.checkpoint.save_every == 0):
                    position = plan.data_position(step + 1)
                    logs.publish()  # on a store: the metrics up to this step, before the checkpoint commits
                    save_checkpoint(plan.run, step=step + 1, model=s.drafter, optimizer=s.optimizer, settings=plan.settings,
                                    data_position=position, drafter_config=plan.drafter.hf_config)  # fmt: skip
        bar.close()
        finished = True
    finally:
        release_loader(s.batches, loader=config.loader)  # before the export: a worker that dies then cannot break it
        if logs is not None and not finished:
            logs.discard()
    summary = {"run": str(plan.run), "method": config.objective.method, "steps": plan.last_step, "elapsed_s": time.time() - started}
    if logs is not None:
        summary = logs.finish(summary, history, drafter=s.drafter, num_slots=plan.num_slots,
                              dtype=getattr(torch, config.checkpoint.save_dtype))  # fmt: skip
    if plan.ranks.world_size > 1:
        dist.barrier()
    return summary
