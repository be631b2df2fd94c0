"""The DFlash2 loss as pure tensor functions, and a DFlash2 drafter's head loss through the frozen
lm_head chunk by chunk (docs/dflash2.md, "The loss").

speculators 0.9 (`models/dflash2/core.py`, `metrics.py`, `losses/`), per drafting slot k = 1..B-1
with target distribution p, draft logits z = lm_head(h) and q = softmax(z):
    l = kl_alpha * KL(p || q) [+ tv_alpha * TV(p, q)] + selector_alpha * CE_K(scores, top token of p)
weighted by w_k = exp(-(k - 1) / 4) (`dflash_decay_gamma` 4; D-PACE weights instead as an option)
over the loss mask. The selector term is a K-way cross-entropy over training candidates: the
unary top-K of z, its weakest candidate replaced by p's top token when that token is missing; the
candidates' scores are z plus the selector's transition scores after the slot's previous token.
speculators reduces each term to sum(w * l * m) / sum(m); our step divides the weighted sum by
sum(w) (pipeline/train/step.py), a constant factor per batch shape.

The cache holds p as its top-k plus a tail mass, not the whole softmax; what that changes:
- KL becomes the KL between the two distributions coarsened to (the k ids, everything else): a
  lower bound of the full KL (merging outcomes never increases a KL), exact when the tail is 0 or
  q's tail is proportional to p's. Its gradient is the top-k + tail cross-entropy's
  (drafter/losses.py), since the two differ by p's (coarsened) entropy.
- TV is half of losses.topk_tail_l1: a lower bound, exact under the same conditions.
- The selector's label is p's top id, exact from a top-k.
Here the KL's p is the method's label distribution (`label_ids/probs`: the corpus token for
`dflash`, the target's top-k + tail otherwise); TV and the selector's label read `dist_ids/probs`,
the target's distribution at the slot (as DSpark's L1 does), which for every method but `dflash`
is the label itself. So the selector always learns the target's top token, as speculators' does
whatever its data holds (docs/dflash2.md, "What the cache supplies").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from drafter.family import SupervisedSlots
from drafter.losses import head_matmul, topk_tail_l1, topk_tail_loss_and_grad, topk_tail_slot_losses

SLOT_WEIGHTINGS = ("exp-decay", "dpace")


# ----------------------------------------------------------------------------------------------
# Per-slot terms


def label_negentropy(label_probs: Tensor) -> Tensor:
    """sum_i p_i log p_i + tau log tau (0 log 0 = 0) per slot [M] of label_probs [M, k], tau the tail."""
    probs = label_probs.float()
    tail = (1.0 - probs.sum(dim=-1)).clamp(min=0.0)
    return torch.xlogy(probs, probs).sum(dim=-1) + torch.xlogy(tail, tail)


def topk_tail_kl(*, draft_logits: Tensor, label_ids: Tensor, label_probs: Tensor) -> Tensor:
    """KL(p || q) per slot [M] with p known as top-k + tail, coarsened to (the k ids, the rest): the
    top-k + tail cross-entropy minus p's coarsened entropy. Exact for the whole vocabulary (k = V)."""
    cross_entropy = topk_tail_slot_losses(draft_logits=draft_logits, label_ids=label_ids, label_probs=label_probs)
    return cross_entropy + label_negentropy(label_probs)


def topk_tail_tv(*, draft_logits: Tensor, dist_ids: Tensor, dist_probs: Tensor) -> Tensor:
    """TV(p, q) = 1 - sum_v min(p, q) per slot [M]: half of topk_tail_l1's lower bound."""
    return 0.5 * topk_tail_l1(draft_probs=draft_logits.float().softmax(dim=-1), dist_ids=dist_ids, dist_probs=dist_probs)


