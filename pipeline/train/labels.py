"""Labels and slot weights of one sequence's draft blocks, for every objective (docs/design.md,
"The method").

`build_block_targets` is the single place where the objectives differ: it follows the method's
recipe (pipeline/train/methods.py), and the train loop feeds its result to the drafter and
`objectives.topk_tail_loss` the same way for every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from drafter.family import BlockLayout
from pipeline.config import opt
from pipeline.train.methods import LABEL_SOURCES, METHODS, ROLLOUT_METHODS, recipe, required_arrays
from storage.format import check_num_slots
from pipeline.train.objectives import (
    alive_mask,
    base_factors,
    cap_mask,
    depth_mask,
    draw_anchors,
    draw_ira_from_parents,
    eligible_anchor_positions,
    hard_gate,
    ira_split,
    rollout_gate,
    secondary_labels,
    secondary_weights,
    slot_control_caps,
    slot_envelope,
    soft_gate,
)

ANCHOR_SOURCES = ("pool", "all")


@dataclass(kw_only=True)
class ObjectiveConfig:
    """How draft blocks are labelled and weighted."""

    method: str = opt(f"Objective: {', '.join(METHODS)}.", default="alr_ira")
    gamma: float = opt("Slot envelope decay for the distillation family (kd, erase, alr, ira).", default=2.0)
    dflash_gamma: float | None = opt(
        "Slot envelope decay for the DFlash cross-entropy baseline (default: the cache's target kind, 7 for a "
        "vision-language target, 2 for a text one).",
        default=None,
    )
    rollout_depth: int | None = opt(
        "R: rollout tokens used for labels (R + 1 slots trained); default and for alr_ira: K - 1 of the cache.", default=None
    )
    anchors_per_step: int | None = opt("Anchors per sequence per step (default: the whole cached pool).", default=None)
    anchor_source: str = opt("pool (the cached anchors) or all (every eligible position; corpus-only methods).", default="pool")
    # What the cache fixes (not flags): the trainer binds them from the manifest (`for_cache`).
    num_slots: int = field(default=15, metadata={"cli": False})
    """K, predicted slots per block (block size K + 1); must match the cache."""
    mask_token_id: int | None = field(default=None, metadata={"cli": False})
    """Token id of the block's MASK slots."""
    stop_token_ids: tuple[int, ...] = field(default=(), metadata={"cli": False})
    """Stop token ids (eos / end of turn): rollout slots after one are not trained."""
    layout: BlockLayout | None = field(default=None, metadata={"cli": False})
    """The drafter family's block on the cache's K labelled slots; None: the DFlash block of K + 1."""

    def __post_init__(self) -> None:
        recipe(self.method)  # a ValueError naming the methods for an unknown one
        check_num_slots(self.num_slots)  # the cache's K: one rule (storage/format.py)
        if not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.layout is not None and self.layout.num_labelled > self.num_slots:
            raise ValueError(
                f"the drafter family's block trains {self.layout.num_labelled} label slots; the cache labels K = {self.num_slots} "
                f"(must be in [1, {self.num_slots}])"
            )
        if self.dflash_gamma is not None and not self.dflash_gamma > 0:
            raise ValueError(f"dflash_gamma must be > 0, got {self.dflash_gamma}")
        if self.rollout_depth is not None and self.rollout_depth < 0:
            raise ValueError(f"rollout_depth must be >= 0, got {self.rollout_depth}")
        if self.mask_token_id is not None:  # bound to a cache (for_cache): its K is known
            self._check_rollout_depth()
        if self.anchors_per_step is not None and self.anchors_per_step < 1:
            raise ValueError(f"anchors_per_step must be >= 1 or None, got {self.anchors_per_step}")
        if self.anchor_source not in ANCHOR_SOURCES:
            raise ValueError(f"anchor_source must be one of {ANCHOR_SOURCES}, got {self.anchor_source!r}")
        if self.anchor_source == "all" and self.method in ROLLOUT_METHODS:
            raise ValueError(
                f"anchor_source 'all' needs rollouts at every position; {self.method} has them only "
                "for the cached pool (use anchor_source 'pool')"
            )
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        self.stop_token_ids = tuple(int(token) for token in self.stop_token_ids)

    def _check_rollout_depth(self) -> None:
        """--rollout-depth against the cache's K: flags are parsed before the cache is opened, so
        this runs once the objective is bound to a cache (the default becomes K - 1 then)."""
        if self.rollout_depth is None:
            self.rollout_depth = self.num_slots - 1
        if self.method in ROLLOUT_METHODS and self.rollout_depth > self.num_slots - 1:
            raise ValueError(
                f"--rollout-depth (rollout_depth) must be <= K - 1 = {self.num_slots - 1} for this cache (K = {self.num_slots}), "
                f"got {self.rollout_depth}"
            )
        if recipe(self.method).ira == "secondaries" and self.rollout_depth != self.num_slots - 1:
            raise ValueError(
                f"--rollout-depth (rollout_depth) must be K - 1 = {self.num_slots - 1} for alr_ira on this cache (K = {self.num_slots}; "
                f"secondaries sit at offsets up to K - 1), got {self.rollout_depth}"
            )

    @property
    def cache_arrays(self) -> set[str]:
        """The cache arrays these blocks read: the method's, and the target's distributions where the
        drafter family's layout asks for them beside one-hot labels."""
        return required_arrays(self.method, distributions=self.layout is not None and self.layout.distributions)

    def for_cache(
        self, *, num_slots: int, mask_token_id: int, stop_token_ids, vision: bool = False, layout: BlockLayout | None = None
    ) -> ObjectiveConfig:
        """This objective bound to a cache's K, mask token and stop tokens (validated again), with
        --dflash-gamma's default taken from the cache's target kind (`vision`); `layout`: the
        drafter family's block (drafter/family.py)."""
        dflash_gamma = self.dflash_gamma if self.dflash_gamma is not None else default_dflash_gamma(vision=vision)
        return replace(
            self, num_slots=num_slots, mask_token_id=mask_token_id, stop_token_ids=tuple(stop_token_ids), dflash_gamma=dflash_gamma,
            layout=layout,
        )  # fmt: skip


