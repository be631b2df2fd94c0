"""The DSpark family (docs/dspark.md): the DFlash backbone plus a Markov head and a confidence head.

Its model is drafter/dspark_model.py (`DSparkConfig`, `DSparkDrafter`, `dspark_draft`), the file its
export ships. This module holds what training and evaluation need of it:
- options (`--dspark-block`, `--markov-rank`, `--confidence-head`, the loss weights), their defaults
  resolved for the cache: B = K, DeepSpec's rank 256 capped at a quarter of the vocabulary;
- the layout: a block of B slots whose slot k predicts x[a + k + 1], so row k takes the cache's
  label column k (the first B of its K), each with DeepSpec's envelope exp(-k / 4) whatever the method;
- DeepSpec's loss (0.1 CE + 0.9 L1 + 1.0 BCE), against the target's top-k + tail distribution;
- drafting: one backbone pass, then the Markov head slot by slot; the confidence head's predicted
  acceptance per slot;
- init: a DSpark checkpoint as it is, or a DFlash one's backbone with fresh heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from drafter.dspark_model import ARCHITECTURE, AUTO_MAP, DSparkConfig, DSparkDrafter, default_markov_rank, dspark_draft
from drafter.family import BlockLayout, DrafterFamily, Drafts, SupervisedSlots, option
from drafter.losses import topk_tail_l1, topk_tail_slot_losses

CONFIDENCE_TARGETS = ("overlap", "greedy")
# Files copied into every DSpark export: its wrapper and model beside the backbone's files.
MODELING_FILES = (
    ("hf_modeling_dspark.py", "modeling_dspark.py"), ("dspark_model.py", "dspark_model.py"), ("model.py", "dflash_model.py"),
    ("config.py", "dflash_config.py"),
)  # fmt: skip


@dataclass(kw_only=True)
class DSparkOptions:
    """--arch dspark: the DSpark block, its heads and the weights of DeepSpec's loss terms (docs/dspark.md)."""

    dspark_block: int | None = option(
        "--arch dspark: B, the slots of a DSpark block (each drafts one token); at most and by default the cache's "
        "K predicted slots (--num-slots of the build; one less than the DFlash block size).",
        default=None,
    )
    markov_rank: int | None = option(
        "--arch dspark: rank of the Markov head, 0 for none; at most a quarter of the vocabulary (default: DeepSpec's 256 "
        "within that bound, or a DSpark --drafter-init's).",
        default=None,
    )
    confidence_head: bool | None = option(
        "--arch dspark: train the confidence head (its acceptance prediction); default on, or as a DSpark --drafter-init has it.",
        default=None,
    )
    dspark_gamma: float = option(
        "--arch dspark: slot envelope decay exp(-k / gamma) over DSpark slot k = 0..B-1, for every method (DeepSpec's 4).",
        default=4.0,
    )
    ce_alpha: float = option("--arch dspark: weight of the label cross-entropy (the method's labels).", default=0.1)
    l1_alpha: float = option(
        "--arch dspark: weight of ||q - p||_1 against the target's distribution (top-k + tail: a lower bound).", default=0.9
    )
    confidence_alpha: float = option("--arch dspark: weight of the confidence head's BCE.", default=1.0)
    confidence_target: str = option(
        "--arch dspark: what the confidence head predicts: overlap (sum min(q, p), acceptance at T = 1; DeepSpec's) or "
        "greedy (argmax q == the target's top token, acceptance at T = 0).",
        default="overlap",
    )

    def __post_init__(self):
        if self.dspark_block is not None and self.dspark_block < 1:
            raise ValueError(f"--dspark-block must be >= 1, got {self.dspark_block}")
        if self.markov_rank is not None and self.markov_rank < 0:
            raise ValueError(f"--markov-rank must be >= 0, got {self.markov_rank}")
        if not self.dspark_gamma > 0:
            raise ValueError(f"dspark_gamma must be > 0, got {self.dspark_gamma}")
        for name in ("ce_alpha", "l1_alpha", "confidence_alpha"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"--confidence-target must be overlap or greedy, got {self.confidence_target!r}")


def resolve_dspark_options(options: DSparkOptions, *, num_slots: int, vocab_size: int, init=None) -> DSparkOptions:
    """B, the Markov rank and the confidence head of a run on a cache of K = num_slots. From a DSpark
    --drafter-init (`init`: its path and config) they are the init's, and a flag that differs is
    refused naming both, so train_config.json, provenance and the export agree. Otherwise B defaults
    to K, the rank to DeepSpec's 256 within a quarter of the vocabulary (a rank near V is a full
    bigram table; docs/dspark.md), the confidence head to on. B may not exceed K (slot B - 1 needs
    the label of the cache's last slot)."""
    given = {"dspark_block": options.dspark_block, "markov_rank": options.markov_rank, "confidence_head": options.confidence_head}
    if init is not None:
        path, config = init
        held = {"dspark_block": config.block_size, "markov_rank": config.markov_rank, "confidence_head": config.enable_confidence_head}
        differ = [f"--{name.replace('_', '-')} {given[name]} (the init has {held[name]})" for name in given
                  if given[name] is not None and given[name] != held[name]]  # fmt: skip
        if differ:
            raise ValueError(f"--drafter-init {path} is a DSpark drafter whose heads are its own: {'; '.join(differ)}; drop the flag")
        given = held
    block = num_slots if given["dspark_block"] is None else given["dspark_block"]
    if block > num_slots:
        what = f"--drafter-init {init[0]}'s block of {block}" if init is not None else f"--dspark-block {block}"
        raise ValueError(
            f"{what} is larger than this cache supports: it labels K = {num_slots} predicted slots per anchor "
            f"(DFlash block size {num_slots + 1}), so a DSpark block has at most B = {num_slots}; build a cache with --num-slots {block} or more"
        )
    rank = default_markov_rank(vocab_size) if given["markov_rank"] is None else given["markov_rank"]
    if init is None and rank > vocab_size // 4:
        raise ValueError(f"--markov-rank {rank} is more than a quarter of the vocabulary ({vocab_size} // 4 = {vocab_size // 4})")
    confidence_head = True if given["confidence_head"] is None else given["confidence_head"]
    return dataclasses.replace(options, dspark_block=block, markov_rank=rank, confidence_head=confidence_head)


