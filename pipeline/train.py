"""`alrira-train`: train a DFlash drafter from a stage-1 cache, never loading the target.

Every method (dflash, kd, erase, erase_hard, alr, alr_gate, alr_ira, slot_control) runs the same
loop; what differs is only `pipeline.labels.build_block_targets`, called in the data workers.
Data parallel under torchrun (gloo on CPU, nccl on GPU):

    torchrun --nproc-per-node 8 -m pipeline.train --cache CACHE --method alr_ira --out runs/x

The step loss is one weighted mean over every supervised slot of the global batch,
sum(w * l) / (sum(w) + 1e-6), so the weight total is all-reduced BEFORE the backward passes and
each micro-batch contributes its weighted sum divided by that total: the result is the same for
any number of ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from drafter.checkpoint import check_compatible, load_drafter, save_drafter
from drafter.config import DFlashConfig
from drafter.masks import flex_block_mask, visibility_mask
from drafter.model import DFlashDrafter
from pipeline.batching import CacheTrainDataset, StepSampler, TrainBatch, collate, steps_per_epoch
from pipeline.labels import METHODS, ObjectiveConfig, required_arrays
from pipeline.objectives import topk_tail_loss
from storage.manifest import load_target_head
from storage.reader import available_arrays, open_cache


def _opt(help: str, **kwargs):
    return field(metadata={"help": help}, **kwargs)


@dataclass(kw_only=True)
class TrainConfig:
    """`alrira-train`: train a DFlash drafter from a cache."""

    cache: str = _opt("Stage-1 cache directory.")
    out: str = _opt("Run directory (checkpoints, metrics.jsonl, the final drafter/).")
    method: str = _opt(f"Objective: {', '.join(METHODS)}.", default="alr_ira")
    drafter_init: str | None = _opt("Initialise from this DFlash checkpoint directory (public release or ours).", default=None)
    draft_layers: int | None = _opt("Fresh drafter with this many layers (default: one per tapped target layer).", default=None)
    epochs: int = _opt("Passes over the cache.", default=3)
    batch_size: int = _opt("Global batch in sequences per optimizer step (all ranks, all micro-batches).", default=24)
    grad_accum: int = _opt("Micro-batches per step on each rank.", default=1)
    lr: float = _opt("Peak learning rate (AdamW, weight decay 0).", default=1.47e-3)
    warmup_frac: float = _opt("Fraction of steps of linear warm-up before the cosine decay to 0.", default=0.04)
    grad_clip: float = _opt("Gradient-norm clip.", default=1.0)
    precision: str = _opt("auto (bf16 autocast on GPU, fp32 on CPU), bf16 or fp32; master weights stay fp32.", default="auto")
    gamma: float = _opt("Slot envelope decay for the distillation family (kd, erase, alr, ira).", default=2.0)
    dflash_gamma: float = _opt("Slot envelope decay for the DFlash cross-entropy baseline (7 vision, 2 text).", default=7.0)
    rollout_depth: int = _opt("R: rollout tokens used for labels (R + 1 slots trained); alr_ira needs K - 1.", default=14)
    anchors_per_step: int | None = _opt("Anchors per sequence per step (default: the whole cached pool).", default=None)
    anchor_source: str = _opt("pool (the cached anchors) or all (every eligible position; corpus-only methods).", default="pool")
    seed: int = _opt("Seed of anchors, IRA splits and offsets, data order and fresh init.", default=0)
    num_workers: int = _opt("DataLoader worker processes reading the cache.", default=2)
    prefetch: int = _opt("Batches each worker prepares ahead.", default=2)
    save_every: int = _opt("Checkpoint every N steps (0: only at the end of each epoch).", default=0)
    resume: bool = _opt("Continue from the latest checkpoint in --out.", default=False)
    max_steps: int | None = _opt("Stop after this many steps (smoke tests, benchmarks).", default=None)
    loss_chunk: int = _opt("Supervised slots per lm_head chunk (bounds the [chunk, vocab] logits).", default=4096)
    activation_checkpointing: bool = _opt(
        "Recompute each drafter layer in backward instead of storing its activations (less memory, ~1 more forward).",
        default=False,
    )
    save_dtype: str = _opt("dtype of the exported drafter weights: bfloat16 or float32.", default="bfloat16")
    progress: bool = _opt("Show a progress bar.", default=True)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("epochs", "batch_size", "grad_accum", "loss_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.warmup_frac < 1 or self.grad_clip <= 0:
            raise ValueError("--lr and --grad-clip must be > 0 and --warmup-frac in [0, 1)")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"--precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.save_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"--save-dtype must be bfloat16 or float32, got {self.save_dtype!r}")
        if self.drafter_init is not None and self.draft_layers is not None:
            raise ValueError("give at most one of --drafter-init and --draft-layers")
        if self.num_workers < 0 or self.save_every < 0:
            raise ValueError("--num-workers and --save-every must be >= 0")


def lr_at(step: int, *, total_steps: int, peak_lr: float, warmup_frac: float) -> float:
    """Linear warm-up over ceil(warmup_frac * total) steps, then cosine from peak to 0."""
    warmup = math.ceil(warmup_frac * total_steps)
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# ----------------------------------------------------------------------------------------------
# The loss of one micro-batch


@dataclass(kw_only=True)
class StepStats:
    loss_sum: torch.Tensor  # weighted loss sum (carries the graph)
    weight_sum: torch.Tensor
    slot_correct: torch.Tensor  # [K] supervised slots where draft argmax == label argmax
    slot_count: torch.Tensor  # [K] supervised slots


def forward_loss(model, batch: TrainBatch, *, embed_tokens, lm_head, block_size: int, loss_chunk: int, autocast) -> StepStats:
    """Draft every block of the batch and score the supervised slots against their labels."""
    mask_inputs = dict(
        context_positions=batch.context_positions,
        context_owner=batch.context_owner,
        context_valid=batch.context_valid,
        block_corpus_limit=batch.block_corpus_limit,
        block_valid=batch.block_valid,
        block_size=block_size,
    )
    if batch.block_tokens.is_cuda:
        attention_mask = flex_block_mask(**mask_inputs, compile=True)
    else:
        attention_mask = visibility_mask(**mask_inputs)  # [B, 1, Q, C + Q]
    with autocast:
        hidden = model(
            context_features=batch.context_features,
            context_positions=batch.context_positions,
            block_embeds=F.embedding(batch.block_tokens, embed_tokens),
            block_positions=batch.block_positions,
            attention_mask=attention_mask,
        )  # [B, Q, H]
    num_batch, num_blocks, num_slots = batch.slot_weights.shape
    hidden = hidden.view(num_batch, num_blocks, block_size, -1)[:, :, 1:]  # slots 1..K: [B, N, K, H]
    supervised = batch.slot_weights > 0
    slot_index = torch.arange(num_slots, device=hidden.device).expand_as(batch.slot_weights)[supervised]  # [M]
    hidden, weights = hidden[supervised], batch.slot_weights[supervised]  # [M, H], [M]
    label_ids, label_probs = batch.label_ids[supervised], batch.label_probs[supervised]  # [M, k]

    def chunk_loss(h, ids, probs, w):
        logits = F.linear(h.float(), lm_head.float())  # [chunk, V] in fp32
        loss_sum, _ = topk_tail_loss(draft_logits=logits, label_ids=ids, label_probs=probs, weights=w)
        return loss_sum, (logits.argmax(-1) == ids[:, 0])

    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(len(slot_index), dtype=torch.bool, device=hidden.device)
    for i in range(0, len(weights), loss_chunk):
        part = slice(i, i + loss_chunk)
        # Recompute the [chunk, vocab] logits in backward instead of keeping them.
        chunk_sum, chunk_correct = checkpoint(
            chunk_loss, hidden[part], label_ids[part], label_probs[part], weights[part], use_reentrant=False
        )
        loss_sum = loss_sum + chunk_sum
        correct[part] = chunk_correct
    slot_correct = torch.zeros(num_slots, device=hidden.device).index_add_(0, slot_index, correct.float())
    slot_count = torch.zeros(num_slots, device=hidden.device).index_add_(0, slot_index, torch.ones_like(weights))
    return StepStats(loss_sum=loss_sum, weight_sum=weights.sum(), slot_correct=slot_correct, slot_count=slot_count)


# ----------------------------------------------------------------------------------------------
# Set-up pieces


def _distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device); initialises the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return (dist.get_rank() if world_size > 1 else 0), world_size, device


def _all_reduce(t: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        dist.all_reduce(t)
    return t


def build_drafter(config: TrainConfig, manifest) -> DFlashDrafter:
    """The drafter to train: loaded from --drafter-init, or fresh from the cache's target config."""
    settings = manifest.settings
    if config.drafter_init is not None:
        drafter = load_drafter(config.drafter_init, dtype=torch.float32)
    else:
        torch.manual_seed(config.seed)
        drafter_config = DFlashConfig.from_target_config(
            manifest.target_config,
            num_draft_layers=config.draft_layers or len(settings.layer_ids),
            mask_token_id=manifest.mask_token_id,
            target_layer_ids=settings.layer_ids,
            block_size=settings.num_slots + 1,
        )
        drafter = DFlashDrafter(drafter_config).float()
    check_compatible(
        drafter.config,
        target_layer_ids=settings.layer_ids,
        hidden_size=manifest.hidden_size,
        vocab_size=manifest.vocab_size,
        block_size=settings.num_slots + 1,
    )
    return drafter


