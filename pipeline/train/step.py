"""One training step's math: the loss of a micro-batch (`forward_loss`) and its sums
(`StepStats`), the one collective every rank runs (`all_reduce_on`), the LR schedule (`lr_at`).

The step loss is one weighted mean over every supervised slot of the global batch,
sum(w * l) / (sum(w) + 1e-6), so the weight total is all-reduced BEFORE the backward passes and
each micro-batch contributes its weighted sum divided by that total: the result is the same for
any number of ranks and micro-batches (docs/design.md, "A training step").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from drafter.masks import flex_block_mask, visibility_mask
from pipeline.train.batching import TrainBatch, decode_feature_bits
from pipeline.train.config import DSparkLossConfig
from pipeline.train.objectives import dspark_slot_losses, topk_tail_loss_and_grad


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


def forward_loss(
    model, batch: TrainBatch, *, embed_tokens, lm_head, block_size: int, loss_chunk: int, autocast, attention: str = "sdpa",
    dspark: DSparkLossConfig | None = None,
) -> StepStats:
    """Draft every block of the batch and score the supervised slots against their labels.

    attention: "flex" (compiled block mask and flex attention) or "sdpa" (dense mask). Under bf16
    autocast the drafter and the lm_head GEMM run in bf16; the residual stream, log-softmax and
    loss stay fp32 (docs/design.md, "A training step"). `dspark`: the model is a DSpark drafter,
    scored with DeepSpec's loss (objectives.dspark_slot_losses) on its Markov-corrected logits."""
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
    slot_index = supervised % num_slots  # [M]: the label's column (DFlash slot k - 1, DSpark slot k)
    # Label column i of block (b, n) is query row (b * N + n) * block_size + i + offset of the
    # drafter's output: offset 1 for DFlash (slot 0 is the anchor), 0 for DSpark (every slot drafts).
    offset = block_size - num_slots
    rows = (supervised // num_slots) * block_size + slot_index + offset  # [M]
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # [M, H]
    weights = batch.slot_weights.reshape(-1).index_select(0, supervised)  # [M]
    label_ids = batch.label_ids.reshape(-1, top_k).index_select(0, supervised)  # [M, k]
    label_probs = batch.label_probs.reshape(-1, top_k).index_select(0, supervised)  # [M, k]
    if dspark is None:
        with autocast:  # the lm_head GEMM's dtype: bf16 under bf16 autocast, else the head's own
            device_type = hidden.device.type
            head_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else lm_head.dtype
        loss_sum, correct = HeadLoss.apply(hidden, lm_head, label_ids, label_probs, weights, loss_chunk, head_dtype)
    else:
        prev_tokens = batch.prev_tokens.reshape(-1).index_select(0, supervised)  # [M]
        dist_ids, dist_probs = label_ids, label_probs
        if batch.dist_ids is not None:
            dist_k = batch.dist_ids.shape[-1]
            dist_ids = batch.dist_ids.reshape(-1, dist_k).index_select(0, supervised)  # [M, k']
            dist_probs = batch.dist_probs.reshape(-1, dist_k).index_select(0, supervised)
        loss_sum, correct = dspark_head_loss(
            hidden, lm_head, label_ids, label_probs, weights, prev_tokens, dist_ids, dist_probs,
            heads=getattr(model, "module", model), dspark=dspark, loss_chunk=loss_chunk, autocast=autocast,
        )  # fmt: skip (the DSpark drafter's heads: DDP wraps it)
    slot_correct = torch.zeros(num_slots, device=hidden.device).index_add_(0, slot_index, correct.float())
    slot_count = torch.zeros(num_slots, device=hidden.device).index_add_(0, slot_index, torch.ones_like(weights))
    return StepStats(loss_sum=loss_sum, weight_sum=weights.sum(), slot_correct=slot_correct, slot_count=slot_count)


class HeadLoss(torch.autograd.Function):
    """The top-k + tail loss of the drafter's hidden states through the frozen lm_head, chunk by
    chunk, with the hidden states' gradient computed in the same pass: each [chunk, V] block of
    logits is made once, turned into its gradient in place (objectives.topk_tail_loss_and_grad)
    and multiplied back through the head, so backward only scales the kept [M, H] gradient. A
    recomputing checkpoint makes the logits twice; this is the step's largest GEMM
    (docs/design.md, "A training step"). Returns (sum of w * l, whether each slot's argmax is its
    first label id)."""

    @staticmethod
    def forward(ctx, hidden, lm_head, label_ids, label_probs, weights, loss_chunk: int, head_dtype: torch.dtype):
        head = lm_head.to(head_dtype)  # no copy when the head is already in the compute dtype
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        for start in range(0, hidden.shape[0], loss_chunk):
            part = slice(start, start + loss_chunk)
            logits = head_matmul(hidden[part], head.t())  # [chunk, V] float32, the GEMM in the head's dtype
            chunk_sum, grad_logits, correct[part] = topk_tail_loss_and_grad(
                draft_logits=logits, label_ids=label_ids[part], label_probs=label_probs[part], weights=weights[part]
            )
            del logits  # float32 logits became grad_logits in place
            loss_sum += chunk_sum
            if need_grad:
                grad_hidden[part] = head_matmul(grad_logits, head).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(correct)
        return loss_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, grad_correct):
        (grad_hidden,) = ctx.saved_tensors
        return grad_loss * grad_hidden, None, None, None, None, None, None


