"""Stage-1 cache build benchmark on a tiny random Qwen3 (CPU), three measurements in one run:

(a) batched greedy rollouts (`run_target_batch`) vs one `model.generate()` per anchor for the same
    anchors: anchors/s of each, the speedup, and a check that both give the same rollout tokens;
(b) the whole build (`build_cache` as a 1-worker Ray job, and `ShardBuilder.build` in-process) vs
    the bare target computation it contains, with the time split into compute / encode / write;
(c) bytes per token on disk vs raw bf16 arrays for each storage format and feature codec.

    .venv/bin/python -m benchmarks.speed.cache_build [--quick] [--out DIR] [--threads 2]

Timings are wall-clock (time.perf_counter) with torch on --threads threads, after one warm-up;
small timings are medians of 3 runs taken in turns, whole Ray builds run once. On a shared machine
--threads 1 gives steadier numbers: two OpenMP threads stall whenever another job holds a core.
Results and how to read them: docs/benchmarks.md.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from benchmarks.common.cli import bench_parser, scratch_directory
from benchmarks.common.process import timed
from benchmarks.common.report import print_table
from benchmarks.common.toy import QUICK_CACHE, ToyCacheSizes, wide_target
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.corpus import CorpusConfig, ingest_corpus, save_tokenized_corpus
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, anchor_pool, run_target_batch
from pipeline.cache_build.shard_builder import ShardBuilder, outputs_to_record, plan_batches
from pipeline.target import load_target
from storage.format import CORPUS_DIR
from storage.reader import cache_stats, open_cache
from storage.shards import write_shard

RAY_CPUS = 2  # the local Ray cluster the script starts
NUM_REPEATS = 3
MIN_SUPERVISED_TOKENS = 32  # CacheBuildConfig's default, so both tokenize alike


@dataclass(kw_only=True)
class BenchSizes:
    """The cache and the build's batching of one benchmark run."""

    cache: ToyCacheSizes
    shard_size: int
    batch_tokens: int
    num_generate_sequences: int  # (a): the first this many sequences, all their anchors


FULL = BenchSizes(
    cache=ToyCacheSizes(target=wide_target(num_hidden_layers=4), num_rows=48, response_words=(80, 160), max_turns=2,
                        max_length=512, layer_ids=[0, 1, 2], num_slots=15, top_k=8, anchors=64),
    shard_size=16, batch_tokens=4096, num_generate_sequences=2,
)  # fmt: skip
QUICK = BenchSizes(cache=QUICK_CACHE, shard_size=4, batch_tokens=1024, num_generate_sequences=2)


# ----------------------------------------------------------------------------------------------
# (a) batched rollouts vs generate() per anchor


