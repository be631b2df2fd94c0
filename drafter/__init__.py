"""DFlash block drafter: config, model, visibility masks, checkpoint I/O (docs/design.md, "The drafter")."""

from drafter.checkpoint import check_compatible, load_drafter, save_drafter
from drafter.config import DFlashConfig, default_target_layer_ids
from drafter.masks import flex_block_mask, visibility_mask, visibility_mask_mod
from drafter.model import ContextKVCache, DFlashDrafter, reference_forward

__all__ = [
    "ContextKVCache",
    "DFlashConfig",
    "DFlashDrafter",
    "check_compatible",
    "default_target_layer_ids",
    "flex_block_mask",
    "load_drafter",
    "reference_forward",
    "save_drafter",
    "visibility_mask",
    "visibility_mask_mod",
]
