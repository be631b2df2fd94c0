"""The DFlash block drafter in plain torch (docs/design.md, "The drafter").

Facts checked against the public code so checkpoints are interchangeable (our code, their math):
- z-lab/dflash (`model/dflash.py`, `dflash/model.py`, class DFlashDraftModel): the context is
  `target_hidden = hidden_norm(fc(target_hidden))`, computed once before the layers and fed
  unchanged to every layer. In each attention layer
      q = q_norm(q_proj(x))                                 (block tokens only)
      k = k_norm(cat([k_proj(ctx), k_proj(x)], seq))         context FIRST, then the block
      v = cat([v_proj(ctx), v_proj(x)], seq)                 (no norm on v)
  and RoPE is applied to all keys (context and block) at their own absolute positions, to the
  queries at the block positions (`position_ids` covers ctx + block; q uses the last Q of them).
  Attention is non-causal, scale head_dim ** -0.5, GQA by repeating each kv head over
  num_heads / num_kv_heads consecutive query heads. Decoder layer = Qwen3's: pre-norm, residual,
  SwiGLU MLP (down(silu(gate(x)) * up(x))); context tokens get no MLP. Output = norm(h); the
  target's lm_head is applied by the caller. fc has no bias; layer/tensor names are
  `fc`, `hidden_norm`, `norm`, `layers.{i}.{input_layernorm, post_attention_layernorm,
  self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}`.
  Config keys read there: `dflash_config.target_layer_ids`, `dflash_config.mask_token_id`,
  `block_size` (top level or inside dflash_config), `num_target_layers`, the Qwen3 keys.
  Context features are `hidden_states[id + 1]` for each tap id (before the final norm).
- vLLM (`vllm/model_executor/models/qwen3_dflash.py`): `fc` is applied when combining the target
  states; context K/V are precomputed as hidden_norm -> k/v projection -> k_norm -> RoPE at the
  context positions (neox-style rotate-half), written into the KV cache before the block's
  forward. Same math as above.
- HF Qwen3 conventions matched here: RMSNorm in fp32 then `weight * x.to(input_dtype)`; RoPE
  inv_freq = theta ** -(arange(0, d, 2) / d), cos/sin computed in fp32 and cast to the input
  dtype, `x * cos + rotate_half(x) * sin`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from drafter.config import DFlashConfig

INITIALIZER_RANGE = 0.02  # HF Qwen3 default


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics like HF Qwen3, so bf16 checkpoints see the same numbers as upstream.
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


def rope_cos_sin(
    positions: Tensor, *, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, head_dim] for integer positions [B, T] (HF 'default' RoPE)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]
    freqs = positions[..., None].float() * inv_freq  # [B, T, head_dim / 2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, d]; cos, sin [B, T, d]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


_compiled_flex_attention = {}  # device type -> torch.compile(flex_attention)


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, *, block_mask: BlockMask, scale: float) -> Tensor:
    # Uncompiled flex attention materialises the full score matrix; compile once per device type.
    # PyTorch 2.13 on CPU: forward only (inputs that require grad raise NotImplementedError, so CPU
    # training uses SDPA), and static shapes, one compile per shape: its C++ template does not
    # compile once shapes turn dynamic (CppCompileError on the second shape).
    device_type = q.device.type
    if device_type not in _compiled_flex_attention:
        dynamic = False if device_type == "cpu" else None
        _compiled_flex_attention[device_type] = torch.compile(flex_attention, dynamic=dynamic)
    return _compiled_flex_attention[device_type](q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, kv_in: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Keys (k_norm, then RoPE at each token's own position) and values [B, nkv, T, d] of kv_in [B, T, H]."""
        batch, num_keys, _ = kv_in.shape
        d = self.head_dim
        k = self.k_norm(self.k_proj(kv_in).view(batch, num_keys, self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(kv_in).view(batch, num_keys, self.num_kv_heads, d).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(
        self,
        x: Tensor,
        ctx: Tensor | tuple[Tensor, Tensor],
        *,
        rope_q: tuple[Tensor, Tensor],
        rope_kv: tuple[Tensor, Tensor],
        attention_mask: Tensor | BlockMask | None,
    ) -> Tensor:
        """ctx: the context hidden states [B, C, H] (training; rope_kv covers context + block), or
        its precomputed (keys, values) from a ContextKVCache (decoding; rope_kv covers the block)."""
        batch, num_queries, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(batch, num_queries, self.num_heads, d)
        q = apply_rope(self.q_norm(q).transpose(1, 2), *rope_q)  # [B, nh, Q, d]
        # Context first, then the block: the layout every public implementation uses.
        if isinstance(ctx, tuple):
            block_k, block_v = self.keys_values(x, rope_kv)
            k, v = torch.cat([ctx[0], block_k], dim=2), torch.cat([ctx[1], block_v], dim=2)  # [B, nkv, C + Q, d]
        else:
            k, v = self.keys_values(torch.cat([ctx, x], dim=1), rope_kv)  # [B, nkv, C + Q, d]

        scale = d**-0.5
        if isinstance(attention_mask, BlockMask):
            out = _flex_attention(q, k, v, block_mask=attention_mask, scale=scale)
        else:
            # Repeat kv heads explicitly: SDPA's fused kernels with a mask do not all take enable_gqa.
            n_rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scale)
        out = out.transpose(1, 2).reshape(batch, num_queries, self.num_heads * d)  # [B, Q, nh*d]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h: Tensor, ctx: Tensor, *, rope_q, rope_kv, attention_mask) -> Tensor:
        h = h + self.self_attn(
            self.input_layernorm(h), ctx, rope_q=rope_q, rope_kv=rope_kv, attention_mask=attention_mask
        )
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class ContextKVCache:
    """Per-layer keys and values of the context positions 0..length-1, for decoding: committed
    context never changes, so each round projects only the newly committed positions."""

    keys: list[Tensor]  # per layer [B, nkv, length, d], k_norm and RoPE applied
    values: list[Tensor]  # per layer [B, nkv, length, d]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


class DFlashDrafter(nn.Module):
    """Qwen3-style block drafter; no embedding and no LM head (the target's are used, frozen)."""

    # The decoder layer a family builds its stack from (a subclass of DecoderLayer with the same
    # names, e.g. DFlash2's with convolutions around its sublayers: drafter/dflash2_model.py).
    layer_class = DecoderLayer

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_taps * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        # Training-time switch, not part of the checkpoint: recompute each layer in backward
        # instead of keeping its activations (the blocks x slots x hidden activations of a step).
        self.activation_checkpointing = False
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF Qwen3 init: linears ~ N(0, 0.02), norms = 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, INITIALIZER_RANGE)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(
        self,
        *,
        context_features: Tensor,
        context_positions: Tensor,
        block_embeds: Tensor,
        block_positions: Tensor,
        attention_mask: Tensor | BlockMask,
    ) -> Tensor:
        """Final-normed hidden states [B, Q, H] of the block tokens.

        context_features [B, C, n*H] raw target features; context_positions [B, C];
        block_embeds [B, Q, H] (target-embedded block tokens); block_positions [B, Q];
        attention_mask: dense bool [B, 1, Q, C + Q] (True = may attend; SDPA path) or a
        flex-attention BlockMask over the same layout (flex path).
        """
        _check_inputs(
            self.config,
            context_features=context_features,
            context_positions=context_positions,
            block_embeds=block_embeds,
            block_positions=block_positions,
            attention_mask=attention_mask,
        )
        cfg = self.config
        ctx = self.hidden_norm(self.fc(context_features))  # [B, C, H], shared by every layer
        dtype = block_embeds.dtype
        rope_q = rope_cos_sin(block_positions, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=dtype)
        kv_positions = torch.cat([context_positions, block_positions], dim=1)  # [B, C + Q]
        rope_kv = rope_cos_sin(kv_positions, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=dtype)
        h = block_embeds
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                h = checkpoint(layer, h, ctx, rope_q=rope_q, rope_kv=rope_kv, attention_mask=attention_mask, use_reentrant=False)
            else:
                h = layer(h, ctx, rope_q=rope_q, rope_kv=rope_kv, attention_mask=attention_mask)
        return self.norm(h)

    def extend_context_cache(
        self, cache: ContextKVCache | None, *, context_features: Tensor, context_positions: Tensor
    ) -> ContextKVCache:
        """`cache` with the context keys/values of new positions appended: context_features [B, n, n*H]
        raw target features, context_positions [B, n] (the positions after cache.length)."""
        cfg = self.config
        ctx = self.hidden_norm(self.fc(context_features))  # [B, n, H]
        rope = rope_cos_sin(context_positions, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=ctx.dtype)
        new = [layer.self_attn.keys_values(ctx, rope) for layer in self.layers]
        if cache is None:
            return ContextKVCache(keys=[k for k, _ in new], values=[v for _, v in new])
        return ContextKVCache(
            keys=[torch.cat([old, k], dim=2) for old, (k, _) in zip(cache.keys, new, strict=True)],
            values=[torch.cat([old, v], dim=2) for old, (_, v) in zip(cache.values, new, strict=True)],
        )

    def forward_cached(self, *, cache: ContextKVCache, block_embeds: Tensor, block_positions: Tensor) -> Tensor:
        """forward() for blocks that see every cached context position and each other (decoding:
        one block right after the context, no mask): final-normed hidden states [B, Q, H]."""
        cfg = self.config
        rope_q = rope_cos_sin(block_positions, head_dim=cfg.head_dim, theta=cfg.rope_theta, dtype=block_embeds.dtype)
        h = block_embeds
        for layer, keys, values in zip(self.layers, cache.keys, cache.values, strict=True):
            h = layer(h, (keys, values), rope_q=rope_q, rope_kv=rope_q, attention_mask=None)
        return self.norm(h)


