"""The target side of stage 1: one corpus forward plus batched greedy rollouts per batch.

For a batch of corpus sequences this computes everything the trainer will ever need from the
target (docs/design.md, "The cache contract"): tapped features, top-k + tail distributions at every position, an anchor
pool per sequence, and for every pool anchor a greedy rollout of depth K - 1 with its
distributions and the tapped features of the rollout tokens.

Rollouts are parallel branches that share the corpus KV cache. Rollout step r feeds, for every
anchor of every sequence at once, the token y*[r] at position a + r; its query sees the corpus
keys at positions <= a and the branch's own earlier rollout keys, nothing else. So the whole
batch takes one corpus forward and K - 1 small forwards of (num_anchors) tokens each, instead of
one `generate()` per anchor. `reference_rollout` below is the plain step-by-step version that
the tests (and the benchmark) compare against.

A vision-language target (Qwen3-VL, docs/vision.md "Stage 1") runs the corpus pass through the full model with the
batch's pixel values and 3-D M-RoPE positions; its rollout steps run the text model alone at
positions pos3[:, b, a] + step on all three axes (text tokens have t = h = w), on the same shared
cache and branch mask. Pixel values are loaded per batch from each sequence's image.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.config import opt
from pipeline.target import attention_mask_for, decoder_stack, is_vision_model, tapped_features
from pipeline.vision import SequenceImage, mm_token_type_ids, rope_positions
from storage.format import check_num_slots

LOGITS_CHUNK = 2048  # positions per lm_head call, bounds the [chunk, vocab] logits buffer


@dataclass(kw_only=True)
class TargetRunConfig:
    """What the target computes per sequence; every field changes cache content."""

    num_slots: int = opt("K: predicted slots per block; rollouts have depth K - 1.", default=15)
    top_k: int = opt("Top-k probabilities kept per distribution (plus the tail mass).", default=8)
    anchors_per_sequence: int = opt("Anchor pool size per sequence (drawn from eligible positions).", flag="anchors", default=128)
    seed: int = opt("Seed of the anchor pools.", default=0)
    rollouts: bool = opt(
        "Run greedy rollouts from the anchor pool (needed by alr, alr_gate, alr_ira, slot_control); "
        "--no-rollouts also leaves out the rollout features. The anchor pool is stored either way.",
        default=True,
    )
    # Resolved from the taps settings by the build (pipeline/cache_build/driver.py), not a flag.
    layer_ids: list[int] | None = field(default=None, metadata={"cli": False})

    def __post_init__(self):
        if self.layer_ids is not None and not self.layer_ids:
            raise ValueError("layer_ids: at least one tapped layer is required")
        check_num_slots(self.num_slots, name="--num-slots")
        if self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
        if self.anchors_per_sequence < 1:
            raise ValueError(f"--anchors must be >= 1, got {self.anchors_per_sequence}")

    @property
    def rollout_depth(self) -> int:
        return self.num_slots - 1


# ----------------------------------------------------------------------------------------------
# Pure pieces


def topk_with_tail(logits: torch.Tensor, *, top_k: int):
    """fp32 softmax of logits [N, V] -> (ids [N, k] int32, probs [N, k] f32, tail [N] f32, argmax [N]).

    Ties in the argmax go to the lowest id (torch.topk is stable only on CPU, so the argmax is
    taken separately with torch.argmax, which returns the first maximal index).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    topk_probs, topk_ids = probs.topk(top_k, dim=-1)  # [N, k]
    argmax = probs.argmax(dim=-1)  # [N]
    # Keep column 0 == argmax even under exact ties, so "top-1" and "greedy" never disagree.
    tie = topk_ids[:, 0] != argmax
    if tie.any():
        topk_ids[tie, 0] = argmax[tie]
    tail = (1.0 - topk_probs.sum(dim=-1)).clamp_min(0.0)
    return topk_ids.int(), topk_probs, tail, argmax


def _eligible_anchors(loss_mask: np.ndarray) -> np.ndarray:
    mask = np.asarray(loss_mask).astype(bool)
    return np.flatnonzero(mask[:-1] & mask[1:])  # [E]


def anchor_pool_size(loss_mask: np.ndarray, *, num_anchors: int) -> int:
    """len(anchor_pool(...)) without drawing the pool (a shard is sized before it is computed)."""
    return min(num_anchors, len(_eligible_anchors(loss_mask)))


