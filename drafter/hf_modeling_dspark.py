"""`modeling_dspark.py` of an exported DSpark drafter: `AutoModel.from_pretrained(dir,
trust_remote_code=True)` returns it (docs/dspark.md). `drafter.checkpoint.save_drafter` copies this
file into the checkpoint as `modeling_dspark.py`, next to `dspark_model.py`, `dflash_model.py` and
`dflash_config.py` (copies of drafter/dspark_model.py, model.py and config.py), and points `config.json`'s
`auto_map` at it. Like drafter/hf_modeling.py, only an exported checkpoint imports it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, Qwen3Config

# Relative imports: in the package these are drafter/dspark_model.py and drafter/model.py; the export
# renames model.py (dflash_model.py) and rewrites these lines to match.
from .config import DFlashConfig  # noqa: F401 (transformers 4.x copies only this file's direct relative imports)
from .dspark_model import DSPARK_KEYS, DSparkConfig, DSparkDrafter
from .model import RMSNorm


def _dspark_config(config: Qwen3Config) -> DSparkConfig:
    """The drafter's config from the HF config object (only the keys a DSpark config.json has)."""
    known = set(DSparkConfig(
        hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        head_dim=8, vocab_size=8, max_position_embeddings=8, num_target_layers=2, target_layer_ids=[0],
        mask_token_id=0, markov_rank=2,
    ).to_hf_dict()) | set(DSPARK_KEYS) | {"rope_parameters", "torch_dtype"}  # fmt: skip
    values = {k: v for k, v in config.to_dict().items() if k in known}
    values["architectures"] = ["Qwen3DSparkModel"]
    values["model_type"] = "qwen3"
    return DSparkConfig.from_hf_dict(values)


class Qwen3DSparkModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        drafter = DSparkDrafter(_dspark_config(config))
        self.dspark_config = drafter.config
        # The drafter's own modules, registered here so the keys are the checkpoint's.
        self.fc, self.hidden_norm, self.layers, self.norm = drafter.fc, drafter.hidden_norm, drafter.layers, drafter.norm
        if drafter.markov_head is not None:
            self.markov_head = drafter.markov_head
        if drafter.confidence_head is not None:
            self.confidence_head = drafter.confidence_head
        object.__setattr__(self, "_drafter", drafter)  # not a submodule: its parameters are the ones above
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.data.normal_(0.0, 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.data.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, **inputs) -> torch.Tensor:
        """The backbone's forward: context_features, context_positions, block_embeds,
        block_positions, attention_mask -> final-normed hidden states [B, Q, H]."""
        return self._drafter(**inputs)

    def markov_bias(self, prev_tokens: torch.Tensor, hidden: torch.Tensor | None = None):
        return self._drafter.markov_bias(prev_tokens, hidden)

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor):
        return self._drafter.confidence_logits(hidden, prev_tokens)
