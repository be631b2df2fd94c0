"""DFlash2 drafters (docs/dflash2.md): the config contract, the convolution (identity at init, blocks
never mixed, its fast path against the formula), the selector's drafting walk, the loss terms on
hand-computed tensors, the chunked head loss against its plain-torch reference (values and
gradients), and the export as HF's AutoModel loads it."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F

from drafter.checkpoint import CONFIG_FILE, save_drafter
from drafter.dflash2 import MODELING_FILES, DFlash2Options
from drafter.dflash2_loss import (
    dflash2_head_loss,
    dpace_weights,
    reference_dflash2_head_loss,
    selector_training_candidates,
    topk_tail_kl,
    topk_tail_tv,
    topk_tail_tv_loss_and_grad,
)
from drafter.dflash2_model import (
    AUTO_MAP,
    DFlash2Config,
    DFlash2Drafter,
    default_selector_top_k,
    dflash2_draft,
    grouped_dynamic_conv,
    init_from_dflash,
    reference_draft,
    reference_grouped_dynamic_conv,
)
from drafter.family import SupervisedSlots
from drafter.masks import visibility_mask
from drafter.model import DFlashDrafter

NO_AUTOCAST = contextlib.nullcontext()


def _config(**overrides) -> DFlash2Config:
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=50, max_position_embeddings=256, num_target_layers=4, target_layer_ids=[0, 2],
        mask_token_id=49, block_size=4, selector_rank=8, selector_top_k=5,
    )  # fmt: skip
    return DFlash2Config(**{**base, **overrides})


def _randomized(model: DFlash2Drafter) -> DFlash2Drafter:
    """Every weight random, the convolutions far from the identity, so a wrong tap shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("base_kernel"):
                param.normal_(0.5, 0.3)
            elif name.endswith("kernel_projection.weight"):
                param.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model.eval()


