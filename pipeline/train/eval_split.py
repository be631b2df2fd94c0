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

from drafter.drafting import block_drafts, match_lengths, position_acceptance, replay_rounds
from storage.eval_split import EvalSplit

CHUNK = 32  # blocks per drafter forward, as replay drafts them


def as_exported(drafter, weights_dtype: torch.dtype):
    """The drafter as its export loads in replay: every weight rounded to `weights_dtype` and back to
    float32 (the training drafter itself when that changes nothing)."""
    if weights_dtype == torch.float32:
        return drafter
    exported = copy.deepcopy(drafter)
    for tensor in exported.state_dict().values():
        tensor.copy_(tensor.to(weights_dtype).float())
    return exported


@torch.no_grad()
def evaluate_split(drafter, split: EvalSplit, *, embed_tokens: torch.Tensor, lm_head: torch.Tensor, device: torch.device,
                   weights_dtype: torch.dtype = torch.float32) -> dict:  # fmt: skip
    """tau of `drafter`, its weights as the export holds them (`weights_dtype`), on every prompt of
    the split, pooled over all rounds and as the mean per request, with the share of rounds accepting
    >= i drafts per position i; float32, as replay."""
    started = time.perf_counter()
    was_training = drafter.training
    drafter.eval()
    scored = as_exported(drafter, weights_dtype)
    embed = nn.Embedding.from_pretrained(embed_tokens.detach().to(device, torch.float32))
    head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False, device=device)
    head.weight.data.copy_(lm_head.detach().float())
    num_drafts = drafter.config.num_drafts
    accepted_all, per_request = [], []
    try:
        for i in range(split.num_prompts):
            tokens, prompt_length, features = split.sequence(i)
            response = tokens[prompt_length:]
            if len(response) < 2:
                continue
            anchors = list(range(prompt_length, len(tokens) - 1))  # a round's anchor is a committed response token
            drafts = block_drafts(
                scored, embed_tokens=embed, lm_head=head, mask_token_id=drafter.config.mask_token_id,
                features=torch.from_numpy(features).to(device), sequence=tokens, anchors=anchors, chunk=CHUNK,
            )  # fmt: skip
            accepted = replay_rounds(match_lengths(drafts, response=response), num_tokens=len(response))
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
