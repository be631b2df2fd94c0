"""The cache and the trainer at the real Qwen3-4B shapes, on CPU (docs/benchmarks.md, "Real shapes").

Synthesizes a few sequences of a cache at Qwen3-4B shapes (F = 5 taps x 2560, V = 151,936, T ~ 700,
A = 128 anchors, K = 15, top-k 8; random bf16 features) through storage's Zarr writer, then in one run:

(a) bytes each method's loader reads per sequence (/proc/self/io rchar around
    `CacheTrainDataset[(0, i)]`, one process) against the least it needs: the on-disk bytes of the
    arrays `required_arrays(method)` names (rollout_features aside), plus for alr_ira the compressed
    chunks of the parents' rollout features it draws;
(b) loader sequences/s on one core (getitem + collate of per-rank batches, torch on 1 thread), and
    an 8-GPU node projection from (a) and (b); (b2) for alr and alr_ira the loader next to its
    floor, the same Blosc frames decoded by bare Blosc on one core, and the cores a rank needs;
(c) one drafter training step (forward_loss + backward) at the Qwen3-4B DFlash shape (1 layer,
    H 2560, 32 x 128 heads, 8 kv heads, I 9728, frozen fp32 embed/lm_head [151936, 2560]) in a
    fresh process: wall time and peak RSS;
(d) a stage-1 worker's peak RSS at two shard sizes (the driver with shards built in this process,
    a random Qwen3 of hidden 512 with 5 taps), a fresh process per size;
(e) stage 1's writer (storage.shards.ShardWriter: Blosc zstd + shuffle, CRC, the shard checksum)
    on real-shape records with 1 and 2 threads, a fresh process each: sequences/s, MB/s of feature
    bits, the shard checksums (equal: bytes do not depend on the threads), the cores per GPU
    that keep 15 sequences/s per GPU, and where the time goes (CPU by thread, the wall with no
    writer thread busy, fsync, checksum: the serial share and its Amdahl bound for 2 threads);
(f) bytes one alr epoch reads from a 48-sequence cache with F = 512 (hidden 512, one tap) against
    the on-disk bytes of what alr needs: the small per-token arrays' chunking.

    .venv/bin/python benchmarks/real_shapes.py [--quick] [--out DIR] [--threads 2] [--writer-only | --loader-only]

(g)-(i), every cache setting at these shapes (bytes per corpus token by array group, the writer's
CPU, the codec profile, the alr_ira loader on the full and the compact cache), are
benchmarks/cache_settings.py, which builds its records with this file's `synthetic_record`.

Page cache warm: rchar counts the bytes read() returned, cached or not, which is what a loader
decompresses from.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from drafter.config import DFlashConfig, default_target_layer_ids
from drafter.model import DFlashDrafter
from pipeline.demo.toy import make_toy_target
from pipeline.train.batching import CacheTrainDataset, collate
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.step import forward_loss
from pipeline.train.methods import required_arrays
from storage.format import SHARD_DIR
from storage.manifest import CacheSettings, Manifest, save_manifest
from storage.reader import open_cache
from storage.shards import write_shard

from _common import empty_workdir, print_table, write_toy_corpus

METHODS = ("dflash", "kd", "erase", "alr", "alr_ira")
MASK_TOKEN_ID = 151_669  # a token id below V (the drafter's MASK slot)
STOP_TOKEN_ID = 151_645  # <|im_end|>
GIB = 1 << 30


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


# ---------------------------------------------------------------------------------------------
# The synthetic cache


def _bf16_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    values = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(torch.bfloat16)
    return values.view(torch.int16).numpy().view(np.uint16)


def _topk(rng: np.random.Generator, shape: tuple[int, ...], *, top_k: int, vocab_size: int):
    """Sorted top-k probabilities (summing below 1), their ids and the tail mass."""
    probs = -np.sort(-rng.dirichlet(np.ones(top_k + 1), size=shape)[..., :top_k], axis=-1).astype(np.float32)
    tail = np.maximum(0.0, 1.0 - probs.sum(-1)).astype(np.float32)
    return rng.integers(0, vocab_size, size=(*shape, top_k)).astype(np.int32), probs, tail


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
    corpus_ids, corpus_probs, corpus_tail = _topk(rng, (num_tokens,), top_k=top_k, vocab_size=vocab)
    rollout_ids, rollout_probs, rollout_tail = _topk(rng, (num_anchors, num_slots), top_k=top_k, vocab_size=vocab)
    rollout_tokens = rng.integers(0, vocab, size=(num_anchors, num_slots + 1)).astype(np.int32)  # [A, K+1]
    rollout_tokens[:, 0] = input_ids[anchor_pos]
    return {
        "source_row": np.asarray(source_row, dtype=np.int64),
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "features": _bf16_bits(rng, (num_tokens, shapes.feature_dim)),  # [T, F]
        "corpus_topk_ids": corpus_ids,  # [T, k]
        "corpus_topk_probs": corpus_probs,
        "corpus_tail": corpus_tail,  # [T]
        "corpus_next_prob": rng.random(num_tokens, dtype=np.float32),
        "anchor_pos": anchor_pos.astype(np.int32),  # [A]
        "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": rollout_ids,  # [A, K, k]
        "rollout_topk_probs": rollout_probs,
        "rollout_tail": rollout_tail,  # [A, K]
        "rollout_features": _bf16_bits(rng, (num_anchors, num_slots - 2, shapes.feature_dim)),  # [A, K-2, F]
    }


def layer_ids(shapes: Shapes) -> list[int]:
    return default_target_layer_ids(num_target_layers=shapes.num_target_layers, num_draft_layers=shapes.num_taps)


def write_cache(root: Path, shapes: Shapes, *, seed: int = 0) -> Path:
    """One Zarr shard (bf16 features) of `shapes.num_sequences` synthetic records, and its manifest."""
    rng = np.random.default_rng(seed)
    records = [synthetic_record(rng, shapes, source_row=i) for i in range(shapes.num_sequences)]
    shard = write_shard(root, shard_index=0, records=records, storage_format="zarr", feature_codec="bf16")
    settings = CacheSettings(
        target_hash="sha256:real-shapes", layer_ids=layer_ids(shapes), num_slots=shapes.num_slots, top_k=shapes.top_k,
        anchors_per_sequence=shapes.num_anchors, seed=0, max_length=shapes.seq_len[1], min_supervised_tokens=0,
        feature_codec="bf16", storage_format="zarr", shard_size=len(records), corpus_hash="sha256:real-shapes",
        skip_bad_rows=False,
    )  # fmt: skip
    save_manifest(root, Manifest(
        settings=settings, target_path="-", target_config={}, num_target_layers=shapes.num_target_layers,
        hidden_size=shapes.hidden_size, vocab_size=shapes.vocab_size, stop_token_ids=[STOP_TOKEN_ID],
        mask_token_id=MASK_TOKEN_ID, corpus_path="-", corpus_stats={}, shards=[shard], num_shards_planned=1,
        created_with="benchmarks/real_shapes.py",
    ))  # fmt: skip
    return root


def objective(method: str, reader, *, anchors_per_step: int | None = None) -> ObjectiveConfig:
    """The trainer's objective for `method` bound to the cache (R = K - 1)."""
    m = reader.manifest
    num_slots = m.settings.num_slots
    return ObjectiveConfig(
        method=method, rollout_depth=num_slots - 1, anchors_per_step=anchors_per_step, num_slots=num_slots
    ).for_cache(num_slots=num_slots, mask_token_id=m.mask_token_id, stop_token_ids=m.stop_token_ids)


