"""The DSpark drafter: the DFlash backbone plus a Markov head and a confidence head (docs/dspark.md).

Facts checked against the reference code (deepseek-ai/DeepSpec, `deepspec/modeling/dspark/`; our
code, their math):
- Backbone = DFlash (drafter/model.py): tapped target features -> `fc` -> `hidden_norm`, layers that
  attend to [context before the anchor; the whole block], a final `norm`; the target's frozen
  embed_tokens embeds the block and its lm_head gives the base logits.
- Layout: a block of B slots, slot 0 = the anchor x[p], slots 1..B-1 = the mask token, all at
  positions p + k; **slot k predicts x[p + k + 1]** (B drafts; DFlash's slot k predicts x[p + k]).
- Markov head (`vanilla`): markov_w1 = Embedding(V, r), markov_w2 = Linear(r, V, no bias);
  logits_k = lm_head(h_k) + markov_w2(markov_w1[prev_k]). prev_0 is the anchor; in training prev_k
  is the token slot k-1 is labelled with (teacher forcing), when drafting the drafter's own token
  of slot k-1, so drafting runs the head slot by slot after one backbone pass.
- Confidence head: c_k = proj([h_k; markov_w1[prev_k]]) (a logit; `confidence_head_with_markov`),
  sigmoid(c_k) = the predicted chance slot k is accepted given the slots before it were.
- Initialisation as HF Qwen3's `_init_weights`: linears and embeddings ~ N(0, 0.02), biases 0.
- Checkpoint names (`Qwen3DSparkModel`, no prefix): the DFlash backbone's, plus
  `markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r],
  `confidence_head.proj.weight` [1, H + r], `confidence_head.proj.bias` [1].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafter.config import ARCHITECTURE as DFLASH_ARCHITECTURE
from drafter.config import DFlashConfig
from drafter.model import INITIALIZER_RANGE, DFlashDrafter

ARCHITECTURE = "Qwen3DSparkModel"
AUTO_MAP = {"AutoModel": "modeling_dspark.Qwen3DSparkModel"}
MARKOV_HEAD_TYPES = ("vanilla",)
DEFAULT_MARKOV_RANK = 256  # DeepSpec's default
DEFAULT_NUM_ANCHORS = 512  # DeepSpec's anchors per sequence (recorded in the config; training draws its own)

# The keys a DSpark config.json adds to the Qwen3 keys (all top level).
DSPARK_KEYS = (
    "target_layer_ids",
    "mask_token_id",
    "num_anchors",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)


def default_markov_rank(vocab_size: int) -> int:
    """DeepSpec's rank 256, capped at a quarter of the vocabulary: a rank near V is a full bigram
    table, far more parameters than a tiny vocabulary's transitions need."""
    return max(1, min(DEFAULT_MARKOV_RANK, vocab_size // 4))


@dataclass(kw_only=True)
class DSparkConfig(DFlashConfig):
    """Shape of a DSpark drafter: the DFlash backbone's fields (block_size = B, the DSpark block)
    plus its heads. markov_rank 0 means no Markov head."""

    markov_rank: int = DEFAULT_MARKOV_RANK
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = DEFAULT_NUM_ANCHORS

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or not 0 <= self.markov_rank <= self.vocab_size:
            raise ValueError(f"markov_rank must be an int in [0, vocab_size = {self.vocab_size}], got {self.markov_rank!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")
        if not isinstance(self.num_anchors, int) or self.num_anchors < 1:
            raise ValueError(f"num_anchors must be a positive int, got {self.num_anchors!r}")

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block: every slot drafts (DFlash: block_size - 1)."""
        return self.block_size

    @classmethod
    def from_dflash(cls, backbone: DFlashConfig, *, block_size: int, markov_rank: int, enable_confidence_head: bool) -> DSparkConfig:
        """A DSpark config on a DFlash backbone's shape (its block size replaced by the DSpark block)."""
        fields = {f.name: getattr(backbone, f.name) for f in dataclasses.fields(DFlashConfig)}
        fields["block_size"] = block_size
        return cls(**fields, markov_rank=markov_rank, enable_confidence_head=enable_confidence_head,
                   confidence_head_with_markov=enable_confidence_head and markov_rank > 0)  # fmt: skip

    def to_hf_dict(self) -> dict:
        """config.json in the contract of DeepSpec's `Qwen3DSparkModel` (what vLLM's and SGLang's
        DSpark loaders read): the Qwen3 keys, then the DSpark keys at the top level."""
        hf = super().to_hf_dict()
        hf.pop("dflash_config")
        hf.pop("eagle_aux_hidden_state_layer_ids")
        hf["architectures"] = [ARCHITECTURE]
        hf.update(
            target_layer_ids=list(self.target_layer_ids),
            mask_token_id=self.mask_token_id,
            num_anchors=self.num_anchors,
            markov_rank=self.markov_rank,
            markov_head_type=self.markov_head_type,
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.enable_confidence_head and self.confidence_head_with_markov,
        )
        return hf

    @classmethod
    def from_hf_dict(cls, d: dict) -> DSparkConfig:
        """Read a DSpark config.json (ours or DeepSpec's); the Qwen3 part is checked as strictly as
        a DFlash config (drafter/config.py), unknown keys refused."""
        d = dict(d)
        architectures = d.pop("architectures", [ARCHITECTURE])
        if ARCHITECTURE not in architectures:
            raise ValueError(f"architectures must include {ARCHITECTURE!r}, got {architectures}")
        for name in ("target_layer_ids", "mask_token_id"):
            if name not in d:
                raise ValueError(f"config.json is missing {name}")
        extras = {name: d.pop(name) for name in DSPARK_KEYS if name in d}
        d["architectures"] = [DFLASH_ARCHITECTURE]
        d["dflash_config"] = {"mask_token_id": extras.pop("mask_token_id"), "target_layer_ids": extras.pop("target_layer_ids")}
        backbone = DFlashConfig.from_hf_dict(d)
        fields = {f.name: getattr(backbone, f.name) for f in dataclasses.fields(DFlashConfig)}
        markov_rank = int(extras.get("markov_rank", 0))
        enable_confidence = bool(extras.get("enable_confidence_head", False))
        return cls(
            **fields,
            markov_rank=markov_rank,
            markov_head_type=str(extras.get("markov_head_type", "vanilla")),
            enable_confidence_head=enable_confidence,
            confidence_head_with_markov=enable_confidence and bool(extras.get("confidence_head_with_markov", False)),
            num_anchors=int(extras.get("num_anchors", DEFAULT_NUM_ANCHORS)),
        )


def is_dspark_hf_config(d: dict) -> bool:
    return ARCHITECTURE in (d.get("architectures") or [])


class MarkovHead(nn.Module):
    """The vanilla Markov head: a rank-r bigram logit bias markov_w2(markov_w1[prev])."""

    def __init__(self, *, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, prev_tokens: Tensor) -> Tensor:
        """Logit bias [..., V] of prev_tokens [...] (long)."""
        return self.markov_w2(self.markov_w1(prev_tokens))


class ConfidenceHead(nn.Module):
    """A linear map to one logit: sigmoid of it predicts the slot's acceptance."""

    def __init__(self, *, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """The DFlash backbone (its forward gives the final-normed hidden states of every slot) with
    the two DSpark heads; the target's embed_tokens and lm_head are applied by the caller."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = MarkovHead(vocab_size=config.vocab_size, rank=config.markov_rank) if config.markov_rank > 0 else None
        self.confidence_head = None
        if config.enable_confidence_head:
            extra = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(input_dim=config.hidden_size + extra)
        self.reset_head_parameters()

    @torch.no_grad()
    def reset_head_parameters(self) -> None:
        """HF Qwen3 init of the heads: weights ~ N(0, 0.02), biases 0."""
        for head in (self.markov_head, self.confidence_head):
            if head is None:
                continue
            for module in head.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, INITIALIZER_RANGE)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()

    def markov_bias(self, prev_tokens: Tensor) -> Tensor | None:
        """The Markov head's logit bias [..., V] for prev_tokens [...], or None without the head."""
        return None if self.markov_head is None else self.markov_head(prev_tokens)

    def confidence_logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """Confidence logits [...] of slot hidden states [..., H] after prev_tokens [...], or None."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.markov_w1(prev_tokens).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features)


@torch.no_grad()
def dspark_draft(
    drafter: DSparkDrafter, *, base_logits: Tensor, hidden: Tensor, anchor_tokens: Tensor, temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Draft N blocks slot by slot after one backbone pass: base_logits [N, B, V] (lm_head of the
    slots' hidden states [N, B, H]), anchor_tokens [N]. Slot k adds the Markov bias of its previous
    token (the anchor, then the drafter's own token of slot k - 1) and takes the argmax (T = 0) or
    a sample of softmax(logits / T). Returns (tokens [N, B], corrected logits [N, B, V],
    confidence probabilities [N, B] or None)."""
    num_slots = base_logits.shape[1]
    prev = anchor_tokens.long()
    tokens, logits, prevs = [], [], []
    for k in range(num_slots):
        step = base_logits[:, k]
        bias = drafter.markov_bias(prev)
        if bias is not None:
            step = step + bias.to(step.dtype)
        if temperature == 0:
            token = step.argmax(dim=-1)
        else:
            probs = torch.softmax(step.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        prevs.append(prev)
        tokens.append(token)
        logits.append(step)
        prev = token
    prev_tokens = torch.stack(prevs, dim=1)  # [N, B]
    confidence = drafter.confidence_logits(hidden, prev_tokens)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), None if confidence is None else confidence.float().sigmoid()
