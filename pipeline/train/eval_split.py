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

import copy
import time

import torch
from torch import nn

from drafter.families import family_of
from drafter.calibration import fit_sts, survival
from drafter.drafting import block_round_drafts, match_lengths, position_acceptance, replay_rounds, replay_walk
from storage.eval_split import EvalSplit, describe_split

CHUNK = 32  # blocks per drafter forward, as replay drafts them


def as_exported(drafter, weights_dtype: torch.dtype):
    """The drafter as its export loads in replay: every weight rounded to `weights_dtype` and back to
    float32, but those its family exports in float32 (the training drafter itself when that changes nothing)."""
    if weights_dtype == torch.float32:
        return drafter
    exported, kept = copy.deepcopy(drafter), family_of(drafter).float32_tensors
    for name, tensor in exported.state_dict().items():
        if not (kept and name.startswith(kept)):
            tensor.copy_(tensor.to(weights_dtype).float())
    return exported


def _prompt_drafts(scored, split: EvalSplit, *, embed_tokens: torch.Tensor, lm_head: torch.Tensor, device: torch.device):
    """(response, Drafts of a round at every committed response token) of each split prompt with a
    response of two tokens or more, drafted by `scored` in float32 with the target's head."""
    embed = nn.Embedding.from_pretrained(embed_tokens.detach().to(device, torch.float32))
    head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, device=device)
    head.weight.data.copy_(lm_head.detach().float())
    for i in range(split.num_prompts):
        tokens, prompt_length, features = split.sequence(i)
        response = tokens[prompt_length:]
        if len(response) < 2:
            continue
        yield response, block_round_drafts(
            scored, embed_tokens=embed, lm_head=head, mask_token_id=scored.config.mask_token_id,
            features=torch.from_numpy(features).to(device), sequence=tokens, anchors=list(range(prompt_length, len(tokens) - 1)),
            chunk=CHUNK,
        )  # fmt: skip  # a round's anchor is a committed response token


@torch.no_grad()
def evaluate_split(drafter, split: EvalSplit, *, embed_tokens: torch.Tensor, lm_head: torch.Tensor, device: torch.device,
                   weights_dtype: torch.dtype = torch.float32) -> dict:  # fmt: skip
    """tau of `drafter`, its weights as the export holds them (`weights_dtype`), on every prompt of
    the split, pooled over all rounds and as the mean per request, with the share of rounds accepting
    >= i drafts per position i; float32, as replay."""
    started = time.perf_counter()
    was_training = drafter.training
    drafter.eval()
    num_drafts = drafter.config.num_drafts
    accepted_all, per_request = [], []
    try:
        for response, drafts in _prompt_drafts(as_exported(drafter, weights_dtype), split, embed_tokens=embed_tokens, lm_head=lm_head,
                                               device=device):  # fmt: skip
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
def calibrate_split(plan, drafter) -> dict | None:
    """The confidence prediction of a run's drafter (as exported) calibrated on its cache's split
    (drafter/calibration.py, Sequential Temperature Scaling): each round of the greedy walk whose
    whole block lies inside the response gives the head's logits and the exact prefix acceptance
    (slots 0..k all equal to the greedy tokens, verify-all, no target). None without a split or a
    round; else the temperatures and the survival's ECE per slot before and after, with their means."""
    split = plan.eval_split
    if split is None:
        return None
    num_drafts = drafter.config.num_drafts
    was_training = drafter.training
    drafter.eval()
    scored = as_exported(drafter, getattr(torch, plan.config.checkpoint.save_dtype))
    logits, accepted = [], []
    try:
        for response, drafts in _prompt_drafts(scored, split, embed_tokens=plan.head["embed_tokens.weight"],
                                               lm_head=plan.head["lm_head.weight"], device=plan.ranks.device):  # fmt: skip
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