def default_dflash_gamma(*, vision: bool) -> float:
    """The DFlash recipe's slot envelope decay: 7 for vision-language targets, 2 for text (docs/objectives.md)."""
    return 7.0 if vision else 2.0


@dataclass(kw_only=True)
class BlockTargets:
    """Inputs, visibility and labels of one sequence's N draft blocks (slot k sits at index k - 1).

    Built as DFlash blocks of K + 1 slots over the cache's K label columns; a family whose block
    differs (`BlockLayout`, drafter/family.py: fewer slots, each predicting what DFlash slot k + 1 does) keeps the
    first columns (`for_drafter`)."""

    block_tokens: Tensor  # [N, K+1] long: slot 0 = anchor token, slots 1..K = mask_token_id (another layout: [N, B])
    block_anchor_pos: Tensor  # [N] long: position of slot 0 (a, or a + j for a secondary)
    block_corpus_limit: Tensor  # [N] long: corpus features visible at positions < limit
    private_parent: Tensor  # [N] long: pool index whose rollout features the block also sees, or -1
    private_len: Tensor  # [N] long: how many of them (y*[1..j-1] at positions a+1..a+j-1), else 0
    label_ids: Tensor  # [N, K, k] long (k = 1 for dflash's one-hot labels)
    label_probs: Tensor  # [N, K, k] float32, tail = max(0, 1 - sum)
    slot_weights: Tensor  # [N, K] float32, 0 = unsupervised
    is_secondary: Tensor  # [N] bool
    # The token before each label on the label's own track (corpus x[a+k-1], rollout y*[k-1], a
    # secondary's y*[j+k-1]): a family's input beside the block (a Markov head's). [N, K] long.
    prev_tokens: Tensor
    # The target distribution each prediction is compared with (a family that `reads_distributions`):
    # the labels themselves, except for one-hot labels, where the corpus pass's top-k (when read). [N, K, k]
    dist_ids: Tensor | None = None
    dist_probs: Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.block_tokens.shape[0]


def compose_slot_weights(
    *,
    base: Tensor,
    label_source: str,
    alive: Tensor | None = None,
    depth: Tensor | None = None,
    cap: Tensor | None = None,
    rollout_gate: Tensor | None = None,
    corpus_gate: Tensor | None = None,
) -> Tensor:
    """Multiply slot weight factors in the fixed order base -> alive, depth, cap -> rollout gate ->
    corpus gate ([N, K + 1] each, or [K + 1]).

    A corpus gate scores the corpus continuation, which rollout labels do not follow: refused.
    """
    if label_source not in LABEL_SOURCES:
        raise ValueError(f"label_source must be one of {LABEL_SOURCES}, got {label_source!r}")
    if label_source == "rollout" and corpus_gate is not None:
        raise ValueError("a corpus gate cannot weight rollout labels (it scores a different continuation)")
    weights = base
    for factor in (alive, depth, cap, rollout_gate, corpus_gate):
        if factor is not None:
            weights = weights * factor
    return weights


