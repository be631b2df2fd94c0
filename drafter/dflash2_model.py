"""The DFlash2 drafter: the DFlash backbone with a local dynamic convolution around each sublayer
and a low-rank candidate selector (docs/dflash2.md). An export ships this file (as
`dflash2_model.py`), so it imports only torch and its shipped siblings; the family's training side
(options, layout, loss) is drafter/dflash2.py.

Facts checked against the reference code (speculators 0.9 `speculators/models/dflash2/`, vLLM 0.32
`model_executor/models/qwen3_dflash2.py` + `v1/worker/gpu/spec_decode/dflash2/speculator.py`,
llama.cpp in llama-cpp-python 0.3.36 `conversion/qwen.py`, `src/models/dflash.cpp`,
`common/speculative.cpp`; our code, their math):
- Backbone = DFlash (drafter/model.py), same layout: slot 0 holds the anchor, slot k predicts
  x[p + k] (`sample_from_anchor` False), B - 1 drafts per block.
- Convolution: every decoder layer wraps its attention and its MLP in a grouped dynamic causal
  convolution over the block's slots. With x the sublayer's normed input,
      kernels = kernel_projection(x)                       [.., 2, taps, H / group]
      y = sublayer(conv(x, kernels[0], base_kernel[0]))    (the "prepare" side)
      h = h + conv(y, kernels[1], base_kernel[1])          (the "finish" side, same kernels' second half)
  where conv(x, d, b)[t] = sum_{j < taps, slot(t) >= j} (b[j] + d[t, j, group(c)]) * x[t - j]: a tap
  never reaches before the block's slot 0, so blocks packed side by side never mix. Identity at
  init: base_kernel[:, 0] = 1, the rest 0, kernel_projection = 0. The context never passes through
  a convolution (its keys and values are the DFlash ones).
- Selector: with h the final-normed hidden state of a slot, prev the token before the slot's
  prediction and c one of the slot's candidates,
      score(c | prev, h) = z(c) + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c]>
  where z are the unary logits (the target's lm_head of h). Candidates are the unary top
  `selector_top_k`. Decoding walks the slots greedily: slot 1 after the anchor, slot k after the
  candidate picked at slot k - 1, each the argmax of its scores (vLLM's selector walk, llama.cpp's
  lattice walk).
- Checkpoint names (no prefix; the engines share embed_tokens and lm_head from the target): the
  DFlash backbone's, plus `layers.{i}.{attention,mlp}_conv.base_kernel` [2, taps, H],
  `layers.{i}.{attention,mlp}_conv.kernel_projection.weight` [2 * taps * H / group, H],
  `candidate_selector.predecessor_codebook` [V, r], `candidate_selector.successor_codebook` [V, r],
  `candidate_selector.hidden_projection.weight` [r, H].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafter.config import ARCHITECTURE as DFLASH_ARCHITECTURE
from drafter.config import DFlashConfig
from drafter.model import INITIALIZER_RANGE, DecoderLayer, DFlashDrafter

ARCHITECTURE = "DFlash2DraftModel"
AUTO_MAP = {"AutoModel": "modeling_dflash2.DFlash2DraftModel"}

# The keys DFlash2 adds inside `dflash_config` (read by llama.cpp's converter, vLLM's model and
# speculator, and the MLX port; all four are required there as here).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# `dflash_config` keys other writers use that we accept only at the value that leaves the math as
# ours (vLLM's speculators conversion writes `sample_from_anchor` and `causal`; llama.cpp and vLLM
# read the three scales). Any other value is refused rather than silently ignored.
NEUTRAL_DFLASH_KEYS = {
    "sample_from_anchor": (False,),
    "causal": (False,),
    "input_embedding_scale": (1.0,),
    "output_multiplier": (1.0,),
    "final_logit_softcapping": (None, 0.0),
}


DEFAULT_SELECTOR_TOP_K = 16  # speculators' default


def default_selector_top_k(*, hidden_size: int, vocab_size: int) -> int:
    """speculators' 16, capped where llama.cpp could not serve it: its selector lattice (K ids and
    K x K scores per slot) is packed into one hidden-sized row, so it refuses K * (K + 1) > H
    (src/models/dflash.cpp); and at most the vocabulary."""
    top_k = min(DEFAULT_SELECTOR_TOP_K, vocab_size)
    while top_k > 1 and top_k * (top_k + 1) > hidden_size:
        top_k -= 1
    return top_k


@dataclass(kw_only=True)
class DFlash2Config(DFlashConfig):
    """Shape of a DFlash2 drafter: the DFlash backbone's fields plus the convolution and the
    selector (speculators 0.9's defaults)."""

    conv_kernel_size: int = 2  # causal taps of each convolution
    conv_group_size: int = 16  # hidden channels sharing one dynamic coefficient
    selector_rank: int = 256
    selector_top_k: int = DEFAULT_SELECTOR_TOP_K  # unary candidates the selector reranks per slot

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in DFLASH2_KEYS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.conv_kernel_size > self.block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size} must not exceed block_size {self.block_size}")
        if self.hidden_size % self.conv_group_size != 0:
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} must not exceed vocab_size {self.vocab_size}")

    @property
    def num_conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_dflash(cls, backbone: DFlashConfig, **dflash2_fields) -> DFlash2Config:
        """A DFlash2 config on a DFlash backbone's shape; the DFlash2 fields default as above."""
        fields = {f.name: getattr(backbone, f.name) for f in dataclasses.fields(DFlashConfig)}
        return cls(**fields, **dflash2_fields)

    def to_hf_dict(self) -> dict:
        """config.json in the z-lab DFlash2 release contract: the DFlash one with
        `architectures: ["DFlash2DraftModel"]` and the four DFlash2 keys (and block_size, which
        llama.cpp reads there first) inside `dflash_config`."""
        hf = super().to_hf_dict()
        hf["architectures"] = [ARCHITECTURE]
        hf["dflash_config"].update({name: getattr(self, name) for name in DFLASH2_KEYS}, block_size=self.block_size)
        return hf

    @classmethod
    def from_hf_dict(cls, d: dict) -> DFlash2Config:
        """Read a DFlash2 config.json (ours or a release); the backbone part is checked as strictly
        as a DFlash config (drafter/config.py), unknown keys refused."""
        d = dict(d)
        architectures = d.pop("architectures", [ARCHITECTURE])
        if ARCHITECTURE not in architectures:
            raise ValueError(f"architectures must include {ARCHITECTURE!r}, got {architectures}")
        dflash = dict(d.pop("dflash_config", None) or {})
        missing = [name for name in DFLASH2_KEYS if name not in dflash]
        if missing:
            raise ValueError(f"dflash_config is missing {missing} (a DFlash2 config names all of {list(DFLASH2_KEYS)})")
        extras = {name: dflash.pop(name) for name in DFLASH2_KEYS}
        for name, neutral in NEUTRAL_DFLASH_KEYS.items():
            if name in dflash and dflash.pop(name) not in neutral:
                raise ValueError(f"dflash_config.{name} must be one of {list(neutral)} (DFlash2 as trained here)")
        backbone = DFlashConfig.from_hf_dict({**d, "architectures": [DFLASH_ARCHITECTURE], "dflash_config": dflash})
        return cls.from_dflash(backbone, **extras)


