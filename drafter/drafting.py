"""What one greedy (T = 0) round of block drafting accepts, computed in batches from a whole
sequence's features (docs/design.md, "Evaluation", greedy replay). At T = 0 every committed token is
the target's greedy token, so a round's outcome depends only on the greedy response and the drafter:
`block_drafts` drafts a block at many anchors of a sequence at once (each seeing exactly the
features before its anchor, as a decoding round does), `match_lengths` counts the leading drafts
equal to the response, and `replay_rounds` walks the rounds as speculative decoding commits them.
`alrira-eval replay` and the trainer's `--eval-every` (pipeline/train/eval_split.py) both use them,
so the two give the same figures.
"""

from __future__ import annotations

import torch

from drafter.families import family_of
from drafter.family import Drafts
from drafter.masks import SHARED_OWNER, visibility_mask


def block_drafts(drafter, *, embed_tokens, lm_head, mask_token_id: int, features: torch.Tensor, sequence: list[int],
                 anchors: list[int], chunk: int = 16) -> torch.Tensor:  # fmt: skip
    """Drafts [N, D] of `block_round_drafts` (its tokens)."""
    return block_round_drafts(drafter, embed_tokens=embed_tokens, lm_head=lm_head, mask_token_id=mask_token_id, features=features,
                              sequence=sequence, anchors=anchors, chunk=chunk).tokens  # fmt: skip


@torch.inference_mode()
def block_round_drafts(drafter, *, embed_tokens, lm_head, mask_token_id: int, features: torch.Tensor, sequence: list[int],
                       anchors: list[int], chunk: int = 16) -> Drafts:  # fmt: skip
    """Drafts of N rounds (tokens [N, D], and the confidence prediction where the family has one):
    for each anchor position a of `sequence`, the block [x[a], MASK x (B - 1)] drafted from the
    features of positions < a, as a decoding round sees them (several blocks per forward, each with
    its own corpus limit), by its family's `draft` (D = the config's num_drafts: K for DFlash, B for
    DSpark, whose Markov head runs slot by slot on its own drafts). features [S, F] of the whole sequence."""
    block_size = drafter.config.block_size
    family = family_of(drafter)
    dtype = next(drafter.parameters()).dtype
    device = features.device
    tokens = torch.as_tensor(sequence, device=device)
    context_positions = torch.arange(features.shape[0], device=device)[None]  # [1, S]
    drafts = []
    for start in range(0, len(anchors), chunk):
        group = torch.as_tensor(anchors[start : start + chunk], device=device)  # [N]
        block_ids = torch.full((len(group), block_size), mask_token_id, dtype=torch.long, device=device)  # [N, B]
        block_ids[:, 0] = tokens[group]
        mask = visibility_mask(
            context_positions=context_positions, context_owner=torch.full_like(context_positions, SHARED_OWNER),
            context_valid=torch.ones_like(context_positions, dtype=torch.bool), block_corpus_limit=group[None],
            block_valid=torch.ones((1, len(group)), dtype=torch.bool, device=device), block_size=block_size,
        )  # fmt: skip  # [1, 1, N*B, S + N*B]
        hidden = drafter(
            context_features=features[None].to(dtype), context_positions=context_positions,
            block_embeds=embed_tokens(block_ids.reshape(1, -1)).to(dtype),
            block_positions=(group[:, None] + torch.arange(block_size, device=device)).reshape(1, -1), attention_mask=mask,
        ).reshape(len(group), block_size, -1)  # fmt: skip  # [N, B, H]
        drafts.append(family.draft(drafter, hidden=hidden, anchor_tokens=block_ids[:, 0], lm_head=lm_head))
    joined = {name: [getattr(d, name) for d in drafts] for name in ("tokens", "confidence", "confidence_logits")}
    return Drafts(**{name: None if parts[0] is None else torch.cat(parts) for name, parts in joined.items()})


def match_lengths(drafts: torch.Tensor, *, response: list[int]) -> list[int]:
    """Leading drafts equal to the greedy response, per anchor: drafts [N, K] for the anchors at
    response tokens 0..N-1; the truth after anchor j is response[j+1 : j+1+K], shorter near the end."""
    num_anchors, num_draft = drafts.shape
    truth = torch.full((num_anchors, num_draft), -1, dtype=torch.long)
    for j in range(num_anchors):
        tail = response[j + 1 : j + 1 + num_draft]
        truth[j, : len(tail)] = torch.as_tensor(tail, dtype=torch.long)
    return torch.cumprod((drafts.cpu() == truth).long(), dim=1).sum(dim=1).tolist()


def replay_rounds(matches: list[int], *, num_tokens: int) -> list[int]:
    """Accepted drafts per round of greedy decoding of a `num_tokens` response: the prefill commits
    token 0; the round anchored at token j commits its matching drafts and one target token, cut at
    the response's end (speculative_decode's `min(num_accepted, len(new) - 1)`)."""
    return [count for _, count in replay_walk(matches, num_tokens=num_tokens)]


def replay_walk(matches: list[int], *, num_tokens: int) -> list[tuple[int, int]]:
    """(anchor j, drafts accepted) of each round of `replay_rounds`, in order."""
    rounds, j = [], 0
    while j < num_tokens - 1:
        remaining = num_tokens - 1 - j  # tokens after the anchor still to commit
        count = min(matches[j], remaining - 1)
        rounds.append((j, count))
        j += count + 1
    return rounds


def position_acceptance(accepted_lengths: list[int], *, num_drafts: int) -> list[float | None]:
    """Per draft position i = 1..num_drafts, the share of rounds that accepted at least i drafts
    (vLLM's `spec_decode_num_accepted_tokens_per_pos` over its `num_drafts`). tau_pooled - 1 is their sum."""
    rounds = len(accepted_lengths)
    return [round(sum(n >= i for n in accepted_lengths) / rounds, 5) if rounds else None for i in range(1, num_drafts + 1)]
