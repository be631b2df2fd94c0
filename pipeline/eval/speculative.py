"""Speculative decoding with a HF target and a DFlash block drafter (docs/design.md, "Evaluation"), batch size 1.

Round r, with the last committed token (the anchor) at position p:
  1. draft:  the drafter reads the tapped target features of every committed token at positions
             < p (the training visibility rule) and the block [anchor, MASK x K] at positions
             p .. p + K; its argmax at slots 1..K are the K draft tokens. Committed context never
             changes, so the drafter keeps its context keys/values (ContextKVCache) and projects
             only the positions committed since the last round, as the public DFlash decoders do;
  2. verify: ONE target forward over [anchor, draft_1 .. draft_K] on top of the target's KV cache
             (which holds positions < p) gives K + 1 posterior tokens (argmax at T = 0, a sample
             from softmax(logits / T) at T > 0);
  3. commit: the longest prefix where draft == posterior, plus the posterior at the first mismatch
             (or the bonus token after a fully accepted block). The KV cache is cropped back to
             the anchor and the accepted tokens, whose features the verify forward just computed;
             the newly committed last token is the next round's anchor, so its cache entry and
             feature come from the next verify.
Every committed token is the target's own choice given the committed prefix, so at T = 0 the
output equals the target's greedy decode token for token.

A vision-language target (docs/vision.md, "Evaluation") prefills through the full model with the prompt's
pixels at 3-D M-RoPE positions; every later forward (AR steps, verify blocks) feeds input ids only
at sequence index + rope delta on all three axes, as `generate` continues. The prefill, vision
encoder included, is outside the decode time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from drafter.families import family_of
from drafter.masks import SHARED_OWNER, visibility_mask
from drafter.model import ContextKVCache, DFlashDrafter
from pipeline.target import is_vision_model, tapped_features
from pipeline.vision import mm_token_type_ids, rope_positions, shifted_positions

# image: (pixel_values [P, D], image_grid_thw [1, 3]) of a vision-language prompt's one image
PromptImage = tuple[Tensor, Tensor]

# draft_fn(context_features [p, F], anchor_token, anchor_pos) -> draft tokens [D] (long), D <= the
# drafter's drafts per block, or (tokens [D], confidence [num drafts]) for one that predicts acceptance
DraftFn = Callable[..., Tensor | tuple[Tensor, Tensor]]


@dataclass(kw_only=True)
class DecodeResult:
    tokens: list[int]  # generated tokens (the prompt excluded)
    accepted_lengths: list[int]  # committed draft tokens per round, 0..K (empty for the AR baseline)
    rounds: int  # drafting rounds (0 for the AR baseline)
    decode_s: float  # wall time after the prefill (which produced the first token)
    prefill_s: float  # wall time of the prefill forward and the first token
    proposed_lengths: list[int] = field(default_factory=list)  # draft tokens verified per round (a confidence cut may shorten it)
    confidences: list[list[float]] = field(default_factory=list)  # per round, the drafter's predicted acceptance of each slot, if any


# ----------------------------------------------------------------------------------------------
# Pure pieces


def accept_length(draft_tokens: Tensor, posterior_tokens: Tensor) -> int:
    """Length of the longest prefix where draft [K] equals posterior [K + 1] (0..K)."""
    num_draft = draft_tokens.shape[0]
    if posterior_tokens.shape[0] != num_draft + 1:
        raise ValueError(
            f"posterior_tokens must have K + 1 = {num_draft + 1} entries, got {posterior_tokens.shape[0]}"
        )
    matches = (draft_tokens == posterior_tokens[:num_draft]).long()  # [K]
    # cumprod stays 1 until the first mismatch, so its sum is the accepted prefix length.
    return int(matches.cumprod(dim=0).sum())


def sample_tokens(logits: Tensor, *, temperature: float, generator: torch.Generator | None) -> Tensor:
    """logits [N, V] -> tokens [N]: argmax at T = 0 (first maximal id), else softmax(logits / T) samples."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [N, V]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def commit_tokens(
    new_tokens: list[int], *, num_generated: int, max_new_tokens: int, stop_token_ids: set[int]
) -> tuple[list[int], bool]:
    """The part of `new_tokens` that is committed after `num_generated` tokens, and whether decoding ends.

    Decoding ends at a stop token (kept, nothing after it) or once max_new_tokens are generated.
    """
    kept = []
    for token in new_tokens:
        if num_generated + len(kept) >= max_new_tokens:
            return kept, True
        kept.append(token)
        if token in stop_token_ids:
            return kept, True
    return kept, num_generated + len(kept) >= max_new_tokens