def check_cache_serves(method: str, arrays: set[str], cache: str) -> None:
    missing = sorted(required_arrays(method) - arrays)
    if missing:
        raise ValueError(f"{cache}: --method {method} needs cache arrays that are missing: {', '.join(missing)}")


# ----------------------------------------------------------------------------------------------
# Checkpoints: model, optimizer, step (the schedule and the data position are functions of it), RNG


def _checkpoint_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def save_checkpoint(run: Path, *, step: int, model: DFlashDrafter, optimizer, config: TrainConfig) -> Path:
    final = _checkpoint_dir(run, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(
        {
            "step": step,
            "model": model.state_dict(),
            "drafter_config": model.config.to_hf_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "config": asdict(config),
        },
        tmp / "state.pt",
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest = run / "checkpoints" / "latest"
    latest.with_suffix(".tmp").write_text(final.name)
    os.replace(latest.with_suffix(".tmp"), latest)
    return final


def load_latest_checkpoint(run: Path) -> dict | None:
    latest = run / "checkpoints" / "latest"
    if not latest.exists():
        return None
    path = run / "checkpoints" / latest.read_text().strip() / "state.pt"
    if not path.is_file():
        raise ValueError(f"{latest}: points to {path}, which does not exist")
    return torch.load(path, map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------------------------
# The loop


def train(config: TrainConfig) -> dict:
    rank, world_size, device = _distributed()
    run = Path(config.out)
    reader = open_cache(config.cache)
    manifest = reader.manifest
    settings = manifest.settings
    check_cache_serves(config.method, available_arrays(reader), config.cache)
    if config.batch_size % (world_size * config.grad_accum):
        raise ValueError(f"--batch-size {config.batch_size} must be a multiple of ranks x --grad-accum ({world_size * config.grad_accum})")
    if len(reader) < config.batch_size:
        raise ValueError(f"--batch-size {config.batch_size} is larger than the cache ({len(reader)} sequences)")
    objective = ObjectiveConfig(
        method=config.method,
        num_slots=settings.num_slots,
        gamma=config.gamma,
        dflash_gamma=config.dflash_gamma,
        rollout_depth=config.rollout_depth,
        anchors_per_step=config.anchors_per_step,
        anchor_source=config.anchor_source,
        mask_token_id=manifest.mask_token_id,
        stop_token_ids=tuple(manifest.stop_token_ids),
    )
    block_size = settings.num_slots + 1

    head = load_target_head(config.cache)
    embed_tokens = head["embed_tokens.weight"].to(device, torch.float32)  # frozen [V, H]
    lm_head = head["lm_head.weight"].to(device, torch.float32)  # frozen [V, H]
    drafter = build_drafter(config, manifest).to(device)
    drafter.activation_checkpointing = config.activation_checkpointing
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, weight_decay=0.0)
    start_step = 0
    state = load_latest_checkpoint(run) if config.resume else None
    if state is not None:
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start_step = state["step"]
    model = torch.nn.parallel.DistributedDataParallel(drafter) if world_size > 1 else drafter
    use_bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    per_epoch = steps_per_epoch(len(reader), batch_size=config.batch_size)
    total_steps = per_epoch * config.epochs
    last_step = min(total_steps, config.max_steps) if config.max_steps else total_steps
    sampler = StepSampler(
        len(reader), batch_size=config.batch_size, grad_accum=config.grad_accum, epochs=config.epochs,
        seed=config.seed, rank=rank, world_size=world_size, start_step=start_step,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(
        CacheTrainDataset(reader, objective=objective, seed=config.seed),
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=config.num_workers,
        prefetch_factor=config.prefetch if config.num_workers else None,
        pin_memory=device.type == "cuda",
        worker_init_fn=_single_threaded_worker,
    )
    batches = iter(loader)

    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / "train_config.json").write_text(json.dumps(asdict(config), indent=2))
    metrics_file = open(run / "metrics.jsonl", "a") if rank == 0 else None
    writer = _tensorboard(run) if rank == 0 else None
    bar = tqdm(total=last_step, initial=start_step, unit="step", desc=config.method, disable=rank != 0 or not config.progress)
    history, started = [], time.time()
    for step in range(start_step, last_step):
        step_start = time.time()
        micro_batches = [next(batches).to(device) for _ in range(config.grad_accum)]
        weight_total = _all_reduce(sum(b.slot_weights.sum() for b in micro_batches).double(), world_size)
        lr = lr_at(step, total_steps=total_steps, peak_lr=config.lr, warmup_frac=config.warmup_frac)
        for group in optimizer.param_groups:
            group["lr"] = lr
        totals = torch.zeros(2 + 2 * settings.num_slots, dtype=torch.float64, device=device)
        for i, batch in enumerate(micro_batches):
            sync = world_size == 1 or i == len(micro_batches) - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                stats = forward_loss(
                    model, batch, embed_tokens=embed_tokens, lm_head=lm_head, block_size=block_size,
                    loss_chunk=config.loss_chunk, autocast=autocast,
                )  # fmt: skip
                # DDP averages gradients over ranks; scaling by world_size makes that the global mean.
                (stats.loss_sum * (world_size / (weight_total.float() + 1e-6))).backward()
            totals += torch.cat([stats.loss_sum.detach()[None], batch.slot_weights.sum()[None].to(stats.loss_sum),
                                 stats.slot_correct, stats.slot_count]).double()  # fmt: skip
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        totals = _all_reduce(totals, world_size).cpu()
        num_tokens = _all_reduce(torch.tensor(float(sum(b.num_tokens for b in micro_batches))), world_size).item()
        loss = (totals[0] / (totals[1] + 1e-6)).item()
        slot_acc = (totals[2 : 2 + settings.num_slots] / totals[2 + settings.num_slots :].clamp_min(1)).tolist()
        record = {
            "step": step + 1,
            "epoch": step // per_epoch,
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "slot_acc": [round(a, 5) for a in slot_acc],
            "supervised_slots": int(totals[2 + settings.num_slots :].sum()),
            "tokens_per_s": num_tokens / max(time.time() - step_start, 1e-9),
        }
        history.append(record)
        if rank == 0:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if writer is not None:
                for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                    writer.add_scalar(f"train/{key}", record[key], step + 1)
            bar.set_postfix(loss=f"{loss:.4f}", acc1=f"{slot_acc[0]:.3f}")
            bar.update(1)
            end_of_epoch = (step + 1) % per_epoch == 0
            if end_of_epoch or (config.save_every and (step + 1) % config.save_every == 0):
                save_checkpoint(run, step=step + 1, model=drafter, optimizer=optimizer, config=config)
    bar.close()
    if metrics_file is not None:
        metrics_file.close()
    if writer is not None:
        writer.close()

    summary = {"run": str(run), "method": config.method, "steps": last_step, "elapsed_s": time.time() - started}
    if rank == 0:
        save_drafter(drafter, run / "drafter", dtype=getattr(torch, config.save_dtype))
        summary.update(_summarize(history, num_slots=settings.num_slots))
        (run / "summary.json").write_text(json.dumps(summary, indent=2))
    if world_size > 1:
        dist.barrier()
    return summary


def _single_threaded_worker(worker_id: int) -> None:
    # Data workers build labels with small tensor ops; several multi-threaded workers next to the
    # training process would oversubscribe the cores and stall the training step.
    torch.set_num_threads(1)


def _tensorboard(run: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(run / "tensorboard"))


def _summarize(history: list[dict], *, num_slots: int) -> dict:
    if not history:
        return {}
    tail = history[-max(1, len(history) // 10) :]
    return {
        "final_loss": history[-1]["loss"],
        "mean_loss_last_10pct": sum(h["loss"] for h in tail) / len(tail),
        "slot_acc_last_10pct": [round(sum(h["slot_acc"][k] for h in tail) / len(tail), 4) for k in range(num_slots)],
        "mean_tokens_per_s": sum(h["tokens_per_s"] for h in history) / len(history),
    }


def format_summary(summary: dict) -> str:
    lines = [f"run        {summary['run']}", f"method     {summary['method']}", f"steps      {summary['steps']}  ({summary['elapsed_s']:.1f}s)"]
    if "final_loss" in summary:
        lines += [
            f"loss       final {summary['final_loss']:.4f}, mean of last 10% {summary['mean_loss_last_10pct']:.4f}",
            f"tokens/s   {summary['mean_tokens_per_s']:.0f}",
            "slot acc   " + " ".join(f"{a:.2f}" for a in summary["slot_acc_last_10pct"]),
            f"drafter    {Path(summary['run']) / 'drafter'}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point for `python -m pipeline.train` / torchrun (same flags as alrira-train)."""
    from pipeline.cli import train_cli

    train_cli.main(args=argv if argv is not None else sys.argv[1:], prog_name="alrira-train")


if __name__ == "__main__":
    main()

