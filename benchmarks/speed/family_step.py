"""Training seconds per step of each drafter family, side by side on one cache: the trainer's own
plan, setup and `train_step` (pipeline/train/), the families taking turns step by step so that load
from other jobs on a shared machine spreads over all of them.

    .venv/bin/python -m benchmarks.speed.family_step --cache CACHE [--archs dflash,dspark,dflash2]
        [--method alr_ira] [--steps 60] [--threads 2] [--out DIR] [--quick]

Every family gets the demo's recipe (pipeline/demo/run.py `train_config`: batch 8, 16 anchors per
step, fp32) on the same cache and seed, so the same batches; the loader runs in the main process
(--num-workers 0), so a step includes building its labels. Reported per family: the median of the
steps after the first `--warmup`, and its ratio to the first family's. docs/results.md,
"Drafter families side by side".
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common.cli import bench_parser, run_record
from benchmarks.common.report import print_table
from pipeline.demo.run import DemoSizes, train_config
from pipeline.train.data import release_loader
from pipeline.train.plan import open_run, plan_training
from pipeline.train.setup import setup
from pipeline.train.step import train_step


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, quick_help="The demo's --quick recipe (a smoke run, not a result).",
                          out_help="Write family_step.json here.", threads=2)  # fmt: skip
    parser.add_argument("--cache", required=True, help="A stage-1 cache (e.g. a methods benchmark's world-0/cache).")
    parser.add_argument("--archs", default="dflash,dspark,dflash2", help="Comma-separated families.")
    parser.add_argument("--method", default="alr_ira", help="The objective every family trains with.")
    parser.add_argument("--steps", type=int, default=60, help="Steps per family.")
    parser.add_argument("--warmup", type=int, default=5, help="First steps of each family left out of the median.")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    archs = [a for a in args.archs.split(",") if a]
    sizes = DemoSizes.make(seed=0, quick=args.quick)
    with tempfile.TemporaryDirectory(prefix="family-step-") as scratch:
        runs = {}
        for arch in archs:  # each family's plan and state, built once
            config = train_config(cache=Path(args.cache), out=Path(scratch) / arch, method=args.method, seed=0, sizes=sizes, arch=arch)
            config = replace(config, loader=replace(config.loader, num_workers=0))
            plan = plan_training(config, open_run(config))
            runs[arch] = (plan, setup(plan))
        seconds = {arch: [] for arch in archs}
        try:
            for step in range(args.steps):
                for arch in archs:  # one step each in turn
                    plan, state = runs[arch]
                    started = time.perf_counter()
                    train_step(plan, state, step)
                    seconds[arch].append(time.perf_counter() - started)
        finally:
            for plan, state in runs.values():
                release_loader(state.batches, loader=plan.config.loader)
    median = {arch: statistics.median(s[args.warmup :]) for arch, s in seconds.items()}
    rows = [[arch, f"{median[arch] * 1000:.1f}", f"{median[arch] / median[archs[0]]:.2f}x"] for arch in archs]
    print_table(f"training step, --method {args.method}", ["family", "ms per step (median)", f"vs {archs[0]}"], rows)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {**run_record(__spec__.name, argv), "method": args.method, "steps": args.steps, "warmup": args.warmup,
                  "median_s_per_step": median, "seconds": seconds}  # fmt: skip
        (out / "family_step.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
