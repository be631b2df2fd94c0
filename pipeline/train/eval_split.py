"""Exact greedy tau while a drafter trains, with no target (`alrira-train --eval-every N`; docs/design.md,
"A training step"). At T = 0 a round's outcome depends only on the target's greedy response and its
features, which the cache's evaluation split holds (storage/eval_split.py, `alrira-cache build
--eval-prompts`): the drafter drafts a block at every response token and the rounds are walked as
speculative decoding commits them (drafter/drafting.py, the functions `alrira-eval replay` uses),
so the figures equal `alrira-eval replay` of the same drafter on the same prompts. The drafter is
scored as its export will be: its weights rounded to the export's dtype (--save-dtype), computed in
float32 as replay computes, whatever precision it trains in.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from drafter.calibration import fit_sts, survival
from drafter.checkpoint import as_exported
from drafter.drafting import block_round_drafts, match_lengths, position_acceptance, replay_rounds, replay_walk
from storage.eval_split import EvalSplit, describe_split

CHUNK = 32  # blocks per drafter forward, as replay drafts them


def _prompt_drafts(drafter, split: EvalSplit, *, head: dict, device: torch.device, weights_dtype: torch.dtype):
    """(response, Drafts of a round at every committed response token) of each split prompt with a
    response of two tokens or more, drafted in float32 with the target's `head` (its embed_tokens /
    lm_head as the cache stores them) by `drafter` as its export at `weights_dtype` loads
    (drafter/checkpoint.py, `as_exported`)."""
    scored = as_exported(drafter, weights_dtype)
    embed_tokens, lm_head = head["embed_tokens.weight"], head["lm_head.weight"]  # [V, H] each
    embed = nn.Embedding.from_pretrained(embed_tokens.detach().to(device, torch.float32))
    logits_layer = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, device=device)
    logits_layer.weight.data.copy_(lm_head.detach().float())
    for tokens, prompt_length, features in split:
        response = tokens[prompt_length:]
        if len(response) < 2:
            continue
        yield response, block_round_drafts(
            scored, embed_tokens=embed, lm_head=logits_layer, mask_token_id=scored.config.mask_token_id,
            features=torch.from_numpy(features).to(device), sequence=tokens, anchors=list(range(prompt_length, len(tokens) - 1)),
            chunk=CHUNK,
        )  # fmt: skip  # a round's anchor is a committed response token


@torch.no_grad()
def evaluate_split(drafter, split: EvalSplit, *, head: dict, device: torch.device, weights_dtype: torch.dtype = torch.float32) -> dict:
    """tau of `drafter`, its weights as the export holds them (`weights_dtype`), on every prompt of
    the split, pooled over all rounds and as the mean per request, with the share of rounds accepting
    >= i drafts per position i; float32, as replay."""
    started = time.perf_counter()
    was_training = drafter.training
    drafter.eval()
    num_drafts = drafter.config.num_drafts
    accepted_all, per_request = [], []
    try:
        for response, drafts in _prompt_drafts(drafter, split, head=head, device=device, weights_dtype=weights_dtype):
            accepted = replay_rounds(match_lengths(drafts.tokens, response=response), num_tokens=len(response))
            accepted_all += accepted
            per_request.append((sum(accepted) + len(accepted)) / len(accepted))
    finally:
        drafter.train(was_training)
    rounds = len(accepted_all)
    return {
        "tau_pooled": (sum(accepted_all) + rounds) / rounds if rounds else None,
        "tau_mean_per_request": sum(per_request) / len(per_request) if per_request else None,
        "acceptance_per_position": position_acceptance(accepted_all, num_drafts=num_drafts),
        "rounds": rounds,
        "prompts": split.num_prompts,
        "weights_dtype": str(weights_dtype).removeprefix("torch."), "compute_dtype": "float32",  # what was scored: the export, as replay
        "split": split.identity,  # which split this point measured (storage/eval_split.py, split_identity)
        "seconds": time.perf_counter() - started,
    }


@torch.no_grad()
def calibrate_split(drafter, split: EvalSplit | None, *, head: dict, device: torch.device,
                    weights_dtype: torch.dtype = torch.float32) -> dict | None:  # fmt: skip
    """The confidence prediction of a run's drafter (as exported, `weights_dtype`) calibrated on its
    cache's split (drafter/calibration.py, Sequential Temperature Scaling): each round of the greedy
    walk whose whole block lies inside the response gives the head's logits and the exact prefix
    acceptance (slots 0..k all equal to the greedy tokens, verify-all, no target). None without a
    split or a round; else the temperatures and the survival's ECE per slot before and after, with
    their means."""
    if split is None:
        return None
    num_drafts = drafter.config.num_drafts
    was_training = drafter.training
    drafter.eval()
    logits, accepted = [], []
    try:
        for response, drafts in _prompt_drafts(drafter, split, head=head, device=device, weights_dtype=weights_dtype):
            matches = match_lengths(drafts.tokens, response=response)
            for j, _ in replay_walk(matches, num_tokens=len(response)):
                if len(response) - 1 - j >= num_drafts:  # every slot's draft has a response token to match
                    logits.append(drafts.confidence_logits[j].double().cpu())
                    accepted.append(matches[j])
    finally:
        drafter.train(was_training)
    if not logits:
        return None
    logits = torch.stack(logits)  # [R, D]
    prefix_accepted = (torch.arange(num_drafts)[None] < torch.tensor(accepted)[:, None]).double()  # [R, D]
    fit = fit_sts(logits, prefix_accepted)
    before = survival(logits)
    return fit | {
        "ece_before_mean": sum(fit["ece_before"]) / num_drafts, "ece_after_mean": sum(fit["ece_after"]) / num_drafts,
        "mean_predicted_survival": before.mean(dim=0).tolist(), "observed_survival": prefix_accepted.mean(dim=0).tolist(),
        "dataset": f"the cache's evaluation {describe_split(split.identity)}", "num_samples": len(accepted),
        "target": "greedy (T = 0) prefix acceptance",
    }  # fmt: skip
