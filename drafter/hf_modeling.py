"""`modeling_dflash.py` of an exported drafter: lets `AutoModel.from_pretrained(dir,
trust_remote_code=True)` return the DFlash drafter, as the public DFlash releases do
(docs/serving.md). `drafter.checkpoint.save_drafter` copies this file into the checkpoint as
`modeling_dflash.py`, next to `dflash_model.py` and `dflash_config.py` (copies of
drafter/model.py and drafter/config.py), and points `config.json`'s `auto_map` at it.

Only the hf_modeling*.py modules import transformers inside `drafter/`, and only in an exported
checkpoint (nothing in the package imports them): the wrapper registers the plain-torch drafter's
modules as its own, so the state-dict keys are the checkpoint's (`fc.weight`, `layers.0...`), and
its forward is the drafter's. A family on the DFlash contract wraps its drafter by subclassing it
(hf_modeling_dflash2.py).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

# Relative imports: in the package these are drafter/config.py and drafter/model.py; the export
# renames them (dflash_config.py, dflash_model.py) and rewrites these two lines to match.
from .config import DFlashConfig
from .model import DFlashDrafter, RMSNorm


def _drafter_config(config: Qwen3Config, *, config_class: type, architecture: str) -> DFlashConfig:
    """The drafter's config from the HF config object (only the keys a DFlash config.json has at its
    top level; a family that keeps its own inside `dflash_config`, as DFlash2, reads the same)."""
    known = set(DFlashConfig(
        hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        head_dim=8, vocab_size=8, max_position_embeddings=8, num_target_layers=2, target_layer_ids=[0],
        mask_token_id=0,
    ).to_hf_dict()) | {"rope_parameters", "torch_dtype"}  # fmt: skip
    values = {k: v for k, v in config.to_dict().items() if k in known}
    values["architectures"] = [architecture]
    values["model_type"] = "qwen3"
    return config_class.from_hf_dict(values)


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    # The plain-torch drafter this wraps, its config class and config.json architecture: a family on
    # the DFlash contract subclasses this wrapper with its own (modeling_dflash2.py).
    drafter_class = DFlashDrafter
    drafter_config_class = DFlashConfig
    drafter_architecture = "DFlashDraftModel"

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        drafter = self.drafter_class(_drafter_config(config, config_class=self.drafter_config_class, architecture=self.drafter_architecture))
        self.dflash_config = drafter.config
        # The drafter's own modules (fc, hidden_norm, layers, norm, a family's heads), registered
        # here so the keys are the checkpoint's.
        for name, module in drafter.named_children():
            setattr(self, name, module)
        object.__setattr__(self, "_drafter", drafter)  # not a submodule: its parameters are the ones above
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, **inputs) -> torch.Tensor:
        """DFlashDrafter.forward: context_features, context_positions, block_embeds,
        block_positions, attention_mask -> final-normed hidden states [B, Q, H]."""
        return self._drafter(**inputs)