# ---------------------------------------------------------------------------------------------
# (a) bytes read, (b) loader throughput


def rchar() -> int:
    """Bytes this process's read() calls have returned so far (all threads, page cache or disk)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def array_disk_bytes(cache: Path) -> dict[str, int]:
    """On-disk bytes of each array of the (single) shard: its chunk/shard files and metadata."""
    shard = cache / SHARD_DIR / "shard-00000.zarr"
    return {
        path.name: sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        for path in shard.iterdir()
        if path.is_dir()
    }


def drawn_parents(example) -> int:
    """Pool anchors whose rollout features an example's IRA secondaries see (what the loader reads)."""
    t = example.targets
    return len({int(p) for p, n in zip(t.private_parent.tolist(), t.private_len.tolist()) if p >= 0 and n > 0})


def measure_reads(reader, cache: Path, *, label: str, method: str, anchors_per_step: int | None) -> dict:
    """(a) for one method: rchar per CacheTrainDataset[(0, i)] over every sequence vs the minimum."""
    dataset = CacheTrainDataset(reader, objective=objective(method, reader, anchors_per_step=anchors_per_step), seed=0)
    disk = array_disk_bytes(cache)
    num_sequences = len(reader)
    base_min = sum(disk[name] for name in required_arrays(method) - {"rollout_features"})
    rollout_chunk = disk["rollout_features"] / reader.manifest.num_anchors  # one anchor per chunk at real shapes
    read, parents, decompressed = [], [], []
    for i in range(num_sequences):
        before = rchar()
        example = dataset[(0, i)]
        read.append(rchar() - before)
        parents.append(drawn_parents(example))
        encoded = reader.read(i, decode_features=False, arrays=dataset.arrays)
        decompressed.append(sum(v.nbytes for v in encoded.values()) + parents[-1] * (reader.manifest.settings.num_slots - 2) * reader.manifest.feature_dim * 2)
    minimum = base_min + sum(parents) * rollout_chunk
    return {
        "label": label,
        "method": method,
        "anchors_per_step": anchors_per_step,
        "read_mb_per_seq": sum(read) / num_sequences / 1e6,
        "min_mb_per_seq": minimum / num_sequences / 1e6,
        "ratio": sum(read) / minimum,
        "parents_per_seq": statistics.mean(parents),
        "decompressed_mb_per_seq": statistics.mean(decompressed) / 1e6,
        "rollout_features_mb_per_seq": disk["rollout_features"] / num_sequences / 1e6,
        "non_rollout_feature_mb_per_seq": sum(v for k, v in disk.items() if k != "rollout_features") / num_sequences / 1e6,
    }


