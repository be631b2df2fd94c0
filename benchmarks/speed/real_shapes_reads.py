"""speed/real_shapes.py's measurements of the trainer's reads at real shapes (docs/benchmarks.md,
"Real shapes"): (a) the bytes each method's loader reads per sequence against the least it needs,
(b) the loader's sequences/s on one core and an 8-GPU node's projection, (b2) the loader next to
its decompression floor, (f) the bytes one alr epoch reads from a small cache."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from benchmarks.common.loader import drawn_parents, loader_and_floor, loader_pass, rank_batches
from benchmarks.common.real_shape_cache import Shapes, objective, write_cache
from benchmarks.common.report import print_table
from pipeline.train.batching import CacheTrainDataset
from pipeline.train.methods import required_arrays
from storage.format import SHARD_DIR
from storage.reader import open_cache

METHODS = ("dflash", "kd", "erase", "alr", "alr_ira")
# A rank's demand: its share of the global batch of 24 over 8 ranks, at a step of 0.15-0.1 s.
RANK_STEP_S = (0.15, 0.1)
CHUNK_READS = {
    "full": dict(num_sequences=48, seq_len=(150, 400), hidden_size=512, num_taps=1, num_anchors=32),
    "quick": dict(num_sequences=12, seq_len=(40, 90), hidden_size=32, num_taps=1, num_anchors=8),
}


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
        parents.append(len(drawn_parents(example)))
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
    batches = rank_batches(len(reader), shapes.rank_batch)
    rates = [loader_pass(dataset, batches, pass_index=p) for p in range(shapes.loader_repeats + 1)]
    return statistics.median(rates[1:])  # pass 0 warms up


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


# ---------------------------------------------------------------------------------------------
# (b2) the loader against its decompression floor, (f) an alr epoch's reads at small shapes


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
    return rows


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
