"""The head losses drafter families share, as pure tensor functions (docs/design.md, "The loss").

A family's loss scores its drafts against the method's labels, each a top-k + tail distribution
(one-hot for the dflash method): `topk_tail_loss` is the reference, `topk_tail_loss_and_grad` the
same loss and its gradient in one pass, and `HeadLoss` that pass through the frozen lm_head, chunk by
chunk, as the training step runs it. `topk_tail_l1` bounds ||q - p||_1 against such a distribution
(DSpark's L1 term). Tensors in, tensors out: no I/O, no process group, no globals.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The tail term's log(1 - covered mass) is clipped here so it stays finite when the label's top-k
# ids already hold (nearly) all of the draft's probability.
MAX_COVERED_MASS = 1.0 - 1e-6


def topk_tail_slot_losses(*, draft_logits: Tensor, label_ids: Tensor, label_probs: Tensor) -> Tensor:
    """Per-slot top-k + tail distillation loss [M] (see topk_tail_loss)."""
    log_q = draft_logits.float().log_softmax(dim=-1)  # [M, V]
    label_log_q = log_q.gather(-1, label_ids.long())  # [M, k]
    probs = label_probs.float()
    cross_entropy = -(probs * label_log_q).sum(dim=-1)  # [M]
    tail = (1.0 - probs.sum(dim=-1)).clamp(min=0.0)
    covered = label_log_q.exp().sum(dim=-1).clamp(max=MAX_COVERED_MASS)
    return cross_entropy - tail * torch.log1p(-covered)  # [M]


def topk_tail_loss(
    *, draft_logits: Tensor, label_ids: Tensor, label_probs: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor]:
    """Top-k + tail distillation loss: (sum of w * l, sum of w) over all slots given.

    Per slot, with label ids/probs p_i, tail tau = max(0, 1 - sum p_i) and draft probs q:
        l = -sum_i p_i log q(id_i) - tau * log(1 - min(sum_i q(id_i), 1 - 1e-6))
    One-hot labels reduce this to plain cross-entropy. The caller forms the weighted mean
    sum(w * l) / (sum(w) + 1e-6) after summing over its batch and ranks.

    draft_logits [M, V], label_ids/label_probs [M, k], weights [M]; any matching leading dims work.
    """
    loss = topk_tail_slot_losses(draft_logits=draft_logits, label_ids=label_ids, label_probs=label_probs)
    weights = weights.float()
    return (weights * loss).sum(), weights.sum()


def topk_tail_loss_and_grad(
    *, draft_logits: Tensor, label_ids: Tensor, label_probs: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum of w * l, its gradient with respect to draft_logits [M, V], whether each slot's first
    label id holds its largest logit [M] (the argmax, a tie counting)), the loss of topk_tail_loss,
    in one pass and without autograd: the training step computes a chunk's logits, this, and the
    hidden states' gradient at once, so it never recomputes the logits in backward (docs/design.md,
    "A training step"). The math is float32 (bf16 logits are widened once); float32 logits are
    overwritten (their storage becomes the gradient). With q = softmax(z), c = sum_i q(id_i), tau
    the tail mass and a = tau / (1 - c) where c is below the clip (0 above it, as the clamp's
    gradient):
        dl/dz_v = q_v * (sum_i p_i - a * c) + sum_i [v == id_i] * (a * q(id_i) - p_i)."""
    ids = label_ids.long()
    probs, weights = label_probs.float(), weights.float()
    logits = draft_logits.float()  # no copy when float32 already
    peak = logits.amax(dim=-1, keepdim=True)  # [M, 1]
    label_logits = logits.gather(-1, ids)  # [M, k]
    first_is_top = label_logits[:, 0] == peak[:, 0]
    unnormalized = logits.sub_(peak).exp_()  # exp(z - max), in place
    total = unnormalized.sum(dim=-1, keepdim=True)  # [M, 1]
    label_log_q = label_logits - (peak + total.log())  # [M, k]
    label_q = label_log_q.exp()
    cross_entropy = -(probs * label_log_q).sum(dim=-1)  # [M]
    tail = (1.0 - probs.sum(dim=-1)).clamp(min=0.0)
    covered = label_q.sum(dim=-1)
    clipped = covered.clamp(max=MAX_COVERED_MASS)
    loss_sum = (weights * (cross_entropy - tail * torch.log1p(-clipped))).sum()
    tail_scale = torch.where(covered <= MAX_COVERED_MASS, tail / (1.0 - clipped), torch.zeros_like(tail))  # [M]
    dense_scale = (weights * (probs.sum(dim=-1) - tail_scale * covered))[:, None] / total  # [M, 1]
    grad = unnormalized.mul_(dense_scale)  # q_v * dense_scale, in place
    grad.scatter_add_(-1, ids, weights[:, None] * (tail_scale[:, None] * label_q - probs))
    return loss_sum, grad, first_is_top



def topk_tail_l1(*, draft_probs: Tensor, dist_ids: Tensor, dist_probs: Tensor) -> Tensor:
    """||q - p||_1 per slot [M] when p is known on its top-k ids (dist_ids/probs [M, k]) plus a tail
    mass tau = max(0, 1 - sum p_i) spread over the other ids in an unknown way: the LOWER bound
        sum_i |q(id_i) - p_i| + |Q_rest - tau|,   Q_rest = 1 - sum_i q(id_i)
    (triangle inequality over the rest; exact when tau = 0, or when p's tail is proportional to q's).
    So 1 - l1 / 2 is an UPPER bound of the overlap sum_v min(q(v), p(v)). draft_probs [M, V]."""
    q_top = draft_probs.float().gather(-1, dist_ids.long())  # [M, k]
    probs = dist_probs.float()
    top = (q_top - probs).abs().sum(dim=-1)
    q_rest = (1.0 - q_top.sum(dim=-1)).clamp(min=0.0)
    tail = (1.0 - probs.sum(dim=-1)).clamp(min=0.0)
    return top + (q_rest - tail).abs()


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
