"""build_block_targets on a small hand-made cache record, checked against slot-by-slot loops."""

import math

import pytest
import torch

from pipeline.train.methods import METHODS, ROLLOUT_METHODS, required_arrays
from pipeline.train.labels import ObjectiveConfig, build_block_targets, compose_slot_weights

K = 15
TOP_K = 3
VOCAB = 50
MASK = VOCAB
STOP = 49
POOL = [8, 12, 18, 24, 30, 36]
STOP_ANCHOR, STOP_SLOT = 2, 5  # the rollout of anchor 18 emits the stop token as y*[5]


def _sorted_probs(generator, *shape):
    raw = torch.rand(*shape, TOP_K, generator=generator) + 0.05
    raw = raw / raw.sum(dim=-1, keepdim=True) * 0.9  # 0.1 tail mass
    return raw.sort(dim=-1, descending=True).values


def make_record(*, seq_len=40, loss_mask=None, pool=POOL, stop=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if loss_mask is None:
        loss_mask = torch.zeros(seq_len, dtype=torch.uint8)
        loss_mask[8:] = 1
        loss_mask[20:23] = 0  # a second user turn inside the sequence
    input_ids = (7 * torch.arange(seq_len) + 3) % STOP
    nxt = torch.cat([input_ids[1:], input_ids[:1]])
    argmax = torch.where(torch.arange(seq_len) % 3 == 0, (nxt + 1) % STOP, nxt)  # disagrees every 3rd
    corpus_topk_ids = torch.stack([argmax, (argmax + 5) % STOP, (argmax + 11) % STOP], dim=1)
    corpus_next_prob = torch.rand(seq_len, generator=generator) * 0.9 + 0.05
    corpus_next_prob[-1] = 0.0
    num_anchors = len(pool)
    anchor_pos = torch.tensor(pool, dtype=torch.int32)
    rollout_tokens = torch.randint(0, 48, (num_anchors, K + 1), generator=generator)  # no stop ids
    rollout_tokens[:, 0] = input_ids[anchor_pos.long()]
    if stop and num_anchors > STOP_ANCHOR:
        rollout_tokens[STOP_ANCHOR, STOP_SLOT] = STOP
    top1 = rollout_tokens[:, 1:]
    rollout_topk_ids = torch.stack([top1, (top1 + 5) % VOCAB, (top1 + 11) % VOCAB], dim=2)
    corpus_topk_probs = _sorted_probs(generator, seq_len)
    rollout_topk_probs = _sorted_probs(generator, num_anchors, K)
    return {
        "source_row": torch.tensor(3),
        "input_ids": input_ids.int(),
        "loss_mask": loss_mask,
        "features": torch.zeros(seq_len, 4, dtype=torch.uint16),
        "corpus_topk_ids": corpus_topk_ids.int(),
        "corpus_topk_probs": corpus_topk_probs,
        "corpus_tail": 1 - corpus_topk_probs.sum(-1),
        "corpus_next_prob": corpus_next_prob,
        "anchor_pos": anchor_pos,
        "rollout_tokens": rollout_tokens.int(),
        "rollout_topk_ids": rollout_topk_ids.int(),
        "rollout_topk_probs": rollout_topk_probs,
        "rollout_tail": 1 - rollout_topk_probs.sum(-1),
        "rollout_features": torch.zeros(num_anchors, K - 2, 4, dtype=torch.uint16),
    }


def config(method, **overrides):
    return ObjectiveConfig(method=method, mask_token_id=MASK, stop_token_ids=(STOP, 48), **overrides)


def build(record, method, seed=0, **overrides):
    generator = torch.Generator().manual_seed(seed)
    return build_block_targets(record, config=config(method, **overrides), generator=generator)


# Slot-by-slot references, written as loops straight from docs/design.md, "The method".


def ref_base_factor(record, a, k):
    seq_len = record["input_ids"].shape[0]
    return 0.0 if k == 0 or a + k >= seq_len else float(record["loss_mask"][a + k])


def ref_envelope(k, gamma):
    return math.exp(-(k - 1) / gamma)


def ref_soft_gate(record, a, k):
    seq_len = record["input_ids"].shape[0]
    next_prob = record["corpus_next_prob"]
    return math.prod(float(next_prob[a + j - 1]) if a + j < seq_len else 1.0 for j in range(1, k))


def ref_hard_gate(record, a, k):
    x, argmax = record["input_ids"], record["corpus_topk_ids"][:, 0]
    seq_len = x.shape[0]
    return math.prod(float(x[a + j] == argmax[a + j - 1]) if a + j < seq_len else 1.0 for j in range(1, k))


def ref_alive(record, pool_index, k):
    return float(all(int(record["rollout_tokens"][pool_index, i]) not in (STOP, 48) for i in range(1, k)))


def ref_rollout_gate(record, pool_index, k):
    return math.prod(float(record["rollout_topk_probs"][pool_index, j - 1, 0]) for j in range(1, k))


def ref_alr_factor(record, pool_index, k, depth=K - 1):
    a = int(record["anchor_pos"][pool_index])
    return ref_base_factor(record, a, k) * ref_alive(record, pool_index, k) * float(k <= depth + 1)


def ref_weights(record, method, *, depth=K - 1):
    rows = []
    for pool_index, a in enumerate(record["anchor_pos"].tolist()):
        row = []
        for k in range(1, K + 1):
            if method == "dflash":
                w = ref_base_factor(record, a, k) * ref_envelope(k, 2.0)  # a config bound to no cache: text
            elif method in ("kd", "erase", "erase_hard"):
                w = ref_base_factor(record, a, k) * ref_envelope(k, 2.0)
                if method == "erase":
                    w *= ref_soft_gate(record, a, k)
                elif method == "erase_hard":
                    w *= ref_hard_gate(record, a, k)
            else:
                w = ref_alr_factor(record, pool_index, k, depth) * ref_envelope(k, 2.0)
                if method == "alr_gate":
                    w *= ref_rollout_gate(record, pool_index, k)
            row.append(w)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize("method", METHODS)
def test_shapes_and_block_inputs(method):
    record = make_record()
    targets = build(record, method)
    width = 1 if method == "dflash" else TOP_K
    n = len(POOL)
    assert targets.block_tokens.shape == (n, K + 1) and targets.block_tokens.dtype == torch.long
    assert targets.label_ids.shape == (n, K, width) and targets.label_ids.dtype == torch.long
    assert targets.label_probs.shape == (n, K, width) and targets.label_probs.dtype == torch.float32
    assert targets.slot_weights.shape == (n, K) and targets.slot_weights.dtype == torch.float32
    for name in ("block_anchor_pos", "block_corpus_limit", "private_parent", "private_len", "is_secondary"):
        assert getattr(targets, name).shape == (n,)
    assert torch.all(targets.block_tokens[:, 1:] == MASK)
    primary = ~targets.is_secondary
    kept = [a for a, secondary in zip(POOL, targets.is_secondary) if not secondary]
    assert targets.block_anchor_pos[primary].tolist() == kept
    anchors = targets.block_anchor_pos[primary]
    assert torch.equal(targets.block_tokens[primary, 0], record["input_ids"].long()[anchors])
    assert torch.equal(targets.block_corpus_limit[primary], anchors)
    assert torch.all(targets.private_parent[primary] == -1) and torch.all(targets.private_len[primary] == 0)


@pytest.mark.parametrize("method", ["dflash", "kd", "erase", "erase_hard", "alr", "alr_gate"])
def test_weights_match_slot_loops(method):
    record = make_record()
    targets = build(record, method)
    torch.testing.assert_close(targets.slot_weights, ref_weights(record, method))


def test_gates_are_not_trivial_on_the_test_record():
    # guards the erase tests above: both gates must bite somewhere
    record = make_record()
    kd = build(record, "kd").slot_weights
    assert (build(record, "erase").slot_weights < kd - 1e-4).any()
    assert ((build(record, "erase_hard").slot_weights == 0) & (kd > 0)).any()


def test_dflash_labels_are_one_hot_corpus_tokens():
    record = make_record()
    targets = build(record, "dflash", dflash_gamma=7.0)
    x = record["input_ids"].long()
    assert targets.label_ids[0, 2, 0].item() == x[8 + 3]  # anchor 8, slot 3
    assert targets.label_probs[0, 2].tolist() == [1.0]
    torch.testing.assert_close(targets.slot_weights[0, 2], torch.tensor(math.exp(-2 / 7)))
    # anchor 36, slot 4 lands on position 40 = T: label 0, weight 0
    assert targets.label_ids[5, 3, 0].item() == 0 and targets.slot_weights[5, 3].item() == 0.0
    assert targets.label_ids[5, 2, 0].item() == x[39]


def test_kd_labels_come_from_position_a_plus_k_minus_1():
    record = make_record()
    targets = build(record, "kd")
    # slot 5 of anchor 12 takes the distribution at position 12 + 5 - 1
    assert torch.equal(targets.label_ids[1, 4], record["corpus_topk_ids"][16].long())
    assert torch.equal(targets.label_probs[1, 4], record["corpus_topk_probs"][16])
    assert torch.equal(targets.label_ids[3, 0], record["corpus_topk_ids"][24].long())  # slot 1 of anchor 24
    assert targets.label_probs[5, 3:].abs().sum().item() == 0  # anchor 36: slots 4.. past the end
    # slots 2-4 of anchor 18 sit on the second user turn (m = 0)
    assert targets.slot_weights[2, 1:4].tolist() == [0.0, 0.0, 0.0] and targets.slot_weights[2, 4] > 0


def test_alr_labels_and_stop_token():
    record = make_record()
    targets = build(record, "alr")
    assert torch.equal(targets.label_ids, record["rollout_topk_ids"].long())
    assert torch.equal(targets.label_probs, record["rollout_topk_probs"])
    stop_row = targets.slot_weights[STOP_ANCHOR]
    assert stop_row[STOP_SLOT - 1] > 0  # the slot that predicts the stop token is trained
    assert stop_row[STOP_SLOT:].abs().sum().item() == 0  # later slots are not
    kd_row = build(record, "kd").slot_weights[STOP_ANCHOR]
    assert kd_row[STOP_SLOT] > 0  # the corpus alone would have trained slot 6


def test_alr_rollout_depth():
    record = make_record(stop=False)
    targets = build(record, "alr", rollout_depth=4)
    torch.testing.assert_close(targets.slot_weights, ref_weights(record, "alr", depth=4))
    assert targets.slot_weights[:, 5:].abs().sum().item() == 0
    assert (targets.slot_weights[1, :5] > 0).all()  # anchor 12: 5 slots trained


def check_secondaries(record, targets, *, pool_anchor_pos):
    pool_anchor_pos = pool_anchor_pos.long()
    secondaries = targets.is_secondary.nonzero().flatten().tolist()
    parents = targets.private_parent[targets.is_secondary].tolist()
    assert len(set(parents)) == len(parents)  # each primary parents at most one secondary
    primary_anchors = set(targets.block_anchor_pos[~targets.is_secondary].tolist())
    for i in secondaries:
        p, j = int(targets.private_parent[i]), int(targets.private_len[i]) + 1
        a = int(pool_anchor_pos[p])
        assert a in primary_anchors
        assert 2 <= j <= K - 1
        assert targets.block_tokens[i, 0] == record["rollout_tokens"][p, j]
        assert targets.block_tokens[i, 1:].eq(MASK).all()
        assert targets.block_anchor_pos[i] == a + j
        assert targets.block_corpus_limit[i] == a + 1
        for k in range(1, K + 1):
            if j + k <= K:
                parent_ids = record["rollout_topk_ids"][p, j + k - 1].long()
                assert torch.equal(targets.label_ids[i, k - 1], parent_ids)
                assert torch.equal(targets.label_probs[i, k - 1], record["rollout_topk_probs"][p, j + k - 1])
                expected = ref_envelope(k, 2.0) * ref_alr_factor(record, p, j + k)
            else:
                assert targets.label_ids[i, k - 1].abs().sum() == 0
                expected = 0.0
            assert targets.slot_weights[i, k - 1].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    return secondaries


def test_alr_ira_primaries_and_secondaries():
    record = make_record()
    alr = build(record, "alr", seed=3)
    targets = build(record, "alr_ira", seed=3)
    assert targets.is_secondary.sum().item() == len(POOL) // 2
    primary = ~targets.is_secondary
    for name in ("label_ids", "label_probs", "slot_weights", "block_tokens", "block_anchor_pos"):
        assert torch.equal(getattr(targets, name)[primary], getattr(alr, name)[primary])
    check_secondaries(record, targets, pool_anchor_pos=record["anchor_pos"])


def test_alr_ira_secondary_supervises_k_minus_j_slots_when_unmasked():
    seq_len = 120
    pool = [10, 20, 30, 40, 50, 60, 70, 80]
    loss_mask = torch.ones(seq_len, dtype=torch.uint8)
    record = make_record(seq_len=seq_len, loss_mask=loss_mask, pool=pool, stop=False)
    seen_offsets = set()
    for seed in range(8):
        targets = build(record, "alr_ira", seed=seed)
        assert (targets.slot_weights[~targets.is_secondary] > 0).all()
        for i in check_secondaries(record, targets, pool_anchor_pos=record["anchor_pos"]):
            j = int(targets.private_len[i]) + 1
            seen_offsets.add(j)
            assert (targets.slot_weights[i] > 0).sum().item() == K - j
    assert len(seen_offsets) > 4


def test_alr_ira_with_a_subsampled_pool_points_at_pool_indices():
    record = make_record()
    for seed in range(6):
        targets = build(record, "alr_ira", seed=seed, anchors_per_step=4)
        assert targets.block_tokens.shape[0] == 4 and targets.is_secondary.sum().item() == 2
        check_secondaries(record, targets, pool_anchor_pos=record["anchor_pos"])


@pytest.mark.parametrize("method", ["alr_ira", "slot_control", "kd"])
def test_same_seed_same_targets(method):
    record = make_record()
    first = build(record, method, seed=11, anchors_per_step=4)
    second = build(record, method, seed=11, anchors_per_step=4)
    for name in first.__dataclass_fields__:
        assert torch.equal(getattr(first, name), getattr(second, name)), name


def test_different_seeds_give_different_splits():
    record = make_record()
    splits = {
        (tuple(t.is_secondary.tolist()), tuple(t.private_len.tolist()))
        for t in (build(record, "alr_ira", seed=s) for s in range(6))
    }
    assert len(splits) > 1


def test_slot_control_matches_ira_blocks_and_caps():
    record = make_record()
    for seed in range(5):
        alr = build(record, "alr", seed=seed)
        ira = build(record, "alr_ira", seed=seed)
        control = build(record, "slot_control", seed=seed)
        assert control.block_tokens.shape[0] == ira.block_tokens.shape[0]
        assert not control.is_secondary.any()
        assert control.block_anchor_pos.tolist() == POOL
        assert torch.equal(control.label_ids, alr.label_ids)
        slots = torch.arange(1, K + 1)
        for i in range(len(POOL)):
            cap = K - (int(ira.private_len[i]) + 1) if ira.is_secondary[i] else K
            torch.testing.assert_close(control.slot_weights[i], alr.slot_weights[i] * (slots <= cap))


def test_anchor_source_all():
    record = make_record()
    targets = build(record, "kd", anchor_source="all")
    mask = record["loss_mask"].bool()
    eligible = [a for a in range(39) if mask[a] and mask[a + 1]]
    assert targets.block_anchor_pos.tolist() == eligible
    for method in ROLLOUT_METHODS:
        with pytest.raises(ValueError, match="anchor_source"):
            config(method, anchor_source="all")


def test_anchors_per_step_draws_sorted_subset_of_pool():
    record = make_record()
    targets = build(record, "erase", anchors_per_step=3, seed=5)
    anchors = targets.block_anchor_pos.tolist()
    assert len(anchors) == 3 and anchors == sorted(anchors) and set(anchors) <= set(POOL)


@pytest.mark.parametrize("method", METHODS)
def test_empty_pool_gives_no_blocks(method):
    record = make_record(pool=[])
    targets = build(record, method)
    width = 1 if method == "dflash" else TOP_K
    assert targets.block_tokens.shape == (0, K + 1)
    assert targets.label_ids.shape == (0, K, width)
    assert targets.slot_weights.shape == (0, K)
    assert targets.is_secondary.shape == (0,)


def test_required_arrays():
    base = {"input_ids", "loss_mask", "features", "anchor_pos"}
    assert required_arrays("dflash") == base
    assert required_arrays("kd") == base | {"corpus_topk_ids", "corpus_topk_probs"}
    assert required_arrays("erase") == required_arrays("kd") | {"corpus_next_prob"}
    assert required_arrays("erase_hard") == required_arrays("kd")
    rollout = base | {"rollout_tokens", "rollout_topk_ids", "rollout_topk_probs"}
    for method in ("alr", "alr_gate", "slot_control"):
        assert required_arrays(method) == rollout
    assert required_arrays("alr_ira") == rollout | {"rollout_features"}
    # every method must be able to build its targets from its arrays alone
    record = make_record()
    for method in METHODS:
        build({name: record[name] for name in required_arrays(method)}, method)
    with pytest.raises(ValueError, match="method"):
        required_arrays("nope")


def test_config_validation():
    with pytest.raises(ValueError, match="method"):
        config("erase_soft")
    with pytest.raises(ValueError, match="rollout_depth"):
        config("alr_ira", rollout_depth=4)
    with pytest.raises(ValueError, match="rollout_depth"):
        config("alr", rollout_depth=15)
    with pytest.raises(ValueError, match="gamma"):
        config("kd", gamma=0.0)
    with pytest.raises(ValueError, match="dflash_gamma"):
        config("dflash", dflash_gamma=-1.0)
    with pytest.raises(ValueError, match="anchors_per_step"):
        config("kd", anchors_per_step=0)
    assert config("alr", rollout_depth=4).rollout_depth == 4
    # --dflash-gamma's default follows the cache's target kind (7 vision, 2 text); a value given stays.
    bind = dict(num_slots=K, mask_token_id=MASK, stop_token_ids=(STOP,))
    assert config("dflash").for_cache(**bind, vision=True).dflash_gamma == 7.0
    assert config("dflash").for_cache(**bind, vision=False).dflash_gamma == 2.0
    assert config("dflash", dflash_gamma=5.0).for_cache(**bind, vision=True).dflash_gamma == 5.0
    assert config("kd", num_slots=4).num_slots == 4  # corpus methods ignore rollout_depth


def test_num_slots_must_match_the_cache():
    with pytest.raises(ValueError, match="num_slots"):
        build(make_record(), "alr", num_slots=7, rollout_depth=6)


def test_compose_slot_weights_refuses_corpus_gate_on_rollout_labels():
    base = torch.tensor([[0.0, 1.0, 0.5]])
    gate = torch.tensor([[1.0, 1.0, 0.5]])
    with pytest.raises(ValueError, match="corpus gate"):
        compose_slot_weights(base=base, label_source="rollout", corpus_gate=gate)
    torch.testing.assert_close(
        compose_slot_weights(base=base, label_source="corpus", corpus_gate=gate),
        torch.tensor([[0.0, 1.0, 0.25]]),
    )
    alive = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(
        compose_slot_weights(base=base, label_source="rollout", alive=alive, rollout_gate=gate),
        torch.tensor([[0.0, 1.0, 0.0]]),
    )