def _blocks_at_corpus_anchors(
    record: dict[str, Tensor], *, anchor_pos: Tensor, label_ids: Tensor, label_probs: Tensor,
    weights: Tensor, config: ObjectiveConfig, prev_tokens: Tensor,
) -> BlockTargets:
    """Blocks [x[a], MASK x K] that see the corpus features before their anchor a and nothing else."""
    num_blocks = anchor_pos.shape[0]
    device = anchor_pos.device
    block_tokens = torch.full((num_blocks, config.num_slots + 1), config.mask_token_id, device=device)
    block_tokens[:, 0] = record["input_ids"].long()[anchor_pos]
    return BlockTargets(
        block_tokens=block_tokens,  # [N, K + 1]
        block_anchor_pos=anchor_pos.clone(),
        block_corpus_limit=anchor_pos.clone(),
        private_parent=torch.full((num_blocks,), -1, dtype=torch.long, device=device),
        private_len=torch.zeros(num_blocks, dtype=torch.long, device=device),
        label_ids=label_ids,
        label_probs=label_probs,
        slot_weights=weights[:, 1:].contiguous(),  # [N, K]: slot 0 is never trained
        is_secondary=torch.zeros(num_blocks, dtype=torch.bool, device=device),
        prev_tokens=prev_tokens,
        dist_ids=label_ids,
        dist_probs=label_probs,
    )


def _corpus_prev_tokens(record: dict[str, Tensor], *, anchor_pos: Tensor, num_slots: int) -> Tensor:
    """x[a + k - 1] for slots k = 1..K ([N, K] long; 0 past the sequence end, where weights are 0)."""
    input_ids = record["input_ids"].long()
    seq_len = input_ids.shape[0]
    positions = anchor_pos[:, None] + torch.arange(num_slots, device=anchor_pos.device)  # [N, K]: a + k - 1
    return torch.where(positions < seq_len, input_ids[positions.clamp(max=seq_len - 1)], 0)


def _corpus_distributions(record: dict[str, Tensor], *, anchor_pos: Tensor, num_slots: int) -> tuple[Tensor, Tensor] | None:
    """The corpus pass's top-k of the tokens slots 1..K predict, [N, K, k] ids and probs (zero past
    the sequence end), or None when the record holds none (a DFlash dflash run reads none)."""
    if "corpus_topk_ids" not in record:
        return None
    seq_len = record["input_ids"].shape[0]
    positions = anchor_pos[:, None] + torch.arange(1, num_slots + 1, device=anchor_pos.device)  # [N, K]: a + k
    in_seq = (positions < seq_len)[:, :, None]
    source = (positions - 1).clamp(max=seq_len - 1)  # the distribution predicting x[a + k] sits at a + k - 1
    ids = torch.where(in_seq, record["corpus_topk_ids"].long()[source], 0)
    return ids, torch.where(in_seq, record["corpus_topk_probs"].float()[source], 0.0)


def _corpus_labels(
    record: dict[str, Tensor], *, anchor_pos: Tensor, config: ObjectiveConfig
) -> tuple[Tensor, Tensor]:
    """Labels of slot k from the corpus pass: [N, K, k] ids and probs, zero past the sequence end."""
    input_ids = record["input_ids"].long()
    seq_len = input_ids.shape[0]
    slots = torch.arange(1, config.num_slots + 1, device=anchor_pos.device)
    positions = anchor_pos[:, None] + slots  # [N, K]: a + k, the token slot k predicts
    in_seq = (positions < seq_len)[:, :, None]
    if recipe(config.method).one_hot_labels:
        tokens = input_ids[positions.clamp(max=seq_len - 1)][:, :, None]
        label_ids = torch.where(in_seq, tokens, 0)  # [N, K, 1]
        return label_ids, torch.ones(label_ids.shape, dtype=torch.float32, device=label_ids.device)
    return _corpus_distributions(record, anchor_pos=anchor_pos, num_slots=config.num_slots)  # [N, K, k] each


