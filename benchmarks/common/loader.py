"""The map loader's rate on one core, as a DataLoader worker runs it (getitem + collate of rank
batches), and its floor: the same Blosc frames decoded by bare Blosc on one core
(docs/benchmarks.md, "Real shapes" (b2)). speed/real_shapes.py, speed/cache_settings.py and
harness/gpu_check.py measure with these."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common.real_shape_cache import Shapes, objective
from pipeline.train.batching import CacheTrainDataset, collate
from storage.format import SHARD_DIR


def rank_batches(num_sequences: int, rank_batch: int) -> list[list[int]]:
    """The sequence indices in consecutive batches of `rank_batch` (the last may be shorter)."""
    indices = list(range(num_sequences))
    return [indices[i : i + rank_batch] for i in range(0, num_sequences, rank_batch)]


def loader_pass(dataset: CacheTrainDataset, batches: list[list[int]], *, pass_index: int) -> float:
    """Sequences/s of one pass of getitem + collate over `batches` (pass `pass_index`'s draws)."""
    start = time.perf_counter()
    for batch in batches:
        collate([dataset[(pass_index, i)] for i in batch])
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


@contextlib.contextmanager
def one_core() -> Iterator[None]:
    """This process pinned to one CPU and Blosc on one thread meanwhile (a DataLoader worker's
    share: a reader's own threads, zarr's pool, get no second core); both restored after."""
    from numcodecs import blosc

    threads, cpus = blosc.set_nthreads(1), os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield
    finally:
        blosc.set_nthreads(threads)
        os.sched_setaffinity(0, cpus)


def drawn_parents(example) -> set[int]:
    """Pool anchors whose rollout features an example's IRA secondaries see (what the loader reads)."""
    t = example.targets
    return {int(p) for p, n in zip(t.private_parent.tolist(), t.private_len.tolist()) if p >= 0 and n > 0}


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
        parents = drawn_parents(dataset[(0, i)])
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


def loader_and_floor(reader, cache: Path, *, method: str, shapes: Shapes, rounds: int = 3) -> tuple[float, float]:
    """(loader, floor) sequences/s on one core, each the best of `rounds` passes taken in turn, so
    that both see the same load on a shared machine (the ratio is what is compared)."""
    dataset = CacheTrainDataset(reader, objective=objective(method, reader), seed=0)
    frames = _floor_frames(reader, cache, dataset)
    batches = rank_batches(len(reader), shapes.rank_batch)
    loader, floor = [], []
    with one_core():
        for p in range(rounds):
            loader.append(loader_pass(dataset, batches, pass_index=p))
            floor.append(_decode_pass(frames))
    return max(loader), max(floor)
