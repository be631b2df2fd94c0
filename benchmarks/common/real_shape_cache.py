"""A synthetic cache at the real Qwen3-4B shapes (F = 5 taps x 2560, V = 151,936, T ~ 700, A = 128
anchors, K = 15, top-k 8; random bf16 features) written through storage's Zarr writer, the
trainer's objective bound to it, and the DFlash drafter of that shape (docs/benchmarks.md, "Real
shapes"). speed/real_shapes.py, speed/cache_settings.py and harness/gpu_check.py measure on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common.records import bf16_bits, synthetic_manifest, topk_labels
from drafter.config import DFlashConfig, default_target_layer_ids
from pipeline.train.labels import ObjectiveConfig
from storage.manifest import save_manifest
from storage.shards import write_shard

MASK_TOKEN_ID = 151_669  # a token id below V (the drafter's MASK slot)
STOP_TOKEN_ID = 151_645  # <|im_end|>


@dataclass(frozen=True, kw_only=True)
class Shapes:
    """The synthetic cache, the drafter step and the stage-1 worker of one run."""

    num_sequences: int
    seq_len: tuple[int, int]  # T drawn uniformly from [lo, hi)
    hidden_size: int  # target hidden H; F = num_taps * H
    num_taps: int
    num_target_layers: int
    vocab_size: int
    num_anchors: int  # A
    num_slots: int  # K
    top_k: int
    loader_repeats: int  # timed passes of (b), after one warm-up
    rank_batch: int  # sequences per rank and step (global batch 24 over 8 ranks)
    # (c) the drafter step
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    step_batch: int
    anchors_per_step: int
    step_repeats: int  # timed steps after one warm-up
    # (d) the stage-1 worker
    stage1_hidden: int
    stage1_layers: int
    stage1_heads: int
    stage1_intermediate: int
    stage1_taps: tuple[int, ...]
    stage1_shard_sizes: tuple[int, int]
    stage1_max_length: int
    stage1_response_words: tuple[int, int]

    @property
    def feature_dim(self) -> int:
        return self.num_taps * self.hidden_size

    @classmethod
    def from_dict(cls, fields: dict) -> Shapes:
        """The shapes sent to a fresh process as `dataclasses.asdict` (tuples come back as lists)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


FULL = Shapes(
    num_sequences=9, seq_len=(650, 750), hidden_size=2560, num_taps=5, num_target_layers=36, vocab_size=151_936,
    num_anchors=128, num_slots=15, top_k=8, loader_repeats=3, rank_batch=3,
    intermediate_size=9728, num_heads=32, num_kv_heads=8, head_dim=128, step_batch=2, anchors_per_step=16,
    step_repeats=1,
    stage1_hidden=512, stage1_layers=7, stage1_heads=8, stage1_intermediate=1536, stage1_taps=(1, 2, 3, 4, 5),
    stage1_shard_sizes=(8, 32), stage1_max_length=768, stage1_response_words=(500, 700),
)  # fmt: skip
QUICK = Shapes(
    num_sequences=4, seq_len=(60, 80), hidden_size=32, num_taps=2, num_target_layers=8, vocab_size=151_936,
    num_anchors=8, num_slots=7, top_k=4, loader_repeats=1, rank_batch=2,
    intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=32, step_batch=2, anchors_per_step=4,
    step_repeats=1,
    stage1_hidden=64, stage1_layers=3, stage1_heads=2, stage1_intermediate=128, stage1_taps=(0, 1),
    stage1_shard_sizes=(1, 3), stage1_max_length=128, stage1_response_words=(30, 60),
)  # fmt: skip


