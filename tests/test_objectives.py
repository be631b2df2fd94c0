"""Objective functions on tiny hand-computed tensors."""

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.train.objectives import (
    IraSplit,
    alive_mask,
    base_weights,
    cap_mask,
    depth_mask,
    draw_anchors,
    eligible_anchor_positions,
    hard_gate,
    ira_split,
    rollout_gate,
    secondary_labels,
    secondary_weights,
    slot_accuracy,
    slot_control_caps,
    slot_envelope,
    soft_gate,
)
from drafter.losses import topk_tail_loss, topk_tail_loss_and_grad


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_slot_envelope():
    envelope = slot_envelope(num_slots=4, gamma=2.0)
    expected = torch.tensor([0.0, 1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])
    torch.testing.assert_close(envelope, expected)
    with pytest.raises(ValueError, match="gamma"):
        slot_envelope(num_slots=4, gamma=0.0)


def test_eligible_anchor_positions():
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.uint8)
    assert eligible_anchor_positions(loss_mask).tolist() == [1, 4, 5]
    assert eligible_anchor_positions(torch.ones(1, dtype=torch.uint8)).tolist() == []


def test_draw_anchors_all_and_subset():
    candidates = torch.tensor([3, 5, 8, 13, 21, 34, 55])
    generator = torch.Generator().manual_seed(0)
    assert draw_anchors(candidates, num_anchors=None, generator=generator).tolist() == list(range(7))
    assert draw_anchors(candidates, num_anchors=9, generator=generator).tolist() == list(range(7))
    draws = set()
    for seed in range(20):
        picked = draw_anchors(candidates, num_anchors=3, generator=seeded(seed))
        assert len(set(picked.tolist())) == 3
        assert torch.all(candidates[picked][1:] > candidates[picked][:-1])  # sorted by position
        again = draw_anchors(candidates, num_anchors=3, generator=seeded(seed))
        assert torch.equal(picked, again)
        draws.add(tuple(picked.tolist()))
    assert len(draws) > 5


def test_draw_anchors_sorts_unsorted_candidates():
    candidates = torch.tensor([30, 10, 20])
    picked = draw_anchors(candidates, num_anchors=None, generator=torch.Generator())
    assert candidates[picked].tolist() == [10, 20, 30]


def test_base_weights_at_sequence_end_and_masked_tokens():
    loss_mask = torch.tensor([0, 1, 1, 1, 0, 1], dtype=torch.uint8)  # T = 6
    weights = base_weights(anchor_pos=torch.tensor([1, 3]), loss_mask=loss_mask, num_slots=4, gamma=2.0)
    e = [math.exp(-i / 2) for i in range(4)]
    expected = torch.tensor(
        [
            [0.0, e[0], e[1], 0.0, e[3]],  # positions 2, 3, 4 (m = 0), 5
            [0.0, 0.0, e[1], 0.0, 0.0],  # positions 4 (m = 0), 5, then past the end
        ]
    )
    torch.testing.assert_close(weights, expected)


def test_soft_gate_products_and_past_end():
    corpus_next_prob = torch.tensor([0.9, 0.5, 0.25, 0.8, 0.4, 0.0])  # T = 6
    gate = soft_gate(anchor_pos=torch.tensor([1, 3]), corpus_next_prob=corpus_next_prob, num_slots=4)
    expected = torch.tensor(
        [
            # c_j = p[a + j - 1]: 0.5, 0.25, 0.8
            [1.0, 1.0, 0.5, 0.125, 0.1],
            # c_1 = p[3], c_2 = p[4], a + 3 = 6 is past the end -> 1
            [1.0, 1.0, 0.8, 0.32, 0.32],
        ]
    )
    torch.testing.assert_close(gate, expected)


def test_hard_gate():
    input_ids = torch.tensor([7, 1, 2, 3, 4, 5])
    corpus_argmax = torch.tensor([1, 2, 9, 4, 5, 0])  # predicts x[t+1] except at t = 2
    gate = hard_gate(
        anchor_pos=torch.tensor([0, 3]), input_ids=input_ids, corpus_argmax=corpus_argmax, num_slots=4
    )
    expected = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0, 0.0],  # agree_1, agree_2 hold, agree_3 (x[3] vs argmax[2]) fails
            [1.0, 1.0, 1.0, 1.0, 1.0],  # agree_1, agree_2 hold, then past the end
        ]
    )
    torch.testing.assert_close(gate, expected)