def _inputs(config: DFlash2Config, *, num_context: int, anchors: list[int], seed: int = 0) -> dict:
    """One row: a context of num_context positions and one block per anchor, packed along Q."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks, block = len(anchors), config.block_size
    limits = torch.tensor([anchors])
    return dict(
        context_features=torch.randn(1, num_context, config.num_taps * config.hidden_size, generator=generator),
        context_positions=torch.arange(num_context)[None],
        block_embeds=torch.randn(1, num_blocks * block, config.hidden_size, generator=generator),
        block_positions=(limits[0, :, None] + torch.arange(block)).reshape(1, -1),
        attention_mask=visibility_mask(
            context_positions=torch.arange(num_context)[None], context_owner=torch.full((1, num_context), -1),
            context_valid=torch.ones(1, num_context, dtype=torch.bool), block_corpus_limit=limits,
            block_valid=torch.ones(1, num_blocks, dtype=torch.bool), block_size=block,
        ),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The config contract


def test_config_round_trips_through_the_release_contract():
    config = _config()
    hf = config.to_hf_dict()
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["model_type"] == "qwen3"
    assert hf["dflash_config"] == {
        "mask_token_id": 49, "target_layer_ids": [0, 2], "block_size": 4,
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5,
    }  # fmt: skip
    assert hf["block_size"] == 4 and hf["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    assert DFlash2Config.from_hf_dict(json.loads(json.dumps(hf))) == config


def test_a_release_style_config_loads_and_neutral_keys_are_accepted():
    # The shape a release writes: block_size only inside dflash_config, rope_parameters, is_causal false.
    release = {
        "model_type": "qwen3", "architectures": ["DFlash2DraftModel"], "hidden_size": 64, "vocab_size": 32,
        "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "num_target_layers": 4,
        "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"}, "is_causal": False,
        "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": 3,
                          "selector_rank": 8, "selector_top_k": 4, "target_layer_ids": [0, 2],
                          "sample_from_anchor": False, "causal": False, "input_embedding_scale": 1.0},
    }  # fmt: skip
    config = DFlash2Config.from_hf_dict(release)
    assert (config.block_size, config.selector_top_k, config.selector_rank, config.rope_theta) == (8, 4, 8, 1e7)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["dflash_config"].pop("selector_rank"), "missing \\['selector_rank'\\]"),
        (lambda d: d["dflash_config"].update(sample_from_anchor=True), "sample_from_anchor"),
        (lambda d: d["dflash_config"].update(output_multiplier=2.0), "output_multiplier"),
        (lambda d: d["dflash_config"].update(markov_rank=8), "unsupported keys: \\['markov_rank'\\]"),
        (lambda d: d.update(architectures=["DFlashDraftModel"]), "DFlash2DraftModel"),
        (lambda d: d["dflash_config"].update(conv_group_size=24), "conv_group_size 24 must divide hidden_size 64"),
    ],
)
def test_config_refuses_what_it_cannot_run(change, message):
    hf = _config().to_hf_dict()
    change(hf)
    with pytest.raises(ValueError, match=message):
        DFlash2Config.from_hf_dict(hf)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("conv_kernel_size", 5, "conv_kernel_size 5 must not exceed block_size 4"),
        ("conv_kernel_size", 0, "conv_kernel_size must be a positive int"),
        ("selector_top_k", 51, "selector_top_k 51 must not exceed vocab_size 50"),
        ("selector_rank", 0, "selector_rank must be a positive int"),
    ],
)
def test_config_validates_each_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(**{field: value})


def test_default_selector_top_k_fits_llama_cpps_lattice_row_and_the_vocabulary():
    assert default_selector_top_k(hidden_size=2560, vocab_size=151_936) == 16  # speculators' default
    assert default_selector_top_k(hidden_size=64, vocab_size=300) == 7  # 7 * 8 <= 64 < 8 * 9
    assert default_selector_top_k(hidden_size=4096, vocab_size=10) == 10


# ----------------------------------------------------------------------------------------------
# The convolution


def test_convolution_matches_the_formula_in_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 8, requires_grad=True)  # two rows of blocks of 4 (the last one partial)
    delta = torch.randn(2, 10, 3, 2, requires_grad=True)  # 3 taps, 2 groups of 4 channels
    base = torch.randn(3, 8, requires_grad=True)
    fast = grouped_dynamic_conv(x, delta, base, block_size=4)
    slow = reference_grouped_dynamic_conv(x, delta, base, block_size=4)
    torch.testing.assert_close(fast, slow)
    upstream = torch.randn_like(fast)
    for a, b in zip(torch.autograd.grad(fast, (x, delta, base), upstream), torch.autograd.grad(slow, (x, delta, base), upstream)):
        torch.testing.assert_close(a, b)


def test_convolution_is_causal_inside_a_block_and_never_crosses_into_the_next():
    torch.manual_seed(0)
    x, delta, base = torch.randn(1, 8, 4), torch.randn(1, 8, 2, 1), torch.randn(2, 4)
    before = grouped_dynamic_conv(x, delta, base, block_size=4)
    x[0, 3] += 1.0  # the last slot of block 0
    changed = (grouped_dynamic_conv(x, delta, base, block_size=4) - before).abs().sum(-1)[0] > 0
    assert changed.tolist() == [False, False, False, True, False, False, False, False]
    x[0, 5] += 1.0  # slot 1 of block 1 reaches slot 2 (2 taps), nothing before it
    changed = (grouped_dynamic_conv(x, delta, base, block_size=4) - before).abs().sum(-1)[0] > 0
    assert changed.tolist() == [False, False, False, True, False, True, True, False]


def test_identity_at_init_a_dflash_backbone_computes_the_same_hidden_states():
    torch.manual_seed(0)
    config = _config()
    backbone = DFlashDrafter(config).eval()  # a DFlash drafter of the same shape
    model = init_from_dflash(backbone, config).eval()
    inputs = _inputs(config, num_context=9, anchors=[3, 7])
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs), backbone(**inputs), rtol=0, atol=0)
        conv = model.layers[0].attention_conv
        assert torch.count_nonzero(conv.kernel_projection.weight) == 0 and conv.base_kernel[:, 0].eq(1).all()


def test_blocks_packed_in_one_row_never_see_each_other():
    torch.manual_seed(0)
    config = _config()
    model = _randomized(DFlash2Drafter(config))
    both = _inputs(config, num_context=12, anchors=[4, 9])
    alone = _inputs(config, num_context=12, anchors=[9])
    alone["block_embeds"] = both["block_embeds"][:, 4:]
    with torch.no_grad():
        torch.testing.assert_close(model(**both)[:, 4:], model(**alone), rtol=1e-5, atol=1e-6)


def test_decoding_with_the_context_cache_equals_the_training_forward():
    torch.manual_seed(0)
    config = _config()
    model = _randomized(DFlash2Drafter(config))
    inputs = _inputs(config, num_context=10, anchors=[10])  # the block right after its whole context
    with torch.no_grad():
        expected = model(**inputs)
        cache = model.extend_context_cache(None, context_features=inputs["context_features"][:, :6], context_positions=inputs["context_positions"][:, :6])
        cache = model.extend_context_cache(cache, context_features=inputs["context_features"][:, 6:], context_positions=inputs["context_positions"][:, 6:])
        decoded = model.forward_cached(cache=cache, block_embeds=inputs["block_embeds"], block_positions=inputs["block_positions"])
    torch.testing.assert_close(decoded, expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Drafting


def test_the_walk_follows_the_selector_not_each_slots_unary_argmax():
    # Vocabulary of 6, 2 candidates per slot. Unary logits prefer token 1 at slot 1 and token 3 at
    # slot 2; the selector makes 4 follow 1 instead. Everything is set by hand.
    config = _config(vocab_size=6, mask_token_id=5, selector_top_k=2, selector_rank=2)
    model = DFlash2Drafter(config)
    hidden = torch.zeros(1, 3, 64)
    hidden[0, 1, 0], hidden[0, 2, 1] = 1.0, 1.0
    head = torch.nn.Linear(64, 6, bias=False)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[1, 0], head.weight[2, 0] = 2.0, 1.0  # slot 1: token 1 (2.0) before token 2 (1.0)
        head.weight[3, 1], head.weight[4, 1] = 2.0, 1.0  # slot 2: token 3 (2.0) before token 4 (1.0)
        selector = model.candidate_selector
        selector.hidden_projection.weight.zero_()
        selector.hidden_projection.weight[0, 1] = 1.0  # slot 2's state opens rank 0
        selector.predecessor_codebook.zero_()
        selector.successor_codebook.zero_()
        selector.predecessor_codebook[1, 0] = 1.0  # after token 1 ...
        selector.successor_codebook[4, 0] = 3.0  # ... token 4 scores 1.0 + 3.0 > 2.0
    anchor = torch.tensor([0])
    assert dflash2_draft(model, hidden=hidden, anchor_tokens=anchor, lm_head=head).tolist() == [[1, 4]]
    assert reference_draft(model, hidden=hidden, anchor_tokens=anchor, lm_head=head).tolist() == [[1, 4]]


def test_the_lattice_walk_equals_the_slot_by_slot_reference():
    torch.manual_seed(0)
    model = _randomized(DFlash2Drafter(_config()))
    with torch.no_grad():
        model.candidate_selector.predecessor_codebook.normal_(0, 1.0)
        model.candidate_selector.successor_codebook.normal_(0, 1.0)
    head = torch.nn.Linear(64, 50, bias=False)
    hidden, anchors = torch.randn(8, 4, 64), torch.randint(0, 50, (8,))
    fast = dflash2_draft(model, hidden=hidden, anchor_tokens=anchors, lm_head=head)
    assert fast.shape == (8, 3)
    assert torch.equal(fast, reference_draft(model, hidden=hidden, anchor_tokens=anchors, lm_head=head))
    unary_argmax = head(hidden[:, 1:]).argmax(-1)
    assert not torch.equal(fast, unary_argmax)  # the selector changed some picks


def test_our_convolution_and_lattice_equal_vllms_cpu_paths():
    """vLLM's own DFlash2 math (its CPU fallbacks in qwen3_dflash2.py), on our tensors."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv, _score_edges

    torch.manual_seed(0)
    x, delta, base = torch.randn(2, 8, 64), torch.randn(2, 8, 2, 4), torch.randn(2, 64)
    theirs = _grouped_conv(x.reshape(16, 64), delta.reshape(16, 2, 4), base, 8, 4, 16, 2).view(2, 8, 64)
    torch.testing.assert_close(grouped_dynamic_conv(x, delta, base, block_size=8), theirs)
    model = _randomized(DFlash2Drafter(_config()))
    selector = model.candidate_selector
    hidden, anchors, candidates = torch.randn(3, 3, 64), torch.randint(0, 50, (3,)), torch.randint(0, 50, (3, 3, 5))
    unary = torch.randn(3, 3, 5)
    with torch.no_grad():
        lattice = _score_edges(selector.predecessor_codebook, selector.successor_codebook, candidates, unary,
                               selector.hidden_projection(hidden), anchors, 5)  # fmt: skip
        prev = torch.cat([anchors[:, None, None].expand(-1, 1, 5), candidates[:, :-1]], dim=1)  # [N, S, K]
        ours = unary[:, :, None, :] + selector.transition_scores(hidden[:, :, None].expand(-1, -1, 5, -1), prev, candidates[:, :, None].expand(-1, -1, 5, -1))
    torch.testing.assert_close(ours, lattice)


