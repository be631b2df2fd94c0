"""What the per-chunk checksums cost the trainer's reads (docs/benchmarks.md, "Read checksums").

Writes the same synthetic records (common/records.py: random bf16 features, real shapes of
storage/format.py) as Zarr and WebDataset shards with and without checksums (CRC32C per Zarr
chunk, CRC32 per tar member), then times `CacheReader.read` over every sequence, both alternating, median of repeats:

    .venv/bin/python -m benchmarks.speed.read_checksums [--quick] [--threads 1]

It also flips one byte of a stored rollout_topk_probs and checks that the checksummed reader
refuses it while the unchecked one returns a silently different value.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common.records import RecordSizes, records_from_command_line, small_manifest
from benchmarks.common.report import print_table
from storage.format import SHARD_DIR
from storage.manifest import save_manifest
from storage.reader import open_cache
from storage.shards import write_shard


def write_cache(root: Path, records: list[dict], sizes: RecordSizes, *, storage_format: str, checksums: bool) -> Path:
    shard = write_shard(
        root, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16",
        chunk_checksums=checksums,
    )  # fmt: skip
    save_manifest(root, small_manifest([shard], sizes, storage_format=storage_format, shard_size=len(records),
                                       created_with="benchmarks/speed/read_checksums.py"))  # fmt: skip
    return root


def read_all_seconds(cache: Path) -> float:
    reader = open_cache(cache)
    start = time.perf_counter()
    for index in range(len(reader)):
        reader.read(index, decode_features=False)
    seconds = time.perf_counter() - start
    reader.close()
    return seconds


def corrupt_reads(cache: Path, storage_format: str) -> str:
    """Flip one byte of the stored rollout_topk_probs; 'refused' or 'silently different'."""
    def every_value(reader) -> np.ndarray:
        return np.concatenate([reader.read(i, decode_features=False)["rollout_topk_probs"].ravel() for i in range(len(reader))])

    reader = open_cache(cache)
    before = every_value(reader)
    reader.close()
    if storage_format == "zarr":
        path = sorted((cache / SHARD_DIR / "shard-00000.zarr" / "rollout_topk_probs").rglob("c/*/*/*"))[0]
        position = len(path.read_bytes()) // 2
    else:
        from storage.formats.wds import WdsShard

        path = cache / SHARD_DIR / "shard-00000.tar"
        shard = WdsShard(path)
        offset, size, _ = shard.samples[0][1]["rollout_topk_probs"]
        shard.close()
        position = offset + size - 5
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))
    reader = open_cache(cache)
    try:
        after = every_value(reader)
    except ValueError:
        return "refused"
    return "silently different" if not np.array_equal(before, after) else "unchanged"


def main() -> None:
    sizes, records, raw_mb = records_from_command_line(__doc__)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for storage_format in ("zarr", "wds"):
            caches = {
                checks: write_cache(Path(tmp) / f"{storage_format}-{checks}", records, sizes, storage_format=storage_format, checksums=checks)
                for checks in (False, True)
            }  # fmt: skip
            times = {False: [], True: []}
            read_all_seconds(caches[False]), read_all_seconds(caches[True])  # warm the page cache
            for _ in range(sizes.repeats):
                for checks in (False, True):
                    times[checks].append(read_all_seconds(caches[checks]))
            plain, checked = statistics.median(times[False]), statistics.median(times[True])
            rows.append([
                storage_format, f"{raw_mb / plain:.0f}", f"{raw_mb / checked:.0f}", f"{checked / plain:.2f}x",
                corrupt_reads(caches[False], storage_format), corrupt_reads(caches[True], storage_format),
            ])  # fmt: skip
    print_table(
        "reading every record (decode_features=False, one process)",
        ["format", "MB/s unchecked", "MB/s checked", "time ratio", "flipped byte, unchecked", "flipped byte, checked"],
        rows,
    )


if __name__ == "__main__":
    main()
