"""One training step: `train_step` (one optimizer step over this rank's micro-batches), its math
(the stored feature bits decoded on the device, `decode_feature_bits`; the loss of a micro-batch,
`forward_loss`, and its sums, `StepStats`), the one collective every rank runs (`all_reduce_on`),
the LR schedule (`lr_at`), and a logged step's metrics (`step_record`).

The step loss is one weighted mean over every supervised slot of the global batch,
sum(w * l) / (sum(w) + 1e-6), so the weight total is all-reduced BEFORE the backward passes and
each micro-batch contributes its weighted sum divided by that total: the result is the same for
any number of ranks and micro-batches (docs/design.md, "A training step").
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from drafter.families import family_of
from drafter.family import SupervisedSlots
from drafter.masks import flex_block_mask, visibility_mask
from pipeline.train.batching import ReadFailure, TrainBatch
from pipeline.train.plan import TrainPlan
from pipeline.train.setup import TrainState
from storage.codecs import FP8_E4M3FN_TABLE


def lr_at(step: int, *, total_steps: int, peak_lr: float, warmup_frac: float) -> float:
    """Linear warm-up over ceil(warmup_frac * total) steps, then cosine from peak to 0."""
    warmup = math.ceil(warmup_frac * total_steps)
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


@dataclass(kw_only=True)
class StepStats:
    """Sums over the supervised slots of a micro-batch (or, added up, of a step on every rank)."""

    loss_sum: torch.Tensor  # [] weighted loss sum (carries the graph until detached)
    weight_sum: torch.Tensor  # [] sum of slot weights
    slot_correct: torch.Tensor  # [K] supervised slots where draft argmax == label argmax
    slot_count: torch.Tensor  # [K] supervised slots

    def detached(self) -> StepStats:
        return StepStats(**{name: value.detach().double() for name, value in vars(self).items()})

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(**{name: value + getattr(other, name) for name, value in vars(self).items()})

    def all_reduced(self, *, device: torch.device, world_size: int) -> StepStats:
        """Summed over ranks (one collective; the tensors stay on the training device)."""
        flat = torch.cat([self.loss_sum[None], self.weight_sum[None], self.slot_correct, self.slot_count])
        flat = all_reduce_on(flat, device=device, world_size=world_size)
        num_slots = self.slot_count.numel()
        return StepStats(loss_sum=flat[0], weight_sum=flat[1], slot_correct=flat[2 : 2 + num_slots], slot_count=flat[2 + num_slots :])


def decode_feature_bits(features: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Stored feature bits -> float32 on their device, exactly as storage.codecs.decode_features:
    bf16 bits (uint16) are the top half of a float32; fp8-e4m3fn bits (uint8) [..., F] are looked up
    in the 256-entry table and times their row's scale [...]. Float features pass."""
    if features.dtype == torch.uint16:
        return (features.to(torch.int32) << 16).view(torch.float32)
    if features.dtype == torch.uint8:
        if scales is None:
            raise ValueError("fp8 feature bits need their per-row scales")
        table = torch.tensor(FP8_E4M3FN_TABLE, device=features.device)  # [256] float32 (a copy: the array is read-only)
        return table[features.long()] * scales.to(features.device, torch.float32)[..., None]
    return features


