"""The DFlash family (docs/design.md, "The drafter"): the block drafter every other family builds on.

Its model is the backbone itself (drafter/model.py, drafter/config.py). A block of K + 1 slots holds
[anchor, MASK x K]; slot k predicts x[a + k], so rows 1..K take the cache's K label columns and
slot 0 is never trained. Its loss is the method's top-k + tail loss through the frozen lm_head, in
one pass (drafter/losses.py, `HeadLoss`); its drafts are the argmax of every slot, each drafted
independently of the others, so a token tree can verify them. The export is the public DFlash
releases' (config.json with `dflash_config`, no embedding or head), shipping its modeling code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafter.config import ARCHITECTURE, AUTO_MAP, DFlashConfig
from drafter.family import BlockLayout, DrafterFamily, Drafts, SupervisedSlots
from drafter.losses import HeadLoss
from drafter.model import DFlashDrafter

# Files copied into every DFlash export: (source in drafter/, name in the checkpoint). The copies
# import each other relatively, as HF's dynamic modules require.
MODELING_FILES = (("hf_modeling.py", "modeling_dflash.py"), ("model.py", "dflash_model.py"), ("config.py", "dflash_config.py"))


def dflash_layout(options, *, num_slots: int) -> BlockLayout:
    """K + 1 slots: rows 1..K predict the K label columns (row 0 holds the anchor); each method's own envelope."""
    return BlockLayout(block_size=num_slots + 1, num_labelled=num_slots)


def dflash_head_loss(model, slots: SupervisedSlots, *, lm_head: Tensor, options, loss_chunk: int, autocast) -> tuple[Tensor, Tensor]:
    """The method's top-k + tail loss of the slots' hidden states through the frozen lm_head, its
    gradient made in the same pass (`HeadLoss`). The GEMM runs in bf16 under bf16 autocast, else in
    the head's own dtype; the loss math is float32 (docs/design.md, "A training step")."""
    with autocast:
        device_type = slots.hidden.device.type
        head_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else lm_head.dtype
    return HeadLoss.apply(slots.hidden, lm_head, slots.label_ids, slots.label_probs, slots.weights, loss_chunk, head_dtype)


def dflash_draft(drafter, *, hidden: Tensor, anchor_tokens: Tensor, lm_head) -> Drafts:
    """The argmax of lm_head at slots 1..K of each block: hidden [N, K + 1, H] -> tokens [N, K]."""
    return Drafts(tokens=lm_head(hidden[:, 1:].to(lm_head.weight.dtype)).argmax(dim=-1))


DFLASH = DrafterFamily(
    name="dflash",
    title="DFlash",
    architecture=ARCHITECTURE,
    config_class=DFlashConfig,
    model_class=DFlashDrafter,
    draft=dflash_draft,
    head_loss=dflash_head_loss,
    layout=dflash_layout,
    tree_verification=True,
    modeling_files=MODELING_FILES,
    auto_map=AUTO_MAP,
)