def topk_tail_tv_loss_and_grad(*, draft_logits: Tensor, dist_ids: Tensor, dist_probs: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of w * topk_tail_tv, its gradient with respect to draft_logits [M, V]) without autograd.
    With s_i = d TV / d q(id_i) = (sign(q(id_i) - p_i) - sign(Q_rest - tau)) / 2 (the rest's mass
    Q_rest = 1 - sum_i q(id_i) moves against the ids'), dTV/dz_v = q_v * ([v = id_i] s_i - sum_i s_i q(id_i))."""
    ids, probs, weights = dist_ids.long(), dist_probs.float(), weights.float()
    q = draft_logits.float().softmax(dim=-1)  # [M, V]
    q_ids = q.gather(-1, ids)  # [M, k]
    q_rest = (1.0 - q_ids.sum(dim=-1)).clamp(min=0.0)
    tail = (1.0 - probs.sum(dim=-1)).clamp(min=0.0)
    loss = 0.5 * ((q_ids - probs).abs().sum(dim=-1) + (q_rest - tail).abs())
    rest_sign = torch.where(q_ids.sum(dim=-1) < 1.0, torch.sign(q_rest - tail), torch.zeros_like(tail))  # clamp's gradient
    slope = 0.5 * weights[:, None] * (torch.sign(q_ids - probs) - rest_sign[:, None])  # [M, k]
    grad = q.mul_(-(slope * q_ids).sum(dim=-1, keepdim=True))  # in place: q is not needed after this
    grad.scatter_add_(-1, ids, slope * q_ids)
    return (weights * loss).sum(), grad


def selector_training_candidates(candidate_ids: Tensor, target_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(training candidates [M, K], the target's index among them [M], whether the unary top-K held
    it [M]) of the unary top-K candidate_ids [M, K] and the target ids [M]: the candidates as they
    are when they hold the target, else with the last (weakest) replaced by it (speculators'
    `selector_training_candidates`: every slot gets a K-way label without scoring the vocabulary)."""
    matches = candidate_ids == target_ids[:, None]
    contains = matches.any(dim=-1)
    training = candidate_ids.clone()
    training[:, -1] = torch.where(contains, candidate_ids[:, -1], target_ids)
    target_index = (training == target_ids[:, None]).int().argmax(dim=-1)
    return training, target_index, contains


def dpace_weights(slot_losses: Tensor, mask: Tensor, *, alpha: float) -> Tensor:
    """D-PACE slot weights [N, S] of per-slot losses [N, S] in block order (mask [N, S], 1 where a
    slot is trained), detached: with c_j = (1 - alpha) * exp(-l_j) + alpha on trained slots (1
    elsewhere) and P_j = prod_{i <= j} c_i, w_k = m_k * sum_{j >= k} m_j P_j (speculators'
    `dpace_loss_decay`: the smoothed chance the block survives to j, summed over the slots from k on)."""
    with torch.no_grad():
        mask = mask.float()
        confidence = torch.where(mask > 0, (1.0 - alpha) * torch.exp(-slot_losses.float()) + alpha, torch.ones_like(mask))
        survival = torch.cumprod(confidence, dim=-1) * mask  # [N, S]
        return survival.flip(-1).cumsum(-1).flip(-1) * mask


def _dpace_on_slots(losses: Tensor, *, blocks: Tensor, slots: Tensor, alpha: float) -> Tensor:
    """dpace_weights for losses [M] of slots given by their block [M] and slot number [M]."""
    dense = losses.new_zeros(int(blocks.max()) + 1, int(slots.max()) + 1)  # [N, S]
    mask = torch.zeros_like(dense)
    dense[blocks, slots] = losses.float()
    mask[blocks, slots] = 1.0
    return dpace_weights(dense, mask, alpha=alpha)[blocks, slots]


@dataclass(kw_only=True)
class SlotTerms:
    """The DFlash2 loss terms of M slots (each [M]) and whether the selector picks the label."""

    kl: Tensor
    tv: Tensor
    selector: Tensor
    correct: Tensor  # bool: the selector's pick (after the right previous token) is the label, the unary top-K holding its target


def dflash2_slot_terms(model, slots: SupervisedSlots, *, draft_logits: Tensor) -> SlotTerms:
    """Every term of M slots from their unary logits [M, V] (plain torch, autograd through
    everything): KL against the label, TV against the target's distribution, and the selector's
    cross-entropy over the training candidates scored after each slot's previous token, labelled
    with the target's top token."""
    selector = getattr(model, "module", model).candidate_selector  # DDP wraps the drafter
    logits = draft_logits.float()
    candidate_ids = logits.detach().topk(selector.top_k, dim=-1).indices  # [M, K]
    training_ids, target_index, contains = selector_training_candidates(candidate_ids, slots.dist_ids[:, 0].long())
    scores = logits.gather(-1, training_ids) + selector.transition_scores(slots.hidden, slots.prev_tokens, training_ids).float()  # [M, K]
    picked = training_ids.gather(-1, scores.detach().argmax(dim=-1, keepdim=True))[:, 0]
    return SlotTerms(
        kl=topk_tail_kl(draft_logits=logits, label_ids=slots.label_ids, label_probs=slots.label_probs),
        tv=topk_tail_tv(draft_logits=logits, dist_ids=slots.dist_ids, dist_probs=slots.dist_probs),
        selector=F.cross_entropy(scores, target_index, reduction="none"),
        correct=(picked == slots.label_ids[:, 0]) & contains,
    )


def term_weights(terms: SlotTerms | None, slots: SupervisedSlots, options) -> tuple[Tensor, Tensor, Tensor]:
    """Weights [M] of the KL, TV and selector terms: alpha * w (exp-decay: w carries the envelope),
    or alpha * w * D-PACE of that term's detached losses (dpace: w without the envelope; each slot's
    block and label column say where it sits). options: the family's (drafter/dflash2.py)."""
    weights = slots.weights.float()
    alphas = (options.kl_alpha, options.tv_alpha, options.selector_alpha)
    if options.dflash2_weighting == "exp-decay":
        return tuple(alpha * weights for alpha in alphas)
    losses = (terms.kl, terms.tv, terms.selector)
    return tuple(
        alpha * weights * _dpace_on_slots(loss.detach(), blocks=slots.block_index, slots=slots.label_column, alpha=options.dpace_alpha)
        for alpha, loss in zip(alphas, losses, strict=True)
    )


def reference_dflash2_head_loss(model, slots: SupervisedSlots, *, lm_head: Tensor, options) -> tuple[Tensor, Tensor]:
    """dflash2_head_loss in plain torch for tests: the whole [M, V] logits at once, autograd throughout."""
    terms = dflash2_slot_terms(model, slots, draft_logits=F.linear(slots.hidden, lm_head))
    kl_w, tv_w, selector_w = term_weights(terms, slots, options)
    return (kl_w * terms.kl + tv_w * terms.tv + selector_w * terms.selector).sum(), terms.correct


# ----------------------------------------------------------------------------------------------
# The head loss, chunked


class UnaryHead(torch.autograd.Function):
    """The unary terms of the drafter's hidden states [M, H] through the frozen lm_head, chunk by
    chunk, with their gradient made in the same pass (as losses.HeadLoss: each [chunk, V] logits is
    made once and turned into its gradient), and the unary logits of the selector's training
    candidates [M, K] as a differentiable output (backward adds their gradient through the K rows
    of the head). Returns (sum of the weighted KL and TV terms, training candidate logits [M, K],
    training candidate ids [M, K], whether the unary top-K held the selector's target [M])."""

    @staticmethod
    def forward(ctx, hidden, lm_head, slots: SupervisedSlots, kl_weights, tv_weights, top_k: int, loss_chunk: int, head_dtype):
        head = lm_head.to(head_dtype)  # no copy when the head is already in the compute dtype
        num_slots = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        training_ids = torch.empty(num_slots, top_k, dtype=torch.long, device=hidden.device)
        training_logits = torch.empty(num_slots, top_k, dtype=torch.float32, device=hidden.device)
        contains = torch.empty(num_slots, dtype=torch.bool, device=hidden.device)
        targets = slots.dist_ids[:, 0].long()  # the selector's label: the target's top token
        for start in range(0, num_slots, loss_chunk):
            part = slice(start, start + loss_chunk)
            logits = head_matmul(hidden[part], head.t())  # [chunk, V] float32
            candidates = logits.topk(top_k, dim=-1).indices
            training_ids[part], _, contains[part] = selector_training_candidates(candidates, targets[part])
            training_logits[part] = logits.gather(-1, training_ids[part])
            grad = None
            if tv_weights is not None:
                tv_sum, grad = topk_tail_tv_loss_and_grad(
                    draft_logits=logits, dist_ids=slots.dist_ids[part], dist_probs=slots.dist_probs[part], weights=tv_weights[part]
                )
                loss_sum += tv_sum
            if kl_weights is not None:  # last: it turns the float32 logits into their gradient in place
                label_probs = slots.label_probs[part]
                kl_sum, kl_grad, _ = topk_tail_loss_and_grad(
                    draft_logits=logits, label_ids=slots.label_ids[part], label_probs=label_probs, weights=kl_weights[part]
                )
                loss_sum += kl_sum + (kl_weights[part] * label_negentropy(label_probs)).sum()
                grad = kl_grad if grad is None else grad.add_(kl_grad)
            del logits
            if grad_hidden is not None and grad is not None:
                grad_hidden[part] = head_matmul(grad, head).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden, lm_head, training_ids)
        ctx.loss_chunk, ctx.head_dtype = loss_chunk, head_dtype
        ctx.mark_non_differentiable(training_ids, contains)
        return loss_sum, training_logits, training_ids, contains

    @staticmethod
    def backward(ctx, grad_loss, grad_training_logits, _grad_ids, _grad_contains):
        grad_hidden, lm_head, training_ids = ctx.saved_tensors
        grad = grad_loss * grad_hidden
        if grad_training_logits is not None:  # d z(id) / d h = the head's row of id
            for start in range(0, grad.shape[0], ctx.loss_chunk):
                part = slice(start, start + ctx.loss_chunk)
                rows = lm_head[training_ids[part]].to(ctx.head_dtype).float()  # [chunk, K, H]
                grad[part] += (grad_training_logits[part, :, None] * rows).sum(dim=1).to(grad.dtype)
        return grad, *([None] * 7)


def dflash2_head_loss(model, slots: SupervisedSlots, *, lm_head: Tensor, options, loss_chunk: int, autocast) -> tuple[Tensor, Tensor]:
    """A DFlash2 drafter's loss over M supervised slots (the family's `head_loss`): the slots'
    final-normed states, labels, target distributions, weights, previous tokens and places
    (drafter/family.py, `SupervisedSlots`) through the frozen lm_head [V, H]. No [M, V] tensor
    lives beyond one chunk: the unary terms go through UnaryHead, the selector (trainable, small)
    through autograd, chunk by chunk and recomputed in backward. dpace first scores every slot
    without gradient (one more pass of the head). Returns (sum of the weighted terms [], whether
    each slot's selector pick, after the right previous token, is its label [M])."""
    selector = getattr(model, "module", model).candidate_selector  # DDP wraps the drafter
    hidden = slots.hidden
    with autocast:  # the head GEMM's dtype: bf16 under bf16 autocast, else the head's own
        device_type = hidden.device.type
        head_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else lm_head.dtype
    terms = None
    if options.dflash2_weighting == "dpace":
        with torch.no_grad():
            terms = _chunked_slot_terms(model, slots, lm_head=lm_head.to(head_dtype), loss_chunk=loss_chunk)
    kl_w, tv_w, selector_w = term_weights(terms, slots, options)
    loss_sum, training_logits, training_ids, contains = UnaryHead.apply(
        hidden, lm_head, slots, kl_w if options.kl_alpha > 0 else None, tv_w if options.tv_alpha > 0 else None,
        selector.top_k, loss_chunk, head_dtype,
    )  # fmt: skip
    target_index = (training_ids == slots.dist_ids[:, :1]).int().argmax(dim=-1)  # [M]

    def chunk_loss(h, prev, ids, unary, index, w, label):
        with autocast:
            transition = selector.transition_scores(h, prev, ids)  # [chunk, K]
        scores = unary + transition.float()
        picked = ids.gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        return (w * F.cross_entropy(scores, index, reduction="none")).sum(), picked == label

    correct = torch.zeros_like(contains)
    inputs = (hidden, slots.prev_tokens, training_ids, training_logits, target_index, selector_w, slots.label_ids[:, 0])
    for start in range(0, hidden.shape[0], loss_chunk):
        part = slice(start, start + loss_chunk)
        chunk_sum, chunk_correct = checkpoint(chunk_loss, *(t[part] for t in inputs), use_reentrant=False)
        loss_sum = loss_sum + chunk_sum
        correct[part] = chunk_correct & contains[part]
    return loss_sum, correct


def _chunked_slot_terms(model, slots: SupervisedSlots, *, lm_head: Tensor, loss_chunk: int) -> SlotTerms:
    """dflash2_slot_terms of every slot, chunk by chunk (for D-PACE's weights, without gradient)."""
    parts = []
    for start in range(0, slots.hidden.shape[0], loss_chunk):
        part = slice(start, start + loss_chunk)
        chunk = slots.select(part)
        parts.append(dflash2_slot_terms(model, chunk, draft_logits=head_matmul(chunk.hidden, lm_head.t())))
    return SlotTerms(**{name: torch.cat([getattr(p, name) for p in parts]) for name in ("kl", "tv", "selector", "correct")})