def is_dflash2_hf_config(d: dict) -> bool:
    return ARCHITECTURE in (d.get("architectures") or [])


# ----------------------------------------------------------------------------------------------
# The convolution


def grouped_dynamic_conv(x: Tensor, delta: Tensor, base: Tensor, *, block_size: int) -> Tensor:
    """Causal convolution over each block of `block_size` consecutive slots (blocks packed along Q
    never mix): x [B, Q, H], delta [B, Q, taps, G] (per-slot coefficients, one per group of
    H / G channels), base [taps, H] -> [B, Q, H] with
        out[t] = sum_{j < taps, slot(t) >= j} (base[j] + delta[t, j, group]) * x[t - j]."""
    batch, num_queries, hidden = x.shape
    taps, num_groups = delta.shape[-2:]
    grouped = x.view(batch, num_queries, num_groups, hidden // num_groups)  # [B, Q, G, H / G]
    base = base.to(x.dtype).view(taps, num_groups, hidden // num_groups)
    slot = torch.arange(num_queries, device=x.device) % block_size  # [Q] position inside the block
    out = grouped * (base[0] + delta[:, :, 0, :, None])
    for j in range(1, min(taps, block_size)):
        shifted = F.pad(grouped[:, :-j], (0, 0, 0, 0, j, 0))  # x[t - j], zero before the row's start
        inside = (slot >= j).view(1, num_queries, 1, 1)  # and zero before the block's slot 0
        out = out + shifted * (base[j] + delta[:, :, j, :, None]) * inside
    return out.view(batch, num_queries, hidden)


def reference_grouped_dynamic_conv(x: Tensor, delta: Tensor, base: Tensor, *, block_size: int) -> Tensor:
    """grouped_dynamic_conv one output element at a time, for tests: the formula as written."""
    batch, num_queries, hidden = x.shape
    taps, num_groups = delta.shape[-2:]
    group_size = hidden // num_groups
    out = torch.zeros_like(x)
    for b in range(batch):
        for t in range(num_queries):
            for j in range(taps):
                if t % block_size >= j:
                    coefficient = base[j] + delta[b, t, j].repeat_interleave(group_size)  # [H]
                    out[b, t] = out[b, t] + coefficient * x[b, t - j]
    return out


class DynamicBlockConv(nn.Module):
    """The two convolutions around one sublayer, their coefficients made from its normed input."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.block_size = config.block_size
        self.taps = config.conv_kernel_size
        self.num_groups = config.num_conv_groups
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, config.hidden_size))  # [side, tap, H]
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.taps * self.num_groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity on both sides: the layer computes exactly the DFlash layer's function."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(the sublayer's convolved input [B, Q, H], the finishing side's coefficients [B, Q, taps, G]) of x [B, Q, H]."""
        kernels = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.num_groups)
        return grouped_dynamic_conv(x, kernels[:, :, 0], self.base_kernel[0], block_size=self.block_size), kernels[:, :, 1]

    def finish(self, y: Tensor, delta: Tensor) -> Tensor:
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], block_size=self.block_size)