def _corpus_targets(
    record: dict[str, Tensor], *, anchor_pos: Tensor, config: ObjectiveConfig
) -> BlockTargets:
    num_slots = config.num_slots
    method = recipe(config.method)
    envelope = slot_envelope(num_slots=num_slots, gamma=envelope_gamma(config))
    in_seq = base_factors(anchor_pos=anchor_pos, loss_mask=record["loss_mask"], num_slots=num_slots)
    corpus_gate = None
    if method.corpus_gate == "soft":
        corpus_gate = soft_gate(
            anchor_pos=anchor_pos, corpus_next_prob=record["corpus_next_prob"], num_slots=num_slots
        )
    elif method.corpus_gate == "hard":
        corpus_gate = hard_gate(
            anchor_pos=anchor_pos,
            input_ids=record["input_ids"],
            corpus_argmax=record["corpus_topk_ids"][:, 0],
            num_slots=num_slots,
        )
    weights = compose_slot_weights(base=in_seq * envelope, label_source="corpus", corpus_gate=corpus_gate)
    label_ids, label_probs = _corpus_labels(record, anchor_pos=anchor_pos, config=config)
    targets = _blocks_at_corpus_anchors(
        record, anchor_pos=anchor_pos, label_ids=label_ids, label_probs=label_probs, weights=weights,
        config=config, prev_tokens=_corpus_prev_tokens(record, anchor_pos=anchor_pos, num_slots=num_slots),
    )
    if method.one_hot_labels:  # the distributions come from the corpus pass, if the run reads them
        targets.dist_ids, targets.dist_probs = _corpus_distributions(record, anchor_pos=anchor_pos, num_slots=num_slots) or (None, None)
    return targets


def envelope_gamma(config: ObjectiveConfig) -> float:
    """The slot envelope's decay: the drafter family's own when it has one (every method), else the
    DFlash baseline's own for dflash and --gamma for the distillation family."""
    if config.layout is not None and config.layout.envelope_gamma is not None:
        return config.layout.envelope_gamma
    if recipe(config.method).dflash_envelope:
        return config.dflash_gamma if config.dflash_gamma is not None else default_dflash_gamma(vision=False)
    return config.gamma


def _rollout_targets(
    record: dict[str, Tensor], *, anchor_pos: Tensor, pool_index: Tensor, config: ObjectiveConfig,
    generator: torch.Generator, split=None,
) -> BlockTargets:
    num_slots = config.num_slots
    num_blocks = anchor_pos.shape[0]
    rollout_tokens = record["rollout_tokens"].long()[pool_index]  # [N, K + 1]
    if rollout_tokens.shape[1] != num_slots + 1:
        raise ValueError(
            f"num_slots is {num_slots} but the cache's rollouts have {rollout_tokens.shape[1] - 1} slots"
        )
    label_ids = record["rollout_topk_ids"].long()[pool_index]  # [N, K, k]: pi[a, 1..K]
    label_probs = record["rollout_topk_probs"].float()[pool_index]  # [N, K, k]
    stop_token_ids = torch.tensor(config.stop_token_ids, dtype=torch.long)
    envelope = slot_envelope(num_slots=num_slots, gamma=envelope_gamma(config))
    in_seq = base_factors(anchor_pos=anchor_pos, loss_mask=record["loss_mask"], num_slots=num_slots)
    alive = alive_mask(rollout_tokens=rollout_tokens, stop_token_ids=stop_token_ids)  # [N, K + 1]
    depth = depth_mask(num_slots=num_slots, rollout_depth=config.rollout_depth)  # [K + 1]
    cap = gate = None
    method = recipe(config.method)
    if method.ira is not None and split is None:
        split = ira_split(num_blocks=num_blocks, num_slots=num_slots, generator=generator)
    if method.ira == "caps":
        cap = cap_mask(slot_control_caps(split=split, num_blocks=num_blocks, num_slots=num_slots), num_slots)
    if method.rollout_gate:
        gate = rollout_gate(rollout_topk_probs=label_probs, num_slots=num_slots)
    weights = compose_slot_weights(
        base=in_seq * envelope, label_source="rollout", alive=alive, depth=depth, cap=cap, rollout_gate=gate
    )  # [N, K + 1]
    targets = _blocks_at_corpus_anchors(
        record, anchor_pos=anchor_pos, label_ids=label_ids, label_probs=label_probs, weights=weights,
        config=config, prev_tokens=rollout_tokens[:, :num_slots].clone(),  # y*[k - 1] for slot k; y*[0] = x[a]
    )
    if method.ira != "secondaries":
        return targets

    # Secondaries take over the blocks drawn at their indices: each is anchored on y*[j] of its
    # parent's rollout, sees the corpus up to a and y*[1..j-1], and reuses the parent's labels.
    secondaries, parents, offsets = split.secondaries, split.parents, split.offsets
    parent_anchor = anchor_pos[parents]  # [n_sec]
    parent_factors = in_seq[parents] * alive[parents] * depth  # [n_sec, K + 1], no envelope
    sec_weights = secondary_weights(
        parent_base_factors=parent_factors, offsets=offsets, envelope=envelope, num_slots=num_slots
    )
    sec_ids, sec_probs = secondary_labels(
        parent_topk_ids=label_ids[parents], parent_topk_probs=label_probs[parents], offsets=offsets,
        num_slots=num_slots,
    )
    targets.block_tokens[secondaries, 0] = rollout_tokens[parents, offsets]
    targets.block_anchor_pos[secondaries] = parent_anchor + offsets
    targets.block_corpus_limit[secondaries] = parent_anchor + 1
    targets.private_parent[secondaries] = pool_index[parents]
    targets.private_len[secondaries] = offsets - 1
    targets.label_ids[secondaries] = sec_ids
    targets.label_probs[secondaries] = sec_probs
    targets.slot_weights[secondaries] = sec_weights[:, 1:]
    targets.is_secondary[secondaries] = True
    # A secondary's slot k follows y*[j + k - 1] of its parent's rollout (clamped where its weight is 0).
    shifted = (offsets[:, None] + torch.arange(num_slots, device=offsets.device)).clamp(max=num_slots)
    targets.prev_tokens[secondaries] = rollout_tokens[parents[:, None], shifted]
    return targets


