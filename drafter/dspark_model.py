"""The DSpark drafter: the DFlash backbone plus a Markov head and a confidence head (docs/dspark.md).

Facts checked against the reference code (deepseek-ai/DeepSpec, `deepspec/modeling/dspark/`; our
code, their math):
- Backbone = DFlash (drafter/model.py): tapped target features -> `fc` -> `hidden_norm`, layers that
  attend to [context before the anchor; the whole block], a final `norm`; the target's frozen
  embed_tokens embeds the block and its lm_head gives the base logits.
- Layout: a block of B slots, slot 0 = the anchor x[p], slots 1..B-1 = the mask token, all at
  positions p + k; **slot k predicts x[p + k + 1]** (B drafts; DFlash's slot k predicts x[p + k]).
- Markov head: markov_w1 = Embedding(V, r), markov_w2 = Linear(r, V, no bias); logits_k =
  lm_head(h_k) + markov_w2(z_k), with z_k per `markov_head_type` (DeepSpec's `markov_head.py`):
  `vanilla` z_k = markov_w1[prev_k]; `gated` z_k = sigmoid(gate_proj([h_k; e_k])) * e_k with
  e_k = markov_w1[prev_k], gate_proj = Linear(H + r, r); `rnn` a GRU-like state s over the block
  (s_-1 = 0): [g; c; o] = joint_proj([s_k-1; e_k; h_k]), joint_proj = Linear(2r + H, 3r),
  s_k = sigmoid(g) * s_k-1 + (1 - sigmoid(g)) * tanh(c), z_k = tanh(o). prev_0 is the anchor; in
  training prev_k is the token slot k-1 is labelled with (teacher forcing), when drafting the
  drafter's own token of slot k-1, so drafting runs the head slot by slot after one backbone pass.
- Confidence head: c_k = proj([h_k; markov_w1[prev_k]]) (a logit; `confidence_head_with_markov`),
  sigmoid(c_k) = the predicted chance slot k is accepted given the slots before it were; with
  per-slot temperatures T_k fitted on the cache's evaluation split (`sts_temperatures`, Sequential
  Temperature Scaling, drafter/calibration.py) the prediction is sigmoid(c_k / T_k).
- Initialisation as HF Qwen3's `_init_weights`: linears and embeddings ~ N(0, 0.02), biases 0.
- Checkpoint names (`Qwen3DSparkModel`, no prefix): the DFlash backbone's, plus
  `markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r] (`gated`:
  `markov_head.gate_proj.weight` [r, H + r] and `.bias` [r]; `rnn`: `markov_head.joint_proj.weight`
  [3r, 2r + H] and `.bias` [3r]), `confidence_head.proj.weight` [1, H + r], `confidence_head.proj.bias`
  [1], the last two kept in float32 by the export as the engines hold them (`FLOAT32_TENSORS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafter.config import ARCHITECTURE as DFLASH_ARCHITECTURE
from drafter.config import DFlashConfig, check_taps
from drafter.model import INITIALIZER_RANGE, DFlashDrafter

ARCHITECTURE = "Qwen3DSparkModel"
AUTO_MAP = {"AutoModel": "modeling_dspark.Qwen3DSparkModel"}
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DEFAULT_MARKOV_RANK = 256  # DeepSpec's default
DEFAULT_NUM_ANCHORS = 512  # DeepSpec's anchors per sequence (recorded in the config; training draws its own)
FLOAT32_TENSORS = ("confidence_head.",)  # held in float32 by vLLM and SGLang whatever the model's dtype

# The keys a DSpark config.json adds to the Qwen3 keys (all top level).
DSPARK_KEYS = (
    "target_layer_ids",
    "mask_token_id",
    "num_anchors",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "sample_from_anchor",
    "dspark_bonus_anchor",
    "sts_temperatures",
)
# The layout (slot k predicts x[p + k + 1]) as the readers name it: vLLM, llama.cpp (`sample_from_anchor`,
# default true there) and vLLM's speculators converter (`dspark_bonus_anchor`, its negation).
LAYOUT_KEYS = {"sample_from_anchor": True, "dspark_bonus_anchor": False}


def default_markov_rank(vocab_size: int) -> int:
    """DeepSpec's rank 256, capped at a quarter of the vocabulary: a rank near V is a full bigram
    table, far more parameters than a tiny vocabulary's transitions need."""
    return max(1, min(DEFAULT_MARKOV_RANK, vocab_size // 4))


@dataclass(kw_only=True)
class DSparkConfig(DFlashConfig):
    """Shape of a DSpark drafter: the DFlash backbone's fields (block_size = B, the DSpark block)
    plus its heads. markov_rank 0 means no Markov head (readable; alrira trains none: docs/dspark.md)."""

    markov_rank: int = DEFAULT_MARKOV_RANK
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = DEFAULT_NUM_ANCHORS
    sts_temperatures: list[float] | None = None  # [B] the confidence logit's per-slot temperatures, or uncalibrated

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
        check_taps(self.target_layer_ids, num_target_layers=self.num_target_layers, what="target_layer_ids")
        if self.sts_temperatures is not None:
            self.sts_temperatures = [float(t) for t in self.sts_temperatures]
            if len(self.sts_temperatures) != self.block_size or not all(t > 0 for t in self.sts_temperatures):
                raise ValueError(f"sts_temperatures must be {self.block_size} positive numbers (one per slot), got {self.sts_temperatures}")

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block: every slot drafts (DFlash: block_size - 1)."""
        return self.block_size

    @classmethod
    def from_dflash(cls, backbone: DFlashConfig, *, block_size: int, markov_rank: int, enable_confidence_head: bool,
                    markov_head_type: str = "vanilla") -> DSparkConfig:  # fmt: skip
        """A DSpark config on a DFlash backbone's shape (its block size replaced by the DSpark block)."""
        fields = {f.name: getattr(backbone, f.name) for f in dataclasses.fields(DFlashConfig)}
        fields["block_size"] = block_size
        return cls(**fields, markov_rank=markov_rank, markov_head_type=markov_head_type, enable_confidence_head=enable_confidence_head,
                   confidence_head_with_markov=enable_confidence_head and markov_rank > 0)  # fmt: skip

    def to_hf_dict(self) -> dict:
        """config.json in the contract of DeepSpec's `Qwen3DSparkModel` (what vLLM's and SGLang's
        DSpark loaders read): the Qwen3 keys, then the DSpark keys at the top level, the layout
        named as every reader names it (`LAYOUT_KEYS`) and the calibration when there is one."""
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
            **LAYOUT_KEYS,
        )
        if self.sts_temperatures is not None:
            hf["sts_temperatures"] = list(self.sts_temperatures)
        return hf

    @classmethod
    def from_hf_dict(cls, d: dict) -> DSparkConfig:
        """Read a DSpark config.json (ours or DeepSpec's); the Qwen3 part is checked as strictly as
        a DFlash config (drafter/config.py), unknown keys refused, and so is a layout other than
        DSpark's (the speculators convention: `sample_from_anchor` false, `speculators_model_type`)."""
        d = dict(d)
        architectures = d.pop("architectures", [ARCHITECTURE])
        if ARCHITECTURE not in architectures:
            raise ValueError(f"architectures must include {ARCHITECTURE!r}, got {architectures}")
        for name in ("target_layer_ids", "mask_token_id"):
            if name not in d:
                raise ValueError(f"config.json is missing {name}")
        check_layout(d)
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
            sts_temperatures=extras.get("sts_temperatures"),
        )


