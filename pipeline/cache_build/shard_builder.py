"""The work of one shard: load the target once, then compute whole shards of the tokenized corpus.

`ray_jobs.build` runs `ShardBuilder.build` on a pool of Ray actors; `pipeline.cache_build.driver`
plans the shards. Everything here also runs in a plain process (tests, benchmarks, one shard).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.cache_build.config import CacheBuildConfig, compute_record
from pipeline.cache_build.corpus import corpus_vision_inputs, load_tokenized_corpus
from pipeline.cache_build.rollouts import TargetSequence, anchor_pool_size, run_target_batch
from pipeline.target import load_target
from storage.codecs import encode_features, encode_features_tensor
from storage.format import ALL_GROUPS, CORPUS_DIR, array_codecs, ira_parent_rows, num_parents, record_array_names
from storage.location import resolve
from storage.manifest import ShardRecord
from storage.formats.zarr.write import set_codec_threads
from storage.shards import ShardSize, ShardWriter

# Batches computed and handed to the writer that may wait for it while the next one computes: two
# keep the writer busy across a batch whose records write slower than the next computes.
WRITE_QUEUE_BATCHES = 2
PLAIN_ARRAYS = (
    "input_ids", "loss_mask", "corpus_topk_ids", "corpus_topk_probs", "corpus_tail", "corpus_next_prob",
    "anchor_pos", "rollout_tokens", "rollout_topk_ids", "rollout_topk_probs", "rollout_tail",
)  # fmt: skip
FEATURE_ARRAYS = (("features", "feature_scales"), ("rollout_features", "rollout_feature_scales"))


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


def _feature_rows(outputs, name: str, ira_parents: int | None) -> torch.Tensor:
    """Feature array `name` of one sequence's outputs as stored: the rollout features of the IRA
    parents only (storage.format.ira_parent_rows) when the cache keeps some."""
    features = getattr(outputs, name)
    if name != "rollout_features" or ira_parents is None or num_parents(len(features), ira_parents) == len(features):
        return features
    return features[torch.from_numpy(ira_parent_rows(len(features), ira_parents)).to(features.device)]


def outputs_to_record(
    outputs, *, feature_codec: str, contents=ALL_GROUPS, rollout_feature_codec: str | None = None,
    ira_parents: int | None = None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """TargetOutputs -> the per-sequence record of storage/format.py (features encoded), holding
    the arrays of the array groups `contents` only, rollout features for `ira_parents` anchors."""
    names = set(record_array_names(feature_codec, contents, rollout_feature_codec))
    codecs = array_codecs(feature_codec, rollout_feature_codec)
    record = {"source_row": np.asarray(outputs.source_row, dtype=np.int64)}
    for name in PLAIN_ARRAYS:
        if name in names:
            record[name] = getattr(outputs, name).cpu().numpy()
    for name, scale_name in FEATURE_ARRAYS:
        if name not in names:
            continue
        bits, scales = encode_features(_feature_rows(outputs, name, ira_parents), codec=codecs[name])
        record[name] = bits
        if scales is not None:
            record[scale_name] = scales
    return record


def outputs_to_records(
    outputs: list, *, feature_codec: str, contents=ALL_GROUPS, rollout_feature_codec: str | None = None,
    ira_parents: int | None = None,
) -> list[dict[str, np.ndarray]]:  # fmt: skip
    """A batch's TargetOutputs -> its records, as outputs_to_record, with the device doing the work:
    features are checked finite and encoded where they were computed, then every array goes to
    the host at once, on CUDA by non-blocking copies into pinned buffers and one synchronize for
    the batch (docs/design.md, "A cache build")."""
    names = set(record_array_names(feature_codec, contents, rollout_feature_codec))
    codecs = array_codecs(feature_codec, rollout_feature_codec)
    on_device, finite = [], []
    for o in outputs:
        arrays = {name: getattr(o, name) for name in PLAIN_ARRAYS if name in names}
        for name, scale_name in FEATURE_ARRAYS:
            if name in names:
                features = _feature_rows(o, name, ira_parents)
                if features.is_floating_point():
                    finite.append(torch.isfinite(features).all())
                arrays[name], scales = encode_features_tensor(features, codec=codecs[name])
                if scales is not None:
                    arrays[scale_name] = scales
        on_device.append(arrays)
    all_finite = _to_host(torch.stack(finite).all()) if finite else None
    on_host = [{name: _to_host(tensor) for name, tensor in arrays.items()} for arrays in on_device]
    if torch.cuda.is_available() and any(t.is_pinned() for arrays in on_host for t in arrays.values()):
        torch.cuda.synchronize()
    if all_finite is not None and not bool(all_finite):
        raise ValueError("features contain NaN or infinite values; refusing to encode them into the cache")
    return [
        {"source_row": np.asarray(o.source_row, dtype=np.int64), **{name: t.numpy() for name, t in arrays.items()}}
        for o, arrays in zip(outputs, on_host, strict=True)
    ]


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor as it is; a CUDA one copied, without waiting, into a new pinned buffer (the
    caller synchronizes once for all of them)."""
    if tensor.device.type != "cuda":
        return tensor
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor, non_blocking=True)


