"""`alrira-train`: train a drafter of any family (drafter/families.py) from a stage-1 cache, never loading the target.

Every method (dflash, kd, erase, erase_hard, alr, alr_gate, alr_ira, slot_control) runs the same
loop; what differs is only `pipeline.train.labels.build_block_targets`, called in the data workers.
Data parallel under torchrun (gloo on CPU, nccl on GPU):

    torchrun --nproc-per-node 8 -m pipeline.train --cache CACHE --method alr_ira --out runs/x

The run reads top to bottom: `plan_training` resolves and checks everything once into a frozen plan
(pipeline/train/plan.py), `setup` builds the drafter, optimizer and batches from it
(pipeline/train/setup.py), each step is `train_step` (pipeline/train/step.py, its data from
pipeline/train/data.py), rank 0 logs, checkpoints (pipeline/train/checkpoints.py) and exports
(pipeline/train/run_dir.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pipeline.outputs import output_lock
from pipeline.train.checkpoints import save_checkpoint
from pipeline.train.config import TrainConfig
from pipeline.train.data import release_loader
from pipeline.train.eval_split import calibrate_split, evaluate_split
from pipeline.train.run_dir import RunLogs
from pipeline.train.plan import TrainPlan, open_run, plan_training
from pipeline.train.setup import setup
from pipeline.train.step import step_record, train_step
from storage.location import is_url


def is_logged(step: int, *, log_every: int, last_step: int) -> bool:
    """Whether 0-based `step` is read and logged: every log_every-th step and the run's last."""
    return (step + 1) % log_every == 0 or step + 1 == last_step


def is_evaluated(step: int, *, eval_every: int, last_step: int) -> bool:
    """Whether 0-based `step` is followed by a tau evaluation on the split: every eval_every-th and the run's last."""
    return (eval_every > 0 and (step + 1) % eval_every == 0) or step + 1 == last_step


def train(config: TrainConfig) -> dict:
    """Train a drafter into --out. A local --cache is recorded resolved (train_config.json is read
    from other directories: `alrira-eval cost`); rank 0 holds --out's lock (pipeline/outputs.py)
    for the whole run, planning included, so a second process on the same --out refuses."""
    if not is_url(config.cache):
        config = replace(config, cache=str(Path(config.cache).resolve()))
    places = open_run(config)  # before the lock: never a lock file in a cache or a stranger's folder
    locked = int(os.environ.get("RANK", "0")) == 0 and places.run.is_local
    with output_lock(places.run.local_path, command="alrira-train") if locked else contextlib.nullcontext():
        plan = plan_training(config, places)
        return run_training(plan)


def run_training(plan: TrainPlan) -> dict:
    """Build the run from its plan and step it to the end (the module docstring)."""
    s = setup(plan)  # the map loader's workers run from here on: every exit below stops them (finally)
    config, main = plan.config, plan.ranks.rank == 0
    export_dtype = getattr(torch, config.checkpoint.save_dtype)  # the export's weights, as the split scores them
    history, started, logs, finished = [], time.time(), None, False
    try:
        # First: --out claimed and marked as a run (for the other ranks' checks); after every refusal (the
        # plan's, the weights' loading in setup), so a refused run leaves nothing in --out.
        logs = RunLogs.start(plan) if main else None
        bar = tqdm(total=plan.last_step, initial=plan.start_step, unit="step", desc=config.objective.method,
                   disable=not main or not config.progress)  # fmt: skip
        window, window_start = [], time.time()
        for step in range(plan.start_step, plan.last_step):
            window.append(train_step(plan, s, step))
            evaluated = is_evaluated(step, eval_every=config.eval_every, last_step=plan.last_step) and plan.eval_split is not None
            if evaluated or is_logged(step, log_every=config.log_every, last_step=plan.last_step):
                record = step_record(plan, window, seconds=time.time() - window_start)
                if evaluated and main:  # the split is rank 0's; nothing collective in it
                    record["eval"] = evaluate_split(s.drafter, plan.eval_split, head=s.head, device=plan.ranks.device,
                                                    weights_dtype=export_dtype)  # fmt: skip
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
        family, calibration = plan.drafter.family, None
        if family.has_confidence(s.drafter.config):  # fitted on the split (None without one)
            calibration = calibrate_split(s.drafter, plan.eval_split, head=s.head, device=plan.ranks.device, weights_dtype=export_dtype)
        summary = logs.finish(summary, history, drafter=s.drafter, num_slots=plan.num_slots, dtype=export_dtype,
                              head=s.head if family.exports_head(plan.drafter.options) else None, calibration=calibration)  # fmt: skip
    if plan.ranks.world_size > 1:
        dist.barrier()
    return summary