def test_alive_mask_stop_token():
    stop = torch.tensor([99, 98])
    rollout_tokens = torch.tensor(
        [
            [5, 1, 2, 99, 4, 6],  # stop at y*[3]: slots 1-3 alive
            [5, 98, 2, 3, 4, 6],  # stop at y*[1]: only slot 1
            [5, 1, 2, 3, 4, 99],  # stop at y*[K]: all alive
            [99, 1, 2, 3, 4, 6],  # the anchor token does not count
        ]
    )
    alive = alive_mask(rollout_tokens=rollout_tokens, stop_token_ids=stop)
    expected = torch.tensor(
        [
            [1.0, 1, 1, 1, 0, 0],
            [1.0, 1, 0, 0, 0, 0],
            [1.0, 1, 1, 1, 1, 1],
            [1.0, 1, 1, 1, 1, 1],
        ]
    )
    torch.testing.assert_close(alive, expected)


def test_depth_mask():
    depth = depth_mask(num_slots=15, rollout_depth=4)
    assert depth[1:].sum().item() == 5
    assert depth[1:6].tolist() == [1.0] * 5 and depth[6:].sum().item() == 0
    assert depth_mask(num_slots=15, rollout_depth=14)[1:].sum().item() == 15


def test_rollout_gate():
    probs = torch.tensor([[[0.5, 0.1], [0.5, 0.2], [0.25, 0.3], [0.9, 0.05]]])  # [1, K = 4, k = 2]
    gate = rollout_gate(rollout_topk_probs=probs, num_slots=4)
    torch.testing.assert_close(gate, torch.tensor([[1.0, 1.0, 0.5, 0.25, 0.0625]]))


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 5, 8, 13])
def test_ira_split_invariants(num_blocks):
    num_slots = 15
    for seed in range(40):
        split = ira_split(num_blocks=num_blocks, num_slots=num_slots, generator=seeded(seed))
        num_primaries = math.ceil(num_blocks / 2)
        assert split.primaries.numel() == num_primaries
        assert split.secondaries.numel() == num_blocks // 2
        everyone = torch.cat([split.primaries, split.secondaries]).sort().values
        assert everyone.tolist() == list(range(num_blocks))
        assert set(split.parents.tolist()) <= set(split.primaries.tolist())
        assert len(set(split.parents.tolist())) == split.parents.numel() == num_blocks // 2
        assert split.offsets.numel() == num_blocks // 2
        assert torch.all((split.offsets >= 2) & (split.offsets <= num_slots - 1))
        again = ira_split(num_blocks=num_blocks, num_slots=num_slots, generator=seeded(seed))
        for name in ("primaries", "secondaries", "parents", "offsets"):
            assert torch.equal(getattr(split, name), getattr(again, name))


def test_ira_split_covers_every_offset_and_varies():
    splits = [ira_split(num_blocks=64, num_slots=15, generator=seeded(s)) for s in range(5)]
    offsets = torch.cat([split.offsets for split in splits])
    assert sorted(set(offsets.tolist())) == list(range(2, 15))
    first = ira_split(num_blocks=10, num_slots=15, generator=seeded(0))
    second = ira_split(num_blocks=10, num_slots=15, generator=seeded(1))
    assert not (torch.equal(first.primaries, second.primaries) and torch.equal(first.offsets, second.offsets))
    with pytest.raises(ValueError, match="num_slots"):
        ira_split(num_blocks=4, num_slots=2, generator=torch.Generator())


def test_secondary_weights_supervised_count():
    num_slots = 15
    envelope = slot_envelope(num_slots=num_slots, gamma=2.0)
    offsets = torch.arange(2, num_slots)  # every j in U{2..K-1}
    parent = torch.ones(offsets.numel(), num_slots + 1)
    parent[:, 0] = 0.0
    weights = secondary_weights(
        parent_base_factors=parent, offsets=offsets, envelope=envelope, num_slots=num_slots
    )
    counts = (weights > 0).sum(dim=1)
    assert counts.tolist() == [num_slots - j for j in offsets.tolist()]
    assert counts.float().mean().item() == 7.0
    for row, j in enumerate(offsets.tolist()):
        torch.testing.assert_close(weights[row, : num_slots - j + 1], envelope[: num_slots - j + 1])


