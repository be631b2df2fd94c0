"""Stage-2 train-step benchmark on a tiny random Qwen3 (CPU), three measurements in one run:

(1) offline step: `forward_loss` + backward + clip + AdamW step on batches collated from the cache,
    for every method;
(2) online step: what a pipeline without a cache does every step for the same batch: the target
    pass (`run_target_batch` on the same sequences, same anchor pool, same K) and then the same
    drafter step. Corpus methods need only the corpus pass (rollouts=False), rollout methods the
    corpus pass plus the K - 1 batched rollout forwards. Label building and collation are left out
    of both (1) and (2): they are the data loader's work, timed in (3);
(3) data loader: sequences/s that a DataLoader over CacheTrainDataset (StepSampler, collate)
    delivers with 0, 1 and 2 workers, against the sequences/s the step of (1) consumes.

    .venv/bin/python -m benchmarks.speed.train_step [--quick] [--out DIR] [--threads 2]

The cache is built once through the CLI (`alrira-cache build`, a 1-worker Ray job). Timings are
wall-clock (time.perf_counter) with torch on 2 threads in the main process (1 per loader worker),
one warm-up each, medians of the repeats. Methods (and loader settings) take turns repeat by repeat,
so load from other jobs on a shared machine spreads over all rows. See docs/benchmarks.md, "Stage 2".
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common.cli import bench_parser, work_directory
from benchmarks.common.report import print_table, write_results
from benchmarks.common.toy import QUICK_CACHE, ToyCacheSizes, wide_target
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, run_target_batch
from pipeline.target import load_target
from pipeline.train.batching import CacheTrainDataset, StepSampler, TrainBatch, collate
from pipeline.train.config import TrainConfig
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.methods import METHODS, ROLLOUT_METHODS
from pipeline.train.plan import plan_drafter
from pipeline.train.setup import build_drafter
from pipeline.train.step import forward_loss
from ray_jobs.cli import cache_cli
from storage.manifest import load_target_head
from storage.reader import open_cache

NUM_THREADS = 2
LOADER_WORKERS = (0, 1, 2)


@dataclass(kw_only=True)
class BenchSizes:
    """Cache and step settings of one benchmark run."""

    cache: ToyCacheSizes  # 2 taps -> a 2-layer drafter; every step trains the whole anchor pool
    batch_size: int  # sequences per step
    num_repeats: int  # timed steps per method (distinct batches, cycling), after one warm-up
    num_loader_passes: int  # timed passes over the cache per loader setting, after one warm-up
    methods: tuple[str, ...]


FULL = BenchSizes(
    cache=ToyCacheSizes(target=wide_target(num_hidden_layers=6), num_rows=48, response_words=(60, 120), max_turns=2,
                        max_length=512, layer_ids=[1, 3], num_slots=15, top_k=8, anchors=16),
    batch_size=8, num_repeats=7, num_loader_passes=3, methods=METHODS,
)  # fmt: skip
QUICK = BenchSizes(
    cache=replace(QUICK_CACHE, num_rows=12), batch_size=4, num_repeats=3, num_loader_passes=3,
    methods=("dflash", "alr_ira"),  # one corpus-only and one rollout method
)  # fmt: skip


def build_benchmark_cache(sizes: BenchSizes, *, target: Path, corpus: Path, out: Path) -> float:
    """`alrira-cache build` through the CLI (the only way a script reaches ray_jobs); seconds."""
    flags = sizes.cache.build_flags() | {"shard_size": 16, "batch_tokens": 4096, "workers": 1, "cpus_per_worker": NUM_THREADS}
    args = ["build", "--target", str(target), "--corpus", str(corpus), "--out", str(out), "--no-progress"]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    start = time.perf_counter()
    cache_cli.main(args=args, standalone_mode=False)
    seconds = time.perf_counter() - start
    import ray

    # The build started a local Ray cluster in this process; its daemons would share the cores.
    if ray.is_initialized():
        ray.shutdown()
    return seconds


def objective_for(method: str, manifest) -> ObjectiveConfig:
    """The trainer's defaults (pool anchors, whole pool per step, R = K - 1) for `method`."""
    num_slots = manifest.settings.num_slots
    return ObjectiveConfig(
        method=method, rollout_depth=num_slots - 1, num_slots=num_slots, mask_token_id=manifest.mask_token_id,
        stop_token_ids=tuple(manifest.stop_token_ids),
    )


