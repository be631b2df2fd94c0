"""`modeling_dflash2.py` of an exported DFlash2 drafter: `AutoModel.from_pretrained(dir,
trust_remote_code=True)` returns it (docs/dflash2.md). The export copies this file into the
checkpoint as `modeling_dflash2.py`, next to `dflash2_model.py`, `dflash_model.py` and
`dflash_config.py` (copies of drafter/dflash2_model.py, model.py and config.py: drafter/dflash2.py's
MODELING_FILES), and points `config.json`'s `auto_map` at it. Like drafter/hf_modeling.py, only an
exported checkpoint imports it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

# Relative imports: in the package these are drafter/config.py, dflash2_model.py and model.py; the export
# renames config.py and model.py (dflash_config.py, dflash_model.py) and rewrites these lines to match.
from .config import DFlashConfig  # noqa: F401 (transformers 4.x copies only this file's direct relative imports)
from .dflash2_model import CandidateSelector, DFlash2Config, DFlash2Drafter, DynamicBlockConv
from .model import RMSNorm


def _dflash2_config(config: Qwen3Config) -> DFlash2Config:
    """The drafter's config from the HF config object (only the keys a DFlash2 config.json has)."""
    known = set(DFlash2Config(
        hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        head_dim=8, vocab_size=16, max_position_embeddings=8, num_target_layers=2, target_layer_ids=[0],
        mask_token_id=0,
    ).to_hf_dict()) | {"rope_parameters", "torch_dtype"}  # fmt: skip
    values = {k: v for k, v in config.to_dict().items() if k in known}
    values["architectures"] = ["DFlash2DraftModel"]
    values["model_type"] = "qwen3"
    return DFlash2Config.from_hf_dict(values)


class DFlash2DraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        drafter = DFlash2Drafter(_dflash2_config(config))
        self.dflash2_config = drafter.config
        # The drafter's own modules, registered here so the keys are the checkpoint's.
        self.fc, self.hidden_norm, self.layers, self.norm = drafter.fc, drafter.hidden_norm, drafter.layers, drafter.norm
        self.candidate_selector = drafter.candidate_selector
        object.__setattr__(self, "_drafter", drafter)  # not a submodule: its parameters are the ones above
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # HF applies this child first: a convolution's projection is drawn, then the convolution
        # resets it with its base kernel to the identity.
        if isinstance(module, (DynamicBlockConv, CandidateSelector)):
            module.reset_parameters()
        elif isinstance(module, torch.nn.Linear):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, **inputs) -> torch.Tensor:
        """The backbone's forward: context_features, context_positions, block_embeds,
        block_positions, attention_mask -> final-normed hidden states [B, Q, H]."""
        return self._drafter(**inputs)

    def transition_scores(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """The selector's transition scores [..., K] (drafter/dflash2.py, CandidateSelector)."""
        return self.candidate_selector.transition_scores(hidden, prev_tokens, candidate_ids)
