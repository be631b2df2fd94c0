"""Does `--loader stream` keep up from an object store? (docs/benchmarks.md, "Object store: does the
stream loader keep up?").

Writes the same synthetic records (common/records.py: random bf16 features, real array
shapes) as WebDataset shards to a local directory and to an S3 bucket on a moto server this script
starts on 127.0.0.1, then runs the trainer's own stream pipeline (`stream_plan`,
`StreamTrainDataset`, `stream_batches`, DataLoader workers, `--method alr` labels) over one epoch
from three sources, side by side:

- local disk;
- the store, each tar read straight from it (`--local-cache-gib 0`: a 1 MiB read-ahead buffer);
- the store through the local cache (storage/local_cache.py): each worker downloads its next tar
  while it reads the current one, within a budget of two shards per worker.

Each source runs three times: as fast as the loader goes (micro-batches/s), then under a
simulated training step, a sleep per micro-batch of 1.5x the time per micro-batch of the local
loader, then of the straight-from-the-store loader, reporting the share of the run the step
spent waiting for data, in all and after the first micro-batch (the epoch's start: worker
processes, store clients, the first download). A thread samples the local
cache's bytes on disk every 5 ms (peak vs budget), and GETs come from the server's log:

    .venv/bin/python -m benchmarks.speed.store_stream [--quick]
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.cli import bench_parser
from benchmarks.common.process import PeakSampler
from benchmarks.common.records import RECORDS_FULL, RECORDS_QUICK, RecordSizes, make_record, small_manifest
from benchmarks.common.report import print_table
from benchmarks.common.store import get_requests, moto_bucket
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.streaming import StreamTrainDataset, stream_batches, stream_plan
from storage.manifest import save_manifest
from storage.reader import open_cache
from storage.shards import write_shard

NUM_WORKERS = 2
MICRO_BATCH = 2


def write_cache(root: str, shards_records: list[list[dict]], sizes: RecordSizes) -> None:
    shards = [
        write_shard(root, shard_index=i, records=records, storage_format="wds", feature_codec="bf16")
        for i, records in enumerate(shards_records)
    ]
    save_manifest(root, small_manifest(shards, sizes, storage_format="wds", shard_size=len(shards_records[0]),
                                       created_with="benchmarks/speed/store_stream.py"))  # fmt: skip


def _as_is(item):
    return item


def _one_thread(worker_id: int) -> None:
    torch.set_num_threads(1)


def _make_loader(dataset):
    return torch.utils.data.DataLoader(
        dataset, num_workers=NUM_WORKERS, batch_size=None, collate_fn=_as_is, prefetch_factor=2, worker_init_fn=_one_thread
    )


def directory_bytes(directory: Path) -> int:
    """Bytes of the files under `directory`, each counted once by inode (a copy renamed from its
    .part name during the walk counts once; a directory deleted under the walk is skipped)."""
    sizes = {}
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                stat = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            sizes[stat.st_dev, stat.st_ino] = stat.st_size
    return sum(sizes.values())


def run_epoch(root: str, *, step_s: float, local_cache_gib: float, local_cache_dir: Path) -> dict:
    """One epoch of the stream loader; a sleep of `step_s` per micro-batch stands in for the step."""
    reader = open_cache(root)
    plan = stream_plan(
        reader, seed=0, rank=0, world_size=1, num_workers=NUM_WORKERS, micro_batch=MICRO_BATCH, grad_accum=1,
        shuffle_buffer=4, local_cache_gib=local_cache_gib, local_cache_dir=str(local_cache_dir),
    )  # fmt: skip
    objective = ObjectiveConfig(method="alr").for_cache(num_slots=reader.manifest.settings.num_slots, mask_token_id=2, stop_token_ids=[1])
    dataset = StreamTrainDataset(plan, objective=objective, feature_codec="bf16")
    batches = stream_batches(dataset, epoch_steps=[plan.epoch_steps(0)], start_step=0, make_loader=_make_loader)
    waited, count, start = 0.0, 0, time.perf_counter()
    first_batch_s = None
    with PeakSampler(lambda: directory_bytes(local_cache_dir), every_s=0.005) as disk:  # the local cache's bytes
        while True:
            asked = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - asked
            if batch is None:
                break
            if not hasattr(batch, "slot_weights"):
                raise SystemExit(f"error: {root}: {batch}")
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - start
            count += 1
            time.sleep(step_s)
    total = time.perf_counter() - start
    share = plan.read_ahead.budget if plan.read_ahead else 0
    return dict(batches=count, total_s=total, waited_s=waited, first_batch_s=first_batch_s, peak_disk=disk.peak,
                budget=share * NUM_WORKERS)  # fmt: skip


def download_rate(store_root: str, shard, tmp: Path) -> float:
    """MB/s of one whole-object download of a shard (what the local cache does per tar)."""
    from storage.location import resolve

    start = time.perf_counter()
    resolve(store_root).download(f"shards/{shard.name}", tmp / "probe.tar")
    seconds = time.perf_counter() - start
    (tmp / "probe.tar").unlink()
    return shard.bytes / 1e6 / seconds


def measure(tmp: Path, store_root: str, log_path: Path, shards_records: list[list[dict]], sizes) -> tuple[list, int, float]:
    """The table's rows, the largest shard's bytes and moto's whole-object download rate."""
    local_root = str(tmp / "local")
    for root in (local_root, store_root):
        write_cache(root, shards_records, sizes)
    largest = max(s.bytes for s in open_cache(local_root).manifest.shards)
    two_shards_per_worker = 2 * largest * NUM_WORKERS / 2**30
    sources = [
        ("local disk", local_root, 0.0),
        ("moto, tar read straight", store_root, 0.0),
        ("moto, local cache + 1 ahead", store_root, two_shards_per_worker),
    ]
    download_mb_s = download_rate(store_root, open_cache(store_root).manifest.shards[0], tmp)
    rows, free = [], {}
    for simulated in (None, "local disk", "moto, tar read straight"):
        for label, root, gib in sources:
            step_s = 1.5 * free[simulated]["total_s"] / free[simulated]["batches"] if simulated else 0.0
            before = get_requests(log_path)
            result = run_epoch(root, step_s=step_s, local_cache_gib=gib, local_cache_dir=Path(tmp) / f"lc-{uuid.uuid4().hex[:6]}")
            gets = get_requests(log_path) - before
            if not simulated:
                free[label] = result
            rows.append([
                label, f"{step_s * 1000:.0f}" if simulated else "none", f"{result['batches'] / result['total_s']:.2f}",
                f"{result['first_batch_s']:.2f}", f"{100 * result['waited_s'] / result['total_s']:.0f}%",
                f"{100 * (result['waited_s'] - result['first_batch_s']) / (result['total_s'] - result['first_batch_s']):.0f}%",
                str(gets),
                f"{result['peak_disk'] / 1e6:.1f} / {result['budget'] / 1e6:.1f}" if gib else "-",
            ])  # fmt: skip
    return rows, largest, download_mb_s