def check_layout(hf: dict) -> None:
    """Refuse a config whose block is laid out otherwise than DSpark's (slot k predicts x[p + k + 1]):
    the speculators convention (slot k predicts x[p + k], slot 0 untrained) read as DSpark's accepts
    about one token a round (SGLang refuses it; a missing flag gave vLLM 0.9% acceptance)."""
    differ = [f"{key} {hf[key]!r}" for key, value in LAYOUT_KEYS.items() if key in hf and hf[key] is not value]
    if "speculators_model_type" in hf:
        differ.append(f"speculators_model_type {hf['speculators_model_type']!r}")
    if differ:
        raise ValueError(
            f"config.json has {', '.join(differ)}: the speculators layout (slot k predicts x[p + k], the anchor slot untrained), "
            "not DSpark's (slot k predicts x[p + k + 1]) that alrira trains, evaluates and exports (docs/dspark.md)"
        )


def is_dspark_hf_config(d: dict) -> bool:
    return ARCHITECTURE in (d.get("architectures") or [])


class MarkovHead(nn.Module):
    """The vanilla Markov head: a rank-r bigram logit bias markov_w2(markov_w1[prev]). Every type
    maps (prev token, slot hidden state, state) to a latent z whose markov_w2(z) is the bias."""

    def __init__(self, *, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        del hidden_size  # the vanilla head reads only the previous token
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def latent(self, prev_tokens: Tensor, hidden: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(z [..., r], the state the next slot reads) for prev_tokens [...] and hidden [..., H]."""
        return self.markov_w1(prev_tokens), None

    def forward(self, prev_tokens: Tensor) -> Tensor:
        """Logit bias [..., V] of prev_tokens [...] (long)."""
        return self.markov_w2(self.markov_w1(prev_tokens))


class GatedMarkovHead(MarkovHead):
    """DeepSpec's `gated` head: the previous token's embedding gated by the slot's hidden state."""

    def __init__(self, *, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size=vocab_size, rank=rank, hidden_size=hidden_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def latent(self, prev_tokens: Tensor, hidden: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        embedding = self.markov_w1(prev_tokens)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedding.to(hidden.dtype)], dim=-1)))
        return gate.to(embedding.dtype) * embedding, None


