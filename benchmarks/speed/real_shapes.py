"""The cache and the trainer at the real Qwen3-4B shapes, on CPU (docs/benchmarks.md, "Real shapes").

Synthesizes a few sequences of a cache at Qwen3-4B shapes (F = 5 taps x 2560, V = 151,936, T ~ 700,
A = 128 anchors, K = 15, top-k 8; random bf16 features; common/real_shape_cache.py) through
storage's Zarr writer, then in one run (the reads (a), (b), (b2), (f) in real_shapes_reads.py, the
writer (e) in real_shapes_writer.py, the fresh processes (c), (d) here):

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

    .venv/bin/python -m benchmarks.speed.real_shapes [--quick] [--out DIR] [--threads 2] [--writer-only | --loader-only]

(g)-(i), every cache setting at these shapes (bytes per corpus token by array group, the writer's
CPU, the codec profile, the alr_ira loader on the full and the compact cache), are
speed/cache_settings.py, which builds its records with the same `synthetic_record`.

Page cache warm: rchar counts the bytes read() returned, cached or not, which is what a loader
decompresses from.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common.cli import bench_parser, work_directory
from benchmarks.common.process import GIB, in_fresh_process, peak_rss_bytes, rss_bytes
from benchmarks.common.real_shape_cache import FULL, QUICK, Shapes, drafter_config, objective, write_cache
from benchmarks.common.report import RunClock, finish_run, print_table, write_results
from benchmarks.common.toy import write_toy_corpus
from benchmarks.speed.real_shapes_reads import array_disk_bytes, bench_chunk_reads, bench_reads, loader_against_floor
from benchmarks.speed.real_shapes_writer import WRITER_RECORDS, bench_writer, print_writer
from drafter.model import DFlashDrafter
from pipeline.demo.toy import make_toy_target
from pipeline.train.batching import CacheTrainDataset, collate
from pipeline.train.step import forward_loss
from storage.reader import open_cache


# ---------------------------------------------------------------------------------------------
# (c) one drafter step at the Qwen3-4B DFlash shape, in a fresh process


def step_batch(cache: Path, shapes: Shapes, *, method: str, first: int, anchors_per_step: int | None):
    """A collated batch of `shapes.step_batch` sequences from the cache, as the trainer builds it."""
    reader = open_cache(cache)
    dataset = CacheTrainDataset(reader, objective=objective(method, reader, anchors_per_step=anchors_per_step), seed=0)
    return collate([dataset[(0, first + i)] for i in range(shapes.step_batch)])


def drafter_step_child(cache: str, shapes_dict: dict, threads: int) -> dict:
    """(c) in a fresh process: build the drafter and a random frozen head, then time forward+backward."""
    torch.set_num_threads(threads)
    shapes = Shapes.from_dict(shapes_dict)
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_config(shapes)).float()
    embed_tokens = torch.empty(shapes.vocab_size, shapes.hidden_size).normal_(0.0, 0.02)  # frozen [V, H]
    lm_head = torch.empty(shapes.vocab_size, shapes.hidden_size).normal_(0.0, 0.02)  # frozen [V, H]
    batches = [
        step_batch(Path(cache), shapes, method="alr_ira", first=i * shapes.step_batch, anchors_per_step=shapes.anchors_per_step)
        for i in range(shapes.step_repeats + 1)
    ]
    rss_before = rss_bytes() / GIB
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
        "peak_rss_gib": peak_rss_bytes() / GIB,
    }


# ---------------------------------------------------------------------------------------------
# (d) a stage-1 worker's peak RSS by shard size, a fresh process per size


def stage1_child(target: str, corpus: str, out: str, shapes_dict: dict, shard_size: int, threads: int) -> dict:
    """(d) in a fresh process: build the shards of one corpus with the driver in this process."""
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    shapes = Shapes.from_dict(shapes_dict)
    config = CacheBuildConfig.from_flags(
        target=target, corpus=corpus, out=out, layers=list(shapes.stage1_taps), num_slots=shapes.num_slots,
        top_k=shapes.top_k, anchors=shapes.num_anchors, max_length=shapes.stage1_max_length, shard_size=shard_size,
        batch_tokens=2 * shapes.stage1_max_length, workers=1, cpus_per_worker=threads, feature_codec="bf16", storage_format="zarr",
    )  # fmt: skip
    rss_before = rss_bytes() / GIB
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
        "peak_rss_gib": peak_rss_bytes() / GIB,
    }


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


def print_step(step: dict, shapes: Shapes, *, threads: int) -> None:
    print_table(
        f"(c) forward_loss + backward, alr_ira, {shapes.anchors_per_step} anchors/step, fp32 on CPU, {threads} threads",
        ["drafter", "params (M)", "sequences", "context tokens", "blocks", "supervised slots", "step s", "RSS before GiB", "peak RSS GiB"],
        [[f"1 layer H{shapes.hidden_size} I{shapes.intermediate_size} V{shapes.vocab_size}", f"{step['params_m']:.1f}",
          step["sequences"], step["context_tokens"], step["blocks"], step["supervised_slots"], f"{step['step_s']:.2f}",
          f"{step['rss_before_gib']:.2f}", f"{step['peak_rss_gib']:.2f}"]],
    )  # fmt: skip


def print_stage1(stage1: list[dict], shapes: Shapes) -> None:
    print_table(
        f"(d) stage-1 worker, random Qwen3 H{shapes.stage1_hidden} x {shapes.stage1_layers} layers, "
        f"taps {list(shapes.stage1_taps)}, A={shapes.num_anchors}, K={shapes.num_slots}, zarr bf16",
        ["shard size", "sequences", "tokens", "F", "build s", "RSS at start GiB", "peak RSS GiB"],
        [[s["shard_size"], s["sequences"], s["tokens"], s["feature_dim"], f"{s['build_s']:.1f}",
          f"{s['rss_before_gib']:.2f}", f"{s['peak_rss_gib']:.2f}"] for s in stage1],
    )  # fmt: skip


def loader_only(work: Path, shapes: Shapes, clock: RunClock) -> None:
    """--loader-only: the cache and (b2)."""
    cache = write_cache(work / "cache", shapes)
    reader = open_cache(cache)
    reader.read(0, arrays=set())
    floors = loader_against_floor(reader, cache, shapes=shapes)
    reader.close()
    path = write_results(work, {"loader_floor": floors, "load_average": clock.load_average()})
    print(f"{clock.load_line()}; {path}")


def cache_and_reads(work: Path, shapes: Shapes) -> tuple[Path, list[dict], list[dict], list[dict]]:
    """The real-shape cache, then (a), (b) and (b2) on it: (cache, reads, projection, floors)."""
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
    return cache, reads, projection, floors


def main() -> None:
    parser = bench_parser(__doc__, quick_help="tiny shapes (a CI smoke run, well under a minute)",
                          out_help="empty work directory (default: a new temp dir)", threads=2,
                          threads_help="torch threads of the drafter step and the stage-1 worker")  # fmt: skip
    parser.add_argument("--skip-stage1", action="store_true", help="leave out (d)")
    parser.add_argument("--writer-only", action="store_true", help="run (e) and (f) only")
    parser.add_argument("--loader-only", action="store_true", help="write the cache and run (b2) only")
    args = parser.parse_args()
    shapes = QUICK if args.quick else FULL
    work = work_directory(args.out, temp_prefix="alrira-real-shapes-")
    clock = RunClock()
    torch.set_num_threads(1)  # (a), (b): the loader of one DataLoader worker
    if args.loader_only:
        return loader_only(work, shapes, clock)
    writer = bench_writer(work, shapes, num_records=WRITER_RECORDS["quick" if args.quick else "full"], fresh=not args.quick)
    control = print_writer(writer, shapes)
    chunk_reads = bench_chunk_reads(work, shapes, quick=args.quick)
    print(clock.load_line(), flush=True)
    if args.writer_only:
        write_results(work, {"writer": writer, "blosc_control": control, "chunk_reads": chunk_reads,
                             "load_average": clock.load_average()})  # fmt: skip
        return

    cache, reads, projection, floors = cache_and_reads(work, shapes)
    print("\n(c) drafter step (fresh process) ...", flush=True)
    step = in_fresh_process(drafter_step_child, str(cache), asdict(shapes), args.threads)
    print_step(step, shapes, threads=args.threads)
    stage1 = []
    if not args.skip_stage1:
        print("\n(d) stage-1 worker (fresh process per shard size) ...", flush=True)
        stage1 = bench_stage1(work, shapes, threads=args.threads)
        print_stage1(stage1, shapes)

    finish_run(work, {"shapes": asdict(shapes), "reads": reads, "projection": projection, "loader_floor": floors, "drafter_step": step,
                      "stage1": stage1, "writer": writer, "blosc_control": control, "chunk_reads": chunk_reads}, clock)  # fmt: skip


if __name__ == "__main__":
    main()