# ----------------------------------------------------------------------------------------------
# The loss terms, on tensors


def test_topk_tail_kl_is_exact_for_the_whole_vocabulary_and_a_lower_bound_from_a_top_k():
    torch.manual_seed(0)
    logits, p = torch.randn(5, 12), torch.softmax(torch.randn(5, 12), dim=-1)
    exact = F.kl_div(logits.log_softmax(-1), p, reduction="none").sum(-1)
    probs, ids = p.sort(dim=-1, descending=True)
    torch.testing.assert_close(topk_tail_kl(draft_logits=logits, label_ids=ids, label_probs=probs), exact)
    top3 = topk_tail_kl(draft_logits=logits, label_ids=ids[:, :3], label_probs=probs[:, :3])
    assert torch.all(top3 <= exact + 1e-6) and torch.any(top3 < exact - 1e-3)
    # Hand-computed: p = (0.5, 0.3, 0.2) known as top-1 + tail 0.5, q uniform: the coarse KL is
    # 0.5 log(0.5 / (1/3)) + 0.5 log(0.5 / (2/3)) = 0.5 log(9/8).
    hand = topk_tail_kl(draft_logits=torch.zeros(1, 3), label_ids=torch.tensor([[0]]), label_probs=torch.tensor([[0.5]]))
    torch.testing.assert_close(hand, torch.tensor([0.5 * torch.log(torch.tensor(9 / 8)).item()]))