def _check_inputs(
    config: DFlashConfig,
    *,
    context_features: Tensor,
    context_positions: Tensor,
    block_embeds: Tensor,
    block_positions: Tensor,
    attention_mask: Tensor | BlockMask,
) -> None:
    batch, num_context = context_positions.shape
    num_queries = block_positions.shape[1]
    expected = {
        "context_features": (batch, num_context, config.num_taps * config.hidden_size),
        "block_embeds": (batch, num_queries, config.hidden_size),
        "block_positions": (batch, num_queries),
    }
    actual = {
        "context_features": tuple(context_features.shape),
        "block_embeds": tuple(block_embeds.shape),
        "block_positions": tuple(block_positions.shape),
    }
    for name, shape in expected.items():
        if actual[name] != shape:
            raise ValueError(f"{name} has shape {actual[name]}, expected {shape}")
    if isinstance(attention_mask, BlockMask):
        q_len, kv_len = attention_mask.seq_lengths
        if (q_len, kv_len) != (num_queries, num_context + num_queries):
            raise ValueError(
                f"block mask covers {(q_len, kv_len)}, expected {(num_queries, num_context + num_queries)}"
            )
    else:
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask must be bool (True = may attend), got {attention_mask.dtype}")
        shape = (batch, 1, num_queries, num_context + num_queries)
        if tuple(attention_mask.shape) != shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {shape}")