def dspark_config(backbone, options: DSparkOptions) -> DSparkConfig:
    """A DSpark config on a DFlash backbone's shape, with the run's B and heads."""
    return DSparkConfig.from_dflash(
        backbone, block_size=options.dspark_block, markov_rank=options.markov_rank, enable_confidence_head=options.confidence_head
    )


def dspark_layout(options: DSparkOptions, *, num_slots: int) -> BlockLayout:
    """B slots; row k predicts label column k (what DFlash slot k + 1 predicts), DeepSpec's envelope."""
    return BlockLayout(
        block_size=options.dspark_block, num_labelled=options.dspark_block, envelope_gamma=options.dspark_gamma,
        distributions=True,  # the L1 and confidence terms compare every prediction with the target's distribution
    )


def dspark_family_draft(drafter: DSparkDrafter, *, hidden: Tensor, anchor_tokens: Tensor, lm_head) -> Drafts:
    """One backbone pass's hidden states [N, B, H] -> B drafts per block, the Markov head run slot by
    slot on the drafter's own tokens (dspark_draft), with the confidence head's predictions."""
    base_logits = lm_head(hidden.to(lm_head.weight.dtype))  # [N, B, V]
    tokens, _, confidence = dspark_draft(drafter, base_logits=base_logits, hidden=hidden, anchor_tokens=anchor_tokens)
    return Drafts(tokens=tokens, confidence=confidence)


def dspark_slot_losses(
    *, draft_logits: Tensor, confidence_logits: Tensor | None, label_ids: Tensor, label_probs: Tensor,
    dist_ids: Tensor, dist_probs: Tensor, ce_alpha: float, l1_alpha: float, confidence_alpha: float,
    confidence_target: str = "overlap",
) -> tuple[Tensor, Tensor]:
    """DeepSpec's DSpark loss per slot [M] and the confidence head's target [M]:
        l = ce_alpha * CE + l1_alpha * ||q - p||_1 + confidence_alpha * BCE(sigmoid(c), c*)
    draft_logits [M, V] are the Markov-corrected logits, q their softmax. CE is the method's label
    loss (topk_tail_slot_losses: the one-hot token for dflash, the label distribution otherwise); p
    (dist_ids/probs [M, k]) is the target's distribution at the slot, known as top-k + tail, so the
    L1 is topk_tail_l1's lower bound. c* is detached: "overlap" = 1 - l1 / 2 (T = 1 acceptance, an
    upper bound from top-k + tail), "greedy" = 1[argmax q == p's top token] (T = 0 acceptance).
    With one weight per slot for all three terms, sum(w * l) / sum(w) is DeepSpec's three separately
    normalised means added up."""
    if confidence_target not in CONFIDENCE_TARGETS:
        raise ValueError(f"confidence_target must be one of {CONFIDENCE_TARGETS}, got {confidence_target!r}")
    logits = draft_logits.float()
    cross_entropy = topk_tail_slot_losses(draft_logits=logits, label_ids=label_ids, label_probs=label_probs)
    l1 = topk_tail_l1(draft_probs=logits.softmax(dim=-1), dist_ids=dist_ids, dist_probs=dist_probs)
    with torch.no_grad():
        if confidence_target == "overlap":
            target = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
        else:
            target = (logits.argmax(dim=-1) == dist_ids[:, 0]).float()
    loss = ce_alpha * cross_entropy + l1_alpha * l1
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), target, reduction="none")
        loss = loss + confidence_alpha * bce
    return loss, target


def dspark_head_loss(heads: DSparkDrafter, slots: SupervisedSlots, *, lm_head: Tensor, options: DSparkOptions, loss_chunk: int,
                     autocast) -> tuple[Tensor, Tensor]:  # fmt: skip
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
            dist_probs=d_probs, ce_alpha=options.ce_alpha, l1_alpha=options.l1_alpha,
            confidence_alpha=options.confidence_alpha, confidence_target=options.confidence_target,
        )  # fmt: skip
        return (w.float() * losses).sum(), (logits.argmax(-1) == ids[:, 0])

    weights = slots.weights
    loss_sum = slots.hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(len(weights), dtype=torch.bool, device=weights.device)
    inputs = (slots.hidden, slots.label_ids, slots.label_probs, weights, slots.prev_tokens, slots.dist_ids, slots.dist_probs)
    for i in range(0, len(weights), loss_chunk):
        part = slice(i, i + loss_chunk)
        chunk_sum, chunk_correct = checkpoint(chunk_loss, *(t[part] for t in inputs), use_reentrant=False)
        loss_sum = loss_sum + chunk_sum
        correct[part] = chunk_correct
    return loss_sum, correct


DSPARK = DrafterFamily(
    name="dspark",
    title="DSpark",
    architecture=ARCHITECTURE,
    config_class=DSparkConfig,
    model_class=DSparkDrafter,
    draft=dspark_family_draft,
    head_loss=dspark_head_loss,
    layout=dspark_layout,
    options_class=DSparkOptions,
    resolve_options=resolve_dspark_options,
    new_config=dspark_config,
    init_from=("dflash",),
    own_envelope=True,
    has_confidence=lambda config: config.enable_confidence_head,
    modeling_files=MODELING_FILES,
    auto_map=AUTO_MAP,
)