def test_topk_tail_tv_fast_gradient_equals_autograd():
    torch.manual_seed(0)
    logits = torch.randn(6, 20) * 2
    p = torch.softmax(torch.randn(6, 20) * 2, dim=-1)
    probs, ids = p.sort(dim=-1, descending=True)
    weights = torch.rand(6)
    for k in (20, 4, 1):
        leaf = logits.clone().requires_grad_(True)
        expected = (weights * topk_tail_tv(draft_logits=leaf, dist_ids=ids[:, :k], dist_probs=probs[:, :k])).sum()
        (expected_grad,) = torch.autograd.grad(expected, leaf)
        loss, grad = topk_tail_tv_loss_and_grad(draft_logits=logits, dist_ids=ids[:, :k], dist_probs=probs[:, :k], weights=weights)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(grad, expected_grad)
    exact = 1.0 - torch.minimum(logits.softmax(-1), p).sum(-1)
    torch.testing.assert_close(topk_tail_tv(draft_logits=logits, dist_ids=ids, dist_probs=probs), exact)


def test_selector_training_candidates_inject_a_missing_target_as_the_weakest():
    candidates = torch.tensor([[7, 3, 9], [7, 3, 9]])
    training, index, contains = selector_training_candidates(candidates, torch.tensor([3, 5]))
    assert training.tolist() == [[7, 3, 9], [7, 3, 5]]
    assert index.tolist() == [1, 2] and contains.tolist() == [True, False]