def main() -> None:
    args = bench_parser(__doc__, quick_help="Tiny sizes (a smoke run for CI).").parse_args()
    torch.set_num_threads(1)
    sizes = RECORDS_QUICK if args.quick else dataclasses.replace(RECORDS_FULL, num_sequences=64)
    per_shard = 2 if args.quick else 4
    rng = np.random.default_rng(0)
    records = [make_record(rng, sizes, source_row=i) for i in range(sizes.num_sequences)]
    shards_records = [records[i : i + per_shard] for i in range(0, len(records), per_shard)]
    raw_mb = sum(v.nbytes for r in records for v in r.values()) / 1e6
    print(f"{sizes.num_sequences} sequences in {len(shards_records)} wds shards, T={sizes.seq_len}, F={sizes.feature_dim}, "
          f"A={sizes.num_anchors}, K={sizes.num_slots}: {raw_mb:.1f} MB of records; {NUM_WORKERS} DataLoader workers, "
          f"micro-batches of {MICRO_BATCH}, --method alr")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, moto_bucket(Path(tmp)) as (store_root, log_path):
        rows, largest, download_mb_s = measure(Path(tmp), store_root, log_path, shards_records, sizes)
    print(f"moto serves a whole shard object at {download_mb_s:.0f} MB/s (one get_file of {largest / 1e6:.1f} MB)\n")
    print_table(
        f"one epoch of the stream loader (shards of {per_shard} sequences, {largest / 1e6:.1f} MB the largest)",
        ["source", "step ms", "micro-batches/s", "first batch s", "waiting", "after the first", "GETs",
         "local MB peak / budget"],
        rows,
    )


if __name__ == "__main__":
    main()