def synthetic_record(rng: np.random.Generator, shapes: Shapes, *, source_row: int) -> dict[str, np.ndarray]:
    """One schema-valid record (storage/format.py): a prompt of T/8 tokens, then supervised tokens,
    the anchor pool drawn from positions whose K slots stay inside the sequence."""
    num_tokens = int(rng.integers(*shapes.seq_len))
    num_anchors, num_slots, top_k, vocab = shapes.num_anchors, shapes.num_slots, shapes.top_k, shapes.vocab_size
    prompt = num_tokens // 8
    input_ids = rng.integers(0, vocab, size=num_tokens).astype(np.int32)  # [T]
    loss_mask = np.zeros(num_tokens, dtype=np.uint8)  # [T]
    loss_mask[prompt:] = 1
    anchor_pos = np.sort(rng.choice(np.arange(prompt, num_tokens - num_slots - 1), size=num_anchors, replace=False))
    corpus_ids, corpus_probs, corpus_tail = topk_labels(rng, (num_tokens,), top_k=top_k, vocab_size=vocab)
    rollout_ids, rollout_probs, rollout_tail = topk_labels(rng, (num_anchors, num_slots), top_k=top_k, vocab_size=vocab)
    rollout_tokens = rng.integers(0, vocab, size=(num_anchors, num_slots + 1)).astype(np.int32)  # [A, K+1]
    rollout_tokens[:, 0] = input_ids[anchor_pos]
    return {
        "source_row": np.asarray(source_row, dtype=np.int64),
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "features": bf16_bits(rng, (num_tokens, shapes.feature_dim)),  # [T, F]
        "corpus_topk_ids": corpus_ids,  # [T, k]
        "corpus_topk_probs": corpus_probs,
        "corpus_tail": corpus_tail,  # [T]
        "corpus_next_prob": rng.random(num_tokens, dtype=np.float32),
        "anchor_pos": anchor_pos.astype(np.int32),  # [A]
        "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": rollout_ids,  # [A, K, k]
        "rollout_topk_probs": rollout_probs,
        "rollout_tail": rollout_tail,  # [A, K]
        "rollout_features": bf16_bits(rng, (num_anchors, num_slots - 2, shapes.feature_dim)),  # [A, K-2, F]
    }


def layer_ids(shapes: Shapes) -> list[int]:
    return default_target_layer_ids(num_target_layers=shapes.num_target_layers, num_draft_layers=shapes.num_taps)


def save_real_shape_manifest(root: Path, shards: list, shapes: Shapes, *, num_records: int, created_with: str,
                             feature_codec: str = "bf16", **settings) -> None:  # fmt: skip
    """The manifest of a one-shard cache of `num_records` synthetic records of `shapes`
    (`settings`: CacheSettings' further fields)."""
    save_manifest(root, synthetic_manifest(
        shards, source_hash="sha256:real-shapes", layer_ids=layer_ids(shapes), num_slots=shapes.num_slots, top_k=shapes.top_k,
        num_anchors=shapes.num_anchors, max_length=shapes.seq_len[1], storage_format="zarr", shard_size=num_records,
        num_target_layers=shapes.num_target_layers, hidden_size=shapes.hidden_size, vocab_size=shapes.vocab_size,
        stop_token_ids=[STOP_TOKEN_ID], mask_token_id=MASK_TOKEN_ID, created_with=created_with, feature_codec=feature_codec,
        **settings,
    ))  # fmt: skip


def write_cache(root: Path, shapes: Shapes, *, seed: int = 0) -> Path:
    """One Zarr shard (bf16 features) of `shapes.num_sequences` synthetic records, and its manifest."""
    rng = np.random.default_rng(seed)
    records = [synthetic_record(rng, shapes, source_row=i) for i in range(shapes.num_sequences)]
    shard = write_shard(root, shard_index=0, records=records, storage_format="zarr", feature_codec="bf16")
    save_real_shape_manifest(root, [shard], shapes, num_records=len(records), created_with="benchmarks/common/real_shape_cache.py")
    return root


def objective(method: str, reader, *, anchors_per_step: int | None = None) -> ObjectiveConfig:
    """The trainer's objective for `method` bound to the cache (R = K - 1)."""
    m = reader.manifest
    num_slots = m.settings.num_slots
    return ObjectiveConfig(
        method=method, rollout_depth=num_slots - 1, anchors_per_step=anchors_per_step, num_slots=num_slots
    ).for_cache(num_slots=num_slots, mask_token_id=m.mask_token_id, stop_token_ids=m.stop_token_ids)


def drafter_config(shapes: Shapes) -> DFlashConfig:
    """A 1-layer DFlash drafter at the shapes' hidden size, heads and vocabulary (the Qwen3-4B
    DFlash shape at FULL)."""
    return DFlashConfig(
        hidden_size=shapes.hidden_size, intermediate_size=shapes.intermediate_size, num_hidden_layers=1,
        num_attention_heads=shapes.num_heads, num_key_value_heads=shapes.num_kv_heads, head_dim=shapes.head_dim,
        max_position_embeddings=40_960, vocab_size=shapes.vocab_size, block_size=shapes.num_slots + 1,
        num_target_layers=shapes.num_target_layers, target_layer_ids=layer_ids(shapes), mask_token_id=MASK_TOKEN_ID,
    )  # fmt: skip