def anchor_pool(loss_mask: np.ndarray, *, num_anchors: int, seed: int, source_row: int) -> np.ndarray:
    """Eligible positions (m[a] = m[a+1] = 1), up to num_anchors drawn without replacement, sorted.

    The generator is seeded by (seed, source_row), so a sequence's pool never depends on which
    shard, batch or worker processed it.
    """
    eligible = _eligible_anchors(loss_mask)
    if len(eligible) > num_anchors:
        rng = np.random.default_rng([seed, source_row])
        eligible = np.sort(rng.choice(eligible, size=num_anchors, replace=False))
    return eligible.astype(np.int32)


def rollout_attention_mask(
    *,
    anchor_pos: torch.Tensor,
    anchor_valid: torch.Tensor,
    corpus_len: int,
    step: int,
) -> torch.Tensor:
    """Visibility for rollout step `step` (1-based): bool [B, 1, A, corpus_len + step * A].

    Key layout in the shared cache: the corpus (padded to corpus_len), then the A branch tokens
    of step 1, then those of step 2, ... A branch query sees corpus keys at positions <= its
    anchor and the keys of its own branch from every step so far. Padding anchors see key 0 and
    themselves only, so no row is fully masked.
    """
    batch, num_anchors = anchor_pos.shape
    limit = torch.where(anchor_valid, anchor_pos, torch.zeros_like(anchor_pos))
    corpus = torch.arange(corpus_len, device=anchor_pos.device)[None, None, :] <= limit[:, :, None]
    own = torch.eye(num_anchors, dtype=torch.bool, device=anchor_pos.device)
    branches = own[None].expand(batch, num_anchors, num_anchors).repeat(1, 1, step)
    return torch.cat([corpus, branches], dim=-1)[:, None]


# ----------------------------------------------------------------------------------------------
# The batched computation


@dataclass(kw_only=True)
class TargetSequence:
    source_row: int
    input_ids: np.ndarray  # [T] int
    loss_mask: np.ndarray  # [T] uint8
    image: SequenceImage | None = None  # vision-language targets: the sequence's image, read per batch


@dataclass(kw_only=True)
class TargetOutputs:
    """One sequence's target outputs as float tensors (features not yet encoded); the rollout_*
    fields are None when the run skipped the rollouts."""

    source_row: int
    input_ids: torch.Tensor  # [T] int32
    loss_mask: torch.Tensor  # [T] uint8
    features: torch.Tensor  # [T, F]
    corpus_topk_ids: torch.Tensor  # [T, k]
    corpus_topk_probs: torch.Tensor  # [T, k]
    corpus_tail: torch.Tensor  # [T]
    corpus_next_prob: torch.Tensor  # [T]
    anchor_pos: torch.Tensor  # [A] int32
    rollout_tokens: torch.Tensor | None = None  # [A, K+1] int32
    rollout_topk_ids: torch.Tensor | None = None  # [A, K, k]
    rollout_topk_probs: torch.Tensor | None = None  # [A, K, k]
    rollout_tail: torch.Tensor | None = None  # [A, K]
    rollout_features: torch.Tensor | None = None  # [A, K-2, F]
    extras: dict = field(default_factory=dict)


def _lm_head_topk(model, hidden: torch.Tensor, *, top_k: int, chunk: int):
    """hidden [N, H] (after the final norm) -> topk_with_tail outputs, lm_head applied in chunks."""
    outs = [topk_with_tail(model.lm_head(hidden[i : i + chunk]), top_k=top_k) for i in range(0, len(hidden), chunk)]
    if not outs:
        empty = hidden.new_zeros((0, top_k))
        return empty.int(), empty.float(), hidden.new_zeros(0).float(), hidden.new_zeros(0).long()
    return tuple(torch.cat(parts) for parts in zip(*outs))


def _next_token_prob(model, hidden: torch.Tensor, next_ids: torch.Tensor, *, chunk: int) -> torch.Tensor:
    """p_T(next_ids[i] | ...) from hidden [N, H]: one gather per chunk of fp32 softmax."""
    probs = []
    for i in range(0, len(hidden), chunk):
        logits = model.lm_head(hidden[i : i + chunk]).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, next_ids[i : i + chunk, None])[:, 0]
        probs.append(logp.exp())
    return torch.cat(probs) if probs else hidden.new_zeros(0).float()


