"""The DFlash2 family (docs/dflash2.md): the DFlash backbone plus block convolutions and a candidate selector.

Its model is drafter/dflash2_model.py (`DFlash2Config`, `DFlash2Drafter`, `dflash2_draft`), the file
its export ships; its loss is drafter/dflash2_loss.py. This module holds what training and
evaluation need of it:
- options: the convolution and selector shape (`--conv-kernel-size`, `--conv-group-size`,
  `--selector-rank`, `--selector-top-k`; unset: speculators' defaults for a fresh drafter, the
  checkpoint's for a DFlash2 --drafter-init) and the loss weights (`--kl-alpha`, `--tv-alpha`,
  `--selector-alpha`, `--dflash2-gamma`, `--dflash2-weighting`, `--dpace-alpha`);
- the layout: DFlash's block of K + 1 (slot k predicts x[a + k]) with speculators' envelope
  exp(-(k - 1) / 4) for every method, or none under D-PACE (its weights replace it); every slot also
  takes the target's distribution (TV, and the selector's label: the target's top token);
- drafting: one backbone pass, then the selector's greedy walk over each slot's unary top-K;
- init: a DFlash2 checkpoint as it is, or a DFlash one's backbone with identity convolutions and a
  fresh selector (it then computes the DFlash drafter's hidden states).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from torch import Tensor

from drafter.config import DFlashConfig
from drafter.dflash2_loss import dflash2_head_loss
from drafter.dflash2_model import ARCHITECTURE, AUTO_MAP, DFLASH2_KEYS, DFlash2Config, DFlash2Drafter, default_selector_top_k, dflash2_draft
from drafter.family import BlockLayout, DrafterFamily, Drafts, option

WEIGHTINGS = ("exp-decay", "dpace")
DEFAULT_CONV_KERNEL_SIZE = 2  # speculators' defaults
DEFAULT_CONV_GROUP_SIZE = 16
DEFAULT_SELECTOR_RANK = 256
# Files copied into every DFlash2 export: its wrapper and model beside the backbone's files (DFlash's wrapper among them).
MODELING_FILES = (
    ("hf_modeling_dflash2.py", "modeling_dflash2.py"), ("hf_modeling.py", "modeling_dflash.py"), ("dflash2_model.py", "dflash2_model.py"),
    ("model.py", "dflash_model.py"), ("config.py", "dflash_config.py"),
)  # fmt: skip
_SHAPE_DEFAULT = "unset: speculators' {default} for a fresh drafter, a DFlash2 --drafter-init's own"


@dataclass(kw_only=True)
class DFlash2Options:
    """--arch dflash2: the convolutions, the candidate selector and speculators' loss terms (docs/dflash2.md)."""

    conv_kernel_size: int | None = option(
        f"--arch dflash2: taps of each block convolution (causal over the block's slots; {_SHAPE_DEFAULT.format(default=2)}).",
        default=None,
    )
    conv_group_size: int | None = option(
        f"--arch dflash2: hidden channels sharing one dynamic coefficient, a divisor of the hidden size "
        f"({_SHAPE_DEFAULT.format(default=16)}).",
        default=None,
    )
    selector_rank: int | None = option(
        f"--arch dflash2: rank of the candidate selector's codebooks ({_SHAPE_DEFAULT.format(default='256, at most a quarter of the vocabulary,')}).",
        default=None,
    )
    selector_top_k: int | None = option(
        f"--arch dflash2: unary candidates K the selector reranks per slot "
        f"({_SHAPE_DEFAULT.format(default='16, at most what llama.cpp serves (K * (K + 1) <= hidden size),')}).",
        default=None,
    )
    kl_alpha: float = option(
        "--arch dflash2: weight of KL(label || draft), speculators' kl_div (top-k + tail: a lower bound; one-hot: the cross-entropy).",
        default=1.0,
    )
    tv_alpha: float = option(
        "--arch dflash2: weight of TV(target, draft), speculators' tv (top-k + tail: a lower bound).", default=0.0
    )
    selector_alpha: float = option(
        "--arch dflash2: weight of the selector's K-way cross-entropy toward the target's top token (speculators' "
        "selector_loss_alpha).",
        default=1.0,
    )
    dflash2_gamma: float = option(
        "--arch dflash2: slot envelope exp(-(k - 1) / gamma) over DFlash2 slots k = 1..B-1, for every method "
        "(speculators' dflash_decay_gamma 4); unused with --dflash2-weighting dpace.",
        default=4.0,
    )
    dflash2_weighting: str = option(
        "--arch dflash2: slot weights: exp-decay (the envelope, speculators' default) or dpace (D-PACE: each slot weighted by "
        "the smoothed chance its block is still accepted there, from each term's detached losses, and no envelope).",
        default="exp-decay",
    )
    dpace_alpha: float = option("--arch dflash2: D-PACE's smoothing constant in [0, 1] (speculators' dpace_alpha).", default=0.5)

    def __post_init__(self):
        for name in DFLASH2_KEYS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("kl_alpha", "tv_alpha", "selector_alpha"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.kl_alpha + self.tv_alpha + self.selector_alpha > 0:
            raise ValueError("--kl-alpha, --tv-alpha and --selector-alpha are all 0: nothing would be trained")
        if not (self.dflash2_gamma > 0 and math.isfinite(self.dflash2_gamma)):
            raise ValueError(f"--dflash2-gamma must be a positive number, got {self.dflash2_gamma}")
        if self.dflash2_weighting not in WEIGHTINGS:
            raise ValueError(f"--dflash2-weighting must be one of {', '.join(WEIGHTINGS)}, got {self.dflash2_weighting!r}")
        if not 0 <= self.dpace_alpha <= 1:
            raise ValueError(f"--dpace-alpha must lie in [0, 1], got {self.dpace_alpha}")


def default_selector_rank(vocab_size: int) -> int:
    """speculators' rank 256, capped at a quarter of the vocabulary (as DSpark's Markov rank: two [V, r]
    codebooks with r near V hold far more than a tiny vocabulary's transitions need)."""
    return max(1, min(DEFAULT_SELECTOR_RANK, vocab_size // 4))


def resolve_dflash2_options(options: DFlash2Options, *, num_slots: int, vocab_size: int, init=None) -> DFlash2Options:
    """The convolution and selector shape of a run on a cache of K = num_slots (a block of K + 1) and
    this vocabulary. From a DFlash2 --drafter-init (`init`: its path and config) it is the init's, and
    a shape flag that differs is refused naming both, so train_config.json, provenance and the export
    agree. Otherwise speculators' defaults, the selector's rank within a quarter of the vocabulary;
    the top-K stays unset unless given: its default is capped by the hidden size (dflash2_config)."""
    given = {name: getattr(options, name) for name in DFLASH2_KEYS}
    if init is not None:
        path, config = init
        held = {name: getattr(config, name) for name in DFLASH2_KEYS}
        differ = [f"--{name.replace('_', '-')} {given[name]} (the init has {held[name]})" for name in DFLASH2_KEYS
                  if given[name] is not None and given[name] != held[name]]  # fmt: skip
        if differ:
            raise ValueError(f"--drafter-init {path} is a DFlash2 drafter whose shape is its own: {'; '.join(differ)}; drop the flag")
        return dataclasses.replace(options, **held)
    if given["conv_kernel_size"] is not None and given["conv_kernel_size"] > num_slots + 1:
        raise ValueError(f"--conv-kernel-size {given['conv_kernel_size']} is longer than this cache's block of {num_slots + 1} slots")
    for name in ("selector_rank", "selector_top_k"):
        if given[name] is not None and given[name] > vocab_size:
            raise ValueError(f"--{name.replace('_', '-')} {given[name]} is larger than the vocabulary ({vocab_size})")
    return dataclasses.replace(
        options, conv_kernel_size=given["conv_kernel_size"] or DEFAULT_CONV_KERNEL_SIZE,
        conv_group_size=given["conv_group_size"] or DEFAULT_CONV_GROUP_SIZE,
        selector_rank=given["selector_rank"] or default_selector_rank(vocab_size),
    )  # fmt: skip


def dflash2_config(backbone: DFlashConfig, options: DFlash2Options) -> DFlash2Config:
    """A DFlash2 config on a DFlash backbone's shape: the options' shape (resolve_dflash2_options),
    speculators' defaults where unset, the selector's top-K capped by default_selector_top_k."""
    hidden, vocab = backbone.hidden_size, backbone.vocab_size
    group = options.conv_group_size or DEFAULT_CONV_GROUP_SIZE
    if hidden % group:
        raise ValueError(f"--conv-group-size {group} must divide the hidden size {hidden}")
    return DFlash2Config.from_dflash(
        backbone,
        conv_kernel_size=options.conv_kernel_size or DEFAULT_CONV_KERNEL_SIZE,
        conv_group_size=group,
        selector_rank=options.selector_rank or default_selector_rank(vocab),
        selector_top_k=options.selector_top_k or default_selector_top_k(hidden_size=hidden, vocab_size=vocab),
    )


def dflash2_layout(options: DFlash2Options, *, num_slots: int) -> BlockLayout:
    """DFlash's K + 1 slots (rows 1..K predict the K label columns), speculators' envelope, or none
    under D-PACE, whose weights take its place (an infinite decay: every slot's envelope is 1)."""
    gamma = options.dflash2_gamma if options.dflash2_weighting == "exp-decay" else math.inf
    return BlockLayout(
        block_size=num_slots + 1, num_labelled=num_slots, envelope_gamma=gamma,
        distributions=True,  # TV and the selector's label read the target's distribution at every slot
    )  # fmt: skip


def dflash2_family_draft(drafter: DFlash2Drafter, *, hidden: Tensor, anchor_tokens: Tensor, lm_head) -> Drafts:
    """One backbone pass's hidden states [N, B, H] -> B - 1 drafts per block: the selector's greedy
    walk over each slot's unary top-K, each slot after the candidate taken before it."""
    return Drafts(tokens=dflash2_draft(drafter, hidden=hidden, anchor_tokens=anchor_tokens, lm_head=lm_head))


DFLASH2 = DrafterFamily(
    name="dflash2",
    title="DFlash2",
    architecture=ARCHITECTURE,
    config_class=DFlash2Config,
    model_class=DFlash2Drafter,
    draft=dflash2_family_draft,
    head_loss=dflash2_head_loss,
    layout=dflash2_layout,
    options_class=DFlash2Options,
    resolve_options=resolve_dflash2_options,
    new_config=dflash2_config,
    init_from=("dflash",),
    own_envelope=True,
    modeling_files=MODELING_FILES,
    auto_map=AUTO_MAP,
)
