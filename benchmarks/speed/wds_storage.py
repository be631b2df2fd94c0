"""Compressed WebDataset shards (storage/formats/wds.py) against Zarr and the uncompressed tars: size on
disk next to the raw bf16 arrays, and read throughput, on the records of speed/cache_build.py's
benchmark target and corpus.

One in-process build per feature codec writes the Zarr cache (pipeline.cache_build.driver with
run_shards_here: no Ray); its records, shard by shard, are then written three more ways:
WdsShardWriter tars (compressed, CRC32 per member), the same without the CRC, and the
uncompressed `.npy` tars the build wrote before (a PAX CRC32 per member). Reads, one process,
page cache warm, median of 3:
  random  every record by (shard, local index), as the map loader reads (ZarrShard / WdsShard);
  stream  every record front to back through webdataset's pipeline (SimpleShardList ->
          tarfile_to_samples -> decode_sample), as `--loader stream` reads;
each of the whole record, and of the arrays dflash reads (input_ids, loss_mask, features,
anchor_pos), which random access fetches alone and the stream lets pass by.

    .venv/bin/python -m benchmarks.speed.wds_storage [--quick] [--out DIR]

Results: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import statistics
import tarfile
import time
import zlib
from functools import partial
from pathlib import Path

import torch
import webdataset
from transformers.utils import logging as hf_logging

from benchmarks.common.cli import bench_parser, scratch_directory
from benchmarks.common.report import print_table
from benchmarks.speed.cache_build import FULL, QUICK, build_config
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.train.methods import required_arrays
from storage.checksums import shard_bytes, shard_checksum
from storage.format import SHARD_DIR, TARGET_HEAD_FILE, record_array_names
from storage.formats.wds import LEGACY_CRC_HEADER, WdsShard, WdsShardWriter, decode_sample, member_selector, npy_bytes
from storage.formats.zarr import ZarrShard
from storage.manifest import save_manifest
from storage.reader import cache_stats, open_cache

NUM_REPEATS = 3
WRITERS = ("wds compressed", "wds compressed, no CRC", "wds uncompressed .npy")


def write_legacy_tar(path: Path, records, *, names: list[str]) -> None:
    """A tar as the build wrote them before storage/formats/wds.py: `.npy` members, PAX CRC32 each."""
    with tarfile.open(path, "x", format=tarfile.PAX_FORMAT) as tar:
        for record in records:
            key = f"{int(record['source_row']):09d}"
            for name in names:
                data = npy_bytes(record[name])
                info = tarfile.TarInfo(f"{key}.{name}.npy")
                info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
                info.pax_headers = {LEGACY_CRC_HEADER: f"{zlib.crc32(data):08x}"}
                tar.addfile(info, io.BytesIO(data))


def rewrite(source: Path, out: Path, *, writer: str) -> Path:
    """The records of Zarr cache `source`, shard by shard, as `writer` tars, with a manifest."""
    reader = open_cache(source)
    manifest = reader.manifest
    (out / SHARD_DIR).mkdir(parents=True)
    shutil.copy(source / TARGET_HEAD_FILE, out / TARGET_HEAD_FILE)
    names = sorted(record_array_names(reader.feature_codec, manifest.settings.contents))
    shards, first = [], 0
    for shard in reader.shards:
        path = out / SHARD_DIR / shard.name.replace(".zarr", ".tar")
        records = (reader.read(i, decode_features=False) for i in range(first, first + shard.sequences))
        if writer == "wds uncompressed .npy":
            write_legacy_tar(path, records, names=names)
        else:
            checks = writer == "wds compressed"
            with WdsShardWriter(path, feature_codec=reader.feature_codec, contents=tuple(manifest.settings.contents),
                                chunk_checksums=checks) as tar:  # fmt: skip
                for record in records:
                    tar.append(record)
        first += shard.sequences
        shards.append(dataclasses.replace(shard, name=path.name, bytes=shard_bytes(path), checksum=shard_checksum(path)))
    settings = dataclasses.replace(manifest.settings, storage_format="wds")
    save_manifest(out, dataclasses.replace(manifest, settings=settings, shards=shards))
    return out


def random_reads(cache: Path, *, arrays: set[str] | None) -> int:
    """Every record by (shard, local index); the number read."""
    reader = open_cache(cache)
    count = 0
    for record in reader.shards:
        path = reader.shard_path(record)
        shard = WdsShard(path) if path.suffix == ".tar" else ZarrShard(path)
        for local in range(shard.num_sequences):
            shard.read(local, arrays)
            count += 1
        shard.close()
    return count


def stream_reads(cache: Path, *, arrays: set[str] | None) -> int:
    """Every record front to back through webdataset's pipeline; the number read."""
    reader = open_cache(cache)
    pipeline = webdataset.DataPipeline(
        webdataset.SimpleShardList([str(reader.shard_path(s)) for s in reader.shards]),
        webdataset.tarfile_to_samples(select_files=member_selector(arrays)),
        webdataset.map(partial(decode_sample, arrays=arrays)),
    )
    return sum(1 for _ in pipeline)


