"""speed/real_shapes.py's (e): stage 1's writer (storage.shards.ShardWriter: Blosc zstd + shuffle,
CRC, the shard checksum) on real-shape records with 1 and 2 threads, a fresh process each:
sequences/s, MB/s of feature bits, the shard checksums (equal: bytes do not depend on the
threads), the cores per GPU that keep 15 sequences/s per GPU, and where the time goes (CPU by
thread, the wall with no writer thread busy, fsync, checksum: the serial share and its Amdahl bound
for 2 threads) (docs/benchmarks.md, "Real shapes" (e))."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.process import in_fresh_process
from benchmarks.common.real_shape_cache import Shapes, synthetic_record
from benchmarks.common.report import print_table

GPU_SEQ_PER_S = 15  # what one GPU computes at Qwen3-4B shapes (docs/benchmarks.md, "Real shapes" (e))
WRITER_RECORDS = {"full": 6, "quick": 4}


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
    shapes = Shapes.from_dict(shapes_dict)
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