def step_keys(num_sequences: int, *, batch_size: int, seed: int) -> list[list[tuple[int, int]]]:
    """(epoch, index) keys of each step of epoch 0, as the trainer's sampler orders them."""
    sampler = StepSampler(num_sequences, batch_size=batch_size, grad_accum=1, epochs=1, seed=seed, rank=0, world_size=1)
    return [micro[0] for _, _, micro in sampler.steps()]


class DrafterStep:
    """The body of the train loop for one rank, one micro-batch, fp32 on CPU."""

    def __init__(self, method: str, *, cache: str, manifest, head: dict, grad_clip: float = 1.0):
        config = TrainConfig.from_flags(cache=cache, out="-", method=method, seed=0)
        self.drafter = build_drafter(plan_drafter(config, manifest))
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=config.optim.lr, weight_decay=0.0)
        self.embed_tokens = head["embed_tokens.weight"].float()  # frozen [V, H]
        self.lm_head = head["lm_head.weight"].float()  # frozen [V, H]
        self.block_size = manifest.settings.num_slots + 1
        self.loss_chunk = config.optim.loss_chunk
        self.grad_clip = grad_clip

    def __call__(self, batch: TrainBatch) -> float:
        stats = forward_loss(
            self.drafter, batch, embed_tokens=self.embed_tokens, lm_head=self.lm_head, block_size=self.block_size,
            loss_chunk=self.loss_chunk, autocast=contextlib.nullcontext(),
        )  # fmt: skip
        loss = stats.loss_sum / (stats.weight_sum + 1e-6)
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


def target_sequences(reader, keys: list[tuple[int, int]]) -> list[TargetSequence]:
    """The corpus sequences of a batch, exactly as stage 1 saw them (ids, loss mask, source row)."""
    sequences = []
    for _, index in keys:
        record = reader.read(index, decode_features=False)
        sequences.append(
            TargetSequence(
                source_row=int(record["source_row"]),
                input_ids=np.asarray(record["input_ids"]),
                loss_mask=np.asarray(record["loss_mask"]),
            )
        )
    return sequences


class MethodBench:
    """(1) and (2) for one method: its drafter, the collated batches and the same batches' sequences."""

    def __init__(self, method: str, *, reader, cache: str, head: dict, target_model, keys, num_batches: int):
        manifest = reader.manifest
        dataset = CacheTrainDataset(reader, objective=objective_for(method, manifest), seed=0)
        self.method = method
        self.batches = [collate([dataset[key] for key in keys[i]]) for i in range(num_batches)]
        self.sequences = [target_sequences(reader, keys[i]) for i in range(num_batches)]
        self.run_config = TargetRunConfig(
            layer_ids=manifest.settings.layer_ids,
            num_slots=manifest.settings.num_slots,
            top_k=manifest.settings.top_k,
            anchors_per_sequence=manifest.settings.anchors_per_sequence,
            seed=manifest.settings.seed,
            rollouts=method in ROLLOUT_METHODS,
        )
        self.step = DrafterStep(method, cache=cache, manifest=manifest, head=head)
        self.target_model = target_model
        self.offline_s, self.target_s, self.online_s = [], [], []

        # Warm-up on batch 0; it also checks that the online target pass drafts from the cached anchors.
        self.step(self.batches[0])
        outputs = run_target_batch(target_model, self.sequences[0], self.run_config)
        for out, (_, index) in zip(outputs, keys[0]):
            if not np.array_equal(out.anchor_pos.numpy(), reader.read(index, decode_features=False)["anchor_pos"]):
                raise SystemExit(f"error: sequence {index}: the online anchor pool differs from the cached one")

    def run(self, i: int) -> None:
        """One offline step on batch i, then one online step (target pass + drafter step) on batch i."""
        start = time.perf_counter()
        self.step(self.batches[i])
        self.offline_s.append(time.perf_counter() - start)

        start = time.perf_counter()
        run_target_batch(self.target_model, self.sequences[i], self.run_config)
        middle = time.perf_counter()
        self.step(self.batches[i])
        end = time.perf_counter()
        self.target_s.append(middle - start)
        self.online_s.append(end - start)

    def summary(self) -> dict:
        timed = self.batches[1:] or self.batches
        return {
            "method": self.method,
            "target_pass": "corpus + rollouts" if self.run_config.rollouts else "corpus only",
            "blocks_per_step": statistics.mean(int(b.block_valid.sum()) for b in timed),
            "supervised_slots_per_step": statistics.mean(int((b.slot_weights > 0).sum()) for b in timed),
            "offline_s": statistics.median(self.offline_s),
            "target_s": statistics.median(self.target_s),
            "online_s": statistics.median(self.online_s),
            # Each online step runs right after its offline step on the same batch; the ratio of the
            # pair is steadier than a ratio of medians when other jobs share the cores.
            "online_over_offline": statistics.median(on / off for on, off in zip(self.online_s, self.offline_s)),
            "offline_runs_s": self.offline_s,
            "target_runs_s": self.target_s,
            "online_runs_s": self.online_s,
        }


