"""DFlashConfig: the drafter's shape, and its HF `config.json` form (docs/design.md, "The drafter").

The checkpoint config is a Qwen3 config (`model_type: "qwen3"`) with the DFlash extras: top-level
`block_size` and `num_target_layers`, and `dflash_config: {mask_token_id, target_layer_ids}`. Every
Qwen3 key is written explicitly so the public DFlash code, SGLang and vLLM read the same values we
trained with, whatever their library defaults are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ARCHITECTURE = "DFlashDraftModel"
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
DTYPES = ("bfloat16", "float16", "float32")

# Keys a public release may carry that do not change the drafter's math (HF bookkeeping, token ids
# the drafter never uses, generation defaults). Anything else unknown is refused, so a config that
# asks for something we would silently ignore (a bias, sliding windows, causal blocks) fails loudly.
HARMLESS_HF_KEYS = frozenset(
    {
        "_name_or_path",
        "auto_map",
        "transformers_version",
        "torch_dtype",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "attention_dropout",
        "max_window_layers",
        "tie_word_embeddings",
        "output_hidden_states",
        "return_dict",
        "pretraining_tp",
    }
)


def default_target_layer_ids(*, num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The tap rule (docs/design.md, "The drafter"): n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1)) for i in 0..n-1."""
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"num_target_layers must be >= 4 for several taps, got {num_target_layers}")
    span = num_target_layers - 4
    # Python's round() rounds halves to even; the reference uses the same builtin, so we match it.
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def check_taps(layer_ids: list[int], *, num_target_layers: int, what: str) -> None:
    """DeepSpec's rules for the tapped layers (its `validate_target_layer_ids` and evaluator):
    strictly increasing (the feature columns follow the layers' order in every engine) and never the
    target's last layer (HF's hidden_states hold it after the final norm, engines tap the raw output)."""
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"{what} {list(layer_ids)} must be strictly increasing")
    if num_target_layers - 1 in layer_ids:
        raise ValueError(
            f"{what} {list(layer_ids)} include the target's last layer {num_target_layers - 1}, whose HF hidden state is after the "
            f"final norm (DeepSpec's evaluator refuses it); tap layers 0..{num_target_layers - 2}"
        )