@dataclass(kw_only=True)
class BuildTimes:
    """Where shard builders' time went, in seconds (summed over shards and workers with `+=`):
    computing batches (the target, then the encode and copy to the host), waiting on the writer
    (a full queue, the end of each shard and its publish), and in all."""

    compute_s: float = 0.0
    writer_wait_s: float = 0.0
    total_s: float = 0.0

    def __iadd__(self, other: BuildTimes) -> BuildTimes:
        self.compute_s, self.writer_wait_s, self.total_s = (
            self.compute_s + other.compute_s, self.writer_wait_s + other.writer_wait_s, self.total_s + other.total_s,
        )  # fmt: skip
        return self

    def shares(self) -> str:
        """`compute 81%, waiting on the writer 14%` of the builders' time (what the build waits on)."""
        if self.total_s <= 0:
            return "no shard computed"
        return (
            f"compute {100 * self.compute_s / self.total_s:.0f}%, "
            f"waiting on the writer {100 * self.writer_wait_s / self.total_s:.0f}%"
        )


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
            raise ValueError("ShardBuilder needs resolved taps (pipeline.cache_build.plan.resolve_layer_ids)")
        self.config = config
        torch.set_num_threads(config.compute.cpus_per_worker)
        set_codec_threads(config.compute.cpus_per_worker)  # before this process's first Zarr write
        self.times = BuildTimes()  # of the last shard built
        device, dtype = config.compute.device_and_dtype()
        self.compute = compute_record(device, dtype)  # recorded in each shard (`auto` resolved on this machine)
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

    def build(
        self, *, shard_index: int, start: int, stop: int, owner: str | None = None,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> ShardRecord:  # fmt: skip
        """Compute sequences [start, stop) of the tokenized corpus and publish them as one shard
        (only while the build `owner` still owns the cache, see storage.ownership.claim_cache);
        `on_batch(sequences, tokens)` is called as each batch's records reach the writer.

        Records go to the shard in batch order (longest first) as they are computed: a background
        thread hands batch i to the writer (which encodes on --cpus-per-worker threads) while
        batch i + 1 runs on the target, and at most WRITE_QUEUE_BATCHES batches wait, so memory
        does not grow with the shard (docs/design.md, "A cache build"). `self.times` says how
        long this shard computed and waited on the writer."""
        began = time.perf_counter()
        sequences = [self._sequence(i) for i in range(start, stop)]
        run, storage, contents = self.config.run, self.config.storage, self.config.contents
        layout = self.config.layout  # codecs and --ira-parents, --compact resolved
        ira_parents, times = layout["ira_parents"], BuildTimes()
        pools = [anchor_pool_size(s.loss_mask, num_anchors=run.anchors_per_sequence) for s in sequences]
        size = ShardSize(
            num_sequences=len(sequences),
            num_tokens=sum(len(s.input_ids) for s in sequences),
            num_anchors=sum(pools),
            num_parents=None if ira_parents is None else sum(num_parents(a, ira_parents) for a in pools),
        )
        batches = plan_batches([len(s.input_ids) for s in sequences], batch_tokens=self.config.compute.batch_tokens)
        codecs = {"feature_codec": layout["feature_codec"], "rollout_feature_codec": layout["rollout_feature_codec"]}

        def write(records: list[dict]) -> None:
            for record in records:
                writer.append(record)
            if on_batch is not None:
                on_batch(len(records), sum(len(r["input_ids"]) for r in records))

        with ShardWriter(
            self.config.out, shard_index=shard_index, size=size, storage_format=storage.storage_format,
            contents=contents, owner=owner, num_threads=self.config.compute.cpus_per_worker, ira_parents=ira_parents,
            compute=self.compute, **codecs,
        ) as writer:  # fmt: skip
            # The pool is left (its write finished) before the writer aborts on an error.
            seconds: dict[str, float] = {}  # target time per part of the cache (docs/design.md, "A cache build")
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer") as pool:
                queued = collections.deque()
                try:
                    for batch in batches:
                        computing = time.perf_counter()
                        outputs = self.run_batch([sequences[i] for i in batch], seconds=seconds)
                        records = outputs_to_records(outputs, contents=contents, ira_parents=ira_parents, **codecs)
                        del outputs  # the device tensors: the records hold the host copies
                        waiting = time.perf_counter()
                        times.compute_s += waiting - computing
                        while len(queued) >= WRITE_QUEUE_BATCHES:
                            queued.popleft().result()  # an earlier batch is written (its error raised) first
                        times.writer_wait_s += time.perf_counter() - waiting
                        queued.append(pool.submit(write, records))
                    waiting = time.perf_counter()
                    while queued:
                        queued.popleft().result()
                except BaseException:
                    for future in queued:
                        future.cancel()
                    raise
            record = writer.publish()
            times.writer_wait_s += time.perf_counter() - waiting
        times.total_s = time.perf_counter() - began
        self.times = times
        return dataclasses.replace(record, build_seconds={k: round(v, 3) for k, v in seconds.items()} or None)

    def _sequence(self, i: int) -> TargetSequence:
        # A vision-language sequence carries its image, re-read and checked when its batch runs.
        return self.corpus.target_sequence(i, vision=self.vision)

    def pid(self) -> int:
        return os.getpid()