def generate_rollouts(model, sequences: list[TargetSequence], anchor_pos: list[np.ndarray], *, num_slots: int):
    """The naive labels: per anchor a greedy generate() of K tokens from x[<=a], with hidden states
    and scores. Returns the generated tokens, [num_anchors_of_seq, K] per sequence."""
    # Exactly K tokens: no eos stop (rollouts run through stop tokens), as in the runner's tests.
    greedy = copy.deepcopy(model.generation_config)
    greedy.update(
        do_sample=False,
        max_new_tokens=num_slots,
        eos_token_id=[],
        pad_token_id=0,
        output_hidden_states=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = []
    for seq, anchors in zip(sequences, anchor_pos):
        rows = []
        for anchor in anchors.tolist():
            prefix = torch.as_tensor(np.asarray(seq.input_ids[: anchor + 1]), dtype=torch.long)[None]
            out = model.generate(prefix, attention_mask=torch.ones_like(prefix), generation_config=greedy)
            rows.append(out.sequences[0, anchor + 1 :].tolist())
        tokens.append(np.asarray(rows, dtype=np.int64).reshape(len(rows), num_slots))
    return tokens


def bench_rollouts(model, sequences: list[TargetSequence], run_config: TargetRunConfig) -> dict:
    outputs = run_target_batch(model, sequences, run_config)  # warm-up; its anchor pools are the ones compared
    anchor_pos = [o.anchor_pos.numpy() for o in outputs]
    num_anchors = sum(len(p) for p in anchor_pos)
    generate_rollouts(model, sequences[:1], [anchor_pos[0][:1]], num_slots=run_config.num_slots)  # warm-up

    # The two take turns repeat by repeat, so load from other jobs falls on both alike.
    batched_times, generate_times = [], []
    for _ in range(NUM_REPEATS):
        seconds, outputs = timed(lambda: run_target_batch(model, sequences, run_config))
        batched_times.append(seconds)
        seconds, generated = timed(
            lambda: generate_rollouts(model, sequences, anchor_pos, num_slots=run_config.num_slots)
        )
        generate_times.append(seconds)
    batched_s, generate_s = statistics.median(batched_times), statistics.median(generate_times)
    num_same = sum(
        int((out.rollout_tokens[:, 1:].numpy() == gen).all(axis=1).sum()) for out, gen in zip(outputs, generated)
    )
    if num_same != num_anchors:
        raise SystemExit(
            f"error: batched rollouts and generate() disagree on {num_anchors - num_same} of {num_anchors} anchors"
        )
    return {
        "num_sequences": len(sequences),
        "num_anchors": num_anchors,
        "batched_s": batched_s,
        "generate_s": generate_s,
        "num_same": num_same,
    }


# ----------------------------------------------------------------------------------------------
# (b) whole build vs the target computation inside it


def shard_batches(lengths: list[int], *, shard_size: int, batch_tokens: int) -> list[list[list[int]]]:
    """Sequence indices per target batch, per shard: the batching ShardBuilder uses."""
    shards = []
    for start in range(0, len(lengths), shard_size):
        stop = min(start + shard_size, len(lengths))
        batches = plan_batches(lengths[start:stop], batch_tokens=batch_tokens)
        shards.append([[start + i for i in batch] for batch in batches])
    return shards


def bare_compute(model, sequences, run_config, shards: list[list[list[int]]]) -> float:
    start = time.perf_counter()
    for batches in shards:
        for batch in batches:
            run_target_batch(model, [sequences[i] for i in batch], run_config)
    return time.perf_counter() - start


def timed_build(model, sequences, run_config, shards, *, out: Path, feature_codec: str, storage_format: str):
    """ShardBuilder.build's loop with a clock around each phase: seconds of compute, encode, write."""
    seconds = {"compute": 0.0, "encode": 0.0, "write": 0.0}
    for shard_index, batches in enumerate(shards):
        records = []
        for batch in batches:
            t0 = time.perf_counter()
            outputs = run_target_batch(model, [sequences[i] for i in batch], run_config)
            t1 = time.perf_counter()
            records.extend(outputs_to_record(o, feature_codec=feature_codec) for o in outputs)
            seconds["compute"] += t1 - t0
            seconds["encode"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        write_shard(
            out, shard_index=shard_index, records=records, storage_format=storage_format, feature_codec=feature_codec
        )
        seconds["write"] += time.perf_counter() - t2
    return seconds


def build_config(
    sizes: BenchSizes, *, target: Path, corpus: Path, out: Path, threads: int, **overrides
) -> CacheBuildConfig:
    settings = dict(
        target=str(target),
        corpus=str(corpus),
        out=str(out),
        **sizes.cache.build_flags(),
        min_supervised_tokens=MIN_SUPERVISED_TOKENS,
        shard_size=sizes.shard_size,
        batch_tokens=sizes.batch_tokens,
        workers=1,
        cpus_per_worker=threads,  # ShardBuilder sets torch's threads to this
        feature_codec="bf16",
        storage_format="zarr",
    )
    return CacheBuildConfig.from_flags(**{**settings, **overrides})


def ray_build(config: CacheBuildConfig) -> tuple[float, dict]:
    from ray_jobs.build import build_cache

    start = time.perf_counter()
    build_cache(config, progress=False, log=lambda message: None)
    seconds = time.perf_counter() - start
    reader = open_cache(config.out)
    try:
        return seconds, cache_stats(reader)
    finally:
        reader.close()


# ----------------------------------------------------------------------------------------------


def prepare(sizes: BenchSizes, work: Path):
    """Toy target + chat corpus on disk; the corpus tokenized exactly as the build will do it."""
    target, corpus_path = sizes.cache.write_inputs(work)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    start = time.perf_counter()
    corpus = ingest_corpus(
        CorpusConfig(path=str(corpus_path), max_length=sizes.cache.max_length, min_supervised_tokens=MIN_SUPERVISED_TOKENS),
        tokenizer,
        progress=False,
    )
    tokenize_s = time.perf_counter() - start
    return target, corpus_path, corpus, tokenize_s


def bench_in_process_build(
    model, sequences, run_config, sizes: BenchSizes, *, work: Path, target: Path, corpus
) -> dict:
    """Seconds of: the bare target compute (cold and warm), the timed copy of ShardBuilder's loop
    (compute / encode / write) and ShardBuilder.build itself, over the whole corpus."""
    lengths = [len(s.input_ids) for s in sequences]
    shards = shard_batches(lengths, shard_size=sizes.shard_size, batch_tokens=sizes.batch_tokens)
    threads = torch.get_num_threads()
    config = build_config(sizes, target=target, corpus=work / "chat.jsonl", out=work / "shard-builder", threads=threads)
    save_tokenized_corpus(corpus, work / "shard-builder" / CORPUS_DIR)
    builder = ShardBuilder(config.with_taps(sizes.cache.layer_ids))  # its own copy of the target

    def build_all() -> None:
        for index, first in enumerate(range(0, len(sequences), sizes.shard_size)):
            builder.build(shard_index=index, start=first, stop=min(first + sizes.shard_size, len(sequences)))

    # The first pass meets every padded batch shape for the first time in this process, as a
    # fresh Ray worker does; it doubles as the warm-up.
    cold_s = bare_compute(model, sequences, run_config, shards)
    # Then the three take turns, so load from other jobs falls on all of them alike.
    rounds = []
    for _ in range(NUM_REPEATS):
        bare_s = bare_compute(model, sequences, run_config, shards)
        phases = timed_build(
            model, sequences, run_config, shards, out=work / "timed-loop", feature_codec="bf16", storage_format="zarr"
        )
        shard_builder_s, _ = timed(build_all)
        rounds.append({"bare_s": bare_s, **phases, "shard_builder_s": shard_builder_s})
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {"num_shards": len(shards), "cold_s": cold_s, **medians}


def time_worker_start(config: CacheBuildConfig, *, layer_ids: list[int]) -> float:
    """Seconds until a fresh CacheWorker actor answers: process, imports, target and corpus load."""
    import ray

    from pipeline.target import target_hash
    from ray_jobs.build import CacheWorker

    driver_target_hash = target_hash(config.target)  # what the driver hands every worker
    start = time.perf_counter()
    worker = CacheWorker.options(num_cpus=config.compute.cpus_per_worker, num_gpus=0).remote(
        config.with_taps(layer_ids), driver_target_hash
    )
    ray.get(worker.pid.remote())
    seconds = time.perf_counter() - start
    ray.kill(worker)
    return seconds


def bench_ray_builds(
    sizes: BenchSizes, *, work: Path, target: Path, corpus_path: Path, threads: int
) -> tuple[dict, float]:
    """build_cache once per storage format and feature codec, {(format, codec): (seconds,
    cache_stats)}, and the start-up time of one more worker on the finished zarr/bf16 cache."""
    import ray

    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    builds, configs = {}, {}
    try:
        for storage_format in ("zarr", "wds"):
            for codec in ("bf16", "fp8"):
                config = build_config(
                    sizes,
                    target=target,
                    corpus=corpus_path,
                    out=work / f"cache-{storage_format}-{codec}",
                    threads=threads,
                    feature_codec=codec,
                    storage_format=storage_format,
                )
                builds[storage_format, codec] = ray_build(config)
                configs[storage_format, codec] = config
        worker_start_s = time_worker_start(configs["zarr", "bf16"], layer_ids=sizes.cache.layer_ids)
    finally:
        ray.shutdown()
    return builds, worker_start_s


def report_rollouts(sizes: BenchSizes, a: dict) -> None:
    batched_rate, generate_rate = a["num_anchors"] / a["batched_s"], a["num_anchors"] / a["generate_s"]
    print_table(
        f"(a) rollouts for the same {a['num_anchors']} anchors ({a['num_sequences']} sequences, depth K-1 = "
        f"{sizes.cache.num_slots - 1}), median of {NUM_REPEATS}",
        ["method", "seconds", "anchors/s", "speedup"],
        [
            [
                "run_target_batch (one batch, incl. corpus pass)",
                f"{a['batched_s']:.3f}",
                f"{batched_rate:.1f}",
                f"{batched_rate / generate_rate:.1f}x",
            ],
            ["generate() per anchor (hidden states + scores)", f"{a['generate_s']:.3f}", f"{generate_rate:.1f}", "1x"],
        ],
    )
    print(f"rollout tokens identical: {a['num_same']}/{a['num_anchors']} anchors", flush=True)


def report_build(*, build: dict, builds: dict, tokenize_s: float, worker_start_s: float) -> None:
    b, stats = build, builds["zarr", "bf16"][1]
    ray_s, bare_s = builds["zarr", "bf16"][0], build["bare_s"]
    loop_s = b["compute"] + b["encode"] + b["write"]
    # What the Ray job spends beyond the parts timed apart (driver bookkeeping, scheduling, noise);
    # its compute is estimated by the in-process medians, which are steadier than one cold pass.
    work_s = bare_s + b["encode"] + b["write"]
    rest_s = ray_s - (tokenize_s + worker_start_s + work_s)
    rows = [
        ("bare target compute (run_target_batch only)", bare_s),
        ("bare target compute, first pass (cold shapes)", b["cold_s"]),
        ("timed loop: compute", b["compute"]),
        ("timed loop: encode (outputs_to_record)", b["encode"]),
        ("timed loop: write (write_shard)", b["write"]),
        ("timed loop: total", loop_s),
        ("ShardBuilder.build in-process (target loaded)", b["shard_builder_s"]),
        ("build_cache, Ray job, 1 worker, end to end", ray_s),
        ("  in it: tokenize corpus (timed apart)", tokenize_s),
        ("  in it: worker start (timed apart)", worker_start_s),
        ("  in it: compute + encode + write (as above)", work_s),
        ("  in it: remainder (driver, scheduling, noise)", rest_s),
    ]
    print_table(
        f"(b) build of {stats['sequences']} sequences, {stats['tokens']} tokens, {stats['anchors']} anchors, "
        f"{b['num_shards']} shards (zarr, bf16); in-process rows: medians of {NUM_REPEATS} rounds in turns, "
        "Ray build: once",
        ["what", "seconds", "x bare compute"],
        [[name, f"{seconds:.2f}", f"{seconds / bare_s:.2f}"] for name, seconds in rows],
    )
    print("worker start = a fresh CacheWorker actor until it answers: process, imports, target and corpus load")


def report_sizes(builds: dict) -> None:
    rows = []
    for (storage_format, codec), (seconds, s) in builds.items():
        rows.append(
            [
                f"{storage_format} {codec}",
                f"{s['bytes_on_disk'] / 1e6:.2f}",
                f"{s['bytes_per_token']:.0f}",
                f"{s['raw_bf16_bytes'] / s['tokens']:.0f}",
                f"{s['bytes_on_disk'] / s['raw_bf16_bytes']:.3f}",
                f"{s['compression_ratio_vs_raw_bf16']:.2f}x",
                f"{seconds:.2f}",
            ]
        )
    print_table(
        "(c) size on disk (cache_stats) vs raw bf16 arrays, random-init target",
        ["format codec", "MB on disk", "bytes/token", "raw bf16 bytes/token", "disk/raw", "raw/disk", "Ray build s"],
        rows,
    )


def main() -> None:
    parser = bench_parser(__doc__, quick_help="tiny sizes (< 1 min), to smoke-test the script",
                          out_help="workspace directory, kept (default: a temp dir, removed)", threads=2,
                          threads_help="torch threads, in-process and per Ray worker (1 or 2; default 2)")  # fmt: skip
    args = parser.parse_args()
    if not 1 <= args.threads <= RAY_CPUS:
        parser.error(f"--threads must be 1..{RAY_CPUS}, got {args.threads}")
    sizes = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    with scratch_directory(args.out, temp_prefix="alrira-bench-cache-") as work:
        run(sizes, work=work, threads=args.threads)
    if args.out is None:
        print("(temporary workspace removed; pass --out DIR to keep the caches)")


def run(sizes: BenchSizes, *, work: Path, threads: int) -> None:
    began, cache = time.perf_counter(), sizes.cache

    target, corpus_path, corpus, tokenize_s = prepare(sizes, work)
    sequences = []
    for i in range(len(corpus)):
        input_ids, loss_mask = corpus.sequence(i)
        source_row = int(corpus.source_rows[i])
        sequences.append(TargetSequence(source_row=source_row, input_ids=input_ids, loss_mask=loss_mask))
    lengths = [len(s.input_ids) for s in sequences]
    run_config = TargetRunConfig(
        layer_ids=cache.layer_ids, num_slots=cache.num_slots, top_k=cache.top_k, anchors_per_sequence=cache.anchors
    )
    model = load_target(target, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"target: random Qwen3, {num_params / 1e6:.2f}M params (hidden {cache.target.hidden_size}, {cache.target.num_hidden_layers} "
        f"layers, {cache.target.num_attention_heads} heads x {cache.target.head_dim}, {cache.target.num_key_value_heads} kv heads, mlp "
        f"{cache.target.intermediate_size}), taps {cache.layer_ids}, fp32\ncorpus: {len(sequences)} sequences, {sum(lengths)} "
        f"tokens (min {min(lengths)}, mean {np.mean(lengths):.0f}, max {max(lengths)}); K={cache.num_slots}, top-k "
        f"{cache.top_k}, {cache.anchors} anchors/sequence; torch threads {torch.get_num_threads()}; load average "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )

    print("(a) batched rollouts vs generate() per anchor ...", flush=True)
    rollouts = bench_rollouts(model, sequences[: sizes.num_generate_sequences], run_config)
    report_rollouts(sizes, rollouts)
    print("\n(b) in-process build vs bare target compute ...", flush=True)
    build = bench_in_process_build(model, sequences, run_config, sizes, work=work, target=target, corpus=corpus)
    print(
        f"bare compute {build['bare_s']:.2f}s (cold {build['cold_s']:.2f}s); timed loop compute "
        f"{build['compute']:.2f}s, encode {build['encode']:.2f}s, write {build['write']:.2f}s; "
        f"ShardBuilder.build {build['shard_builder_s']:.2f}s",
        flush=True,
    )
    print("(b, c) Ray builds ...", flush=True)
    builds, worker_start_s = bench_ray_builds(
        sizes, work=work, target=target, corpus_path=corpus_path, threads=threads
    )

    # The Ray job tokenizes the corpus itself; it must have computed what the in-process runs did.
    stats = builds["zarr", "bf16"][1]
    num_anchors = sum(
        len(anchor_pool(s.loss_mask, num_anchors=sizes.cache.anchors, seed=run_config.seed, source_row=s.source_row))
        for s in sequences
    )
    if (stats["tokens"], stats["anchors"]) != (sum(lengths), num_anchors):
        raise SystemExit(
            f"error: the Ray build holds {stats['tokens']} tokens and {stats['anchors']} anchors, "
            f"the in-process runs {sum(lengths)} and {num_anchors}"
        )
    report_build(build=build, builds=builds, tokenize_s=tokenize_s, worker_start_s=worker_start_s)
    report_sizes(builds)
    print(
        f"\ntotal benchmark time {time.perf_counter() - began:.0f}s; load average now {os.getloadavg()[0]:.2f}; "
        f"workspace {work}"
    )


if __name__ == "__main__":
    main()