def bench_steps(*, reader, cache: str, head: dict, target_model, sizes: BenchSizes, keys) -> list[dict]:
    """(1) and (2) for every method, round-robin: repeat r times each method once, so a burst of
    load from other jobs spreads over the methods instead of landing on one of them."""
    num_batches = min(len(keys), sizes.num_repeats + 1)
    benches = [
        MethodBench(method, reader=reader, cache=cache, head=head, target_model=target_model, keys=keys, num_batches=num_batches)
        for method in sizes.methods
    ]
    for r in range(sizes.num_repeats):
        i = 1 + r % (num_batches - 1) if num_batches > 1 else 0
        for bench in benches:
            bench.run(i)
        print(f"  round {r + 1}/{sizes.num_repeats} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    return [bench.summary() for bench in benches]


def _one_thread(worker_id: int) -> None:
    torch.set_num_threads(1)  # as the trainer's workers: no oversubscription of the 2 cores


def make_loader(method: str, *, reader, sizes: BenchSizes, num_workers: int):
    """The trainer's DataLoader (StepSampler batches, collate, 1-thread workers) for one epoch."""
    dataset = CacheTrainDataset(reader, objective=objective_for(method, reader.manifest), seed=0)
    sampler = StepSampler(len(reader), batch_size=sizes.batch_size, grad_accum=1, epochs=1, seed=0, rank=0, world_size=1)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        prefetch_factor=2 if num_workers else None,
        persistent_workers=num_workers > 0,  # worker start-up is paid once, in the warm-up pass
        worker_init_fn=_one_thread,
    )


def bench_loaders(*, reader, sizes: BenchSizes) -> dict[tuple[str, int], dict]:
    """(3): sequences/s of whole passes over the cache (collated, no training) for every method and
    worker count; pass p of every loader runs before pass p + 1 of any (round-robin, as in (1))."""
    loaders = {
        (method, workers): make_loader(method, reader=reader, sizes=sizes, num_workers=workers)
        for method in sizes.methods
        for workers in LOADER_WORKERS
    }
    rates = {key: [] for key in loaders}
    for p in range(sizes.num_loader_passes + 1):  # pass 0: warm-up (worker start-up)
        for key, loader in loaders.items():
            start = time.perf_counter()
            num_sequences = sum(batch.num_sequences for batch in loader)
            if p > 0:
                rates[key].append(num_sequences / (time.perf_counter() - start))
    del loaders  # ends the persistent workers
    return {
        (method, workers): {"method": method, "num_workers": workers, "sequences_per_s": statistics.median(r), "runs": r}
        for (method, workers), r in rates.items()
    }