@torch.inference_mode()
def run_target_batch(
    model, sequences: list[TargetSequence], config: TargetRunConfig, *, seconds: dict[str, float] | None = None
) -> list[TargetOutputs]:
    """Corpus forward + batched greedy rollouts (unless config.rollouts is False) for a batch of
    sequences (right-padded). The computed tensors stay on the model's device: the builder checks
    and encodes them there and copies a whole batch to the host at once
    (pipeline.cache_build.shard_builder.outputs_to_records). `seconds`, if given, accumulates the
    wall time of each part ("corpus": the corpus pass and its top-k; "rollouts"), which the
    manifest records per shard."""
    started = time.perf_counter()
    device = next(model.parameters()).device
    batch = len(sequences)
    lengths = [len(s.input_ids) for s in sequences]
    max_len = max(lengths)
    top_k = config.top_k

    input_ids = torch.zeros((batch, max_len), dtype=torch.long, device=device)  # [B, S]
    token_valid = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
    for b, seq in enumerate(sequences):
        input_ids[b, : lengths[b]] = torch.tensor(np.asarray(seq.input_ids), dtype=torch.long)
        token_valid[b, : lengths[b]] = True

    out, positions = _corpus_forward(model, sequences, input_ids=input_ids, token_valid=token_valid, use_cache=config.rollouts)
    corpus_features = tapped_features(out.hidden_states, config.layer_ids)  # [B, S, F]
    final_hidden = out.last_hidden_state  # [B, S, H], after the final norm

    flat_hidden = final_hidden[token_valid]  # [sum T, H]
    c_ids, c_probs, c_tail, c_argmax = _lm_head_topk(model, flat_hidden, top_k=top_k, chunk=LOGITS_CHUNK)
    # p_T(x[t+1] | x[<=t]); the last position of each sequence has no next token.
    next_ids = torch.zeros((batch, max_len), dtype=torch.long, device=device)
    next_ids[:, :-1] = input_ids[:, 1:]
    c_next = _next_token_prob(model, flat_hidden, next_ids[token_valid], chunk=LOGITS_CHUNK)
    is_last = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
    is_last[torch.arange(batch), torch.as_tensor(lengths, device=device) - 1] = True
    c_next = c_next.masked_fill(is_last[token_valid], 0.0)
    split = [int(n) for n in lengths]
    c_ids, c_probs, c_tail, c_argmax, c_next = (t.split(split) for t in (c_ids, c_probs, c_tail, c_argmax, c_next))

    # Anchor pools, padded to a common count A.
    pools = [
        anchor_pool(s.loss_mask, num_anchors=config.anchors_per_sequence, seed=config.seed, source_row=s.source_row)
        for s in sequences
    ]
    num_anchors = max((len(p) for p in pools), default=0)
    anchor_pos = torch.zeros((batch, num_anchors), dtype=torch.long, device=device)  # [B, A]
    anchor_valid = torch.zeros((batch, num_anchors), dtype=torch.bool, device=device)
    for b, pool in enumerate(pools):
        anchor_pos[b, : len(pool)] = torch.as_tensor(pool, dtype=torch.long)
        anchor_valid[b, : len(pool)] = True

    corpus_done = time.perf_counter()
    rollout = None
    if config.rollouts:
        rollout = _batched_rollouts(
            model, out.past_key_values, config=config, input_ids=input_ids, positions=positions, anchor_pos=anchor_pos,
            anchor_valid=anchor_valid, corpus_topk=(c_ids, c_probs, c_tail, c_argmax),
            feature_dim=corpus_features.shape[-1], feature_dtype=corpus_features.dtype,
        )  # fmt: skip

    if seconds is not None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds["corpus"] = seconds.get("corpus", 0.0) + corpus_done - started
        seconds["rollouts"] = seconds.get("rollouts", 0.0) + time.perf_counter() - corpus_done
    results = []
    for b, seq in enumerate(sequences):
        n, a = lengths[b], len(pools[b])
        mine = {} if rollout is None else {name: t[b, :a] for name, t in rollout.items()}
        results.append(
            TargetOutputs(
                source_row=int(seq.source_row),
                input_ids=input_ids[b, :n].int(),
                loss_mask=torch.tensor(np.asarray(seq.loss_mask), dtype=torch.uint8),
                features=corpus_features[b, :n],
                corpus_topk_ids=c_ids[b],
                corpus_topk_probs=c_probs[b],
                corpus_tail=c_tail[b],
                corpus_next_prob=c_next[b],
                anchor_pos=torch.as_tensor(pools[b], dtype=torch.int32),
                **mine,
            )
        )
    return results


