"""The training objectives as pure tensor functions (docs/design.md, "The method").

Notation: K = num_slots predicted slots. A block has K + 1 slots; slot 0 holds the anchor token and is
never trained, so per-slot tensors here are [..., K + 1] and column k is slot k. A sequence has T
tokens and loss mask m. pi[a, k] is the target distribution of slot k along the greedy rollout y* from
anchor a; the cache stores it at index k - 1 of the K axis (`rollout_topk_*[:, k - 1]`).

Every function takes and returns tensors: no I/O, no process group, no globals. Randomness comes in
through an explicit `torch.Generator`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

def slot_envelope(*, num_slots: int, gamma: float) -> Tensor:
    """Slot weight envelope [K + 1]: 0 for the anchor slot, w_k = exp(-(k - 1) / gamma)."""
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    slots = torch.arange(num_slots + 1, dtype=torch.float64)
    envelope = torch.exp(-(slots - 1) / gamma).float()  # [K + 1]
    envelope[0] = 0.0
    return envelope


def eligible_anchor_positions(loss_mask: Tensor) -> Tensor:
    """Positions a with m[a] = 1 and m[a + 1] = 1 (so slot 1 is supervised), ascending, long."""
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def draw_anchors(candidates: Tensor, *, num_anchors: int | None, generator: torch.Generator) -> Tensor:
    """Indices into `candidates` drawn without replacement, ordered by position.

    None or num_anchors >= len(candidates) takes them all (and consumes no randomness).
    """
    num_candidates = candidates.shape[0]
    if num_anchors is not None and num_anchors < 0:
        raise ValueError(f"num_anchors must be >= 0 or None, got {num_anchors}")
    if num_anchors is None or num_anchors >= num_candidates:
        picked = torch.arange(num_candidates, device=candidates.device)
    else:
        perm = torch.randperm(num_candidates, generator=generator, device=generator.device)
        picked = perm[:num_anchors].to(candidates.device)
    order = torch.argsort(candidates[picked], stable=True)
    return picked[order]


def _slot_positions(anchor_pos: Tensor, num_slots: int) -> Tensor:
    """Absolute position a + k of every slot: [N, K + 1] long."""
    slots = torch.arange(num_slots + 1, device=anchor_pos.device)
    return anchor_pos.long()[:, None] + slots


def base_factors(*, anchor_pos: Tensor, loss_mask: Tensor, num_slots: int) -> Tensor:
    """(a + k < T) * (k > 0) * m[a + k]: the base weight without its envelope, [N, K + 1] float32."""
    seq_len = loss_mask.shape[0]
    positions = _slot_positions(anchor_pos, num_slots)  # [N, K + 1]
    in_seq = positions < seq_len
    on_mask = loss_mask.bool()[positions.clamp(max=seq_len - 1)] & in_seq
    on_mask[:, 0] = False
    return on_mask.float()


def base_weights(*, anchor_pos: Tensor, loss_mask: Tensor, num_slots: int, gamma: float) -> Tensor:
    """Base weight (a + k < T) * (k > 0) * m[a + k] * w_k of every slot: [N, K + 1] float32."""
    factors = base_factors(anchor_pos=anchor_pos, loss_mask=loss_mask, num_slots=num_slots)
    return factors * slot_envelope(num_slots=num_slots, gamma=gamma).to(factors.device)


def _exclusive_slot_product(factors: Tensor) -> Tensor:
    """Factors c_1..c_K [N, K] -> gates [N, K + 1] with g_0 = g_1 = 1 and g_k = prod_{j<k} c_j."""
    ones = factors.new_ones(factors.shape[0], 2)
    return torch.cat([ones, factors[:, :-1].cumprod(dim=1)], dim=1)


def soft_gate(*, anchor_pos: Tensor, corpus_next_prob: Tensor, num_slots: int) -> Tensor:
    """Soft survival gate along the corpus, g_k = prod_{1<=j<k} p_T(x[a+j] | x[<a+j]): [N, K + 1].

    p_T(x[a+j] | x[<a+j]) is corpus_next_prob[a + j - 1]; a position a + j past the end gives 1.
    """
    seq_len = corpus_next_prob.shape[0]
    positions = _slot_positions(anchor_pos, num_slots)[:, 1:]  # [N, K]: a + j for j = 1..K
    next_prob = corpus_next_prob.float()[(positions - 1).clamp(max=seq_len - 1)]
    factors = torch.where(positions < seq_len, next_prob, 1.0)  # [N, K]
    return _exclusive_slot_product(factors)


def hard_gate(*, anchor_pos: Tensor, input_ids: Tensor, corpus_argmax: Tensor, num_slots: int) -> Tensor:
    """Hard gate, gate_k = prod_{j<k} 1[x[a+j] == target argmax at a+j-1]: [N, K + 1] float32.

    A position a + j past the end gives 1.
    """
    seq_len = input_ids.shape[0]
    positions = _slot_positions(anchor_pos, num_slots)[:, 1:]  # [N, K]: a + j for j = 1..K
    tokens = input_ids.long()[positions.clamp(max=seq_len - 1)]
    predicted = corpus_argmax.long()[(positions - 1).clamp(max=seq_len - 1)]
    factors = torch.where(positions < seq_len, (tokens == predicted).float(), 1.0)  # [N, K]
    return _exclusive_slot_product(factors)


def alive_mask(*, rollout_tokens: Tensor, stop_token_ids: Tensor) -> Tensor:
    """Slot k is alive unless one of y*[1..k-1] is a stop token: [N, K + 1] float32.

    The slot whose label predicts the stop token is still trained; the slots after it are not.
    """
    is_stop = torch.isin(rollout_tokens[:, 1:], stop_token_ids.to(rollout_tokens.device))  # [N, K]
    stops_so_far = is_stop.long().cumsum(dim=1)  # [N, K]: stops among y*[1..i+1] at column i
    ones = torch.ones(rollout_tokens.shape[0], 2, device=rollout_tokens.device)
    return torch.cat([ones, (stops_so_far[:, :-1] == 0).float()], dim=1)


def depth_mask(*, num_slots: int, rollout_depth: int) -> Tensor:
    """1[k <= R + 1]: R rollout steps label slots 1..R+1. [K + 1] float32."""
    slots = torch.arange(num_slots + 1)
    return (slots <= rollout_depth + 1).float()


def rollout_gate(*, rollout_topk_probs: Tensor, num_slots: int) -> Tensor:
    """Soft gate along the rollout, c_j = pi[a, j](y*[j]): [N, K + 1] float32.

    y*[j] is pi[a, j]'s argmax, so its probability is the top-1 column.
    """
    assert rollout_topk_probs.shape[1] == num_slots, rollout_topk_probs.shape
    factors = rollout_topk_probs[:, :, 0].float()  # [N, K]
    return _exclusive_slot_product(factors)


@dataclass(kw_only=True)
class IraSplit:
    """Which of the m drawn blocks are IRA primaries, and where each secondary sits."""

    primaries: Tensor  # [ceil(m/2)] long, indices into the drawn anchors, ascending
    secondaries: Tensor  # [floor(m/2)] long, the other indices, ascending
    parents: Tensor  # [floor(m/2)] long, drawn index of each secondary's primary (all distinct)
    offsets: Tensor  # [floor(m/2)] long, j ~ U{2..K-1}: the secondary is anchored on y*[j]


def ira_split(*, num_blocks: int, num_slots: int, generator: torch.Generator) -> IraSplit:
    """Split m blocks into ceil(m/2) primaries and floor(m/2) secondaries with parents and offsets.

    Consumes the generator in a fixed order: block permutation, parent permutation, offsets.
    """
    if num_slots < 3:
        raise ValueError(f"num_slots must be >= 3 for IRA offsets j ~ U{{2..K-1}}, got {num_slots}")
    num_primaries = (num_blocks + 1) // 2
    num_secondaries = num_blocks - num_primaries
    device = generator.device
    perm = torch.randperm(num_blocks, generator=generator, device=device)
    primaries = perm[:num_primaries].sort().values
    secondaries = perm[num_primaries:].sort().values
    parent_perm = torch.randperm(num_primaries, generator=generator, device=device)
    parents = primaries[parent_perm[:num_secondaries]]
    offsets = torch.randint(2, num_slots, (num_secondaries,), generator=generator, device=device)
    return IraSplit(primaries=primaries, secondaries=secondaries, parents=parents, offsets=offsets)


def draw_ira_from_parents(
    candidates: Tensor, parent_rows: Tensor, *, num_anchors: int | None, num_slots: int, generator: torch.Generator
) -> tuple[Tensor, IraSplit]:
    """IRA on a cache that keeps rollout features for only some pool anchors (`parent_rows`, pool
    indices; docs/design.md, "The cache contract"): (drawn pool indices [m] in position order, the
    split). Secondaries replace their drawn block wholesale, so IRA's m blocks are its floor(m/2)
    parents, ceil(m/2) - floor(m/2) further primaries and floor(m/2) secondaries placed off the
    parents: the parents are drawn from `parent_rows`, the other m - floor(m/2) anchors from the
    rest of the pool, as many blocks and secondaries as `ira_split` gives. ValueError when the
    pool keeps fewer parents than floor(m/2) (the trainer refuses such a cache up front).

    Consumes the generator in a fixed order: parents, other anchors, secondaries, pairing, offsets.
    """
    num_pool = candidates.shape[0]
    m = num_pool if num_anchors is None else min(num_anchors, num_pool)
    num_secondaries = m // 2
    if parent_rows.shape[0] < num_secondaries:
        raise ValueError(
            f"IRA draws {num_secondaries} parents among {m} anchors but this sequence keeps rollout features "
            f"for {parent_rows.shape[0]} anchors"
        )
    device = generator.device
    parents = parent_rows.long()[torch.randperm(parent_rows.shape[0], generator=generator, device=device)[:num_secondaries]]
    rest = torch.ones(num_pool, dtype=torch.bool)
    rest[parents] = False
    others = torch.nonzero(rest).flatten()
    others = others[torch.randperm(others.shape[0], generator=generator, device=device)[: m - num_secondaries]]
    picked = torch.cat([parents, others])
    order = torch.argsort(candidates[picked], stable=True)
    drawn = picked[order]  # [m] pool indices in position order
    is_parent = torch.zeros(num_pool, dtype=torch.bool)
    is_parent[parents] = True
    parent_blocks = torch.nonzero(is_parent[drawn]).flatten()  # [floor(m/2)] drawn indices, ascending
    other_blocks = torch.nonzero(~is_parent[drawn]).flatten()
    chosen = torch.randperm(other_blocks.shape[0], generator=generator, device=device)[:num_secondaries]
    secondaries = other_blocks[chosen].sort().values
    is_secondary = torch.zeros(m, dtype=torch.bool)
    is_secondary[secondaries] = True
    pairing = torch.randperm(num_secondaries, generator=generator, device=device)
    offsets = torch.randint(2, num_slots, (num_secondaries,), generator=generator, device=device)
    split = IraSplit(
        primaries=torch.nonzero(~is_secondary).flatten(), secondaries=secondaries, parents=parent_blocks[pairing],
        offsets=offsets,
    )  # fmt: skip
    return drawn, split


def _shifted_slot_index(offsets: Tensor, num_columns: int) -> tuple[Tensor, Tensor]:
    """Column i + j of the parent for column i of the secondary, clamped, and whether it exists."""
    index = offsets.long()[:, None] + torch.arange(num_columns, device=offsets.device)
    valid = index < num_columns
    return index.clamp(max=num_columns - 1), valid


def secondary_weights(
    *, parent_base_factors: Tensor, offsets: Tensor, envelope: Tensor, num_slots: int
) -> Tensor:
    """Secondary slot k weight w_k * 1[j + k <= K] * (parent's factors at slot j + k): [n_sec, K + 1].

    `parent_base_factors` [n_sec, K + 1] is the parent's in-sequence * loss mask * alive * depth
    product WITHOUT the envelope: the secondary carries its own envelope w_k.
    """
    assert parent_base_factors.shape[1] == num_slots + 1, parent_base_factors.shape
    index, valid = _shifted_slot_index(offsets, num_slots + 1)  # [n_sec, K + 1]
    shifted = parent_base_factors.gather(1, index) * valid
    return shifted * envelope.to(shifted.device)


def secondary_labels(
    *, parent_topk_ids: Tensor, parent_topk_probs: Tensor, offsets: Tensor, num_slots: int
) -> tuple[Tensor, Tensor]:
    """Secondary slot k takes the parent's pi[a, j + k]; zero ids and probs where j + k > K.

    parent_topk_ids/probs: [n_sec, K, k] (the parent's rollout labels, slot k at index k - 1).
    """
    assert parent_topk_ids.shape[1] == num_slots, parent_topk_ids.shape
    index, valid = _shifted_slot_index(offsets, num_slots)  # [n_sec, K]
    top_k = parent_topk_ids.shape[2]
    index = index[:, :, None].expand(-1, -1, top_k)  # [n_sec, K, k]
    valid = valid[:, :, None]
    label_ids = torch.where(valid, parent_topk_ids.gather(1, index), 0)
    label_probs = torch.where(valid, parent_topk_probs.gather(1, index), 0.0)
    return label_ids, label_probs


def slot_control_caps(*, split: IraSplit, num_blocks: int, num_slots: int) -> Tensor:
    """Slot caps of the slot-matched control: K - j at the IRA secondary positions, K elsewhere. [m]."""
    caps = torch.full((num_blocks,), num_slots, dtype=torch.long, device=split.offsets.device)
    caps[split.secondaries] = num_slots - split.offsets
    return caps


def cap_mask(caps: Tensor, num_slots: int) -> Tensor:
    """1[k <= cap] per block: [m, K + 1] float32."""
    slots = torch.arange(num_slots + 1, device=caps.device)
    return (slots[None, :] <= caps[:, None]).float()


def slot_accuracy(draft_logits: Tensor, label_ids: Tensor) -> Tensor:
    """Whether the draft argmax equals the label argmax (label_ids[..., 0], labels sort descending)."""
    return draft_logits.argmax(dim=-1) == label_ids[..., 0]