def measure_loader(reader, *, method: str, shapes: Shapes, anchors_per_step: int | None) -> float:
    """(b) sequences/s of getitem + collate over per-rank batches, one process, median of passes."""
    dataset = CacheTrainDataset(reader, objective=objective(method, reader, anchors_per_step=anchors_per_step), seed=0)
    indices = list(range(len(reader)))
    batches = [indices[i : i + shapes.rank_batch] for i in range(0, len(indices), shapes.rank_batch)]
    rates = []
    for p in range(shapes.loader_repeats + 1):  # pass 0 warms up
        start = time.perf_counter()
        for batch in batches:
            collate([dataset[(p, i)] for i in batch])
        if p > 0:
            rates.append(len(indices) / (time.perf_counter() - start))
    return statistics.median(rates)


def sequence_chunk_bytes(cache: Path, *, index: int, arrays: set[str], parent_rows) -> list[bytes]:
    """The compressed Blosc frames the map loader decodes for sequence `index` of the
    (single-shard) cache: every chunk of `arrays` that its rows touch, and the chunks of the
    rollout_features rows `parent_rows` of its pool (read, crc32c checked, by storage/formats/zarr/rows.py)."""
    import zarr

    from storage.formats.zarr.rows import ZarrRows
    from storage.records import ANCHOR_INDEXED_ARRAYS

    shard = cache / SHARD_DIR / "shard-00000.zarr"
    chunks = ZarrRows(shard)
    seq_offsets, anchor_offsets = (zarr.open_array(shard / name, mode="r")[:] for name in ("seq_offsets", "anchor_offsets"))
    t0, t1, a0, a1 = (int(x) for x in (seq_offsets[index], seq_offsets[index + 1], anchor_offsets[index], anchor_offsets[index + 1]))
    wanted = {name: range(a0, a1) if name in ANCHOR_INDEXED_ARRAYS else range(t0, t1) for name in arrays - {"source_row"}}
    wanted["rollout_features"] = [a0 + int(r) for r in parent_rows]
    frames = []
    for name, rows in sorted(wanted.items()):
        size = chunks.layout(name).chunk_rows
        frames += [chunks.frame(name, c) for c in sorted({int(r) // size for r in rows})]
    return [f for f in frames if f is not None]


def _floor_frames(reader, cache: Path, dataset) -> list[list[bytes]]:
    """Per sequence, the Blosc frames the map loader decodes for it (its drawn parents included)."""
    frames = []
    for i in range(len(reader)):
        t = dataset[(0, i)].targets
        parents = {int(p) for p, n in zip(t.private_parent.tolist(), t.private_len.tolist()) if p >= 0 and n > 0}
        frames.append(sequence_chunk_bytes(cache, index=i, arrays=dataset.arrays, parent_rows=sorted(parents)))
    return frames


def _decode_pass(frames: list[list[bytes]]) -> float:
    """Sequences/s of bare Blosc decoding of `frames` on one thread."""
    from numcodecs import blosc

    blosc.use_threads, threads = False, blosc.set_nthreads(1)
    try:
        start = time.perf_counter()
        for sequence in frames:
            for frame in sequence:
                blosc.decompress(frame)
        return len(frames) / (time.perf_counter() - start)
    finally:
        blosc.set_nthreads(threads)


def decompression_floor(reader, cache: Path, *, method: str) -> float:
    """Sequences/s that bare Blosc (zstd + shuffle) decoding on one core allows for the bytes the
    method's map loader decodes: its floor (docs/benchmarks.md, "Real shapes")."""
    dataset = CacheTrainDataset(reader, objective=objective(method, reader), seed=0)
    return _decode_pass(_floor_frames(reader, cache, dataset))


def loader_and_floor(reader, cache: Path, *, method: str, shapes: Shapes, rounds: int = 3) -> tuple[float, float]:
    """(loader, floor) sequences/s on one core, each the best of `rounds` passes taken in turn, so
    that both see the same load on a shared machine (the ratio is what is compared). The process
    is pinned to one CPU meanwhile: a reader's own threads (zarr's pool) get no second core."""
    from numcodecs import blosc

    dataset = CacheTrainDataset(reader, objective=objective(method, reader), seed=0)
    frames = _floor_frames(reader, cache, dataset)
    batches = [list(range(len(reader)))[i : i + shapes.rank_batch] for i in range(0, len(reader), shapes.rank_batch)]
    loader, floor, threads = [], [], blosc.set_nthreads(1)  # the loader's workers decode on one thread
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        for p in range(rounds):
            start = time.perf_counter()
            for batch in batches:
                collate([dataset[(p, i)] for i in batch])
            loader.append(len(reader) / (time.perf_counter() - start))
            floor.append(_decode_pass(frames))
    finally:
        blosc.set_nthreads(threads)
        os.sched_setaffinity(0, cpus)
    return max(loader), max(floor)


# A rank's demand: its share of the global batch of 24 over 8 ranks, at a step of 0.15-0.1 s.
RANK_STEP_S = (0.15, 0.1)


def loader_against_floor(reader, cache: Path, *, shapes: Shapes) -> list[dict]:
    """(b2) for alr and alr_ira: the loader's sequences/s per core next to its decompression floor,
    measured in turn, and the cores a rank needs at each to keep up with its GPU."""
    rows = []
    for method in ("alr", "alr_ira"):
        loader, floor = loader_and_floor(reader, cache, method=method, shapes=shapes)
        demand = [shapes.rank_batch / s for s in RANK_STEP_S]
        rows.append({"method": method, "loader_seq_per_s": loader, "floor_seq_per_s": floor,
                     "floor_over_loader": floor / loader, "rank_demand_seq_per_s": demand})  # fmt: skip
    print_table(
        f"(b2) loader vs its decompression floor (the same Blosc frames through bare Blosc/zstd, one core; best of 3 "
        f"passes each, taken in turn); a rank's "
        f"demand at {shapes.rank_batch} sequences per {RANK_STEP_S[0]}-{RANK_STEP_S[1]} s step",
        ["method", "loader seq/s/core", "floor seq/s/core", "floor / loader", "rank needs seq/s", "cores/rank at loader",
         "cores/rank at floor"],
        [[r["method"], f"{r['loader_seq_per_s']:.2f}", f"{r['floor_seq_per_s']:.2f}", f"{r['floor_over_loader']:.2f}x",
          f"{r['rank_demand_seq_per_s'][0]:.0f}-{r['rank_demand_seq_per_s'][1]:.0f}",
          f"{r['rank_demand_seq_per_s'][0] / r['loader_seq_per_s']:.1f}-{r['rank_demand_seq_per_s'][1] / r['loader_seq_per_s']:.1f}",
          f"{r['rank_demand_seq_per_s'][0] / r['floor_seq_per_s']:.1f}-{r['rank_demand_seq_per_s'][1] / r['floor_seq_per_s']:.1f}"]
         for r in rows],
    )  # fmt: skip
    sys.stdout.flush()
    return rows


# ---------------------------------------------------------------------------------------------
# (c) one drafter step at the Qwen3-4B DFlash shape, in a fresh process


def drafter_config(shapes: Shapes) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=shapes.hidden_size, intermediate_size=shapes.intermediate_size, num_hidden_layers=1,
        num_attention_heads=shapes.num_heads, num_key_value_heads=shapes.num_kv_heads, head_dim=shapes.head_dim,
        max_position_embeddings=40_960, vocab_size=shapes.vocab_size, block_size=shapes.num_slots + 1,
        num_target_layers=shapes.num_target_layers, target_layer_ids=layer_ids(shapes), mask_token_id=MASK_TOKEN_ID,
    )  # fmt: skip


def step_batch(cache: Path, shapes: Shapes, *, method: str, first: int, anchors_per_step: int | None):
    """A collated batch of `shapes.step_batch` sequences from the cache, as the trainer builds it."""
    reader = open_cache(cache)
    dataset = CacheTrainDataset(reader, objective=objective(method, reader, anchors_per_step=anchors_per_step), seed=0)
    return collate([dataset[(0, first + i)] for i in range(shapes.step_batch)])


def rss_gib() -> float:
    return psutil.Process().memory_info().rss / GIB


def peak_rss_gib() -> float:
    """This process's peak RSS since its exec (VmHWM; ru_maxrss would carry the forking parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GIB  # kB
    raise RuntimeError("/proc/self/status has no VmHWM line")


def drafter_step_child(cache: str, shapes_dict: dict, threads: int) -> dict:
    """(c) in a fresh process: build the drafter and a random frozen head, then time forward+backward."""
    torch.set_num_threads(threads)
    shapes = Shapes(**{k: tuple(v) if isinstance(v, list) else v for k, v in shapes_dict.items()})
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_config(shapes)).float()
    embed_tokens = torch.empty(shapes.vocab_size, shapes.hidden_size).normal_(0.0, 0.02)  # frozen [V, H]
    lm_head = torch.empty(shapes.vocab_size, shapes.hidden_size).normal_(0.0, 0.02)  # frozen [V, H]
    batches = [
        step_batch(Path(cache), shapes, method="alr_ira", first=i * shapes.step_batch, anchors_per_step=shapes.anchors_per_step)
        for i in range(shapes.step_repeats + 1)
    ]
    rss_before = rss_gib()
    seconds = []
    for i, batch in enumerate(batches):  # batch 0 warms up
        start = time.perf_counter()
        stats = forward_loss(
            model, batch, embed_tokens=embed_tokens, lm_head=lm_head, block_size=shapes.num_slots + 1,
            loss_chunk=4096, autocast=contextlib.nullcontext(), attention="sdpa",
        )  # fmt: skip
        (stats.loss_sum / (stats.weight_sum + 1e-6)).backward()
        model.zero_grad(set_to_none=True)
        if i > 0:
            seconds.append(time.perf_counter() - start)
    last = batches[-1]
    return {
        "step_s": statistics.median(seconds),
        "sequences": last.num_sequences,
        "context_tokens": int(last.context_valid.sum()),
        "blocks": int(last.block_valid.sum()),
        "supervised_slots": int((last.slot_weights > 0).sum()),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "rss_before_gib": rss_before,
        "peak_rss_gib": peak_rss_gib(),
    }


# ---------------------------------------------------------------------------------------------
# (d) a stage-1 worker's peak RSS by shard size, a fresh process per size


def stage1_child(target: str, corpus: str, out: str, shapes_dict: dict, shard_size: int, threads: int) -> dict:
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    shapes = Shapes(**{k: tuple(v) if isinstance(v, list) else v for k, v in shapes_dict.items()})
    config = CacheBuildConfig.from_flags(
        target=target, corpus=corpus, out=out, layers=list(shapes.stage1_taps), num_slots=shapes.num_slots,
        top_k=shapes.top_k, anchors=shapes.num_anchors, max_length=shapes.stage1_max_length, shard_size=shard_size,
        batch_tokens=2 * shapes.stage1_max_length, workers=1, cpus_per_worker=threads, feature_codec="bf16", storage_format="zarr",
    )  # fmt: skip
    rss_before = rss_gib()
    start = time.perf_counter()
    manifest = build_cache(config, run_shards=run_shards_here, progress=False, log=lambda message: None)
    return {
        "shard_size": shard_size,
        "sequences": manifest.num_sequences,
        "tokens": manifest.num_tokens,
        "anchors": manifest.num_anchors,
        "feature_dim": manifest.feature_dim,
        "build_s": time.perf_counter() - start,
        "rss_before_gib": rss_before,
        "peak_rss_gib": peak_rss_gib(),
    }


def in_fresh_process(fn, *args):
    """fn(*args) in a new spawned process (its own peak RSS, none of this one's memory)."""
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def bench_stage1(work: Path, shapes: Shapes, *, threads: int) -> list[dict]:
    target = make_toy_target(
        work / "stage1-target", hidden_size=shapes.stage1_hidden, num_hidden_layers=shapes.stage1_layers,
        num_attention_heads=shapes.stage1_heads, num_key_value_heads=max(1, shapes.stage1_heads // 2),
        head_dim=shapes.stage1_hidden // shapes.stage1_heads, intermediate_size=shapes.stage1_intermediate,
        seed=0, peaked=True,
    )  # fmt: skip
    results = []
    for shard_size in shapes.stage1_shard_sizes:
        corpus = write_toy_corpus(
            work / f"stage1-corpus-{shard_size}.jsonl", num_rows=shard_size, response_words=shapes.stage1_response_words, max_turns=1
        )  # fmt: skip
        out = work / f"stage1-cache-{shard_size}"
        results.append(in_fresh_process(stage1_child, str(target), str(corpus), str(out), asdict(shapes), shard_size, threads))
    return results


# ---------------------------------------------------------------------------------------------
# (e) stage 1's writer at real shapes, (f) bytes an alr epoch reads at small shapes

GPU_SEQ_PER_S = 15  # what one GPU computes at Qwen3-4B shapes (docs/benchmarks.md, "Real shapes" (e))
WRITER_RECORDS = {"full": 6, "quick": 4}
CHUNK_READS = {
    "full": dict(num_sequences=48, seq_len=(150, 400), hidden_size=512, num_taps=1, num_anchors=32),
    "quick": dict(num_sequences=12, seq_len=(40, 90), hidden_size=32, num_taps=1, num_anchors=8),
}


def _thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of a live thread of this process, from /proc."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of `intervals`."""
    covered, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            covered += hi - max(lo, end)
            end = hi
    return covered


def writer_child(shapes_dict: dict, storage_format: str, threads: int, num_records: int, out: str) -> dict:
    """(e) in a fresh process (Zarr's pool is sized once per process): synthesize the records,
    then time appending them to a ShardWriter on `threads` threads and publishing the shard.

    Where the time goes: each piece the writer hands its threads is timed (wall interval, thread
    CPU); "main only" is the wall during which no piece runs (the main thread's appends, publish's
    fsync and checksum), i.e. the part no writer thread can take; zarr's threads' CPU is read from
    /proc (its event-loop thread is one thread whatever `threads` is)."""
    import storage.formats.zarr.write
    import storage.shards
    from storage.formats.zarr.write import set_codec_threads
    from storage.shards import ShardSize, ShardWriter

    set_codec_threads(threads)
    torch.set_num_threads(1)
    shapes = Shapes(**{k: tuple(v) if isinstance(v, list) else v for k, v in shapes_dict.items()})
    rng = np.random.default_rng(0)
    records = [synthetic_record(rng, shapes, source_row=i) for i in range(num_records)]
    pieces: list[tuple[float, float, float]] = []  # (start, end, thread CPU s) of each piece
    phases = {"sync_s": 0.0, "checksum_s": 0.0}

    def timed(fn):
        def piece(*args, **kwargs):
            cpu, begin = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                pieces.append((begin, time.perf_counter(), time.thread_time() - cpu))
        return piece

    def phase(name, fn):
        def run(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] += time.perf_counter() - begin
        return run

    patched = {"fsync_tree": "sync_s", "shard_checksum": "checksum_s"}
    # The publish step's fsync and checksum, and a Zarr body's own checksum of what it wrote.
    places = [(storage.shards, "fsync_tree"), (storage.shards, "shard_checksum"), (storage.formats.zarr.write, "shard_checksum")]
    originals = {(module, name): getattr(module, name) for module, name in places}
    for (module, name), fn in originals.items():  # (restored below: --quick runs in this process)
        setattr(module, name, phase(patched[name], fn))
    zarr_cpu_before = {t.name: _thread_cpu_s(t.native_id) for t in threading.enumerate() if t.name.startswith("zarr")}
    cpu_start, main_start, start = time.process_time(), time.thread_time(), time.perf_counter()
    with ShardWriter(
        out, shard_index=0, size=ShardSize.of_records(records), storage_format=storage_format, feature_codec="bf16",
        num_threads=threads,
    ) as writer:  # fmt: skip
        submit = writer.writes.submit
        writer.writes.submit = lambda fn, *args, **kwargs: submit(timed(fn), *args, **kwargs)
        for record in records:
            writer.append(record)
        appended = time.perf_counter()
        shard = writer.publish()
    end = time.perf_counter()
    for (module, name), fn in originals.items():
        setattr(module, name, fn)
    zarr_cpu = {
        t.name: _thread_cpu_s(t.native_id) - zarr_cpu_before.get(t.name, 0.0)
        for t in threading.enumerate() if t.name.startswith("zarr")
    }  # fmt: skip
    return {
        "format": storage_format,
        "threads": threads,
        "sequences": num_records,
        "seconds": end - start,
        "publish_s": end - appended,
        "cpu_s": time.process_time() - cpu_start,
        "main_cpu_s": time.thread_time() - main_start,
        "writer_cpu_s": sum(cpu for _, _, cpu in pieces),
        "zarr_loop_cpu_s": sum(v for k, v in zarr_cpu.items() if k == "zarr_io"),
        "zarr_pool_cpu_s": sum(v for k, v in zarr_cpu.items() if k != "zarr_io"),
        "main_only_s": (end - start) - _union_s([(lo, hi) for lo, hi, _ in pieces]),
        **phases,
        "feature_mb": sum(r["features"].nbytes + r["rollout_features"].nbytes for r in records) / 1e6,
        "checksum": shard.checksum,
    }


def blosc_control(shapes: Shapes, *, num_records: int) -> list[dict]:
    """(e)'s control: the records' feature bits through bare Blosc (the writer's codec, 256 KiB
    pieces as its chunks) on 1 and 2 threads, in this process: how much a second thread can give
    on this machine right now, whatever the writer does."""
    from numcodecs import Blosc

    codec = Blosc(cname="zstd", clevel=3, shuffle=Blosc.SHUFFLE, typesize=2)
    rng = np.random.default_rng(0)
    bits = [synthetic_record(rng, shapes, source_row=i)["features"] for i in range(num_records)]
    pieces = [piece for b in bits for piece in np.array_split(b.reshape(-1), max(1, b.nbytes // (256 << 10)))]
    rows = []
    for threads in (1, 2):
        with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
            start = time.perf_counter()
            list(pool.map(codec.encode, pieces))
            rows.append({"threads": threads, "mb_per_s": sum(b.nbytes for b in bits) / 1e6 / (time.perf_counter() - start)})
    return rows


def bench_writer(work: Path, shapes: Shapes, *, num_records: int, fresh: bool) -> list[dict]:
    """(e) per format and thread count; `fresh`: each in a fresh process (else in this one, where
    Zarr's pool keeps its first size: a smoke run's shortcut)."""
    rows = []
    for storage_format in ("zarr", "wds"):
        for threads in (1, 2):
            args = (asdict(shapes), storage_format, threads, num_records, str(work / f"writer-{storage_format}-{threads}"))
            rows.append(in_fresh_process(writer_child, *args) if fresh else writer_child(*args))
    return rows


def serial_share(row: dict) -> float:
    """The part of a writer run no second thread can shorten: the wall during which no piece ran
    (main-thread work, publish's fsync and checksum) and the CPU of zarr's one event-loop thread,
    over the run's wall; measured at 1 thread, it gives the Amdahl bound 1 / (s + (1 - s) / n)."""
    return min(1.0, (row["main_only_s"] + row["zarr_loop_cpu_s"]) / row["seconds"])


def print_writer(rows: list[dict], shapes: Shapes) -> list[dict]:
    one = {r["format"]: r for r in rows if r["threads"] == 1}
    print_table(
        f"(e) ShardWriter at F={shapes.feature_dim}, T~{sum(shapes.seq_len) // 2}, A={shapes.num_anchors}, "
        f"K={shapes.num_slots}, bf16 (append + publish; a fresh process each, but with --quick)",
        ["format", "threads", "seq/s", "feature MB/s", "speedup", "publish s", "CPU s/seq",
         f"cores/GPU for {GPU_SEQ_PER_S} seq/s", "checksum"],
        [[r["format"], r["threads"], f"{r['sequences'] / r['seconds']:.2f}", f"{r['feature_mb'] / r['seconds']:.0f}",
          f"{one[r['format']]['seconds'] / r['seconds']:.2f}x", f"{r['publish_s']:.2f}", f"{r['cpu_s'] / r['sequences']:.2f}",
          f"{GPU_SEQ_PER_S * r['cpu_s'] / r['sequences']:.1f}", r["checksum"].split(":")[1][:12]] for r in rows],
    )  # fmt: skip
    print_table(
        "(e) where the writer's time goes: CPU s by thread; main only = wall with no piece on a writer thread; "
        "serial share = (main only + zarr loop CPU) / wall; Amdahl 2 threads = 1 / (s + (1 - s) / 2) of the 1-thread run",
        ["format", "threads", "wall s", "main CPU", "writer threads CPU", "zarr loop CPU", "zarr pool CPU",
         "main only s", "fsync s", "checksum s", "serial share", "Amdahl 2 threads"],
        [[r["format"], r["threads"], f"{r['seconds']:.2f}", f"{r['main_cpu_s']:.2f}", f"{r['writer_cpu_s']:.2f}",
          f"{r['zarr_loop_cpu_s']:.2f}", f"{r['zarr_pool_cpu_s']:.2f}", f"{r['main_only_s']:.2f}", f"{r['sync_s']:.2f}",
          f"{r['checksum_s']:.2f}", f"{serial_share(r):.0%}",
          f"{1 / (serial_share(r) + (1 - serial_share(r)) / 2):.2f}x" if r["threads"] == 1 else ""] for r in rows],
    )  # fmt: skip
    control = blosc_control(shapes, num_records=2)
    print(f"control, bare Blosc on the features of 2 records: {control[0]['mb_per_s']:.0f} MB/s on 1 thread, "
          f"{control[1]['mb_per_s']:.0f} on 2 ({control[1]['mb_per_s'] / control[0]['mb_per_s']:.2f}x)")  # fmt: skip
    for storage_format in one:
        same = {r["checksum"] for r in rows if r["format"] == storage_format}
        if len(same) != 1:
            raise SystemExit(f"error: {storage_format} shards differ between thread counts: {same}")
    return control


def bench_chunk_reads(work: Path, shapes: Shapes, *, quick: bool) -> dict:
    """(f) one alr epoch over a small cache: rchar of every CacheTrainDataset[(0, i)] against the
    on-disk bytes of alr's arrays (measure_reads)."""
    small = dataclasses.replace(shapes, **CHUNK_READS["quick" if quick else "full"])
    cache = write_cache(work / "chunk-reads", small, seed=1)
    reader = open_cache(cache)
    reader.read(0, arrays=set())
    row = measure_reads(reader, cache, label="alr", method="alr", anchors_per_step=None)
    reader.close()
    num = small.num_sequences
    print_table(
        f"(f) one alr epoch, {num} sequences, T in [{small.seq_len[0]}, {small.seq_len[1]}), F={small.feature_dim}, "
        f"A={small.num_anchors}, K={small.num_slots}, top-k {small.top_k}",
        ["objective", "MB read / epoch", "alr arrays on disk MB", "ratio", "non-rollout-feature arrays on disk MB"],
        [["alr", f"{row['read_mb_per_seq'] * num:.2f}", f"{row['min_mb_per_seq'] * num:.2f}", f"{row['ratio']:.2f}x",
          f"{row['non_rollout_feature_mb_per_seq'] * num:.2f}"]],
    )  # fmt: skip
    return row


def bench_reads(reader, cache: Path, shapes: Shapes) -> tuple[list[dict], list[dict]]:
    """(a) bytes read per sequence and (b) the loader on one core, per method; the 8-GPU node projection."""
    variants = [(method, method, None) for method in METHODS] + [
        (f"alr_ira ({shapes.anchors_per_step} anchors/step)", "alr_ira", shapes.anchors_per_step)
    ]
    reads = [measure_reads(reader, cache, label=label, method=method, anchors_per_step=a) for label, method, a in variants]
    rates = {r["label"]: measure_loader(reader, method=r["method"], shapes=shapes, anchors_per_step=r["anchors_per_step"]) for r in reads}
    for r in reads:
        r["loader_seq_per_s"] = rates[r["label"]]
    alr = next(r for r in reads if r["label"] == "alr")
    rollout_mb = alr["rollout_features_mb_per_seq"]
    print_table(
        "(a) bytes read per sequence through CacheTrainDataset (rchar) vs the minimum; (b) loader on one core",
        ["method", "MB read/seq", "min MB/seq", "ratio", "parents/seq", "extra over alr (x rollout features)",
         "decompressed MB/seq", "seq/s/core"],
        [[r["label"], f"{r['read_mb_per_seq']:.2f}", f"{r['min_mb_per_seq']:.2f}", f"{r['ratio']:.3f}x",
          f"{r['parents_per_seq']:.1f}", f"{(r['read_mb_per_seq'] - alr['read_mb_per_seq']) / rollout_mb:.2f}",
          f"{r['decompressed_mb_per_seq']:.2f}", f"{r['loader_seq_per_s']:.2f}"] for r in reads],
    )  # fmt: skip
    print(f"on disk per sequence: {alr['non_rollout_feature_mb_per_seq']:.2f} MB without rollout_features, "
          f"{rollout_mb:.2f} MB of rollout_features")  # fmt: skip

    # 8-GPU node: global batch 24 over 8 ranks, a step of 0.1-0.3 s -> 80-240 sequences/s per node.
    projection = []
    for r in reads:
        need_lo, need_hi = 24 / 0.3, 24 / 0.1
        projection.append({
            "label": r["label"], "node_seq_per_s": [need_lo, need_hi],
            "node_decompressed_mb_per_s": [need_lo * r["decompressed_mb_per_seq"], need_hi * r["decompressed_mb_per_seq"]],
            "node_read_mb_per_s": [need_lo * r["read_mb_per_seq"], need_hi * r["read_mb_per_seq"]],
            "cores": [need_lo / r["loader_seq_per_s"], need_hi / r["loader_seq_per_s"]],
        })  # fmt: skip
    for p in projection:
        lo, hi = p["node_decompressed_mb_per_s"]
        print(f"8-GPU node projection, {p['label']}: global batch 24 / 8 ranks at 0.3-0.1 s/step needs "
              f"{p['node_seq_per_s'][0]:.0f}-{p['node_seq_per_s'][1]:.0f} seq/s = {lo / 1e3:.2f}-{hi / 1e3:.2f} GB/s decompressed "
              f"({p['node_read_mb_per_s'][0] / 1e3:.2f}-{p['node_read_mb_per_s'][1] / 1e3:.2f} GB/s read); measured "
              f"{rates[p['label']]:.2f} seq/s per core -> {p['cores'][0]:.0f}-{p['cores'][1]:.0f} loader cores per node")  # fmt: skip
    return reads, projection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a CI smoke run, well under a minute)")
    parser.add_argument("--out", default=None, help="empty work directory (default: a new temp dir)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the drafter step and the stage-1 worker")
    parser.add_argument("--skip-stage1", action="store_true", help="leave out (d)")
    parser.add_argument("--writer-only", action="store_true", help="run (e) and (f) only")
    parser.add_argument("--loader-only", action="store_true", help="write the cache and run (b2) only")
    args = parser.parse_args()
    shapes = QUICK if args.quick else FULL
    work = empty_workdir(args.out) if args.out else Path(tempfile.mkdtemp(prefix="alrira-real-shapes-"))
    began, load_before = time.perf_counter(), os.getloadavg()[0]
    torch.set_num_threads(1)  # (a), (b): the loader of one DataLoader worker

    if args.loader_only:
        cache = write_cache(work / "cache", shapes)
        reader = open_cache(cache)
        reader.read(0, arrays=set())
        floors = loader_against_floor(reader, cache, shapes=shapes)
        reader.close()
        results = {"loader_floor": floors, "load_average": [load_before, os.getloadavg()[0]]}
        (work / "results.json").write_text(json.dumps(results, indent=1))
        print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; {work / 'results.json'}")
        return
    writer = bench_writer(work, shapes, num_records=WRITER_RECORDS["quick" if args.quick else "full"], fresh=not args.quick)
    control = print_writer(writer, shapes)
    chunk_reads = bench_chunk_reads(work, shapes, quick=args.quick)
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    if args.writer_only:
        results = {"writer": writer, "blosc_control": control, "chunk_reads": chunk_reads,
                   "load_average": [load_before, os.getloadavg()[0]]}  # fmt: skip
        (work / "results.json").write_text(json.dumps(results, indent=1))
        return

    start = time.perf_counter()
    cache = write_cache(work / "cache", shapes)
    reader = open_cache(cache)
    reader.read(0, arrays=set())  # opens the shard (array metadata) outside the measured reads
    m = reader.manifest
    disk_mb = sum(array_disk_bytes(cache).values()) / 1e6
    print(f"cache: {len(reader)} sequences, {m.num_tokens} tokens, F={m.feature_dim}, A={shapes.num_anchors}, "
          f"K={shapes.num_slots}, top-k {shapes.top_k}, V={shapes.vocab_size}: {disk_mb:.1f} MB on disk, "
          f"written in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip

    reads, projection = bench_reads(reader, cache, shapes)
    floors = loader_against_floor(reader, cache, shapes=shapes)
    reader.close()

    print("\n(c) drafter step (fresh process) ...", flush=True)
    step = in_fresh_process(drafter_step_child, str(cache), asdict(shapes), args.threads)
    print_table(
        f"(c) forward_loss + backward, alr_ira, {shapes.anchors_per_step} anchors/step, fp32 on CPU, {args.threads} threads",
        ["drafter", "params (M)", "sequences", "context tokens", "blocks", "supervised slots", "step s", "RSS before GiB", "peak RSS GiB"],
        [[f"1 layer H{shapes.hidden_size} I{shapes.intermediate_size} V{shapes.vocab_size}", f"{step['params_m']:.1f}",
          step["sequences"], step["context_tokens"], step["blocks"], step["supervised_slots"], f"{step['step_s']:.2f}",
          f"{step['rss_before_gib']:.2f}", f"{step['peak_rss_gib']:.2f}"]],
    )  # fmt: skip

    stage1 = []
    if not args.skip_stage1:
        print("\n(d) stage-1 worker (fresh process per shard size) ...", flush=True)
        stage1 = bench_stage1(work, shapes, threads=args.threads)
        print_table(
            f"(d) stage-1 worker, random Qwen3 H{shapes.stage1_hidden} x {shapes.stage1_layers} layers, "
            f"taps {list(shapes.stage1_taps)}, A={shapes.num_anchors}, K={shapes.num_slots}, zarr bf16",
            ["shard size", "sequences", "tokens", "F", "build s", "RSS at start GiB", "peak RSS GiB"],
            [[s["shard_size"], s["sequences"], s["tokens"], s["feature_dim"], f"{s['build_s']:.1f}",
              f"{s['rss_before_gib']:.2f}", f"{s['peak_rss_gib']:.2f}"] for s in stage1],
        )  # fmt: skip

    results = {"shapes": asdict(shapes), "reads": reads, "projection": projection, "loader_floor": floors, "drafter_step": step, "stage1": stage1,
               "writer": writer, "blosc_control": control, "chunk_reads": chunk_reads,
               "load_average": [load_before, os.getloadavg()[0]], "wall_s": time.perf_counter() - began}  # fmt: skip
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nwall {results['wall_s']:.0f} s; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; {work / 'results.json'}")


if __name__ == "__main__":
    main()
