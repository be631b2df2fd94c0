"""Correctness contract of stage 1: batched rollouts against plain forwards and generate()."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pipeline.cache_build.rollouts import (
    TargetRunConfig,
    TargetSequence,
    anchor_pool,
    anchor_pool_size,
    reference_rollout,
    rollout_attention_mask,
    run_target_batch,
    topk_with_tail,
)
from pipeline.target import load_target

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def model(toy_target):
    return load_target(toy_target, dtype=torch.float32)


@pytest.fixture(scope="module")
def batch(model):
    """Three sequences of different lengths (padding!) with a loss mask over the tail."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size - 16
    sequences = []
    for row, length in enumerate([48, 31, 60]):
        loss_mask = np.zeros(length, np.uint8)
        loss_mask[8:] = 1
        sequences.append(TargetSequence(source_row=row, input_ids=rng.integers(0, vocab, length), loss_mask=loss_mask))
    config = TargetRunConfig(layer_ids=LAYERS, anchors_per_sequence=5, top_k=4, seed=3)
    return sequences, config, run_target_batch(model, sequences, config)


def _plain_forward(model, ids):
    with torch.inference_mode():
        out = model.model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)[None], output_hidden_states=True)
    return out


def test_rollout_tokens_equal_generate(model, batch):
    sequences, config, outputs = batch
    # Plain greedy decoding of exactly K tokens: no eos stop (rollouts run through stop tokens;
    # the trainer masks what follows), and no min_new_tokens, which would suppress eos logits.
    greedy = copy.deepcopy(model.generation_config)
    greedy.update(do_sample=False, max_new_tokens=config.num_slots, eos_token_id=[], pad_token_id=0)
    for seq, out in zip(sequences, outputs):
        for j, anchor in enumerate(out.anchor_pos.tolist()):
            prefix = torch.as_tensor(seq.input_ids[: anchor + 1], dtype=torch.long)[None]
            generated = model.generate(prefix, attention_mask=torch.ones_like(prefix), generation_config=greedy)
            assert generated[0, anchor + 1 :].tolist() == out.rollout_tokens[j, 1:].tolist()
            assert out.rollout_tokens[j, 0] == seq.input_ids[anchor]


def test_rollout_distributions_and_features_equal_plain_forward(model, batch):
    sequences, config, outputs = batch
    for seq, out in zip(sequences, outputs):
        for j, anchor in enumerate(out.anchor_pos.tolist()):
            ref = reference_rollout(model, seq.input_ids, anchor=anchor, config=config)
            assert torch.equal(ref["rollout_tokens"], out.rollout_tokens[j])
            assert torch.equal(ref["rollout_topk_ids"], out.rollout_topk_ids[j])
            torch.testing.assert_close(out.rollout_topk_probs[j], ref["rollout_topk_probs"], atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(out.rollout_tail[j], ref["rollout_tail"], atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(out.rollout_features[j], ref["rollout_features"], atol=1e-4, rtol=1e-4)


def test_corpus_features_and_distributions_equal_plain_forward(model, batch):
    sequences, config, outputs = batch
    for seq, out in zip(sequences, outputs):
        plain = _plain_forward(model, seq.input_ids)
        features = torch.cat([plain.hidden_states[i + 1] for i in LAYERS], dim=-1)[0]
        torch.testing.assert_close(out.features, features, atol=1e-4, rtol=1e-4)
        with torch.inference_mode():
            probs = torch.softmax(model.lm_head(plain.last_hidden_state[0]).float(), dim=-1)  # [T, V]
        top_probs, top_ids = probs.topk(config.top_k, dim=-1)
        assert torch.equal(out.corpus_topk_ids.long(), top_ids)
        torch.testing.assert_close(out.corpus_topk_probs, top_probs, atol=2e-6, rtol=1e-5)
        next_ids = torch.as_tensor(seq.input_ids[1:], dtype=torch.long)
        expected_next = probs[:-1].gather(-1, next_ids[:, None])[:, 0]
        torch.testing.assert_close(out.corpus_next_prob[:-1], expected_next, atol=2e-6, rtol=1e-5)
        assert out.corpus_next_prob[-1] == 0


def test_probabilities_sum_to_one(batch):
    _, _, outputs = batch
    for out in outputs:
        total = out.corpus_topk_probs.sum(-1) + out.corpus_tail
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)
        total = out.rollout_topk_probs.sum(-1) + out.rollout_tail
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)
        # Column 0 is the greedy token: y*[k] is the argmax of pi[a, k].
        assert torch.equal(out.rollout_topk_ids[:, :, 0], out.rollout_tokens[:, 1:])


def test_batch_composition_does_not_change_tokens(model, batch):
    """A sequence computed alone gives the same anchors and rollout tokens as inside a padded batch."""
    sequences, config, outputs = batch
    alone = run_target_batch(model, [sequences[1]], config)[0]
    assert torch.equal(alone.anchor_pos, outputs[1].anchor_pos)
    assert torch.equal(alone.rollout_tokens, outputs[1].rollout_tokens)
    torch.testing.assert_close(alone.rollout_topk_probs, outputs[1].rollout_topk_probs, atol=2e-6, rtol=1e-5)


def test_anchor_pool_is_seeded_per_row_and_eligible():
    loss_mask = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1], np.uint8)
    eligible = [2, 3, 6, 7, 8, 9, 10]  # m[a] = m[a+1] = 1
    assert anchor_pool(loss_mask, num_anchors=100, seed=0, source_row=0).tolist() == eligible
    pool = anchor_pool(loss_mask, num_anchors=4, seed=0, source_row=5)
    assert len(pool) == 4 and set(pool.tolist()) <= set(eligible) and list(pool) == sorted(pool)
    assert np.array_equal(pool, anchor_pool(loss_mask, num_anchors=4, seed=0, source_row=5))
    others = {tuple(anchor_pool(loss_mask, num_anchors=4, seed=s, source_row=5)) for s in range(10)}
    assert len(others) > 1
    for num_anchors in (0, 4, 7, 100):  # what a shard is sized by, before the pools are drawn
        assert anchor_pool_size(loss_mask, num_anchors=num_anchors) == len(
            anchor_pool(loss_mask, num_anchors=num_anchors, seed=3, source_row=1)
        )


def test_rollout_mask_layout():
    mask = rollout_attention_mask(
        anchor_pos=torch.tensor([[2, 4]]), anchor_valid=torch.tensor([[True, False]]), corpus_len=6, step=2
    )
    assert mask.shape == (1, 1, 2, 6 + 2 * 2)
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0, 1, 0, 1, 0],  # anchor 2: corpus <= 2, own branch at steps 1 and 2
            [1, 0, 0, 0, 0, 0, 0, 1, 0, 1],  # padding anchor: key 0 and itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


def test_topk_with_tail_breaks_ties_to_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    ids, probs, tail, argmax = topk_with_tail(logits, top_k=2)
    assert argmax.tolist() == [1] and ids[0, 0] == 1
    torch.testing.assert_close(probs.sum() + tail.sum(), torch.tensor(1.0))
