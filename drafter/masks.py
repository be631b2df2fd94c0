"""Who may attend to whom in a batch of DFlash blocks (docs/design.md, "The drafter" and "IRA").

Keys are ordered context first, then block tokens: key j < C is context token j, key C + t is
block token t (block t // block_size). A query in block b sees
  1. shared corpus context c (owner -1) iff it is valid and context_positions[c] < corpus limit[b];
  2. private context c (owner == b: an IRA secondary's rollout features) iff it is valid;
  3. every token of its own block (bidirectional);
and nothing else. Invalid (padding) blocks see only themselves, so no row is fully masked.

Corpus limit: an ordinary block anchored at a sees the corpus strictly before a (limit a; the
anchor's own feature is not visible). An IRA secondary at offset j of a parent anchored at a sees
the corpus up to and including a (limit a + 1) plus its private rollout features at positions
a+1 .. a+j-1; its own anchor sits at a + j.

`visibility_mask` is the dense reference (for SDPA); `visibility_mask_mod` is the same rule as a
flex-attention mask_mod, and `flex_block_mask` wraps it in a BlockMask for flex attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

SHARED_OWNER = -1

_compiled_create_block_mask = None  # torch.compile(create_block_mask), built on first use


def _check_shapes(
    *,
    context_positions: Tensor,
    context_owner: Tensor,
    context_valid: Tensor,
    block_corpus_limit: Tensor,
    block_valid: Tensor,
    block_size: int,
) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if context_positions.dim() != 2:
        raise ValueError(f"context_positions must be [B, C], got {tuple(context_positions.shape)}")
    for name, t in (("context_owner", context_owner), ("context_valid", context_valid)):
        if t.shape != context_positions.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} != context_positions {tuple(context_positions.shape)}"
            )
    if block_corpus_limit.dim() != 2 or block_corpus_limit.shape[0] != context_positions.shape[0]:
        raise ValueError(f"block_corpus_limit must be [B, N], got {tuple(block_corpus_limit.shape)}")
    if block_valid.shape != block_corpus_limit.shape:
        raise ValueError(
            f"block_valid shape {tuple(block_valid.shape)} != "
            f"block_corpus_limit {tuple(block_corpus_limit.shape)}"
        )
    if context_valid.dtype != torch.bool or block_valid.dtype != torch.bool:
        raise ValueError("context_valid and block_valid must be bool tensors")


def visibility_mask(
    *,
    context_positions: Tensor,
    context_owner: Tensor,
    context_valid: Tensor,
    block_corpus_limit: Tensor,
    block_valid: Tensor,
    block_size: int,
) -> Tensor:
    """Dense bool mask [B, 1, N*block_size, C + N*block_size]; True = may attend."""
    _check_shapes(
        context_positions=context_positions,
        context_owner=context_owner,
        context_valid=context_valid,
        block_corpus_limit=block_corpus_limit,
        block_valid=block_valid,
        block_size=block_size,
    )
    batch, num_blocks = block_corpus_limit.shape
    device = block_corpus_limit.device
    block_ids = torch.arange(num_blocks, device=device)  # [N]

    shared = (context_owner == SHARED_OWNER)[:, None, :] & (
        context_positions[:, None, :] < block_corpus_limit[:, :, None]
    )  # [B, N, C]
    private = context_owner[:, None, :] == block_ids[None, :, None]  # [B, N, C]
    sees_context = (shared | private) & context_valid[:, None, :] & block_valid[:, :, None]  # [B, N, C]
    sees_blocks = (block_ids[:, None] == block_ids[None, :]).expand(batch, -1, -1)  # [B, N, N]

    # Expand block-level rows/columns to tokens: every token of a block shares its block's row.
    sees_context = sees_context.repeat_interleave(block_size, dim=1)  # [B, Q, C]
    sees_blocks = sees_blocks.repeat_interleave(block_size, dim=1)  # [B, Q, N]
    sees_blocks = sees_blocks.repeat_interleave(block_size, dim=2)  # [B, Q, Q]
    return torch.cat([sees_context, sees_blocks], dim=2)[:, None]  # [B, 1, Q, C + Q]


def visibility_mask_mod(
    *,
    context_positions: Tensor,
    context_owner: Tensor,
    context_valid: Tensor,
    block_corpus_limit: Tensor,
    block_valid: Tensor,
    block_size: int,
):
    """The same rule as a flex-attention mask_mod(b, h, q_idx, kv_idx) -> bool."""
    _check_shapes(
        context_positions=context_positions,
        context_owner=context_owner,
        context_valid=context_valid,
        block_corpus_limit=block_corpus_limit,
        block_valid=block_valid,
        block_size=block_size,
    )
    num_context = context_positions.shape[1]
    if num_context == 0:
        # Indexing an empty context would be out of bounds even in an unused where() branch.
        def own_block_only(b, h, q_idx, kv_idx):
            return q_idx // block_size == kv_idx // block_size

        return own_block_only

    def mask_mod(b, h, q_idx, kv_idx):
        q_block = q_idx // block_size
        # Both branches of the final where() are evaluated: clamp indices into range.
        c = torch.clamp(kv_idx, max=num_context - 1)
        owner = context_owner[b, c]
        shared = (owner == SHARED_OWNER) & (context_positions[b, c] < block_corpus_limit[b, q_block])
        private = owner == q_block
        sees_context = (shared | private) & context_valid[b, c] & block_valid[b, q_block]
        # Context keys give a negative block id, which no query block has; the where() picks
        # sees_context for them anyway. (A clamp here trips inductor's range analysis.)
        kv_block = (kv_idx - num_context) // block_size
        sees_block = kv_block == q_block
        return torch.where(kv_idx < num_context, sees_context, sees_block)

    return mask_mod


def flex_block_mask(
    *,
    context_positions: Tensor,
    context_owner: Tensor,
    context_valid: Tensor,
    block_corpus_limit: Tensor,
    block_valid: Tensor,
    block_size: int,
    compile: bool = False,
):
    """A flex-attention BlockMask for the rule, on the tensors' device.

    compile=True (training) traces the mask with torch.compile, which evaluates mask_mod block by
    block; eager evaluates it on the whole [B, Q, C + Q] grid at once (fine for tests and decoding).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    global _compiled_create_block_mask
    if compile and _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask)
    build = _compiled_create_block_mask if compile else create_block_mask
    mask_mod = visibility_mask_mod(
        context_positions=context_positions,
        context_owner=context_owner,
        context_valid=context_valid,
        block_corpus_limit=block_corpus_limit,
        block_valid=block_valid,
        block_size=block_size,
    )
    batch, num_blocks = block_corpus_limit.shape
    num_queries = num_blocks * block_size
    return build(
        mask_mod,
        B=batch,
        H=None,
        Q_LEN=num_queries,
        KV_LEN=context_positions.shape[1] + num_queries,
        device=block_corpus_limit.device,
    )
