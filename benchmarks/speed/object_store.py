"""The trainer's reads from an object store next to a local disk (docs/benchmarks.md, "Object store").

Writes the same synthetic records (common/records.py: random bf16 features, real
array shapes) as one Zarr and one WebDataset shard to a local directory and, through the same
ShardWriter, to an S3 bucket on a moto server this script starts on 127.0.0.1, then times
`CacheReader.read` over every sequence from each (all arrays, and only what `alr` trains on),
median of repeats, and counts the GET requests a pass sends (from the server's request log):

    .venv/bin/python -m benchmarks.speed.object_store [--quick] [--threads 1]

moto is a server in one Python process on this machine: it measures the requests (one ranged GET
per Zarr chunk or tar member read) without a network, not S3's bandwidth, and a ranged GET costs
it more the larger the object (it reads an object above 16 MiB from a temp file per request; the
script prints the latency for a small and a shard-sized object). Every record read from the store
is compared with the local one.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common.records import RecordSizes, records_from_command_line, small_manifest
from benchmarks.common.report import print_table
from benchmarks.common.store import get_requests, moto_bucket
from pipeline.train.methods import required_arrays
from storage.location import resolve
from storage.manifest import Manifest
from storage.reader import CacheReader
from storage.shards import write_shard


def read_all_seconds(where: str, manifest: Manifest, arrays: set[str] | None, want: list[dict] | None = None) -> float:
    """Seconds to read every sequence in a fresh reader (shard opened inside the timing, as a
    DataLoader worker does); with `want`, each record is compared with it."""
    start = time.perf_counter()
    reader = CacheReader(where, manifest)
    for index in range(len(reader)):
        record = reader.read(index, decode_features=False, arrays=arrays)
        if want is not None:
            for name, value in record.items():
                np.testing.assert_array_equal(value, want[index][name], err_msg=f"{where} sequence {index} {name}")
    seconds = time.perf_counter() - start
    reader.close()
    return seconds


def range_get_ms(store_root: str, size: int) -> float:
    """Milliseconds of one 4 KiB ranged GET on an object of `size` bytes (median of 20)."""
    location = resolve(store_root)
    location.write_bytes(f"latency-{size}", os.urandom(size))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        location.read_range(f"latency-{size}", size // 2, 4096)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def measure(records: list[dict], sizes: RecordSizes, *, local_root: str, store_root: str, log_path: Path) -> list[list[str]]:
    rows = []
    for storage_format in ("zarr", "wds"):
        manifests = {}
        for label, root in (("local disk", local_root), ("moto S3", store_root)):
            shard = write_shard(root, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16")
            manifest = small_manifest([shard], sizes, storage_format=storage_format, shard_size=len(records),
                                      created_with="benchmarks/speed/object_store.py")  # fmt: skip
            manifests[label] = (root, manifest)
        # The same bytes (the store's record adds its objects' tags, storage.shards.shard_object_tags).
        stored = [dataclasses.replace(s, object_tags=None) for s in manifests["moto S3"][1].shards]
        assert manifests["local disk"][1].shards == stored
        read_all_seconds(*manifests["moto S3"], None, want=records)  # every record equal; warms both caches
        for arrays_label, arrays in (("all arrays", None), ("alr arrays", required_arrays("alr"))):
            mb = sum(v.nbytes for r in records for n, v in r.items() if arrays is None or n in arrays | {"source_row"}) / 1e6
            before = get_requests(log_path)
            read_all_seconds(*manifests["moto S3"], arrays)
            gets = get_requests(log_path) - before
            times = {label: [] for label in manifests}
            for _ in range(sizes.repeats):
                for label, (root, manifest) in manifests.items():
                    times[label].append(read_all_seconds(root, manifest, arrays))
            local, store = statistics.median(times["local disk"]), statistics.median(times["moto S3"])
            n = len(records)
            rows.append([
                storage_format, arrays_label, f"{n / local:.1f}", f"{n / store:.1f}", f"{mb / local:.0f}", f"{mb / store:.0f}",
                f"{store / local:.1f}x", f"{gets / n:.0f}",
            ])  # fmt: skip
    return rows


def main() -> None:
    sizes, records, raw_mb = records_from_command_line(__doc__)
    with tempfile.TemporaryDirectory() as tmp, moto_bucket(Path(tmp)) as (store_root, log_path):
        (Path(tmp) / "local").mkdir()
        rows = measure(records, sizes, local_root=str(Path(tmp) / "local"), store_root=store_root, log_path=log_path)
        latency = {size: range_get_ms(store_root, size) for size in (1 << 20, int(raw_mb * 1e6))}
    print_table(
        "reading every record with CacheReader (decode_features=False, one process, shard opened per pass)",
        ["format", "arrays", "seq/s local", "seq/s moto", "MB/s local", "MB/s moto", "time ratio", "GETs/seq"],
        rows,
    )
    print("\nmoto: one 4 KiB ranged GET " + ", ".join(f"{ms:.1f} ms on a {size / 1e6:.0f} MB object" for size, ms in latency.items()))


if __name__ == "__main__":
    main()
