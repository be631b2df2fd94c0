"""Synthetic cache records for the storage benchmarks: every array of storage/format.py at real
shapes, random bf16 features and random top-k distributions, and the manifest of a cache of them
(no target behind it: its hash, path and config are placeholders).

`make_record` is the small record of speed/read_checksums.py, object_store.py and store_stream.py;
real_shape_cache.py builds its Qwen3-4B-shaped records from the same pieces."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.common.cli import bench_parser
from storage.manifest import CacheSettings, Manifest

SMALL_VOCAB = 150_000  # the small records' token ids are drawn below this


def bf16_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal values rounded to bf16, as the uint16 bits the cache stores."""
    values = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(torch.bfloat16)
    return values.view(torch.int16).numpy().view(np.uint16)


def topk_labels(rng: np.random.Generator, shape: tuple[int, ...], *, top_k: int, vocab_size: int):
    """(ids, probabilities, tail mass): sorted top-k probabilities summing below 1, random ids."""
    probs = -np.sort(-rng.dirichlet(np.ones(top_k + 1), size=shape)[..., :top_k], axis=-1).astype(np.float32)
    tail = np.maximum(0.0, 1.0 - probs.sum(-1)).astype(np.float32)
    return rng.integers(0, vocab_size, size=(*shape, top_k)).astype(np.int32), probs, tail


def synthetic_manifest(shards: list, *, source_hash: str, layer_ids: list[int], num_slots: int, top_k: int, num_anchors: int,
                       max_length: int, storage_format: str, shard_size: int, num_target_layers: int, hidden_size: int,
                       vocab_size: int, stop_token_ids: list[int], mask_token_id: int, created_with: str,
                       feature_codec: str = "bf16", **settings) -> Manifest:  # fmt: skip
    """The manifest of synthetic `shards` (`settings`: CacheSettings' further fields, e.g. contents);
    `source_hash` stands for both the target's and the corpus's hash."""
    return Manifest(
        settings=CacheSettings(
            target_hash=source_hash, layer_ids=layer_ids, num_slots=num_slots, top_k=top_k, anchors_per_sequence=num_anchors,
            seed=0, max_length=max_length, min_supervised_tokens=0, feature_codec=feature_codec, storage_format=storage_format,
            shard_size=shard_size, corpus_hash=source_hash, skip_bad_rows=False, **settings,
        ),
        target_path="-", target_config={}, num_target_layers=num_target_layers, hidden_size=hidden_size, vocab_size=vocab_size,
        stop_token_ids=stop_token_ids, mask_token_id=mask_token_id, corpus_path="-", corpus_stats={}, shards=list(shards),
        num_shards_planned=len(shards), created_with=created_with,
    )  # fmt: skip


@dataclass(frozen=True)
class RecordSizes:
    """The small records: every sequence T tokens, F features per token, A anchors."""

    num_sequences: int
    seq_len: int  # T
    feature_dim: int  # F
    num_anchors: int  # A
    num_slots: int = 15  # K
    top_k: int = 8
    repeats: int = 3


RECORDS_FULL = RecordSizes(num_sequences=16, seq_len=512, feature_dim=2048, num_anchors=64)
RECORDS_QUICK = RecordSizes(num_sequences=4, seq_len=64, feature_dim=64, num_anchors=8, repeats=1)


def make_record(rng: np.random.Generator, sizes: RecordSizes, source_row: int) -> dict[str, np.ndarray]:
    """One schema-valid record, every token supervised, anchors anywhere but the last token."""
    t, a, k, top_k = sizes.seq_len, sizes.num_anchors, sizes.num_slots, sizes.top_k
    input_ids = rng.integers(0, SMALL_VOCAB, size=t).astype(np.int32)
    anchor_pos = np.sort(rng.choice(t - 1, size=a, replace=False)).astype(np.int32)
    corpus_ids, corpus_probs, corpus_tail = topk_labels(rng, (t,), top_k=top_k, vocab_size=SMALL_VOCAB)
    rollout_ids, rollout_probs, rollout_tail = topk_labels(rng, (a, k), top_k=top_k, vocab_size=SMALL_VOCAB)
    rollout_tokens = rng.integers(0, SMALL_VOCAB, size=(a, k + 1)).astype(np.int32)
    rollout_tokens[:, 0] = input_ids[anchor_pos]
    return {
        "source_row": np.asarray(source_row, dtype=np.int64),
        "input_ids": input_ids,
        "loss_mask": np.ones(t, dtype=np.uint8),
        "features": bf16_bits(rng, (t, sizes.feature_dim)),
        "corpus_topk_ids": corpus_ids,
        "corpus_topk_probs": corpus_probs,
        "corpus_tail": corpus_tail,
        "corpus_next_prob": rng.random(t, dtype=np.float32),
        "anchor_pos": anchor_pos,
        "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": rollout_ids,
        "rollout_topk_probs": rollout_probs,
        "rollout_tail": rollout_tail,
        "rollout_features": bf16_bits(rng, (a, k - 2, sizes.feature_dim)),
    }


def small_manifest(shards: list, sizes: RecordSizes, *, storage_format: str, shard_size: int, created_with: str) -> Manifest:
    """The manifest of shards of small records (one tap of F features)."""
    return synthetic_manifest(
        shards, source_hash="sha256:bench", layer_ids=[0], num_slots=sizes.num_slots, top_k=sizes.top_k,
        num_anchors=sizes.num_anchors, max_length=sizes.seq_len, storage_format=storage_format, shard_size=shard_size,
        num_target_layers=2, hidden_size=sizes.feature_dim, vocab_size=SMALL_VOCAB, stop_token_ids=[1], mask_token_id=2,
        created_with=created_with,
    )  # fmt: skip


def records_from_command_line(doc: str) -> tuple[RecordSizes, list[dict[str, np.ndarray]], float]:
    """(sizes, records, their MB) for a script taking --quick and --threads (speed/read_checksums.py and
    object_store.py), the sizes printed."""
    parser = bench_parser(doc, quick_help="Tiny sizes (a smoke run for CI).", threads=1, threads_help="torch threads.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = RECORDS_QUICK if args.quick else RECORDS_FULL
    rng = np.random.default_rng(0)
    records = [make_record(rng, sizes, source_row=i) for i in range(sizes.num_sequences)]
    raw_mb = sum(v.nbytes for r in records for v in r.values()) / 1e6
    print(f"{sizes.num_sequences} sequences, T={sizes.seq_len}, F={sizes.feature_dim}, A={sizes.num_anchors}, "
          f"K={sizes.num_slots}, top-k {sizes.top_k}: {raw_mb:.1f} MB of records; median of {sizes.repeats}")  # fmt: skip
    return sizes, records, raw_mb
