"""Tree verification: the drafter's per-slot top-B candidates as a token tree of at most N nodes,
verified in ONE target forward with a tree attention mask (docs/design.md, "Evaluation").

Round r, anchor at position p (greedy, T = 0):
  1. draft:  the drafter's logits at slots 1..K (one pass, as in the chain loop);
  2. tree:   the top-1 chain first (so the tree holds everything the chain would verify), then
             best-first by the path's summed log-probability, each node's children being the
             top-`branch` tokens of the next slot, until `budget` nodes;
  3. verify: one target forward over [anchor, node_1 .. node_N] at positions p + depth, each node
             seeing the committed prefix, the anchor and its own ancestors only;
  4. commit: from the anchor, follow the child whose token equals the target's argmax at the
             current node; the accepted path plus the target's token after its last node. The KV
             cache keeps the anchor and the path's entries (gathered, in path order), as does
             the feature buffer.
Every committed token is the target's greedy choice given the committed prefix, so the output
equals greedy AR token for token; tau counts accepted + 1 per round, as the chain loop does.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.eval.speculative import DecodeResult, PromptImage, check_decode_args, commit_tokens, prefill, sync_device
from pipeline.target import attention_mask_for, tapped_features


@dataclass(kw_only=True)
class TokenTree:
    """N draft nodes in topological order (a parent before its children); the anchor is node -1."""

    tokens: Tensor  # [N] long
    parents: Tensor  # [N] long: index of the parent node, -1 for a child of the anchor
    depths: Tensor  # [N] long: 1 for a child of the anchor (= the slot the token drafts)


def build_tree(slot_logits: Tensor, *, budget: int, branch: int) -> TokenTree:
    """A tree of at most `budget` nodes from the drafter's logits [K, V] at slots 1..K."""
    num_slots = slot_logits.shape[0]
    logprobs = torch.log_softmax(slot_logits.float(), dim=-1)
    top_logprobs, top_ids = logprobs.topk(min(branch, logprobs.shape[-1]), dim=-1)  # [K, B]
    tokens, parents, depths, scores = [], [], [], []
    added: set[tuple[int, int]] = set()  # (parent, rank among its siblings) of every node
    frontier: list[tuple[float, int, int, int]] = []  # (-path score, parent, depth, rank)

    def add(parent: int, depth: int, rank: int) -> int:
        tokens.append(int(top_ids[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        scores.append((scores[parent] if parent >= 0 else 0.0) + float(top_logprobs[depth - 1, rank]))
        added.add((parent, rank))
        node = len(tokens) - 1
        if depth < num_slots:  # its children become candidates
            for child_rank in range(top_ids.shape[1]):
                score = scores[node] + float(top_logprobs[depth, child_rank])
                heapq.heappush(frontier, (-score, node, depth + 1, child_rank))
        return node

    # The top-1 chain first (the tree verifies at least what the chain loop would), then
    # best-first by path score, the anchor's own children included.
    for rank in range(top_ids.shape[1]):
        heapq.heappush(frontier, (-float(top_logprobs[0, rank]), -1, 1, rank))
    node = -1
    for depth in range(1, min(num_slots, budget) + 1):
        node = add(node, depth, 0)
    while frontier and len(tokens) < budget:
        _, parent, depth, rank = heapq.heappop(frontier)
        if (parent, rank) not in added:
            add(parent, depth, rank)
    return TokenTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths))


def tree_attention_mask(tree: TokenTree, *, num_past: int) -> Tensor:
    """bool [1, 1, 1 + N, num_past + 1 + N]: every query sees the committed prefix and the anchor;
    a node sees its ancestors and itself."""
    num_nodes = tree.tokens.shape[0]
    within = torch.eye(num_nodes + 1, dtype=torch.bool)  # [1 + N, 1 + N], index 0 = the anchor
    within[:, 0] = True
    for node in range(num_nodes):  # topological order: a parent's row is complete before its children
        parent = int(tree.parents[node])
        within[node + 1] |= within[parent + 1]
    past = torch.ones((num_nodes + 1, num_past), dtype=torch.bool)
    return torch.cat([past, within], dim=1)[None, None]


def accepted_path(tree: TokenTree, posterior: Tensor) -> list[int]:
    """Nodes accepted from the anchor down: the child whose token equals the target's argmax at
    the current node (posterior [1 + N], index 0 = the anchor)."""
    path, current = [], -1
    while True:
        want = int(posterior[current + 1])
        child = next((n for n in range(tree.tokens.shape[0]) if int(tree.parents[n]) == current and int(tree.tokens[n]) == want), None)
        if child is None:
            return path
        path.append(child)
        current = child


def keep_cache_entries(cache, keep: Tensor) -> None:
    """Keep only the cache positions `keep` (long, in order) in every layer of a DynamicCache."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., keep, :]
        layer.values = layer.values[..., keep, :]


@torch.inference_mode()
def tree_speculative_decode(
    target, *, draft_logits_fn, layer_ids: list[int], num_draft: int, prompt_ids: list[int], max_new_tokens: int,
    stop_token_ids: list[int], budget: int, branch: int, image: PromptImage | None = None,
) -> DecodeResult:  # fmt: skip
    """Greedy speculative decoding with tree verification (see the module docstring); a
    vision-language target's nodes sit at index + rope delta on all three M-RoPE axes."""
    check_decode_args(prompt_ids, max_new_tokens=max_new_tokens, temperature=0.0)
    device = next(target.parameters()).device
    stops, num_prompt = set(stop_token_ids), len(prompt_ids)
    state = prefill(
        target, prompt_ids, layer_ids=layer_ids, extra_rows=num_draft + 1, max_new_tokens=max_new_tokens,
        temperature=0.0, generator=None, stop_token_ids=stops, image=image,
    )  # fmt: skip
    cache, features, tokens, done = state.cache, state.features, state.tokens, state.done
    accepted_lengths = []
    while not done:
        anchor_pos = num_prompt + len(tokens) - 1
        assert cache.get_seq_length() == anchor_pos, (cache.get_seq_length(), anchor_pos)
        logits = draft_logits_fn(context_features=features[:anchor_pos], anchor_token=tokens[-1], anchor_pos=anchor_pos)
        tree = build_tree(logits, budget=budget, branch=branch)
        block = torch.cat([torch.tensor([tokens[-1]]), tree.tokens]).to(device)[None]  # [1, 1 + N]
        mask = tree_attention_mask(tree, num_past=anchor_pos).to(device)
        positions = (anchor_pos + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])).to(device)[None]  # [1, 1 + N]
        if state.rope_delta is not None:
            positions = (positions + state.rope_delta)[None].expand(3, -1, -1)  # [3, 1, 1 + N]
        out = target(
            input_ids=block, past_key_values=cache, use_cache=True, output_hidden_states=True,
            attention_mask=attention_mask_for(target, mask), position_ids=positions,
        )  # fmt: skip
        posterior = out.logits[0].argmax(dim=-1)  # [1 + N]
        path = accepted_path(tree, posterior)
        rows = torch.tensor([0] + [n + 1 for n in path], device=device)  # the anchor, then the path's nodes
        keep_cache_entries(cache, torch.cat([torch.arange(anchor_pos, device=device), anchor_pos + rows]))
        features[anchor_pos : anchor_pos + len(rows)] = tapped_features(out.hidden_states, layer_ids)[0, rows]
        new_tokens = [int(tree.tokens[n]) for n in path] + [int(posterior[rows[-1]])]
        new, done = commit_tokens(new_tokens, num_generated=len(tokens), max_new_tokens=max_new_tokens, stop_token_ids=stops)
        tokens += new
        accepted_lengths.append(min(len(path), len(new) - 1))
    sync_device(device)
    end = time.perf_counter()
    return DecodeResult(
        tokens=tokens, accepted_lengths=accepted_lengths, rounds=len(accepted_lengths),
        decode_s=end - state.prefill_end, prefill_s=state.prefill_end - state.start,
    )  # fmt: skip
