"""`modeling_dflash2.py` of an exported DFlash2 drafter: `AutoModel.from_pretrained(dir,
trust_remote_code=True)` returns it (docs/dflash2.md). The export copies this file into the
checkpoint as `modeling_dflash2.py`, next to `modeling_dflash.py`, `dflash2_model.py`,
`dflash_model.py` and `dflash_config.py` (copies of drafter/hf_modeling.py, dflash2_model.py,
model.py and config.py: drafter/dflash2.py's MODELING_FILES), and points `config.json`'s `auto_map`
at it. It is DFlash's wrapper around the DFlash2 drafter. Like drafter/hf_modeling.py, only an
exported checkpoint imports it.
"""

from __future__ import annotations

import torch

# Relative imports: in the package these are drafter/config.py, hf_modeling.py, dflash2_model.py and
# model.py; the export renames them (drafter/dflash2.py's MODELING_FILES) and rewrites these lines.
from .config import DFlashConfig  # noqa: F401 (transformers 4.x copies only this file's direct relative imports)
from .dflash2_model import ARCHITECTURE, CandidateSelector, DFlash2Config, DFlash2Drafter, DynamicBlockConv
from .hf_modeling import DFlashDraftModel
from .model import DFlashDrafter  # noqa: F401 (as above)


class DFlash2DraftModel(DFlashDraftModel):
    _no_split_modules = ["DFlash2DecoderLayer"]
    drafter_class = DFlash2Drafter
    drafter_config_class = DFlash2Config
    drafter_architecture = ARCHITECTURE

    def _init_weights(self, module: torch.nn.Module) -> None:
        # HF applies this child first: a convolution's projection is drawn, then the convolution
        # resets it with its base kernel to the identity.
        if isinstance(module, (DynamicBlockConv, CandidateSelector)):
            module.reset_parameters()
        else:
            super()._init_weights(module)

    def transition_scores(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
        """The selector's transition scores [..., K] (drafter/dflash2_model.py, CandidateSelector)."""
        return self.candidate_selector.transition_scores(hidden, prev_tokens, candidate_ids)
