"""Speculative decoding is lossless: at T = 0 it reproduces HF greedy generate() token for token,
whatever the drafter proposes; acceptance bookkeeping is exact with an oracle drafter; at T > 0
the committed tokens follow the target's sampling distribution."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch

from drafter.config import DFlashConfig
from drafter.masks import visibility_mask
from drafter.model import DFlashDrafter, reference_forward
from pipeline.eval.speculative import (
    accept_length,
    autoregressive_decode,
    cached_draft_fn,
    commit_tokens,
    drafter_draft,
    speculative_decode,
)
from pipeline.target import load_target
from pipeline.demo.toy import make_toy_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 17, 42, 8, 99, 5], [120, 7, 7, 64, 30, 31, 2, 150, 11, 90, 4], [55]]


@pytest.fixture(scope="module")
def target(toy_target):
    return load_target(toy_target, dtype=torch.float32)


@pytest.fixture(scope="module")
def drafter(toy_target):
    target_config = json.loads((toy_target / "config.json").read_text())
    mask_token_id = len(make_toy_tokenizer())
    config = DFlashConfig.from_target_config(target_config, num_draft_layers=1, mask_token_id=mask_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DFlashDrafter(config)
    return model.eval()


def hf_greedy(target, prompt: list[int], *, max_new_tokens: int, eos: list[int]) -> list[int]:
    greedy = copy.deepcopy(target.generation_config)
    greedy.update(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
    return out[0, len(prompt) :].tolist()


def spec(target, drafter, prompt, *, max_new_tokens, stops=(), temperature=0.0, seed=0, draft_fn=None):
    return speculative_decode(
        target,
        drafter,
        embed_tokens=target.get_input_embeddings(),
        lm_head=target.get_output_embeddings(),
        prompt_ids=prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_token_ids=list(stops),
        generator=torch.Generator().manual_seed(seed),
        mask_token_id=drafter.config.mask_token_id,
        draft_fn=draft_fn,
    )


def oracle(greedy: list[int], *, num_prompt: int, num_draft: int, wrong_from: int | None = None):
    """Drafts the target's own greedy continuation (the token at position i is greedy[i - num_prompt]);
    slots from `wrong_from` on are deliberately wrong."""

    def draft_fn(*, context_features, anchor_token, anchor_pos):
        assert context_features.shape[0] == anchor_pos  # sees exactly the positions before the anchor
        start = anchor_pos + 1 - num_prompt
        tokens = greedy[start : start + num_draft]
        if wrong_from is not None:
            tokens = tokens[:wrong_from] + [(t + 1) % 200 for t in tokens[wrong_from:]]
        return torch.tensor(tokens)

    return draft_fn


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "draft, posterior, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3),
        ([1, 2, 3], [9, 2, 3, 4], 0),
        ([1, 2, 3], [1, 2, 9, 4], 2),
        ([1, 2, 3], [1, 9, 3, 4], 1),  # a later match after a mismatch does not count
        ([5], [5, 0], 1),
    ],
)
def test_accept_length(draft, posterior, expected):
    assert accept_length(torch.tensor(draft), torch.tensor(posterior)) == expected


def test_accept_length_rejects_bad_shapes():
    with pytest.raises(ValueError, match="K \\+ 1"):
        accept_length(torch.tensor([1, 2]), torch.tensor([1, 2]))


def test_commit_tokens_stops_and_truncates():
    assert commit_tokens([4, 5, 6], num_generated=0, max_new_tokens=10, stop_token_ids={5}) == ([4, 5], True)
    assert commit_tokens([4, 5, 6], num_generated=8, max_new_tokens=10, stop_token_ids=set()) == ([4, 5], True)
    assert commit_tokens([4, 5], num_generated=8, max_new_tokens=10, stop_token_ids=set()) == ([4, 5], True)
    assert commit_tokens([4, 5], num_generated=0, max_new_tokens=10, stop_token_ids=set()) == ([4, 5], False)


def test_drafter_draft_matches_reference_forward(target, drafter):
    """The draft step wires embeddings, positions and the 'strictly before the anchor' mask as in training."""
    cfg = drafter.config
    anchor_pos, anchor = 7, 42
    features = torch.randn(anchor_pos, cfg.num_taps * cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        draft = drafter_draft(
            drafter,
            embed_tokens=target.get_input_embeddings(),
            lm_head=target.get_output_embeddings(),
            mask_token_id=cfg.mask_token_id,
            context_features=features,
            anchor_token=anchor,
            anchor_pos=anchor_pos,
        )
        block_ids = torch.tensor([[anchor] + [cfg.mask_token_id] * (cfg.block_size - 1)])
        hidden = reference_forward(
            drafter,
            context_features=features[None],
            context_positions=torch.arange(anchor_pos)[None],
            block_embeds=target.get_input_embeddings()(block_ids),
            block_positions=torch.arange(anchor_pos, anchor_pos + cfg.block_size)[None],
            attention_mask=torch.ones((1, 1, cfg.block_size, anchor_pos + cfg.block_size), dtype=torch.bool),
        )
        expected = target.get_output_embeddings()(hidden[0, 1:]).argmax(-1)
    assert draft.tolist() == expected.tolist()
    # The one-block mask with corpus limit p is all-visible over positions < p.
    mask = visibility_mask(
        context_positions=torch.arange(anchor_pos)[None],
        context_owner=torch.full((1, anchor_pos), -1),
        context_valid=torch.ones((1, anchor_pos), dtype=torch.bool),
        block_corpus_limit=torch.tensor([[anchor_pos]]),
        block_valid=torch.ones((1, 1), dtype=torch.bool),
        block_size=cfg.block_size,
    )
    assert bool(mask.all())


def test_cached_drafts_equal_uncached_drafts_round_by_round(target, drafter):
    """The decoder's default draft step (context keys/values kept across rounds) proposes exactly
    what drafter_draft, which recomputes the whole context each round, proposes."""
    kwargs = dict(embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings(), mask_token_id=drafter.config.mask_token_id)
    calls = []

    def uncached(**call):
        draft = drafter_draft(drafter, **kwargs, **call)
        calls.append((call, draft))
        return draft

    for prompt in PROMPTS[:2]:
        calls.clear()
        reference = spec(target, drafter, prompt, max_new_tokens=48, draft_fn=uncached)
        result = spec(target, drafter, prompt, max_new_tokens=48)
        assert result.tokens == reference.tokens
        assert result.accepted_lengths == reference.accepted_lengths
        assert len(calls) >= 3
        cached = cached_draft_fn(drafter, **kwargs)
        with torch.inference_mode():
            for call, draft in calls:
                assert cached(**call).tolist() == draft.tolist(), call["anchor_pos"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_hf_generate(target, drafter, prompt):
    expected = hf_greedy(target, prompt, max_new_tokens=40, eos=[])
    ar = autoregressive_decode(
        target, prompt, max_new_tokens=40, temperature=0.0, stop_token_ids=[], generator=None
    )
    result = spec(target, drafter, prompt, max_new_tokens=40)
    assert ar.tokens == expected
    assert result.tokens == expected
    assert result.rounds == len(result.accepted_lengths) >= 1
    assert sum(n + 1 for n in result.accepted_lengths) == len(result.tokens) - 1


def test_greedy_stops_at_stop_token_like_hf(target, drafter):
    prompt = PROMPTS[1]
    free = hf_greedy(target, prompt, max_new_tokens=40, eos=[])
    stop = free[9]  # a token the greedy continuation does produce
    expected = hf_greedy(target, prompt, max_new_tokens=40, eos=[stop])
    assert expected == free[: free.index(stop) + 1]  # HF keeps the stop token and nothing after
    result = spec(target, drafter, prompt, max_new_tokens=40, stops=[stop])
    assert result.tokens == expected
    ar = autoregressive_decode(target, prompt, max_new_tokens=40, temperature=0.0, stop_token_ids=[stop], generator=None)
    assert ar.tokens == expected


def test_oracle_drafter_accepts_every_slot(target, drafter):
    """Drafting the target's own continuation: K accepted per round, tau = K + 1, and a last round
    cut by max_new_tokens counts only what it committed."""
    prompt = PROMPTS[0]
    num_draft = drafter.config.block_size - 1
    max_new = 1 + 2 * (num_draft + 1) + 5  # prefill token, two full rounds, a truncated third
    greedy = hf_greedy(target, prompt, max_new_tokens=max_new + num_draft + 1, eos=[])
    result = spec(target, drafter, prompt, max_new_tokens=max_new, draft_fn=oracle(greedy, num_prompt=len(prompt), num_draft=num_draft))
    assert result.tokens == greedy[:max_new]
    assert result.accepted_lengths == [num_draft, num_draft, 4]

    full = spec(target, drafter, prompt, max_new_tokens=1 + 2 * (num_draft + 1), draft_fn=oracle(greedy, num_prompt=len(prompt), num_draft=num_draft))
    tau = sum(n + 1 for n in full.accepted_lengths) / full.rounds
    assert tau == num_draft + 1


def test_partly_wrong_drafter_accepts_the_right_prefix(target, drafter):
    prompt = PROMPTS[2]
    num_draft = drafter.config.block_size - 1
    greedy = hf_greedy(target, prompt, max_new_tokens=60 + num_draft + 1, eos=[])
    draft_fn = oracle(greedy, num_prompt=len(prompt), num_draft=num_draft, wrong_from=3)
    result = spec(target, drafter, prompt, max_new_tokens=41, draft_fn=draft_fn)
    assert result.tokens == greedy[:41]
    # Each round commits 3 drafts + the target's correction: 40 decode tokens = 10 rounds of 4.
    assert result.accepted_lengths == [3] * 10


def exact_third_token_probs(target, prompt: list[int], *, temperature: float, mass: float = 0.999) -> torch.Tensor:
    """p(3rd generated token) under plain sampling at `temperature`, by enumerating the first two
    tokens over their top-`mass` support with full (uncached) forwards: [V], missing <= ~2 (1 - mass)."""

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            logits = target(input_ids=torch.tensor(prefixes)).logits[:, -1]
        return torch.softmax(logits.float() / temperature, dim=-1)  # [N, V]

    def support(probs: torch.Tensor) -> list[tuple[int, float]]:
        sorted_probs, ids = probs.sort(descending=True)
        keep = int((sorted_probs.cumsum(0) < mass).sum()) + 1
        return list(zip(ids[:keep].tolist(), sorted_probs[:keep].tolist()))

    first = support(next_probs([prompt])[0])
    second_probs = next_probs([prompt + [t0] for t0, _ in first])
    paths = [(t0, t1, p0 * p1) for (t0, p0), row in zip(first, second_probs) for t1, p1 in support(row)]
    third_probs = next_probs([prompt + [t0, t1] for t0, t1, _ in paths])  # [num_paths, V]
    weights = torch.tensor([w for _, _, w in paths])
    return (weights[:, None] * third_probs).sum(0)


def total_variation(samples: Counter, probs: torch.Tensor) -> float:
    num = sum(samples.values())
    empirical = torch.zeros_like(probs)
    for token, count in samples.items():
        empirical[token] = count / num
    return 0.5 * float((empirical - probs).abs().sum())


def test_sampling_matches_the_target_distribution(target, drafter):
    """At T > 0 the committed tokens are target samples: the third generated token, which follows a
    verify round whose draft is accepted part of the time, has the exact plain-sampling marginal."""
    prompt, temperature, num_samples = PROMPTS[0], 0.5, 300
    num_draft = drafter.config.block_size - 1
    greedy = hf_greedy(target, prompt, max_new_tokens=num_draft + 2, eos=[])
    draft_fn = oracle(greedy, num_prompt=len(prompt), num_draft=num_draft)
    spec_third, ar_third, accepted = Counter(), Counter(), 0
    for i in range(num_samples):
        result = spec(target, drafter, prompt, max_new_tokens=3, temperature=temperature, seed=1000 + i, draft_fn=draft_fn)
        assert len(result.tokens) == 3
        assert sum(n + 1 for n in result.accepted_lengths) == 2
        accepted += sum(result.accepted_lengths)
        spec_third[result.tokens[2]] += 1
        generator = torch.Generator().manual_seed(5000 + i)
        ar = autoregressive_decode(
            target, prompt, max_new_tokens=3, temperature=temperature, stop_token_ids=[], generator=generator
        )
        ar_third[ar.tokens[2]] += 1
    assert accepted > 0.2 * num_samples  # the accept path is exercised at T > 0
    exact = exact_third_token_probs(target, prompt, temperature=temperature)
    assert float(exact.sum()) > 0.99
    # Sampling noise of 300 draws over a ~10-token support is ~0.05 in total variation.
    assert total_variation(ar_third, exact) < 0.1
    assert total_variation(spec_third, exact) < 0.1
    # A sampler that ignores the temperature (or commits unverified drafts) is far off.
    assert total_variation(spec_third, exact_third_token_probs(target, prompt, temperature=1.0)) > 0.1


def test_sampling_long_run_respects_limits(target, drafter):
    result = spec(target, drafter, PROMPTS[1], max_new_tokens=37, temperature=1.0, seed=3)
    assert len(result.tokens) == 37
    assert all(0 <= t < target.config.vocab_size for t in result.tokens)
    assert sum(n + 1 for n in result.accepted_lengths) == 36


def test_bad_arguments(target, drafter):
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec(target, drafter, PROMPTS[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt_ids"):
        spec(target, drafter, [], max_new_tokens=4)