class DFlash2DecoderLayer(DecoderLayer):
    """The DFlash decoder layer with a convolution around its attention and its MLP."""

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.attention_conv = DynamicBlockConv(config)
        self.mlp_conv = DynamicBlockConv(config)

    def forward(self, h: Tensor, ctx: Tensor, *, rope_q, rope_kv, attention_mask) -> Tensor:
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))
        attended = self.self_attn(x, ctx, rope_q=rope_q, rope_kv=rope_kv, attention_mask=attention_mask)
        h = h + self.attention_conv.finish(attended, delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), delta)


# ----------------------------------------------------------------------------------------------
# The selector


class CandidateSelector(nn.Module):
    """The low-rank bilinear transition score of a candidate after a previous token."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """speculators' init: every weight ~ N(0, 0.02)."""
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            weight.normal_(0.0, INITIALIZER_RANGE)

    def context(self, hidden: Tensor, prev_tokens: Tensor) -> Tensor:
        """predecessor_codebook[prev] * hidden_projection(h): [..., r] of hidden [..., H], prev_tokens [...]."""
        # Rows through F.embedding: its CPU backward sums repeated ids in a fixed order, where indexing's
        # accumulates them with parallel atomic adds (training would not repeat bit for bit).
        predecessor = F.embedding(prev_tokens.long(), self.predecessor_codebook)
        return predecessor * self.hidden_projection(hidden).to(predecessor.dtype)

    def transition_scores(self, hidden: Tensor, prev_tokens: Tensor, candidate_ids: Tensor) -> Tensor:
        """Transition scores [..., K] of candidate_ids [..., K] after prev_tokens [...] at slots with hidden [..., H]."""
        context = self.context(hidden, prev_tokens)  # [..., r]
        successors = F.embedding(candidate_ids.long(), self.successor_codebook)  # [..., K, r]
        return (successors @ context[..., :, None])[..., 0]