def crop_cache(cache, length: int) -> None:
    """Drop cached positions >= length (a negative crop() removes that many in transformers 4 and 5)."""
    excess = cache.get_seq_length() - length
    assert excess >= 0, (cache.get_seq_length(), length)
    if excess > 0:
        cache.crop(-excess)


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_forward(target, prompt_ids: list[int], *, image: PromptImage | None, cache, **kwargs):
    """The prefill forward over the prompt -> (output, rope delta). A text target gets input ids
    only (rope delta None: later positions follow the cache length); a vision-language one also
    the image's pixels and the prompt's 3-D M-RoPE positions."""
    device = next(target.parameters()).device
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, n]
    if not is_vision_model(target):
        if image is not None:
            raise ValueError("a prompt with an image needs a vision-language target")
        return target(input_ids=input_ids, past_key_values=cache, use_cache=True, **kwargs), None
    grid = None if image is None else image[1].to(device)
    positions, rope_delta = rope_positions(target, input_ids[0], image_grid_thw=grid)  # [3, n]
    pixels = {} if image is None else {"pixel_values": image[0].to(device, target.dtype), "image_grid_thw": grid}
    out = target(
        input_ids=input_ids, position_ids=positions[:, None], past_key_values=cache, use_cache=True,
        mm_token_type_ids=mm_token_type_ids(input_ids, image_token_id=target.config.image_token_id), **pixels, **kwargs,
    )  # fmt: skip
    return out, rope_delta


def position_kwargs(rope_delta: int | None, *, start: int, length: int, device) -> dict:
    """{} for a text target (positions follow the cache); else the shifted 1-D positions of
    sequence indices start .. start + length - 1 on all three M-RoPE axes."""
    if rope_delta is None:
        return {}
    return {"position_ids": shifted_positions(start, length, rope_delta=rope_delta, device=device)}


def check_decode_args(prompt_ids: list[int], *, max_new_tokens: int, temperature: float) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")


# ----------------------------------------------------------------------------------------------
# Autoregressive baseline


@torch.inference_mode()
def autoregressive_decode(
    target,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_token_ids: list[int],
    generator: torch.Generator | None,
    image: PromptImage | None = None,
) -> DecodeResult:
    """Plain decoding: prefill, then one cached target forward per token."""
    from transformers import DynamicCache

    check_decode_args(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature)
    device = next(target.parameters()).device
    stops = set(stop_token_ids)

    sync_device(device)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    out, rope_delta = prompt_forward(target, prompt_ids, image=image, cache=cache, logits_to_keep=1)
    token = sample_tokens(out.logits[:, -1], temperature=temperature, generator=generator)  # [1]
    tokens, done = commit_tokens([int(token)], num_generated=0, max_new_tokens=max_new_tokens, stop_token_ids=stops)
    sync_device(device)
    prefill_end = time.perf_counter()

    while not done:
        step = position_kwargs(rope_delta, start=len(prompt_ids) + len(tokens) - 1, length=1, device=device)
        out = target(input_ids=token[None], past_key_values=cache, use_cache=True, **step)
        token = sample_tokens(out.logits[:, -1], temperature=temperature, generator=generator)  # [1]
        new, done = commit_tokens(
            [int(token)], num_generated=len(tokens), max_new_tokens=max_new_tokens, stop_token_ids=stops
        )
        tokens += new
    sync_device(device)
    end = time.perf_counter()
    return DecodeResult(
        tokens=tokens, accepted_lengths=[], rounds=0, decode_s=end - prefill_end, prefill_s=prefill_end - start
    )


# ----------------------------------------------------------------------------------------------
# Speculative decoding