def _corpus_forward(model, sequences: list[TargetSequence], *, input_ids: torch.Tensor, token_valid: torch.Tensor, use_cache: bool):
    """The corpus pass over the right-padded batch input_ids [B, S]: (model output, positions) with
    positions [B, S] (text) or [3, B, S] (M-RoPE of a vision-language target, from each sequence's
    image grid). Causal over real tokens; padding keys sit after every real token, so causality
    already hides them from real queries, and the mask is written out to keep that explicit."""
    batch, max_len = input_ids.shape
    device = input_ids.device
    steps = torch.arange(max_len, device=device)
    causal = steps[None, :] <= steps[:, None]  # [S, S]
    corpus_mask = (causal[None] & token_valid[:, None, :])[:, None]  # [B, 1, S, S]
    corpus_mask |= torch.eye(max_len, dtype=torch.bool, device=device)[None, None]  # padding rows see themselves
    mask = attention_mask_for(model, corpus_mask)
    if not is_vision_model(model):
        positions = steps[None].expand(batch, -1)
        out = decoder_stack(model)(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=use_cache, output_hidden_states=True
        )
        return out, positions
    images = [s.image.pixel_inputs() if s.image is not None else None for s in sequences]  # (pixels [P, D], grid [1, 3])
    positions = steps[None, None].repeat(3, batch, 1)  # [3, B, S]; padding keeps its index
    for b, seq in enumerate(sequences):
        n = len(seq.input_ids)
        grid = None if images[b] is None else images[b][1].to(device)
        positions[:, b, :n] = rope_positions(model, input_ids[b, :n], image_grid_thw=grid)[0]
    pixel_values = torch.cat([im[0] for im in images if im is not None]).to(device, model.dtype) if any(images) else None
    grids = torch.cat([im[1] for im in images if im is not None]).to(device) if any(images) else None
    out = model.model(
        input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grids,
        mm_token_type_ids=mm_token_type_ids(input_ids, image_token_id=model.config.image_token_id),
        attention_mask=mask, position_ids=positions, use_cache=use_cache, output_hidden_states=True,
    )  # fmt: skip
    return out, positions


def _rollout_positions(positions: torch.Tensor, anchor_pos: torch.Tensor, step: int) -> torch.Tensor:
    """Positions of rollout step `step` for anchors [B, A]: the anchor's position + step, [B, A]
    for a text target, [3, B, A] (the same on every axis) for M-RoPE positions [3, B, S]."""
    if positions.ndim == 2:
        return anchor_pos + step
    anchor_time = positions[0].gather(1, anchor_pos)  # [B, A]; a text anchor has t = h = w
    return (anchor_time + step)[None].expand(3, -1, -1)