def main() -> None:
    parser = bench_parser(__doc__, quick_help="tiny sizes (< 1 min), to smoke-test the script",
                          out_help="workspace directory (default: a new temp dir)", threads=NUM_THREADS,
                          threads_help="torch threads of the main process")  # fmt: skip
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    work = work_directory(args.out, temp_prefix="alrira-bench-train-")
    began = time.perf_counter()
    load_before = os.getloadavg()

    target, corpus = sizes.cache.write_inputs(work)
    cache = work / "cache"
    print("building the cache (alrira-cache build, Ray, 1 worker) ...", flush=True)
    build_s = build_benchmark_cache(sizes, target=target, corpus=corpus, out=cache)

    torch.set_num_threads(args.threads)
    reader = open_cache(cache)
    manifest = reader.manifest
    head = load_target_head(cache)
    target_model = load_target(target, dtype=torch.float32)
    keys = step_keys(len(reader), batch_size=sizes.batch_size, seed=0)
    if len(keys) < 2:
        raise SystemExit(f"error: the cache holds {len(reader)} sequences, fewer than 2 steps of {sizes.batch_size}")
    lengths = [len(reader.read(i, decode_features=False)["input_ids"]) for i in range(len(reader))]
    num_target_params = sum(p.numel() for p in target_model.parameters())
    num_drafter_params = sum(p.numel() for p in build_drafter(plan_drafter(TrainConfig.from_flags(cache=str(cache), out="-"), manifest)).parameters())
    print(
        f"target: Qwen3 {num_target_params / 1e6:.2f}M params (hidden {sizes.cache.target.hidden_size}, {sizes.cache.target.num_hidden_layers} layers, "
        f"{sizes.cache.target.num_attention_heads}x{sizes.cache.target.head_dim} heads), taps {sizes.cache.layer_ids}; drafter: {len(sizes.cache.layer_ids)} layers, "
        f"{num_drafter_params / 1e6:.2f}M trained params; cache: {len(reader)} sequences, {sum(lengths)} tokens "
        f"(mean {np.mean(lengths):.0f}, max {max(lengths)}), K={sizes.cache.num_slots}, top-k {sizes.cache.top_k}, "
        f"pool {sizes.cache.anchors} anchors/sequence (all trained each step), built in {build_s:.1f}s; "
        f"batch {sizes.batch_size} sequences; torch threads {torch.get_num_threads()}",
        flush=True,
    )

    print("(1, 2) offline and online steps ...", flush=True)
    steps = bench_steps(reader=reader, cache=str(cache), head=head, target_model=target_model, sizes=sizes, keys=keys)
    print("(3) data loader ...", flush=True)
    loaders = bench_loaders(reader=reader, sizes=sizes)
    reader.close()

    print_table(
        f"(1, 2) one step of {sizes.batch_size} sequences: offline (drafter step on a cached batch) vs online "
        f"(target pass + the same drafter step); ms, median (min) of {sizes.num_repeats} after 1 warm-up; "
        "online/offline = median of the per-batch ratios, and min online / min offline",
        ["method", "blocks", "slots", "offline ms", "target pass", "target ms", "online ms", "online/offline", "min/min"],
        [
            [
                s["method"],
                f"{s['blocks_per_step']:.0f}",
                f"{s['supervised_slots_per_step']:.0f}",
                f"{1e3 * s['offline_s']:.0f} ({1e3 * min(s['offline_runs_s']):.0f})",
                s["target_pass"],
                f"{1e3 * s['target_s']:.0f} ({1e3 * min(s['target_runs_s']):.0f})",
                f"{1e3 * s['online_s']:.0f} ({1e3 * min(s['online_runs_s']):.0f})",
                f"{s['online_over_offline']:.2f}x",
                f"{min(s['online_runs_s']) / min(s['offline_runs_s']):.2f}x",
            ]
            for s in steps
        ],
    )
    rows = []
    for s in steps:
        consumed = sizes.batch_size / s["offline_s"]
        consumed_best = sizes.batch_size / min(s["offline_runs_s"])
        row = [s["method"], f"{consumed:.1f}", f"{consumed_best:.1f}"]
        for w in LOADER_WORKERS:
            delivered = loaders[s["method"], w]["sequences_per_s"]
            row.append(f"{delivered:.1f} ({delivered / consumed:.1f}x, {delivered / consumed_best:.1f}x)")
        rows.append(row)
    print_table(
        f"(3) data loader alone (CacheTrainDataset + collate, no training) vs the offline step: sequences/s, "
        f"median of {sizes.num_loader_passes} passes over {len(keys) * sizes.batch_size} sequences; "
        "(loader / median step, loader / fastest step), > 1x = keeps up",
        ["method", "step: median", "fastest", *[f"loader, {w} workers" for w in LOADER_WORKERS]],
        rows,
    )
    total_s = time.perf_counter() - began
    write_results(work, {"sizes": asdict(sizes), "steps": steps, "loaders": list(loaders.values()), "build_s": build_s,
                         "total_s": total_s, "load_before": load_before, "load_after": os.getloadavg()})  # fmt: skip
    load_after = os.getloadavg()
    print(
        f"\ntotal benchmark time {total_s:.0f}s; load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/"
        f"{load_before[2]:.1f}, after {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} on {os.cpu_count()} cores; "
        f"workspace {work} (results.json)"
    )


if __name__ == "__main__":
    main()