NARROW_GEMM_ROWS = 512  # rows per GEMM when the head is narrower than float32 (bf16)


def head_matmul(left: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """left [M, X] float32 @ head [X, Y] (the frozen head or its transpose) in the head's dtype ->
    float32 [M, Y]. A bf16 head takes its operand NARROW_GEMM_ROWS rows at a time, each product
    widened into the float32 result, so no [M, V] bf16 tensor (the logits, or the cast of their
    gradient) is ever held beside the float32 one."""
    if head.dtype == torch.float32:
        return left.float() @ head
    out = left.new_empty(left.shape[0], head.shape[1], dtype=torch.float32)
    for start in range(0, left.shape[0], NARROW_GEMM_ROWS):
        rows = slice(start, start + NARROW_GEMM_ROWS)
        out[rows] = left[rows].to(head.dtype) @ head
    return out


def dspark_head_loss(hidden, lm_head, label_ids, label_probs, weights, prev_tokens, dist_ids, dist_probs, *, heads, dspark: DSparkLossConfig,
                     loss_chunk: int, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """A DSpark drafter's loss through the lm_head plus its Markov and confidence heads (trainable,
    so autograd runs through them): chunk by chunk, each [chunk, V] logits recomputed in backward
    instead of kept. Returns (sum of w * l, whether each slot's argmax is its first label id)."""

    def chunk_loss(h, ids, probs, w, prev, d_ids, d_probs):
        with autocast:
            logits = F.linear(h, lm_head)  # [chunk, V]: a bf16 GEMM under autocast, else fp32
            bias = heads.markov_bias(prev)  # [chunk, V] or None
            confidence = heads.confidence_logits(h, prev)  # [chunk] or None
        logits = logits.float()
        if bias is not None:
            logits = logits + bias.float()
        losses, _ = dspark_slot_losses(
            draft_logits=logits, confidence_logits=confidence, label_ids=ids, label_probs=probs, dist_ids=d_ids,
            dist_probs=d_probs, ce_alpha=dspark.ce_alpha, l1_alpha=dspark.l1_alpha, confidence_alpha=dspark.confidence_alpha,
            confidence_target=dspark.confidence_target,
        )  # fmt: skip
        return (w.float() * losses).sum(), (logits.argmax(-1) == ids[:, 0])

    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(len(weights), dtype=torch.bool, device=hidden.device)
    inputs = (hidden, label_ids, label_probs, weights, prev_tokens, dist_ids, dist_probs)
    for i in range(0, len(weights), loss_chunk):
        part = slice(i, i + loss_chunk)
        chunk_sum, chunk_correct = checkpoint(chunk_loss, *(t[part] for t in inputs), use_reentrant=False)
        loss_sum = loss_sum + chunk_sum
        correct[part] = chunk_correct
    return loss_sum, correct


def all_reduce_on(t: torch.Tensor, *, device: torch.device, world_size: int) -> torch.Tensor:
    """Sum t over ranks in place; every collective of the loop goes through here. t must be on the
    training device: NCCL cannot reduce a CPU tensor, so the check runs on one process too."""
    if t.device != torch.device(device):
        raise RuntimeError(f"collective on a {t.device} tensor while training on {device}")
    if world_size > 1:
        dist.all_reduce(t)
    return t