def reference_forward(
    model: DFlashDrafter,
    *,
    context_features: Tensor,
    context_positions: Tensor,
    block_embeds: Tensor,
    block_positions: Tensor,
    attention_mask: Tensor,
) -> Tensor:
    """Slow plain-torch forward for tests: per-sequence, per-head loops, explicit softmax.

    Written independently of the fast path (pairwise RoPE, explicit kv-head lookup, -inf masking)
    so that a shared mistake is unlikely. Takes only a dense bool mask.
    """
    cfg = model.config
    d = cfg.head_dim
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    half = d // 2

    def rms(x: Tensor, weight: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        return weight * normed.to(x.dtype)

    def rope(x: Tensor, positions: Tensor) -> Tensor:
        # Rotate each pair (i, i + d/2) by angle pos * theta^(-2i/d).
        freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float) * 2 / d)  # [d/2]
        angle = positions.float()[:, None] * freq[None, :]  # [T, d/2]
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        a, b = x[:, :half], x[:, half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    ctx = rms(context_features @ model.fc.weight.T, model.hidden_norm.weight)  # [B, C, H]
    h = block_embeds
    for layer in model.layers:
        attn = layer.self_attn
        x = rms(h, layer.input_layernorm.weight)
        per_sequence = []
        for b in range(x.shape[0]):
            keys_in = torch.cat([ctx[b], x[b]], dim=0)  # [C + Q, H]
            key_positions = torch.cat([context_positions[b], block_positions[b]])
            heads = []
            for head in range(cfg.num_attention_heads):
                kv_head = head // group
                rows = slice(head * d, (head + 1) * d)
                kv_rows = slice(kv_head * d, (kv_head + 1) * d)
                q = rope(rms(x[b] @ attn.q_proj.weight[rows].T, attn.q_norm.weight), block_positions[b])
                k = rope(rms(keys_in @ attn.k_proj.weight[kv_rows].T, attn.k_norm.weight), key_positions)
                v = keys_in @ attn.v_proj.weight[kv_rows].T
                scores = (q @ k.T) / math.sqrt(d)  # [Q, C + Q]
                scores = scores.masked_fill(~attention_mask[b, 0], float("-inf"))
                heads.append(torch.softmax(scores, dim=-1) @ v)
            per_sequence.append(torch.cat(heads, dim=-1))
        h = h + torch.stack(per_sequence) @ attn.o_proj.weight.T
        y = rms(h, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        h = h + (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms(h, model.norm.weight)