def drafter_draft(
    drafter: DFlashDrafter,
    *,
    embed_tokens: nn.Module,
    lm_head: nn.Module,
    mask_token_id: int,
    context_features: Tensor,
    anchor_token: int,
    anchor_pos: int,
) -> Tensor:
    """Draft tokens [K]: argmax of lm_head(drafter hidden) at slots 1..K of [anchor, MASK x K].

    context_features [p, n*H] are the features of positions 0..p-1 (p = anchor_pos).
    """
    block_size = drafter.config.block_size
    device = context_features.device
    dtype = next(drafter.parameters()).dtype
    num_context = context_features.shape[0]
    assert num_context == anchor_pos, (num_context, anchor_pos)

    block_ids = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=device)  # [1, B]
    block_ids[0, 0] = anchor_token
    block_positions = torch.arange(anchor_pos, anchor_pos + block_size, device=device)[None]  # [1, B]
    context_positions = torch.arange(num_context, device=device)[None]  # [1, p]
    # One block whose corpus limit is its anchor: it sees exactly the features at positions < p.
    attention_mask = visibility_mask(
        context_positions=context_positions,
        context_owner=torch.full_like(context_positions, SHARED_OWNER),
        context_valid=torch.ones_like(context_positions, dtype=torch.bool),
        block_corpus_limit=torch.tensor([[anchor_pos]], device=device),
        block_valid=torch.ones((1, 1), dtype=torch.bool, device=device),
        block_size=block_size,
    )  # [1, 1, B, p + B]
    hidden = drafter(
        context_features=context_features[None].to(dtype),
        context_positions=context_positions,
        block_embeds=embed_tokens(block_ids).to(dtype),
        block_positions=block_positions,
        attention_mask=attention_mask,
    )  # [1, B, H]
    head_dtype = lm_head.weight.dtype
    return lm_head(hidden[0, 1:].to(head_dtype)).argmax(dim=-1)  # [K]


def cached_block_hidden_fn(drafter: DFlashDrafter, *, embed_tokens: nn.Module, mask_token_id: int):
    """For one decode: block_hidden(context_features=, anchor_token=, anchor_pos=) -> the drafter's
    final hidden states [1, B, H] of the block [anchor, MASK x (B - 1)] at positions anchor_pos..,
    with its context keys/values kept across rounds: each call projects only the context rows added
    since the previous call, O(new tokens) context work per round instead of O(p)."""
    block_size = drafter.config.block_size
    dtype = next(drafter.parameters()).dtype
    cache: ContextKVCache | None = None

    def block_hidden(*, context_features: Tensor, anchor_token: int, anchor_pos: int) -> Tensor:
        nonlocal cache
        device = context_features.device
        assert context_features.shape[0] == anchor_pos, (context_features.shape[0], anchor_pos)
        cached = 0 if cache is None else cache.length
        if anchor_pos > cached:
            cache = drafter.extend_context_cache(
                cache,
                context_features=context_features[None, cached:anchor_pos].to(dtype),
                context_positions=torch.arange(cached, anchor_pos, device=device)[None],
            )
        block_ids = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=device)  # [1, B]
        block_ids[0, 0] = anchor_token
        return drafter.forward_cached(
            cache=cache,
            block_embeds=embed_tokens(block_ids).to(dtype),
            block_positions=torch.arange(anchor_pos, anchor_pos + block_size, device=device)[None],
        )  # [1, B, H]

    return block_hidden


def cached_draft_logits_fn(drafter: DFlashDrafter, *, embed_tokens: nn.Module, lm_head: nn.Module, mask_token_id: int) -> DraftFn:
    """For one decode: draft(context_features=, anchor_token=, anchor_pos=) -> the drafter's logits
    [K, V] at slots 1..K, from cached_block_hidden_fn (the context's keys/values kept across rounds)."""
    block_hidden = cached_block_hidden_fn(drafter, embed_tokens=embed_tokens, mask_token_id=mask_token_id)

    def draft_logits(**inputs) -> Tensor:
        hidden = block_hidden(**inputs)  # [1, B, H]
        return lm_head(hidden[0, 1:].to(lm_head.weight.dtype))  # [K, V]

    return draft_logits