class DFlash2Drafter(DFlashDrafter):
    """The DFlash backbone with convolutions in every layer (its forward gives the final-normed
    hidden states of every slot) and the candidate selector; the target's embed_tokens and lm_head
    are applied by the caller."""

    layer_class = DFlash2DecoderLayer  # the backbone's stack, with the convolutions

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)  # drawn by its own init

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The backbone's HF Qwen3 init, then identity convolutions and the selector's own init."""
        super().reset_parameters()
        for module in self.modules():
            if isinstance(module, (DynamicBlockConv, CandidateSelector)):
                module.reset_parameters()


def init_from_dflash(backbone: DFlashDrafter, config: DFlash2Config) -> DFlash2Drafter:
    """A DFlash2 drafter carrying a DFlash drafter's weights, with fresh (identity) convolutions and
    a fresh selector: at init it computes the DFlash drafter's hidden states."""
    model = DFlash2Drafter(config).to(device=backbone.fc.weight.device, dtype=backbone.fc.weight.dtype)
    missing, unexpected = model.load_state_dict(backbone.state_dict(), strict=False)
    fresh = [name for name in missing if "_conv." not in name and not name.startswith("candidate_selector.")]
    if fresh or unexpected:
        raise ValueError(f"a DFlash backbone of another shape: missing {fresh}, unexpected {unexpected}")
    return model


# ----------------------------------------------------------------------------------------------
# Drafting


def unary_candidates(hidden: Tensor, *, lm_head: nn.Module, top_k: int) -> tuple[Tensor, Tensor]:
    """(candidate ids [..., K], their unary logits [..., K] float32): the top_k of lm_head(hidden [..., H])."""
    logits = lm_head(hidden.to(lm_head.weight.dtype)).float()  # [..., V]
    values, ids = logits.topk(top_k, dim=-1)
    return ids, values


@torch.no_grad()
def dflash2_draft(model: DFlash2Drafter, *, hidden: Tensor, anchor_tokens: Tensor, lm_head: nn.Module) -> Tensor:
    """Draft tokens [N, B - 1] of N blocks from their final-normed hidden states [N, B, H] (slot 0
    the anchor, anchor_tokens [N]): the unary top-K candidates of every drafting slot and the
    selector's transition scores between consecutive slots' candidates, as one lattice
    [N, B - 1, K (previous), K (candidate)], then a greedy walk: slot 1 after the anchor, slot k
    after the candidate picked at slot k - 1 (vLLM's and llama.cpp's walk)."""
    model = getattr(model, "module", model)
    selector = model.candidate_selector
    slots = hidden[:, 1:]  # [N, S, H], S = B - 1 drafting slots
    candidate_ids, unary = unary_candidates(slots, lm_head=lm_head, top_k=selector.top_k)  # [N, S, K] each
    num_blocks, num_slots, top_k = candidate_ids.shape
    # Previous tokens of each lattice row: the anchor for slot 1, slot k - 1's candidates after.
    prev = torch.cat([anchor_tokens.long()[:, None, None].expand(-1, 1, top_k), candidate_ids[:, :-1]], dim=1)  # [N, S, K]
    context = selector.context(slots[:, :, None, :], prev)  # [N, S, K, r]
    successors = F.embedding(candidate_ids, selector.successor_codebook)  # [N, S, K, r]
    lattice = unary[:, :, None, :] + (context @ successors.transpose(-1, -2)).float()  # [N, S, K, K]
    rows = torch.arange(num_blocks, device=hidden.device)
    picked = torch.zeros(num_blocks, dtype=torch.long, device=hidden.device)  # slot 1's rows are all the anchor
    tokens = []
    for s in range(num_slots):
        picked = lattice[rows, s, picked].argmax(dim=-1)  # [N]
        tokens.append(candidate_ids[rows, s, picked])
    return torch.stack(tokens, dim=1) if tokens else candidate_ids.new_zeros(num_blocks, 0)


@torch.no_grad()
def reference_draft(model: DFlash2Drafter, *, hidden: Tensor, anchor_tokens: Tensor, lm_head: nn.Module) -> Tensor:
    """dflash2_draft slot by slot, for tests: each slot's candidates scored after the token actually
    drafted before it (no lattice)."""
    model = getattr(model, "module", model)
    selector = model.candidate_selector
    prev = anchor_tokens.long()
    tokens = []
    for s in range(1, hidden.shape[1]):
        ids, unary = unary_candidates(hidden[:, s], lm_head=lm_head, top_k=selector.top_k)  # [N, K]
        scores = unary + selector.transition_scores(hidden[:, s], prev, ids).float()
        prev = ids.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        tokens.append(prev)
    return torch.stack(tokens, dim=1) if tokens else anchor_tokens.new_zeros(anchor_tokens.shape[0], 0).long()