def tar_overhead_bytes(cache: Path) -> int | None:
    """Bytes of a wds cache's tars outside member data (512-byte headers, padding to 512, end
    blocks); None for Zarr."""
    reader = open_cache(cache)
    if reader.storage_format != "wds":
        return None
    total = 0
    for record in reader.shards:
        shard = WdsShard(reader.shard_path(record))
        total += shard_bytes(shard.path) - sum(m.size for _, members in shard.samples for m in members.values())
        shard.close()
    return total


def measure(label: str, cache: Path) -> dict:
    dflash = set(required_arrays("dflash"))
    reads = {"random all": partial(random_reads, cache, arrays=None), "random dflash": partial(random_reads, cache, arrays=dflash)}
    if label != "zarr":
        reads["stream all"] = partial(stream_reads, cache, arrays=None)
        reads["stream dflash"] = partial(stream_reads, cache, arrays=dflash)
    seconds = {}
    for name, read in reads.items():
        count = read()  # warm-up: page cache, codecs
        times = []
        for _ in range(NUM_REPEATS):
            start = time.perf_counter()
            assert read() == count
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times)
    return {"label": label, "stats": cache_stats(open_cache(cache)), "seconds": seconds, "overhead": tar_overhead_bytes(cache)}


def report(rows: list[dict], *, codec: str) -> None:
    table = []
    for row in rows:
        s, seconds = row["stats"], row["seconds"]

        def rate(name: str, *, per_sequence: bool) -> str:
            if name not in seconds:
                return "-"
            return f"{s['sequences'] / seconds[name]:.0f}" if per_sequence else f"{s['raw_bf16_bytes'] / 1e6 / seconds[name]:.0f}"

        overhead = "-" if row["overhead"] is None else f"{row['overhead'] / 1e6:.2f}"
        table.append([
            row["label"], f"{s['bytes_on_disk'] / 1e6:.2f}", overhead, f"{s['bytes_on_disk'] / s['tokens']:.0f}",
            f"{s['compression_ratio_vs_raw_bf16']:.2f}x", rate("random all", per_sequence=False),
            rate("random dflash", per_sequence=True), rate("stream all", per_sequence=False),
            rate("stream dflash", per_sequence=True),
        ])  # fmt: skip
    stats = rows[0]["stats"]
    print_table(
        f"{codec}: {stats['sequences']} sequences, {stats['tokens']} tokens, raw bf16 {stats['raw_bf16_bytes'] / 1e6:.2f} MB; "
        f"all = whole records (raw bf16 MB/s), dflash = its 4 arrays (sequences/s); median of {NUM_REPEATS}",
        ["storage", "MB on disk", "tar headers MB", "bytes/token", "raw/disk", "random all MB/s", "random dflash seq/s",
         "stream all MB/s", "stream dflash seq/s"],  # fmt: skip
        table,
    )


def run(sizes, *, work: Path) -> None:
    began = time.perf_counter()
    target, corpus = sizes.cache.write_inputs(work)
    for codec in ("bf16", "fp8"):
        zarr_cache = work / f"zarr-{codec}"
        config = build_config(sizes, target=target, corpus=corpus, out=zarr_cache, threads=torch.get_num_threads(),
                              feature_codec=codec)  # fmt: skip
        build_cache(config, run_shards=run_shards_here, progress=False, log=lambda message: None)
        caches = {"zarr": zarr_cache}
        for writer in WRITERS:
            caches[writer] = rewrite(zarr_cache, work / f"{writer.replace(' ', '-').replace(',', '')}-{codec}", writer=writer)
        report([measure(label, cache) for label, cache in caches.items()], codec=codec)
    print(f"\ntotal {time.perf_counter() - began:.0f}s; load average {os.getloadavg()[0]:.2f}; workspace {work}")


def main() -> None:
    parser = bench_parser(__doc__, quick_help="tiny sizes, to smoke-test the script",
                          out_help="workspace directory, kept (default: a temp dir, removed)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    sizes = QUICK if args.quick else FULL
    with scratch_directory(args.out, temp_prefix="alrira-bench-wds-") as work:
        run(sizes, work=work)


if __name__ == "__main__":
    main()
