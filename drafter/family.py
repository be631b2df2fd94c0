"""What a drafter family provides, in one place (docs/design.md, "Drafter families").

A family is a kind of block drafter on the DFlash backbone (DFlash, DSpark, ...): its module
(drafter/dflash.py, drafter/dspark.py) builds one `DrafterFamily` and drafter/families.py registers
it by name. The trainer, the evaluator, the CLI and the checkpoint code look the family up (by
`--arch`, by a checkpoint's `architectures`, by a model's class) and call what it holds; none of
them asks which family it is. As torchtitan's `TrainSpec`, it is data: names, classes and pure
functions, no class hierarchy.

The pieces, and who calls them:
- `config_class` / `model_class`: the checked config (with its HF `config.json` contract,
  `from_hf_dict` / `to_hf_dict`, and `num_drafts`) and the model, whose `forward` is the
  backbone's (final-normed hidden states of the block slots). checkpoint.py saves and loads them.
- `options_class`: the family's training options, a typed dataclass whose fields are flags of
  `alrira-train` (pipeline/train/config.py gathers every family's); `resolve_options` fills their
  defaults from the cache, or from a `--drafter-init` of the family (refusing a flag that contradicts
  it); `new_config` builds a fresh drafter's config on the backbone's shape; `init_from` names the
  families whose checkpoint's backbone may start this one with fresh heads.
- `layout`: how the family's block sits on the cache's K labelled slots (`BlockLayout`), applied by
  the label builder (pipeline/train/labels.py) to every method's blocks.
- `head_loss`: the loss of the supervised slots' hidden states through the frozen lm_head (and the
  family's own heads), against the labels and, where the layout asks for them, the target's
  distributions.
- `draft`: one round's drafts of N blocks from their hidden states (evaluation, replay, training-time
  tau); `tree_verification`: the slots are drafted independently, so a token tree can verify them;
  `has_confidence`: whether a drafter of this config predicts each slot's acceptance.
- `modeling_files` / `auto_map`: the modeling code an export ships for
  `AutoModel.from_pretrained(dir, trust_remote_code=True)`; `float32_tensors`: weights the export
  (and loading it) keeps in float32; `exports_head`: whether a run's export also holds the target's
  embed_tokens and lm_head; `notes`: lines the trainer prints about a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor


def option(help: str, **kwargs) -> Any:
    """A field of a family's options with its flag help (read by pipeline/config.py as `opt`'s)."""
    return dataclasses.field(metadata={"help": help}, **kwargs)


@dataclass(frozen=True, kw_only=True)
class BlockLayout:
    """How a family's block sits on the cache's labelled slots (docs/design.md, "Drafter families").

    The cache labels the K slots of a DFlash block anchored at a: label column c (0..K-1) is the
    token at a + c + 1, with its label distribution, its target distribution, its weight and the
    token before it on its own track (the corpus, a rollout, an IRA secondary's parent rollout). A
    family's block holds [anchor, MASK x (block_size - 1)] at positions a, a + 1, ...; its LAST
    num_labelled rows predict label columns 0 .. num_labelled - 1 (DFlash: rows 1..K, row 0 holds
    the anchor and is never trained; DSpark: rows 0..B-1)."""

    block_size: int
    num_labelled: int  # label columns trained: the first num_labelled of the cache's K
    envelope_gamma: float | None = None  # the family's slot envelope exp(-c / gamma) for every method; None: the method's
    # Every labelled row also takes the target's distribution at its token (the corpus pass's top-k
    # under one-hot labels, which the method alone would not read): the family's loss compares with it.
    distributions: bool = False

    def __post_init__(self):
        if not 1 <= self.num_labelled <= self.block_size:
            raise ValueError(f"a block of {self.block_size} slots cannot hold {self.num_labelled} labelled rows")


@dataclass(kw_only=True)
class SupervisedSlots:
    """The supervised slots of a micro-batch as a family's loss takes them (M slots)."""

    hidden: Tensor  # [M, H] final-normed drafter states of the rows that predict them
    label_ids: Tensor  # [M, k] long: the method's label (k = 1 for one-hot labels)
    label_probs: Tensor  # [M, k] float32, tail = max(0, 1 - sum)
    weights: Tensor  # [M] float32 slot weights
    prev_tokens: Tensor  # [M] long: the token before each label on the label's own track
    dist_ids: Tensor  # [M, k'] long: the target's distribution at the slot (the labels unless one-hot)
    dist_probs: Tensor  # [M, k'] float32
    # Where each slot sits, for a loss that couples the slots of one block (DFlash2's D-PACE weights):
    block_index: Tensor  # [M] long: its block among the micro-batch's blocks
    label_column: Tensor  # [M] long: its label column c (0..num_labelled - 1), the slot's order in its block
    # The labelled rows of the micro-batch's N blocks, in slot order, for a head whose slot reads the
    # slots before it (DSpark's rnn Markov head); block_slot is each supervised slot's row among them.
    block_hidden: Tensor | None = None  # [N, L, H] (L = the layout's num_labelled)
    block_prev_tokens: Tensor | None = None  # [N, L] long
    block_slot: Tensor | None = None  # [M] long, into N * L

    def select(self, part: slice) -> SupervisedSlots:
        """The slots `part` of these (a loss taken chunk by chunk): every per-slot field sliced, the
        blocks' rows kept whole (block_slot still indexes them)."""
        per_block = ("block_hidden", "block_prev_tokens")
        return SupervisedSlots(**{
            name: value if name in per_block or value is None else value[part] for name, value in vars(self).items()
        })  # fmt: skip


@dataclass(kw_only=True)
class Drafts:
    """One round's drafts of N blocks."""

    tokens: Tensor  # [N, D] long, D = the config's num_drafts
    confidence: Tensor | None = None  # [N, D] float32: the predicted chance each slot is accepted, or None
    confidence_logits: Tensor | None = None  # [N, D] float32: its logits before any calibration (drafter/calibration.py)


@dataclass(frozen=True, kw_only=True)
class DrafterFamily:
    """One kind of block drafter, as the rest of alrira sees it (the module docstring says who calls what)."""

    name: str  # --arch, recorded in train_config.json and summary.json
    title: str  # how messages and docs name it ("DSpark")
    architecture: str  # the `architectures` entry of its config.json
    config_class: type
    model_class: type
    # (drafter, *, hidden [N, B, H], anchor_tokens [N], lm_head) -> Drafts
    draft: Callable[..., Drafts]
    # (model, slots: SupervisedSlots, *, lm_head [V, H], options, loss_chunk, autocast) -> (sum of w * l [], correct [M] bool)
    head_loss: Callable[..., tuple[Tensor, Tensor]]
    # (options, *, num_slots) -> BlockLayout
    layout: Callable[..., BlockLayout]
    options_class: type | None = None
    # (options, *, num_slots, vocab_size, init: (path, config) of a --drafter-init of this family or None)
    # -> options with their defaults filled in (the init's, else the cache's), bounds checked; a flag
    # that contradicts the init is refused naming both
    resolve_options: Callable[..., Any] = lambda options, **given: options
    # (backbone: DFlashConfig, options) -> the family's config on that shape
    new_config: Callable[..., Any] = lambda backbone, options: backbone
    init_from: tuple[str, ...] = ()  # families whose checkpoint's backbone starts this one (fresh heads)
    own_envelope: bool = False  # layout.envelope_gamma is set: the methods' --gamma / --dflash-gamma are unused
    tree_verification: bool = False
    has_confidence: Callable[[Any], bool] = lambda config: False
    modeling_files: tuple[tuple[str, str], ...] = ()  # (source in drafter/, its name in the export)
    auto_map: dict | None = None
    float32_tensors: tuple[str, ...] = ()  # name prefixes of weights the export keeps in float32 whatever --save-dtype
    exports_head: Callable[[Any], bool] = lambda options: False  # (options) -> the export also holds the target's embed_tokens / lm_head
    notes: Callable[[Any], list[str]] = lambda config: []  # (config) -> lines a run prints about it (an engine that cannot serve it)

    def option_flags(self) -> dict[str, Any]:
        """{flag: default} of the family's options (what a run of another family leaves unset)."""
        if self.options_class is None:
            return {}
        return {field.name: getattr(self.options_class(), field.name) for field in dataclasses.fields(self.options_class)}