def test_secondary_weights_take_parent_factors_at_j_plus_k():
    num_slots = 6
    envelope = slot_envelope(num_slots=num_slots, gamma=2.0)
    parent = torch.tensor([[0.0, 1, 1, 1, 1, 0, 1]])  # parent slot 5 masked (e.g. m = 0 there)
    weights = secondary_weights(
        parent_base_factors=parent, offsets=torch.tensor([3]), envelope=envelope, num_slots=num_slots
    )
    # slot k looks at parent slot 3 + k: slot 1 -> 4 (1), slot 2 -> 5 (0), slot 3 -> 6 (1), 4.. -> past K
    expected = torch.tensor([[0.0, envelope[1], 0.0, envelope[3], 0.0, 0.0, 0.0]])
    torch.testing.assert_close(weights, expected)


def test_secondary_labels_shift_and_pad():
    num_slots = 5
    ids = torch.arange(num_slots * 2).reshape(1, num_slots, 2) + 100  # slot k -> [100+2(k-1), 101+2(k-1)]
    probs = torch.rand(1, num_slots, 2)
    label_ids, label_probs = secondary_labels(
        parent_topk_ids=ids, parent_topk_probs=probs, offsets=torch.tensor([3]), num_slots=num_slots
    )
    assert label_ids[0, 0].tolist() == ids[0, 3].tolist()  # slot 1 <- parent slot 4
    assert label_ids[0, 1].tolist() == ids[0, 4].tolist()  # slot 2 <- parent slot 5
    assert label_ids[0, 2:].abs().sum().item() == 0
    torch.testing.assert_close(label_probs[0, :2], probs[0, 3:5])
    assert label_probs[0, 2:].abs().sum().item() == 0


def test_slot_control_caps_and_mask():
    split = IraSplit(
        primaries=torch.tensor([0, 2, 3]),
        secondaries=torch.tensor([1, 4]),
        parents=torch.tensor([3, 0]),
        offsets=torch.tensor([2, 4]),
    )
    caps = slot_control_caps(split=split, num_blocks=5, num_slots=6)
    assert caps.tolist() == [6, 4, 6, 6, 2]
    mask = cap_mask(caps, 6)
    assert mask.shape == (5, 7)
    assert mask[:, 1:].sum(dim=1).tolist() == [6, 4, 6, 6, 2]
    assert mask[4].tolist() == [1.0, 1, 1, 0, 0, 0, 0]


def test_topk_tail_loss_hand_computed():
    q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])
    logits = torch.log(q).repeat(2, 1) + torch.tensor([[0.0], [3.0]])  # a shift changes nothing
    label_ids = torch.tensor([[1, 0], [2, 4]])
    label_probs = torch.tensor([[0.5, 0.3], [0.6, 0.4]])
    weights = torch.tensor([1.0, 0.5])
    loss_sum, weight_sum = topk_tail_loss(
        draft_logits=logits, label_ids=label_ids, label_probs=label_probs, weights=weights
    )
    first = -(0.5 * math.log(0.3) + 0.3 * math.log(0.4)) - 0.2 * math.log(1 - 0.7)
    second = -(0.6 * math.log(0.1) + 0.4 * math.log(0.1))  # no tail
    assert loss_sum.item() == pytest.approx(first + 0.5 * second, rel=1e-5)
    assert weight_sum.item() == pytest.approx(1.5)


def test_topk_tail_loss_clamps_covered_mass():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.1]]))
    label_ids = torch.tensor([[0, 1, 2, 3, 4]])  # covers all of q
    label_probs = torch.tensor([[0.5, 0.2, 0.1, 0.05, 0.05]])  # tail 0.1
    loss_sum, _ = topk_tail_loss(
        draft_logits=logits, label_ids=label_ids, label_probs=label_probs, weights=torch.ones(1)
    )
    cross = -sum(p * math.log(x) for p, x in zip([0.5, 0.2, 0.1, 0.05, 0.05], [0.4, 0.3, 0.1, 0.1, 0.1]))
    expected = cross - 0.1 * math.log(1e-6)
    assert loss_sum.item() == pytest.approx(expected, rel=1e-3)


def test_one_hot_labels_give_cross_entropy_and_its_gradient():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=generator, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=generator)
    others = torch.randint(0, 11, (6,), generator=generator)
    label_ids = torch.stack([targets, others, torch.zeros(6, dtype=torch.long)], dim=1)
    label_probs = torch.tensor([1.0, 0.0, 0.0]).repeat(6, 1)
    weights = torch.tensor([1.0, 2.0, 0.0, 0.5, 1.0, 3.0])
    loss_sum, weight_sum = topk_tail_loss(
        draft_logits=logits, label_ids=label_ids, label_probs=label_probs, weights=weights
    )
    reference = (F.cross_entropy(logits, targets, reduction="none") * weights).sum()
    torch.testing.assert_close(loss_sum, reference)
    assert weight_sum.item() == pytest.approx(7.5)
    (grad,) = torch.autograd.grad(loss_sum, logits)
    (reference_grad,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, reference_grad)