def cached_draft_fn(drafter: DFlashDrafter, *, embed_tokens: nn.Module, lm_head: nn.Module, mask_token_id: int) -> DraftFn:
    """drafter_draft for one decode, from cached_draft_logits_fn: the same drafts as drafter_draft
    (tests/test_speculative.py)."""
    draft_logits = cached_draft_logits_fn(drafter, embed_tokens=embed_tokens, lm_head=lm_head, mask_token_id=mask_token_id)
    return lambda **inputs: draft_logits(**inputs).argmax(dim=-1)  # [K]


def cached_family_draft_fn(drafter, *, embed_tokens: nn.Module, lm_head: nn.Module, confidence_threshold: float = 0.0) -> DraftFn:
    """For one decode: the drafter family's draft step (drafter/family.py, `draft`) after one
    backbone pass over the block [anchor, MASK x (B - 1)] (cached_block_hidden_fn; its config's mask
    token). The drafts are the argmax at every temperature: the verification accepts a draft only if
    it equals the target's token, so the most likely one is the best draft. A family that predicts
    each slot's acceptance gives (tokens [D], the prediction for all slots), its proposal cut before
    the first slot whose prediction is below confidence_threshold when that is > 0 (DeepSpec's rule,
    docs/design.md "Drafter families"); otherwise tokens [D]."""
    family = family_of(drafter)
    block_hidden = cached_block_hidden_fn(drafter, embed_tokens=embed_tokens, mask_token_id=drafter.config.mask_token_id)

    def draft(*, context_features: Tensor, anchor_token: int, anchor_pos: int) -> Tensor | tuple[Tensor, Tensor]:
        hidden = block_hidden(context_features=context_features, anchor_token=anchor_token, anchor_pos=anchor_pos)  # [1, B, H]
        anchor = torch.tensor([anchor_token], device=hidden.device)
        drafts = family.draft(drafter, hidden=hidden, anchor_tokens=anchor, lm_head=lm_head)
        if drafts.confidence is None:
            return drafts.tokens[0]
        length = confident_prefix_length(drafts.confidence[0], threshold=confidence_threshold)
        return drafts.tokens[0, :length], drafts.confidence[0]

    return draft


def confident_prefix_length(confidence: Tensor, *, threshold: float) -> int:
    """Slots before the first whose predicted acceptance is below `threshold` (all for threshold 0)."""
    if threshold <= 0:
        return int(confidence.shape[0])
    below = torch.nonzero(confidence < threshold).flatten()
    return int(below[0]) if below.numel() else int(confidence.shape[0])


@dataclass(kw_only=True)
class Prefilled:
    """The state after the prefill: the target's cache over the prompt, the committed tokens'
    features (row i = position i, rows filled as tokens are verified), the first token."""

    cache: object  # transformers DynamicCache
    features: Tensor  # [capacity, F]
    tokens: list[int]
    done: bool
    start: float
    prefill_end: float
    rope_delta: int | None = None  # vision-language targets: later positions are index + rope_delta