def test_dpace_weights_by_hand():
    # One block: slot 0 (the anchor) untrained, slots 1-2 trained with losses 0 and log 2, alpha 0.5:
    # c = (1, 0.75); survival P = (1, 0.75); w_1 = 1 + 0.75, w_2 = 0.75.
    losses = torch.tensor([[9.0, 0.0, torch.log(torch.tensor(2.0)).item()]])
    weights = dpace_weights(losses, torch.tensor([[0.0, 1.0, 1.0]]), alpha=0.5)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.75, 0.75]]))


def test_options_refuse_bad_values_naming_the_flag():
    with pytest.raises(ValueError, match="--dflash2-weighting"):
        DFlash2Options(dflash2_weighting="linear")
    with pytest.raises(ValueError, match="--tv-alpha"):
        DFlash2Options(tv_alpha=-1.0)
    with pytest.raises(ValueError, match="--selector-rank must be >= 1"):
        DFlash2Options(selector_rank=0)


# ----------------------------------------------------------------------------------------------
# The chunked head loss against its reference


def _slots(hidden: torch.Tensor, *, vocab: int = 50, top_k: int = 6, seed: int = 0, block_size: int = 3) -> tuple[SupervisedSlots, torch.Tensor]:
    """(M supervised slots with hidden [M, H], in blocks of block_size, the head [V, H]): labels the
    top_k of a random distribution, the target's distribution two ids wider."""
    num_slots = hidden.shape[0]
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(num_slots, vocab, generator=generator) * 2, dim=-1)
    probs, ids = p.sort(dim=-1, descending=True)
    lm_head = torch.randn(vocab, hidden.shape[1], generator=generator) * 0.3
    return SupervisedSlots(
        hidden=hidden, label_ids=ids[:, :top_k], label_probs=probs[:, :top_k],
        dist_ids=ids[:, : top_k + 2], dist_probs=probs[:, : top_k + 2],
        weights=torch.rand(num_slots, generator=generator),
        prev_tokens=torch.randint(0, vocab, (num_slots,), generator=generator),
        block_index=torch.arange(num_slots) // block_size, label_column=torch.arange(num_slots) % block_size,
    ), lm_head  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [DFlash2Options(), DFlash2Options(tv_alpha=0.7), DFlash2Options(kl_alpha=0.0, tv_alpha=1.0, selector_alpha=0.3),
     DFlash2Options(tv_alpha=0.5, dflash2_weighting="dpace")],
    ids=["kl", "kl+tv", "tv", "dpace"],
)  # fmt: skip
def test_head_loss_equals_its_reference_in_values_and_gradients(options):
    torch.manual_seed(0)
    model = _randomized(DFlash2Drafter(_config()))
    hidden = torch.randn(23, 64, requires_grad=True)
    slots, lm_head = _slots(hidden)
    params = [hidden, *model.candidate_selector.parameters()]
    expected, expected_correct = reference_dflash2_head_loss(model, slots, lm_head=lm_head, options=options)
    expected_grads = torch.autograd.grad(expected, params)
    loss, correct = dflash2_head_loss(model, slots, lm_head=lm_head, loss_chunk=7, autocast=NO_AUTOCAST, options=options)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, params), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert torch.equal(correct, expected_correct)


def test_dpace_weights_follow_the_blocks_the_slots_sit_in():
    torch.manual_seed(0)
    model = _randomized(DFlash2Drafter(_config()))
    hidden = torch.randn(12, 64)
    options = DFlash2Options(dflash2_weighting="dpace")
    in_threes, lm_head = _slots(hidden, block_size=3)
    in_fours, _ = _slots(hidden, block_size=4)
    three, _ = dflash2_head_loss(model, in_threes, lm_head=lm_head, loss_chunk=5, autocast=NO_AUTOCAST, options=options)
    four, _ = dflash2_head_loss(model, in_fours, lm_head=lm_head, loss_chunk=5, autocast=NO_AUTOCAST, options=options)
    assert abs(three.item() - four.item()) > 1e-3  # a slot's weight sums its block's later slots