def forward_loss(
    model, batch: TrainBatch, *, embed_tokens, lm_head, block_size: int, loss_chunk: int, autocast, attention: str = "sdpa",
    options=None,
) -> StepStats:
    """Draft every block of the batch and score the supervised slots against their labels.

    attention: "flex" (compiled block mask and flex attention) or "sdpa" (dense mask). Under bf16
    autocast the drafter and the lm_head GEMM run in bf16; the residual stream, log-softmax and
    loss stay fp32 (docs/design.md, "A training step"). The loss is the drafter family's
    (`DrafterFamily.head_loss`, with the run's `options` of that family)."""
    mask_inputs = dict(
        context_positions=batch.context_positions,
        context_owner=batch.context_owner,
        context_valid=batch.context_valid,
        block_corpus_limit=batch.block_corpus_limit,
        block_valid=batch.block_valid,
        block_size=block_size,
    )
    if attention == "flex":
        attention_mask = flex_block_mask(**mask_inputs, compile=True)
    else:
        attention_mask = visibility_mask(**mask_inputs)  # [B, 1, Q, C + Q]
    with autocast:
        hidden = model(
            context_features=decode_feature_bits(batch.context_features, batch.context_feature_scales),  # on the device
            context_positions=batch.context_positions,
            block_embeds=F.embedding(batch.block_tokens, embed_tokens).float(),  # fp32 residual stream
            block_positions=batch.block_positions,
            attention_mask=attention_mask,
        )  # [B, Q, H]
    num_slots, top_k = batch.label_ids.shape[-2:]
    # The supervised slots' flat indices come from the collate (computed on the CPU by the worker):
    # a boolean mask here would wait on the device for its count, once per tensor and micro-batch.
    supervised = batch.supervised_index  # [M] into [B * N * K]
    slot_index = supervised % num_slots  # [M]: the label column
    # The labelled rows are the block's last num_slots (drafter/family.py, `BlockLayout`): label
    # column i of block (b, n) is query row (b * N + n) * block_size + i + block_size - num_slots.
    rows = (supervised // num_slots) * block_size + slot_index + (block_size - num_slots)  # [M]
    label_ids = batch.label_ids.reshape(-1, top_k).index_select(0, supervised)  # [M, k]
    label_probs = batch.label_probs.reshape(-1, top_k).index_select(0, supervised)  # [M, k]
    dist_ids, dist_probs = label_ids, label_probs  # the target's distribution: the labels, unless one-hot ones
    if batch.dist_ids is not None:
        dist_k = batch.dist_ids.shape[-1]
        dist_ids = batch.dist_ids.reshape(-1, dist_k).index_select(0, supervised)  # [M, k']
        dist_probs = batch.dist_probs.reshape(-1, dist_k).index_select(0, supervised)
    slots = SupervisedSlots(
        hidden=hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows),  # [M, H]
        label_ids=label_ids, label_probs=label_probs, weights=batch.slot_weights.reshape(-1).index_select(0, supervised),
        prev_tokens=batch.prev_tokens.reshape(-1).index_select(0, supervised), dist_ids=dist_ids, dist_probs=dist_probs,
        block_hidden=hidden.reshape(-1, block_size, hidden.shape[-1])[:, block_size - num_slots :],  # [B * N, K, H], a view
        block_prev_tokens=batch.prev_tokens.reshape(-1, num_slots), block_slot=supervised,
        block_index=supervised // num_slots, label_column=slot_index,
    )  # fmt: skip
    drafter = getattr(model, "module", model)  # the family's own heads (DDP wraps the drafter)
    loss_sum, correct = family_of(drafter).head_loss(
        drafter, slots, lm_head=lm_head, options=options, loss_chunk=loss_chunk, autocast=autocast
    )
    weights = slots.weights
    slot_correct = torch.zeros(num_slots, device=weights.device).index_add_(0, slot_index, correct.float())
    slot_count = torch.zeros(num_slots, device=weights.device).index_add_(0, slot_index, torch.ones_like(weights))
    return StepStats(loss_sum=loss_sum, weight_sum=weights.sum(), slot_correct=slot_correct, slot_count=slot_count)


def all_reduce_on(t: torch.Tensor, *, device: torch.device, world_size: int) -> torch.Tensor:
    """Sum t over ranks in place; every collective of the loop goes through here. t must be on the
    training device: NCCL cannot reduce a CPU tensor, so the check runs on one process too."""
    if t.device != torch.device(device):
        raise RuntimeError(f"collective on a {t.device} tensor while training on {device}")
    if world_size > 1:
        dist.all_reduce(t)
    return t


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