def prefill(target, prompt_ids: list[int], *, layer_ids: list[int], extra_rows: int, max_new_tokens: int,
            temperature: float, generator, stop_token_ids: set[int], image: PromptImage | None = None) -> Prefilled:  # fmt: skip
    """Prefill forward over the prompt (timed apart from decoding) and the first token."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    sync_device(device)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    out, rope_delta = prompt_forward(
        target, prompt_ids, image=image, cache=cache, output_hidden_states=True, logits_to_keep=1
    )
    prompt_features = tapped_features(out.hidden_states, layer_ids)[0]  # [n, F]
    num_prompt = len(prompt_ids)
    features = prompt_features.new_empty((num_prompt + max_new_tokens + extra_rows, prompt_features.shape[-1]))
    features[:num_prompt] = prompt_features
    first = sample_tokens(out.logits[:, -1], temperature=temperature, generator=generator)  # [1]
    tokens, done = commit_tokens([int(first)], num_generated=0, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    sync_device(device)
    return Prefilled(
        cache=cache, features=features, tokens=tokens, done=done, start=start, prefill_end=time.perf_counter(),
        rope_delta=rope_delta,
    )  # fmt: skip


@torch.inference_mode()
def speculative_decode(
    target,
    drafter: DFlashDrafter,
    *,
    embed_tokens: nn.Module,
    lm_head: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    stop_token_ids: list[int],
    generator: torch.Generator | None,
    mask_token_id: int,
    draft_fn: DraftFn | None = None,
    image: PromptImage | None = None,
    confidence_threshold: float = 0.0,
) -> DecodeResult:
    """Speculative decoding of one prompt (see the module docstring).

    `draft_fn(context_features=..., anchor_token=..., anchor_pos=...) -> [K]` replaces the drafter's
    draft step (cached_draft_fn) when given (tests use an oracle and the uncached drafter_draft);
    the drafter's config still sets the block size and the tapped layers. `image` is a
    vision-language prompt's image.
    """
    check_decode_args(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature)
    if draft_fn is None:
        draft_fn = cached_family_draft_fn(drafter, embed_tokens=embed_tokens, lm_head=lm_head, confidence_threshold=confidence_threshold)

    device = next(target.parameters()).device
    layer_ids = list(drafter.config.target_layer_ids)
    num_draft = drafter.config.num_drafts  # the family's drafts per block
    stops = set(stop_token_ids)
    num_prompt = len(prompt_ids)
    state = prefill(
        target, prompt_ids, layer_ids=layer_ids, extra_rows=num_draft + 1, max_new_tokens=max_new_tokens,
        temperature=temperature, generator=generator, stop_token_ids=stops, image=image,
    )  # fmt: skip
    cache, features, tokens, done = state.cache, state.features, state.tokens, state.done

    accepted_lengths, proposed_lengths, confidences = [], [], []
    while not done:
        anchor_pos = num_prompt + len(tokens) - 1  # position of the last committed token
        anchor = tokens[-1]
        assert cache.get_seq_length() == anchor_pos, (cache.get_seq_length(), anchor_pos)
        draft = draft_fn(context_features=features[:anchor_pos], anchor_token=anchor, anchor_pos=anchor_pos)  # [D]
        if isinstance(draft, tuple):  # the drafter's tokens and its predicted acceptance per slot
            draft, confidence = draft
            confidences.append([round(float(c), 6) for c in confidence])
        assert draft.dim() == 1 and draft.shape[0] <= num_draft, draft.shape
        proposed_lengths.append(int(draft.shape[0]))

        block = torch.cat([torch.tensor([anchor], device=device), draft.to(device)])[None]  # [1, D + 1]
        positions = position_kwargs(state.rope_delta, start=anchor_pos, length=block.shape[1], device=device)
        out = target(input_ids=block, past_key_values=cache, use_cache=True, output_hidden_states=True, **positions)
        posterior = sample_tokens(out.logits[0], temperature=temperature, generator=generator)  # [K + 1]
        num_accepted = accept_length(draft.to(device), posterior)

        # The anchor and the accepted draft tokens are now committed context: keep their cache
        # entries and features; drop the rejected tail.
        num_kept = num_accepted + 1
        crop_cache(cache, anchor_pos + num_kept)
        features[anchor_pos : anchor_pos + num_kept] = tapped_features(out.hidden_states, layer_ids)[0, :num_kept]
        new_tokens = posterior[:num_kept].tolist()  # accepted drafts (== posterior there) + one target token
        new, done = commit_tokens(
            new_tokens, num_generated=len(tokens), max_new_tokens=max_new_tokens, stop_token_ids=stops
        )
        tokens += new
        # A round cut short by a stop token or max_new_tokens counts only what it committed, so
        # sum(accepted + 1) over rounds == tokens generated after the prefill.
        accepted_lengths.append(min(num_accepted, len(new) - 1))
    sync_device(device)
    end = time.perf_counter()
    return DecodeResult(
        tokens=tokens,
        accepted_lengths=accepted_lengths,
        rounds=len(accepted_lengths),
        decode_s=end - state.prefill_end,
        prefill_s=state.prefill_end - state.start,
        proposed_lengths=proposed_lengths,
        confidences=confidences,
    )