@dataclass(kw_only=True)
class DFlashConfig:
    """Shape of a DFlash block drafter. Field names follow the HF Qwen3 config."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int  # drafter layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int
    vocab_size: int
    block_size: int = 16
    num_target_layers: int
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int
    hidden_act: str = "silu"
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
            "num_target_layers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type != "default":
                raise ValueError(f"rope_scaling: only default RoPE is supported, got {self.rope_scaling}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {self.block_size!r}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids has duplicates: {self.target_layer_ids}")
        if any(i < 0 or i >= self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must lie in [0, {self.num_target_layers})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} must lie in [0, {self.vocab_size})")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (Qwen3 SwiGLU), got {self.hidden_act!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block: slots 1..block_size - 1 (slot 0 holds the anchor)."""
        return self.block_size - 1

    @classmethod
    def from_target_config(
        cls,
        target_config: dict,
        *,
        num_draft_layers: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        block_size: int = 16,
    ) -> DFlashConfig:
        """A fresh drafter for a target, from the target's HF config.json dict.

        Vision-language targets keep the language model's config under `text_config`; that is
        the part the drafter mirrors. Its RoPE is plain at the target's theta whatever scaling the
        target uses (Llama 3's "llama3", YaRN): the drafter's positions are its own, and training
        and every engine read them from the drafter's config.
        """
        cfg = target_config.get("text_config", target_config)
        num_target_layers = cfg["num_hidden_layers"]
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(
                num_target_layers=num_target_layers, num_draft_layers=num_draft_layers
            )
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or target_config.get("torch_dtype") or "bfloat16"
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_draft_layers,
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            rope_scaling=None,
            max_position_embeddings=cfg["max_position_embeddings"],
            vocab_size=cfg["vocab_size"],
            block_size=block_size,
            num_target_layers=num_target_layers,
            target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id,
            hidden_act=cfg.get("hidden_act", "silu"),
            dtype=dtype,
        )

    def to_hf_dict(self) -> dict:
        """The checkpoint's config.json (docs/design.md, "The drafter"), every Qwen3 key explicit."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            # Older vLLM builds read only this key; vLLM counts the embeddings as layer 0.
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "sliding_window": None,
            "use_sliding_window": False,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> DFlashConfig:
        """Read our config.json or a public DFlash release's; refuse anything we cannot run."""
        d = dict(d)
        architectures = d.pop("architectures", [ARCHITECTURE])
        if ARCHITECTURE not in architectures:
            raise ValueError(f"architectures must include {ARCHITECTURE!r}, got {architectures}")
        model_type = d.pop("model_type", "qwen3")
        if model_type != "qwen3":
            raise ValueError(f"model_type must be 'qwen3', got {model_type!r}")

        dflash = dict(d.pop("dflash_config", None) or {})
        for name in ("mask_token_id", "target_layer_ids"):
            if name not in dflash:
                raise ValueError(f"dflash_config.{name} is missing")
        mask_token_id = dflash.pop("mask_token_id")
        target_layer_ids = [int(i) for i in dflash.pop("target_layer_ids")]
        # Some releases put block_size inside dflash_config; accept either place, not a conflict.
        block_size = d.pop("block_size", None)
        inner_block_size = dflash.pop("block_size", None)
        if block_size is not None and inner_block_size is not None and block_size != inner_block_size:
            raise ValueError(
                f"block_size {block_size} disagrees with dflash_config.block_size {inner_block_size}"
            )
        block_size = block_size if block_size is not None else inner_block_size
        if dflash:
            raise ValueError(f"dflash_config has unsupported keys: {sorted(dflash)}")

        aux_ids = d.pop("eagle_aux_hidden_state_layer_ids", None)
        if aux_ids is not None and list(aux_ids) != [i + 1 for i in target_layer_ids]:
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {aux_ids} must equal target_layer_ids + 1 "
                f"({[i + 1 for i in target_layer_ids]})"
            )

        num_hidden_layers = d.pop("num_hidden_layers", None)
        layer_types = d.pop("layer_types", None)
        if layer_types is not None:
            if num_hidden_layers is not None and len(layer_types) != num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(layer_types)} entries for {num_hidden_layers} layers"
                )
            if any(t != "full_attention" for t in layer_types):
                raise ValueError(f"layer_types must all be 'full_attention', got {layer_types}")
        if d.pop("use_sliding_window", False):
            raise ValueError("use_sliding_window must be false (DFlash blocks use full attention)")
        d.pop("sliding_window", None)  # meaningless once sliding attention is off
        if d.pop("attention_bias", False):
            raise ValueError("attention_bias must be false (the drafter has no biases)")
        if d.pop("is_causal", False):
            raise ValueError("is_causal must be false (attention inside a block is bidirectional)")

        rope_theta = _rope_theta(d)
        rope_scaling = _rope_scaling(d)
        d.pop("rope_theta", None)
        d.pop("rope_parameters", None)
        d.pop("rope_scaling", None)
        dtype = d.pop("dtype", None) or d.get("torch_dtype") or "bfloat16"

        kwargs = {}
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "vocab_size",
            "num_target_layers",
        ):
            if name not in d:
                raise ValueError(f"config.json is missing {name}")
            kwargs[name] = d.pop(name)
        for name in ("rms_norm_eps", "hidden_act"):
            if name in d:
                kwargs[name] = d.pop(name)
        if num_hidden_layers is None:
            raise ValueError("config.json is missing num_hidden_layers")

        unknown = sorted(k for k in d if k not in HARMLESS_HF_KEYS)
        if unknown:
            raise ValueError(f"config.json has unsupported keys: {unknown}")
        return cls(
            num_hidden_layers=num_hidden_layers,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            block_size=16 if block_size is None else block_size,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            dtype=dtype,
            **kwargs,
        )


def _rope_theta(cfg: dict) -> float:
    """rope_theta lives at the top level (transformers 4) or in rope_parameters (transformers 5)."""
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in cfg and "rope_theta" in params and cfg["rope_theta"] != params["rope_theta"]:
        raise ValueError(
            f"rope_theta {cfg['rope_theta']} disagrees with rope_parameters.rope_theta {params['rope_theta']}"
        )
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError("config has no rope_theta (neither top-level nor in rope_parameters)")
    return float(theta)


def _rope_scaling(cfg: dict) -> dict | None:
    """None for plain RoPE; a non-default rope_parameters type is kept so validation refuses it."""
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        return scaling
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        return {k: v for k, v in params.items() if k != "rope_theta"}
    return None
