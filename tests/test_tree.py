"""Tree verification: the tree, its mask and path acceptance by hand; lossless at T = 0 against
greedy generate(); an oracle drafter accepts every slot; a drafter's tree tau >= its chain tau."""

from __future__ import annotations

import pytest
import torch

from pipeline.eval.speculative import cached_draft_logits_fn
from pipeline.eval.tree import TokenTree, accepted_path, build_tree, tree_attention_mask, tree_speculative_decode
from tests.test_speculative import PROMPTS, drafter, hf_greedy, spec, target  # noqa: F401, F811 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_build_tree_holds_the_chain_then_the_most_likely_paths():
    # 3 slots over a 5-token vocabulary; slot 1 prefers 0 then 1, slot 2 prefers 2 then 3, slot 3 4.
    logits = torch.full((3, 5), -10.0)
    logits[0, 0], logits[0, 1] = 2.0, 1.9
    logits[1, 2], logits[1, 3] = 3.0, 0.0
    logits[2, 4] = 3.0
    tree = build_tree(logits, budget=5, branch=2)
    assert tree.tokens[:3].tolist() == [0, 2, 4] and tree.parents[:3].tolist() == [-1, 0, 1]  # the chain
    # Next best: token 1 at slot 1 (log p ~ -0.74), then its top child 2 (path ~ -0.79).
    assert tree.tokens[3:].tolist() == [1, 2] and tree.parents[3:].tolist() == [-1, 3]
    assert tree.depths.tolist() == [1, 2, 3, 1, 2]
    assert len(build_tree(logits, budget=2, branch=2).tokens) == 2


def test_tree_mask_and_path_acceptance():
    tree = TokenTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, 0, -1, 2]), depths=torch.tensor([1, 2, 1, 2]))
    mask = tree_attention_mask(tree, num_past=3)[0, 0]  # [5, 3 + 5]
    assert mask[:, :3].all()  # the committed prefix
    assert mask[:, 3].all()  # the anchor
    assert mask[2, 3:].tolist() == [True, True, True, False, False]  # node 1 (6): anchor, node 0, itself
    assert mask[4, 3:].tolist() == [True, False, False, True, True]  # node 3 (8): anchor, node 2, itself
    # posterior index 0 = after the anchor; node i at index i + 1.
    assert accepted_path(tree, torch.tensor([7, 0, 0, 8, 0])) == [2, 3]
    assert accepted_path(tree, torch.tensor([5, 9, 0, 0, 0])) == [0]
    assert accepted_path(tree, torch.tensor([9, 0, 0, 0, 0])) == []


def _tree_decode(target, drafter, prompt, *, max_new_tokens, stops=(), budget=24, branch=4, draft_logits_fn=None):
    if draft_logits_fn is None:
        draft_logits_fn = cached_draft_logits_fn(
            drafter, embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings(),
            mask_token_id=drafter.config.mask_token_id,
        )  # fmt: skip
    return tree_speculative_decode(
        target, draft_logits_fn=draft_logits_fn, layer_ids=list(drafter.config.target_layer_ids),
        num_draft=drafter.config.block_size - 1, prompt_ids=prompt, max_new_tokens=max_new_tokens,
        stop_token_ids=list(stops), budget=budget, branch=branch,
    )  # fmt: skip


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tree_decoding_is_lossless_against_greedy_generate(target, drafter, prompt):
    eos = [int(target.generation_config.eos_token_id)] if target.generation_config.eos_token_id is not None else []
    expected = hf_greedy(target, prompt, max_new_tokens=40, eos=eos)
    result = _tree_decode(target, drafter, prompt, max_new_tokens=40, stops=eos)
    assert result.tokens == expected
    assert sum(n + 1 for n in result.accepted_lengths) == len(result.tokens) - 1


def test_oracle_logits_accept_every_slot(target, drafter):
    prompt, max_new = PROMPTS[0], 1 + 3 * drafter.config.block_size
    greedy = hf_greedy(target, prompt, max_new_tokens=max_new, eos=[])
    num_draft, vocab = drafter.config.block_size - 1, target.config.vocab_size

    def oracle_logits(*, context_features, anchor_token, anchor_pos):
        start = anchor_pos + 1 - len(prompt)
        logits = torch.zeros(num_draft, vocab)
        logits[torch.arange(num_draft), torch.tensor(greedy[start : start + num_draft])] = 10.0
        return logits

    result = _tree_decode(target, drafter, prompt, max_new_tokens=max_new, draft_logits_fn=oracle_logits)
    assert result.tokens == greedy
    assert result.accepted_lengths == [num_draft] * 3


def test_tree_tau_is_at_least_the_chain_tau_of_the_same_drafter(target, drafter):
    """The tree holds the chain, so it accepts at least as much; summed over prompts it must not lose."""
    chain_tokens = chain_rounds = tree_tokens = tree_rounds = 0
    for prompt in PROMPTS:
        chain = spec(target, drafter, prompt, max_new_tokens=48)
        tree = _tree_decode(target, drafter, prompt, max_new_tokens=48, budget=63, branch=8)
        assert tree.tokens == chain.tokens
        chain_tokens += sum(n + 1 for n in chain.accepted_lengths)
        chain_rounds += chain.rounds
        tree_tokens += sum(n + 1 for n in tree.accepted_lengths)
        tree_rounds += tree.rounds
    assert tree_tokens / tree_rounds >= chain_tokens / chain_rounds


def test_a_trained_drafter_accepts_more_with_the_tree(k7_cache, target, tmp_path):
    """A drafter trained with alr for a few epochs: tree tau > 1 and >= its chain tau, lossless."""
    from drafter.checkpoint import load_drafter
    from tests.conftest import train_alr_drafter

    run = tmp_path / "run"
    train_alr_drafter(k7_cache, run, epochs=12)
    trained = load_drafter(run / "drafter", dtype=torch.float32).eval()
    chain_taus, tree_taus = [], []
    for prompt in PROMPTS[:2]:
        chain = spec(target, trained, prompt, max_new_tokens=48)
        tree = _tree_decode(target, trained, prompt, max_new_tokens=48, budget=63, branch=8)
        assert tree.tokens == chain.tokens
        chain_taus.append(sum(n + 1 for n in chain.accepted_lengths) / chain.rounds)
        tree_taus.append(sum(n + 1 for n in tree.accepted_lengths) / tree.rounds)
    print(f"chain tau {chain_taus}, tree tau {tree_taus}")
    assert sum(tree_taus) >= sum(chain_taus) and max(tree_taus) > 1.0