def test_the_selector_learns_the_targets_top_token_and_correct_counts_the_label():
    """For one-hot labels (the dflash method) the selector's label is the target's top token
    (dist_ids[:, 0], speculators' rule); "correct" counts picks equal to the method's label."""
    model = DFlash2Drafter(_config())
    hidden = torch.randn(23, 64)
    slots, lm_head = _slots(hidden)
    lm_head = lm_head * 20  # every slot's unary argmax by a wide margin: the selector (near zero at init) agrees
    top = (hidden @ lm_head.T).argmax(-1)
    slots.dist_ids[:, 0], slots.label_ids = top, top[:, None].clone()
    slots.label_probs = torch.ones(23, 1)
    _, correct = dflash2_head_loss(model, slots, lm_head=lm_head, loss_chunk=5, autocast=NO_AUTOCAST, options=DFlash2Options())
    assert correct.all()
    slots.label_ids = (hidden @ lm_head.T).argmin(-1)[:, None]  # a corpus token the drafter never ranks
    _, correct = dflash2_head_loss(model, slots, lm_head=lm_head, loss_chunk=5, autocast=NO_AUTOCAST, options=DFlash2Options())
    assert not correct.any()
    # The selector's term alone does not move with the one-hot label: its label is the target's top.
    selector_only = DFlash2Options(kl_alpha=0.0)
    a, _ = reference_dflash2_head_loss(model, slots, lm_head=lm_head, options=selector_only)
    slots.label_ids = top[:, None].clone()
    b, _ = reference_dflash2_head_loss(model, slots, lm_head=lm_head, options=selector_only)
    torch.testing.assert_close(a, b)


def test_head_loss_under_bf16_autocast_stays_close_to_fp32():
    torch.manual_seed(0)
    model = _randomized(DFlash2Drafter(_config()))
    slots, lm_head = _slots(torch.randn(23, 64))
    fp32, _ = dflash2_head_loss(model, slots, lm_head=lm_head, loss_chunk=7, autocast=NO_AUTOCAST, options=DFlash2Options())
    bf16, _ = dflash2_head_loss(model, slots, lm_head=lm_head, loss_chunk=7, autocast=torch.autocast("cpu", dtype=torch.bfloat16),
                                options=DFlash2Options())  # fmt: skip
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=0)


# ----------------------------------------------------------------------------------------------
# The export


def test_export_names_and_shapes_are_the_engines(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "drafter"
    save_drafter(DFlash2Drafter(_config()), out, dtype=torch.float32)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    hf = json.loads((out / CONFIG_FILE).read_text())
    # llama.cpp's create_tensor dims (reversed) and vLLM's parameters, names without a prefix.
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 2, 64)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * 4, 64)
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == (50, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, 64)
    assert not any(name.startswith(("model.", "embed_tokens", "lm_head")) for name in shapes)
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["auto_map"] == AUTO_MAP


@pytest.mark.parametrize("transformers_457", [False, True], ids=["transformers-5", "transformers-4.57"])
def test_automodel_loads_the_dflash2_export(tmp_path, transformers_457):
    from tests.test_export import TRANSFORMERS_457, _load_with_automodel

    if transformers_457 and not TRANSFORMERS_457.is_dir():
        pytest.skip(f"transformers 4.57 not installed at {TRANSFORMERS_457} (.ci/install puts it there)")
    torch.manual_seed(0)
    config = _config()
    model = _randomized(DFlash2Drafter(config))
    out = tmp_path / "drafter"
    save_drafter(model, out, dtype=torch.float32)
    for _, name in MODELING_FILES:
        imports = "".join(line for line in (out / name).read_text().splitlines() if line.startswith(("from ", "import ")))
        assert "drafter" not in imports, name
    inputs = _inputs(config, num_context=6, anchors=[6])
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = model(**inputs)
    info, hidden = _load_with_automodel(out, tmp_path / "inputs.pt", extra_path=TRANSFORMERS_457 if transformers_457 else None)
    assert info["class"] == "DFlash2DraftModel"
    assert info["missing"] == [] and info["unexpected"] == [] and set(info["keys"]) == set(model.state_dict())
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)