def _batched_rollouts(
    model, cache, *, config: TargetRunConfig, input_ids: torch.Tensor, positions: torch.Tensor, anchor_pos: torch.Tensor,
    anchor_valid: torch.Tensor, corpus_topk: tuple, feature_dim: int, feature_dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Greedy rollouts of depth K - 1 from every pool anchor of the batch at once, sharing the
    corpus KV `cache`: one target forward of [B, A] tokens per rollout step. Returns the rollout_*
    arrays padded to [B, A, ...] (storage/format.py shapes per sequence after slicing)."""
    c_ids, c_probs, c_tail, c_argmax = corpus_topk  # per sequence: [T, k], [T, k], [T], [T]
    batch, num_anchors = anchor_pos.shape
    num_slots, top_k, device = config.num_slots, config.top_k, input_ids.device
    max_len = input_ids.shape[1]
    # Slot 1 of every rollout is the corpus distribution at the anchor itself.
    roll_ids = torch.zeros((batch, num_anchors, num_slots, top_k), dtype=torch.int32, device=device)
    roll_probs = torch.zeros((batch, num_anchors, num_slots, top_k), dtype=torch.float32, device=device)
    roll_tail = torch.zeros((batch, num_anchors, num_slots), dtype=torch.float32, device=device)
    roll_tokens = torch.zeros((batch, num_anchors, num_slots + 1), dtype=torch.long, device=device)
    roll_features = torch.zeros((batch, num_anchors, num_slots - 2, feature_dim), dtype=feature_dtype, device=device)
    for b in range(batch):
        pos = anchor_pos[b, anchor_valid[b]]
        roll_ids[b, : len(pos), 0] = c_ids[b][pos]
        roll_probs[b, : len(pos), 0] = c_probs[b][pos]
        roll_tail[b, : len(pos), 0] = c_tail[b][pos]
        roll_tokens[b, : len(pos), 0] = input_ids[b, pos]
        roll_tokens[b, : len(pos), 1] = c_argmax[b][pos]

    if num_anchors > 0:
        for step in range(1, config.rollout_depth + 1):
            step_out = decoder_stack(model)(
                input_ids=roll_tokens[:, :, step],  # y*[step] for every branch: [B, A]
                attention_mask=attention_mask_for(
                    model,
                    rollout_attention_mask(
                        anchor_pos=anchor_pos, anchor_valid=anchor_valid, corpus_len=max_len, step=step
                    ),
                ),
                position_ids=_rollout_positions(positions, anchor_pos, step),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
            )
            if step <= num_slots - 2:
                roll_features[:, :, step - 1] = tapped_features(step_out.hidden_states, config.layer_ids)
            step_hidden = step_out.last_hidden_state.reshape(batch * num_anchors, -1)  # [B * A, H]
            ids, probs, tail, argmax = _lm_head_topk(model, step_hidden, top_k=top_k, chunk=LOGITS_CHUNK)
            roll_ids[:, :, step] = ids.view(batch, num_anchors, top_k)
            roll_probs[:, :, step] = probs.view(batch, num_anchors, top_k)
            roll_tail[:, :, step] = tail.view(batch, num_anchors)
            roll_tokens[:, :, step + 1] = argmax.view(batch, num_anchors)

    return {
        "rollout_tokens": roll_tokens.int(),
        "rollout_topk_ids": roll_ids,
        "rollout_topk_probs": roll_probs,
        "rollout_tail": roll_tail,
        "rollout_features": roll_features,
    }


# ----------------------------------------------------------------------------------------------
# Plain reference: one anchor at a time, a full forward per rollout step (no cache tricks).


@torch.inference_mode()
def reference_rollout(
    model, input_ids: np.ndarray, *, anchor: int, config: TargetRunConfig, image: SequenceImage | None = None
) -> dict[str, torch.Tensor]:
    """Rollout of one anchor by plain full forwards over x[<=a] + y*[<k] (with the sequence's image
    through the full model, HF placing the M-RoPE positions itself); used by tests and benchmarks."""
    device = next(model.parameters()).device
    prefix = torch.as_tensor(np.asarray(input_ids[: anchor + 1]), dtype=torch.long, device=device)[None]
    tokens, ids, probs, tails, features = [], [], [], [], []
    vision = {}
    if image is not None:
        pixel_values, grid = image.pixel_inputs()
        vision = {"pixel_values": pixel_values.to(device, model.dtype), "image_grid_thw": grid.to(device)}
    for slot in range(1, config.num_slots + 1):
        if vision:
            vision["mm_token_type_ids"] = mm_token_type_ids(prefix, image_token_id=model.config.image_token_id)
        out = model.model(input_ids=prefix, output_hidden_states=True, **vision)
        k_ids, k_probs, k_tail, argmax = topk_with_tail(model.lm_head(out.last_hidden_state[0, -1:]), top_k=config.top_k)
        ids.append(k_ids[0])
        probs.append(k_probs[0])
        tails.append(k_tail[0])
        if slot >= 2:  # features of y*[slot - 1], the token fed last
            features.append(tapped_features(out.hidden_states, config.layer_ids)[0, -1])
        tokens.append(int(argmax[0]))
        prefix = torch.cat([prefix, argmax.view(1, 1)], dim=1)
    return {
        "rollout_tokens": torch.tensor([int(input_ids[anchor])] + tokens, dtype=torch.int32),
        "rollout_topk_ids": torch.stack(ids),
        "rollout_topk_probs": torch.stack(probs),
        "rollout_tail": torch.stack(tails),
        "rollout_features": torch.stack(features[: config.num_slots - 2]),
    }