class RNNMarkovHead(MarkovHead):
    """DeepSpec's `rnn` head: a GRU-like state carried slot by slot through the block (zero before slot 0)."""

    def __init__(self, *, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size=vocab_size, rank=rank, hidden_size=hidden_size)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def latent(self, prev_tokens: Tensor, hidden: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        embedding = self.markov_w1(prev_tokens).to(hidden.dtype)
        if state is None:
            state = torch.zeros_like(embedding)
        gate_raw, candidate_raw, output_raw = self.joint_proj(torch.cat([state, embedding, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        return torch.tanh(output_raw), gate * state + (1.0 - gate) * torch.tanh(candidate_raw)


MARKOV_HEADS = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNMarkovHead}


class ConfidenceHead(nn.Module):
    """A linear map to one logit: sigmoid of it predicts the slot's acceptance. Its weights may be
    float32 in a lower-precision drafter (the export keeps them so), so it computes in theirs."""

    def __init__(self, *, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """The DFlash backbone (its forward gives the final-normed hidden states of every slot) with
    the two DSpark heads; the target's embed_tokens and lm_head are applied by the caller."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        self.markov_head = None
        if config.markov_rank > 0:
            self.markov_head = MARKOV_HEADS[config.markov_head_type](
                vocab_size=config.vocab_size, rank=config.markov_rank, hidden_size=config.hidden_size
            )
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

    def markov_bias(self, prev_tokens: Tensor, hidden: Tensor | None = None) -> Tensor | None:
        """The Markov head's logit bias [..., V] for slots read one by one (prev_tokens [...], their
        hidden states [..., H]), or None without the head; an `rnn` head needs its block (block_markov_latents)."""
        if self.markov_head is None:
            return None
        if self.config.markov_head_type == "rnn":
            raise ValueError("an rnn Markov head's bias depends on the slots before it: use block_markov_latents")
        return self.markov_head.markov_w2(self.markov_head.latent(prev_tokens, hidden, None)[0])

    def block_markov_latents(self, prev_tokens: Tensor, hidden: Tensor) -> Tensor:
        """Teacher-forced latents z [N, L, r] of N blocks' slots in order (prev_tokens [N, L], hidden
        [N, L, H]): an `rnn` head's state runs through the block, the others read each slot alone."""
        latents, state = [], None
        for k in range(prev_tokens.shape[1]):
            latent, state = self.markov_head.latent(prev_tokens[:, k], hidden[:, k], state)
            latents.append(latent)
        return torch.stack(latents, dim=1)

    def confidence_logits(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor | None:
        """Confidence logits [...] of slot hidden states [..., H] after prev_tokens [...], or None."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, self.markov_head.markov_w1(prev_tokens).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features)


def calibrated(logits: Tensor, temperatures: list[float] | None) -> Tensor:
    """Confidence probabilities [N, D] from logits [N, D]: sigmoid(c_k / T_k) (Sequential Temperature
    Scaling, as TensorRT-LLM's and SGLang's `apply_sts`), plain sigmoid when uncalibrated."""
    logits = logits.float()
    if temperatures is not None:
        logits = logits / torch.tensor(temperatures[: logits.shape[-1]], dtype=torch.float32, device=logits.device)
    return logits.sigmoid()


@torch.no_grad()
def dspark_draft(
    drafter: DSparkDrafter, *, base_logits: Tensor, hidden: Tensor, anchor_tokens: Tensor, temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Draft N blocks slot by slot after one backbone pass: base_logits [N, B, V] (lm_head of the
    slots' hidden states [N, B, H]), anchor_tokens [N]. Slot k adds the Markov bias of its previous
    token (the anchor, then the drafter's own token of slot k - 1; an `rnn` head's state carried
    along) and takes the argmax (T = 0) or a sample of softmax(logits / T). Returns (tokens [N, B],
    corrected logits [N, B, V], confidence probabilities [N, B] (calibrated where the config holds
    temperatures) or None, their raw logits [N, B] or None)."""
    num_slots = base_logits.shape[1]
    prev = anchor_tokens.long()
    tokens, logits, prevs, state = [], [], [], None
    for k in range(num_slots):
        step = base_logits[:, k]
        if drafter.markov_head is not None:
            latent, state = drafter.markov_head.latent(prev, hidden[:, k], state)
            step = step + drafter.markov_head.markov_w2(latent).to(step.dtype)
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
    if confidence is None:
        return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), None, None
    probs = calibrated(confidence, drafter.config.sts_temperatures)
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1), probs, confidence.float()
