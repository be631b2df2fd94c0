"""What `alrira-train --eval-every` costs: one tau evaluation on a cache's evaluation split against
one training step, on the demo world (docs/benchmarks.md, "Training-time tau").

    .venv/bin/python -m benchmarks.speed.eval_cost [--out results/eval-cost] [--world-dir DIR] [--steps 60] [--eval-every 20]

Builds the demo world and its cache (or reuses --world-dir's `world/` and `cache/`, e.g. a
speed/methods.py output's world-0), adds the evaluation split of the world's held-out prompts
(pipeline/eval/split.py, the target in float32), then trains each architecture with the demo's
recipe for --steps steps, evaluating every --eval-every steps. Reports per architecture the seconds
of a training step (the run's time less its evaluations, over its steps), of one evaluation, and
their ratio; writes OUT/eval_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common.cli import command_line
from pipeline.demo.run import DemoSizes, build_demo_cache, train_config
from pipeline.demo.world import build_world
from pipeline.eval.split import build_eval_split, plan_eval_split
from pipeline.target import load_tokenizer
from pipeline.train.loop import train
from storage.eval_split import SplitFit
from storage.location import resolve
from storage.manifest import load_manifest


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/eval-cost")
    parser.add_argument("--world-dir", help="a folder holding world/ and cache/ to reuse (else built under --out)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = DemoSizes.make(seed=0, quick=False)
    world_dir = Path(args.world_dir) if args.world_dir else out / "world-0"
    world = build_world(world_dir / "world", sizes.world, log=print)
    cache = build_demo_cache(world, world_dir / "cache", sizes, log=print)
    manifest = load_manifest(cache)
    plan = plan_eval_split(str(world.prompts), target=str(world.target), tokenizer=load_tokenizer(world.target),
                           max_new_tokens=sizes.max_new_tokens, max_prompts=None, corpus=world.corpus)  # fmt: skip
    record = build_eval_split(resolve(cache), plan, target=str(world.target), fit=SplitFit.of(manifest))
    results = {}
    for arch in ("dflash", "dspark"):
        run = out / f"run-{arch}"
        config = train_config(cache=cache, out=run, method="alr", seed=0, sizes=sizes, arch=arch)
        config = replace(config, max_steps=args.steps, eval_every=args.eval_every, log_every=args.eval_every)
        config = replace(config, checkpoint=replace(config.checkpoint, resume=False, overwrite=True))
        started = time.perf_counter()
        summary = train(config)
        wall = time.perf_counter() - started
        evals = [json.loads(line)["eval"] for line in (run / "metrics.jsonl").read_text().splitlines() if "eval" in json.loads(line)]
        eval_s = [e["seconds"] for e in evals]
        step_s = (summary["elapsed_s"] - sum(eval_s)) / summary["steps"]
        results[arch] = {
            "steps": summary["steps"], "evaluations": len(evals), "step_s": step_s, "eval_s_median": statistics.median(eval_s),
            "eval_over_step": statistics.median(eval_s) / step_s, "final_tau_pooled": evals[-1]["tau_pooled"], "wall_s": wall,
        }  # fmt: skip
        print(f"{arch}: step {step_s:.3f} s, evaluation {results[arch]['eval_s_median']:.3f} s "
              f"({results[arch]['eval_over_step']:.1f} steps), {len(evals)} evaluations, final tau {evals[-1]['tau_pooled']:.3f}")  # fmt: skip
    report = {
        "command": command_line(__spec__.name, argv),
        "split": {"prompts": record["num_prompts"], "tokens": record["num_tokens"]}, "threads": args.threads, "results": results,
    }  # fmt: skip
    (out / "eval_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