@pytest.mark.parametrize("case", ["tail", "one_hot_with_repeated_ids", "covered_past_the_clip"])
def test_topk_tail_loss_and_grad_equals_autograd_of_topk_tail_loss(case):
    """The training step's one-pass loss and logit gradient (no recompute in backward) are
    topk_tail_loss and its autograd gradient: with a tail, with one-hot labels whose unused ids
    repeat (their zero-probability ids still count in the covered mass), and past the clip."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 13, generator=generator, dtype=torch.float64).float() * 3
    if case == "tail":
        label_ids = torch.stack([torch.randperm(13, generator=generator)[:4] for _ in range(9)])
        label_probs = torch.rand(9, 4, generator=generator) * 0.24
    elif case == "one_hot_with_repeated_ids":
        label_ids = torch.cat([torch.randint(0, 13, (9, 1), generator=generator), torch.zeros(9, 2, dtype=torch.long)], dim=1)
        label_probs = torch.tensor([1.0, 0.0, 0.0]).repeat(9, 1)
    else:
        logits[:, 0] = 40.0  # id 0 holds all of q
        label_ids = torch.stack([torch.randperm(13, generator=generator)[:3] for _ in range(9)])
        label_ids[:, 0] = 0
        label_probs = torch.tensor([0.5, 0.2, 0.1]).repeat(9, 1)
    weights = torch.rand(9, generator=generator)
    weights[2] = 0.0
    kwargs = dict(label_ids=label_ids, label_probs=label_probs, weights=weights)
    leaf = logits.clone().requires_grad_(True)
    reference, _ = topk_tail_loss(draft_logits=leaf, **kwargs)
    (reference_grad,) = torch.autograd.grad(reference, leaf)
    loss_sum, grad, first_is_top = topk_tail_loss_and_grad(draft_logits=logits.clone(), **kwargs)
    assert torch.equal(first_is_top, logits.argmax(-1) == label_ids[:, 0])
    torch.testing.assert_close(loss_sum, reference.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-6)


def test_topk_tail_loss_and_grad_of_bf16_logits_is_the_float32_math():
    """bf16 logits (the lm_head GEMM under bf16): the loss and the float32 gradient are
    topk_tail_loss's and autograd's on the same logits (float32 math), and the logits are kept."""
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(7, 50, generator=generator) * 4).to(torch.bfloat16)
    label_ids = torch.stack([torch.randperm(50, generator=generator)[:3] for _ in range(7)])
    label_probs = torch.rand(7, 3, generator=generator) * 0.3
    kwargs = dict(label_ids=label_ids, label_probs=label_probs, weights=torch.rand(7, generator=generator) + 0.1)
    leaf = logits.float().requires_grad_(True)
    reference, _ = topk_tail_loss(draft_logits=leaf, **kwargs)
    (reference_grad,) = torch.autograd.grad(reference, leaf)
    kept = logits.clone()
    loss_sum, grad, first_is_top = topk_tail_loss_and_grad(draft_logits=logits, **kwargs)
    assert grad.dtype == torch.float32 and torch.equal(logits, kept)
    torch.testing.assert_close(loss_sum, reference.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(first_is_top, logits.float().argmax(-1) == label_ids[:, 0])


def test_topk_tail_loss_upcasts_bf16_logits():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 7, generator=generator).to(torch.bfloat16)
    label_ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 0]])
    label_probs = torch.tensor([[0.6, 0.2]]).repeat(4, 1)
    kwargs = dict(label_ids=label_ids, label_probs=label_probs, weights=torch.ones(4))
    low, _ = topk_tail_loss(draft_logits=logits, **kwargs)
    full, _ = topk_tail_loss(draft_logits=logits.float(), **kwargs)
    assert low.dtype == torch.float32
    assert torch.equal(low, full)


def test_slot_accuracy():
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.5]])
    label_ids = torch.tensor([[1, 0], [2, 0]])
    assert slot_accuracy(logits, label_ids).tolist() == [True, False]
