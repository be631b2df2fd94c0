"""The work of one shard: load the target once, then compute whole shards of the tokenized corpus.

`ray_jobs.build` runs `ShardBuilder.build` on a pool of Ray actors; `pipeline.cache_build.driver`
plans the shards. Everything here also runs in a plain process (tests, benchmarks, one shard).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.corpus import corpus_vision_inputs, load_tokenized_corpus
from pipeline.cache_build.rollouts import TargetSequence, anchor_pool_size, run_target_batch
from pipeline.target import load_target
from storage.codecs import encode_features
from storage.format import ALL_GROUPS, CORPUS_DIR, record_array_names
from storage.location import resolve
from storage.manifest import ShardRecord
from storage.shards import ShardSize, ShardWriter


def plan_batches(lengths: list[int], *, batch_tokens: int) -> list[list[int]]:
    """Split sequence indices into batches whose padded size stays within batch_tokens, packing
    sequences longest first so each batch holds similar lengths (little padding; docs/design.md,
    "A cache build").

    Deterministic in the lengths alone (ties keep index order), so a shard is always computed with
    the same batches in the same order (padding changes floating-point rounding, and a resumed
    build must match an uninterrupted one).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current, longest = [], [], 0
    for i in order:
        n = lengths[i]
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


def fix_mmap_threshold(num_bytes: int = 1 << 20) -> None:
    """Serve allocations of num_bytes or more by mmap, always (glibc's M_MMAP_THRESHOLD).

    glibc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which a
    batch's many-MB CPU tensors come from the heap and fragment it: a worker's RSS then crept up
    ~30 MB per batch while the shard writer's buffers stayed bounded. With a fixed threshold it
    stays flat (docs/benchmarks.md, "Real shapes" (d)). No-op where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, int(num_bytes))  # M_MMAP_THRESHOLD = -3 (malloc.h); fixing it disables the dynamic rise


class ShardBuilder:
    """Loads the target once; builds whole shards of the tokenized corpus on request."""

    def __init__(self, config: CacheBuildConfig):
        if config.run.layer_ids is None:
            raise ValueError("ShardBuilder needs resolved taps (pipeline.cache_build.driver.resolve_layer_ids)")
        self.config = config
        torch.set_num_threads(config.compute.cpus_per_worker)
        device, dtype = config.compute.device_and_dtype()
        if config.compute.backend == "vllm":
            from pipeline.cache_build.vllm_runner import VllmTargetRunner

            runner = VllmTargetRunner(
                config.target,
                run_config=config.run,
                tensor_parallel_size=config.compute.tensor_parallel_size,
                dtype=str(dtype).removeprefix("torch."),
            )
            self.run_batch = lambda sequences, seconds=None: runner.run(sequences)  # one engine call: no split by part
        else:
            model = load_target(config.target, device=device, dtype=dtype)
            self.run_batch = lambda sequences, seconds=None: run_target_batch(model, sequences, config.run, seconds=seconds)
        # --out on a store: a node-local copy of the tokenized corpus, shared by this node's workers.
        self.corpus = load_tokenized_corpus(resolve(config.out).child(CORPUS_DIR).local_copy(), mmap=True)
        self.vision = corpus_vision_inputs(config.target, config.corpus)  # None for a text target
        fix_mmap_threshold()

    def build(self, *, shard_index: int, start: int, stop: int, owner: str | None = None) -> ShardRecord:
        """Compute sequences [start, stop) of the tokenized corpus and publish them as one shard
        (only while the build `owner` still owns the cache, see storage.ownership.claim_cache).

        Records go to the shard in batch order (longest first) as they are computed: a background
        thread encodes and writes batch i while batch i + 1 runs on the target, and at most one
        batch waits, so memory does not grow with the shard (docs/design.md, "A cache build")."""
        sequences = [self._sequence(i) for i in range(start, stop)]
        run, storage, contents = self.config.run, self.config.storage, self.config.contents
        size = ShardSize(
            num_sequences=len(sequences),
            num_tokens=sum(len(s.input_ids) for s in sequences),
            num_anchors=sum(anchor_pool_size(s.loss_mask, num_anchors=run.anchors_per_sequence) for s in sequences),
        )
        batches = plan_batches([len(s.input_ids) for s in sequences], batch_tokens=self.config.compute.batch_tokens)
        codec = storage.feature_codec

        def write(outputs) -> None:
            for o in outputs:
                writer.append(outputs_to_record(o, feature_codec=codec, contents=contents))

        with ShardWriter(
            self.config.out, shard_index=shard_index, size=size, storage_format=storage.storage_format,
            feature_codec=codec, contents=contents, owner=owner,
        ) as writer:  # fmt: skip
            # The pool is left (its write finished) before the writer aborts on an error.
            seconds: dict[str, float] = {}  # target time per part of the cache (docs/design.md, "A cache build")
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
                writing = None
                for batch in batches:
                    outputs = self.run_batch([sequences[i] for i in batch], seconds=seconds)
                    if writing is not None:
                        writing.result()  # the previous batch is written (its error raised) first
                    writing = pool.submit(write, outputs)
                if writing is not None:
                    writing.result()
            record = writer.publish()
            return dataclasses.replace(record, build_seconds={k: round(v, 3) for k, v in seconds.items()} or None)

    def _sequence(self, i: int) -> TargetSequence:
        # A vision-language sequence carries its image, re-read and checked when its batch runs.
        return self.corpus.target_sequence(i, vision=self.vision)

    def pid(self) -> int:
        return os.getpid()