def build_block_targets(
    record: dict[str, Tensor], *, config: ObjectiveConfig, generator: torch.Generator
) -> BlockTargets:
    """Draw one sequence's anchors and build its blocks' inputs, labels and slot weights.

    `record` holds the sequence's cache arrays as CPU tensors (see `required_arrays`), and for a
    cache that keeps rollout features for only some pool anchors `ira_parent_rows` (their pool
    indices, fewer than the pool): alr_ira then draws its parents from them (draw_ira_from_parents).
    Randomness is taken from `generator` in a fixed order (anchor draw, then the IRA split), so a
    seed fixes the targets bit for bit. A sequence with no anchors gives N = 0 blocks.
    """
    if config.mask_token_id is None:
        raise ValueError("the objective is not bound to a cache (ObjectiveConfig.for_cache)")
    parent_rows = record.get("ira_parent_rows")
    if parent_rows is not None and recipe(config.method).ira == "secondaries" and config.anchor_source == "pool":
        candidates = record["anchor_pos"].long()  # [A]
        drawn, split = draw_ira_from_parents(
            candidates, parent_rows, num_anchors=config.anchors_per_step, num_slots=config.num_slots, generator=generator
        )  # fmt: skip
        return for_drafter(_rollout_targets(
            record, anchor_pos=candidates[drawn], pool_index=drawn, config=config, generator=generator, split=split
        ), config)  # fmt: skip
    if config.anchor_source == "pool":
        candidates = record["anchor_pos"].long()  # [A]
    else:
        candidates = eligible_anchor_positions(record["loss_mask"])
    drawn = draw_anchors(candidates, num_anchors=config.anchors_per_step, generator=generator)  # [N]
    anchor_pos = candidates[drawn]  # [N]
    if recipe(config.method).label_source == "corpus":
        return for_drafter(_corpus_targets(record, anchor_pos=anchor_pos, config=config), config)
    return for_drafter(_rollout_targets(
        record, anchor_pos=anchor_pos, pool_index=drawn, config=config, generator=generator
    ), config)  # fmt: skip


def for_drafter(targets: BlockTargets, config: ObjectiveConfig) -> BlockTargets:
    """The DFlash blocks as the drafter family trains them (`config.layout`, drafter/family.py): its
    block holds the first `block_size` of [anchor, MASK x K], and its labelled rows take the first
    `num_labelled` label columns with their weights, distributions and previous tokens. A layout
    that is the DFlash block itself leaves them as they are."""
    layout = config.layout
    if layout is None or (layout.block_size, layout.num_labelled) == (config.num_slots + 1, config.num_slots):
        return targets
    num_labelled = layout.num_labelled

    def first(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[:, :num_labelled].contiguous()

    label_ids, label_probs = first(targets.label_ids), first(targets.label_probs)
    same = targets.dist_ids is targets.label_ids  # the labels are the distributions: keep them one tensor
    return replace(
        targets, block_tokens=targets.block_tokens[:, : layout.block_size].contiguous(), label_ids=label_ids,
        label_probs=label_probs, slot_weights=first(targets.slot_weights), prev_tokens=first(targets.prev_tokens),
        dist_ids=label_ids if same else first(targets.dist_ids), dist_probs=label_probs if same else first(targets.dist_probs),
    )  # fmt: skip
