"""Methods benchmark: tau of dflash, kd, erase, alr and alr_ira on the demo world, over seeds, at T = 0 and T = 1.

    .venv/bin/python -m benchmarks.speed.methods [--out results/methods] [--seeds 0,1,2] [--world-seed same|N] [--archs dflash,dspark,dflash2]

`--archs dflash,dspark,dflash2` trains each method as a drafter of each family from the same cache
(rows named `FAMILY:METHOD`, DFlash's plain `METHOD`; every family drafts the cache's K tokens per
round), reports the DSpark confidence head's calibration per slot (docs/dspark.md) and, by
`families_section`, the families side by side with their training time per step.

A replicate is one (world seed, drafter seed) pair. By default each drafter seed gets its own world
(`--world-seed same`: world seed = drafter seed), so the spread covers both the world (chains,
corpus, prompts, target training) and the drafter's training (init, data order, anchor draws);
`--world-seed 0` keeps one world and varies only the drafters. For each world it builds the demo
world (pipeline.demo.world) and one cache with the Ray job, trains every method from that cache
with the demo's recipe (identical settings except the method) and decodes the held-out prompts at
each temperature. The table reports the mean and sample SD over replicates of the
geometric-mean tau (and of the speedup), plus the mean per-prompt-group tau. Every phase is
skipped when its output exists, so a run resumes. Outputs in --out: methods.json (every
replicate), methods.md (the tables), tau_by_method.png. See docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.cli import float_list, int_list, run_record
from benchmarks.common.report import mean_sd, stamped_log
from pipeline.demo.run import (
    DEMO_METHODS,
    DemoSizes,
    build_demo_cache,
    evaluate_method,
    method_results,
    plot_taus,
    train_config,
    train_method,
)
from pipeline.demo.world import build_world


def summarize(replicates: list[dict], *, methods: list[str], temperatures: list[float]) -> dict:
    """{method: {"T0": {"tau_mean", "tau_sd", "speedup_mean", "speedup_sd", "tau_by_group"}, "train_s_mean"}}."""
    table = {}
    for method in methods:
        rows = [r["methods"][method] for r in replicates]
        entry = {"train_s_mean": statistics.fmean(r["train_s"] for r in rows)}
        for t in temperatures:
            key = f"T{t:g}"
            tau_mean, tau_sd = mean_sd([r[key]["tau"] for r in rows])
            speed_mean, speed_sd = mean_sd([r[key]["speedup"] for r in rows])
            groups = rows[0][key]["tau_by_group"]
            entry[key] = {
                "tau_mean": tau_mean, "tau_sd": tau_sd, "speedup_mean": speed_mean, "speedup_sd": speed_sd,
                "tau_by_group": {g: statistics.fmean(r[key]["tau_by_group"][g] for r in rows) for g in groups},
                "taus": [r[key]["tau"] for r in rows],
            }  # fmt: skip
        table[method] = entry
    return table


def markdown_table(table: dict, *, temperatures: list[float], num_replicates: int) -> str:
    groups = list(next(iter(table.values()))[f"T{temperatures[0]:g}"]["tau_by_group"])
    lines = []
    for t in temperatures:
        key = f"T{t:g}"
        lines += [
            f"T = {t:g} (mean ± SD over {num_replicates} replicates; per-group columns are means)",
            "",
            "| method | tau | speedup | " + " | ".join(f"tau {g}" for g in groups) + " | train s |",
            "|---|---|---|" + "---|" * len(groups) + "---|",
        ]
        for method, entry in table.items():
            e = entry[key]
            lines.append(
                f"| {method} | {e['tau_mean']:.3f} ± {e['tau_sd']:.3f} | {e['speedup_mean']:.2f}x ± {e['speedup_sd']:.2f} | "
                + " | ".join(f"{e['tau_by_group'][g]:.3f}" for g in groups)
                + f" | {entry['train_s_mean']:.0f} |"
            )
        lines.append("")
    return "\n".join(lines)


def calibration_table(report: dict, *, methods: list[str], temperature: float, num_slots: int = 8) -> str:
    """A DSpark confidence head's calibration: per slot, over every replicate's rounds that reached
    it (every earlier draft accepted), the observed acceptance and the head's mean prediction."""
    key = f"T{temperature:g}"
    lines = ["| method | " + " | ".join(f"slot {k}" for k in range(num_slots)) + " |", "|---|" + "---|" * num_slots]
    for method in methods:
        cells = []
        for k in range(num_slots):
            slots = [r["methods"][method]["slot_acceptance"][key][k] for r in report["replicates"]]
            reached = sum(s["reached"] for s in slots)
            observed = sum(s["acceptance"] * s["reached"] for s in slots if s["acceptance"] is not None) / reached if reached else None
            predicted = sum(s["predicted"] * s["reached"] for s in slots if s["predicted"] is not None) / reached if reached else None
            cells.append("-" if observed is None else f"{observed:.3f} / {predicted:.3f}" if predicted is not None else f"{observed:.3f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markov_table(with_head: dict, without_head: dict, *, methods: list[str], temperatures: list[float]) -> str:
    """tau of DSpark drafters with and without their Markov head, per method (mean ± SD)."""
    lines = ["| method | " + " | ".join(f"T = {t:g}: with head | without | gain" for t in temperatures) + " |",
             "|---|" + "---|---|---|" * len(temperatures)]  # fmt: skip
    for method in methods:
        cells = []
        for t in temperatures:
            a, b = with_head[method][f"T{t:g}"], without_head[method][f"T{t:g}"]
            cells += [f"{a['tau_mean']:.3f} ± {a['tau_sd']:.3f}", f"{b['tau_mean']:.3f} ± {b['tau_sd']:.3f}",
                      f"{100 * (a['tau_mean'] / b['tau_mean'] - 1):+.1f}%"]  # fmt: skip
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ordering(table: dict, key: str) -> str:
    """Methods sorted by mean tau, highest first: 'alr_ira > alr > ...'."""
    ranked = sorted(table, key=lambda m: -table[m][key]["tau_mean"])
    return " > ".join(ranked)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/methods", help="Output directory (resumable).")
    parser.add_argument("--seeds", type=int_list, default=[0, 1, 2], help="Comma-separated drafter training seeds.")
    parser.add_argument("--world-seed", default="same", help="'same' (a world per drafter seed) or one world seed for all.")
    parser.add_argument("--temperatures", type=float_list, default=[0.0, 1.0], help="Comma-separated decoding temperatures.")
    parser.add_argument("--methods", default=",".join(DEMO_METHODS), help="Comma-separated methods.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads of this process.")
    parser.add_argument("--quick", action="store_true", help="The demo's --quick sizes (a smoke run, not a result).")
    parser.add_argument("--archs", default="dflash", help="Comma-separated drafter families (--arch): dflash, dspark, dflash2.")
    parser.add_argument("--markov-rank", type=int, default=None,
                        help="DSpark arms: the Markov head's rank (>= 1: alrira-train refuses 0, which no engine serves as DSpark).")
    args = parser.parse_args(argv)
    archs = [a for a in args.archs.split(",") if a]
    methods = [f"{arch}:{m}" if arch != "dflash" else m for arch in archs for m in args.methods.split(",") if m]
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, log = time.time(), stamped_log()
    pairs = [(seed if args.world_seed == "same" else int(args.world_seed), seed) for seed in args.seeds]
    replicates = []
    for world_seed, seed in pairs:
        world_dir = out / f"world-{world_seed}"
        sizes = DemoSizes.make(seed=world_seed, quick=args.quick)
        world = build_world(world_dir / "world", sizes.world, log=log)
        cache = build_demo_cache(world, world_dir / "cache", sizes, log=log)
        results = {}
        for method in methods:
            arch, _, name = method.rpartition(":")
            folder = method.replace(":", "-")
            run = world_dir / f"seed-{seed}" / "runs" / folder
            summary = train_method(
                train_config(cache=cache, out=run, method=name, seed=seed, sizes=sizes, arch=arch or "dflash",
                             markov_rank=args.markov_rank if arch == "dspark" else None), log=log
            )
            evals = {
                t: evaluate_method(
                    world=world, drafter=run / "drafter", out=world_dir / f"seed-{seed}" / "evals" / f"{folder}-T{t:g}",
                    temperature=t, seed=seed, sizes=sizes, log=log,
                )  # fmt: skip
                for t in args.temperatures
            }
            results[method] = method_results(train_summary=summary, evals=evals)
            results[method]["train_steps"] = summary["steps"]  # training time per step: train_s / train_steps
            results[method]["slot_acceptance"] = {f"T{t:g}": e.get("slot_acceptance") for t, e in evals.items()}
            taus = ", ".join(f"tau {results[method][f'T{t:g}']['tau']:.3f} (T={t:g})" for t in args.temperatures)
            log(f"world {world_seed} seed {seed} {method}: {taus}")
        world_stats = {k: v for k, v in world.stats.items() if k != "config"}
        replicates.append({"world_seed": world_seed, "seed": seed, "world": world_stats, "methods": results})

    table = summarize(replicates, methods=methods, temperatures=args.temperatures)
    markdown = markdown_table(table, temperatures=args.temperatures, num_replicates=len(replicates))
    report = {
        **run_record(__spec__.name, argv),
        "wall_s": time.time() - started,
        "replicates_world_and_drafter_seed": pairs,
        "temperatures": args.temperatures,
        "table": table,
        "ordering": {f"T{t:g}": ordering(table, f"T{t:g}") for t in args.temperatures},
        "replicates": replicates,
    }
    (out / "methods.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "methods.md").write_text(markdown + "\n")
    plot_taus(
        {m: [table[m][f"T{t:g}"]["tau_mean"] for t in args.temperatures] for m in methods}, out / "tau_by_method.png",
        errors={m: [table[m][f"T{t:g}"]["tau_sd"] for t in args.temperatures] for m in methods},
        labels=[f"T = {t:g}" for t in args.temperatures],
        title=f"demo world: tau at T = {', '.join(f'{t:g}' for t in args.temperatures)} (mean ± SD, {len(replicates)} replicates)",
    )  # fmt: skip
    print()
    print(markdown)
    for key, order in report["ordering"].items():
        print(f"ordering by mean tau at {key}: {order}")
    print(f"wall {report['wall_s']:.0f}s; {out / 'methods.json'}")
    return report


def dspark_section(full: dict, without_head: dict) -> str:
    """docs/results.md's DSpark tables from two runs' methods.json: `full` (--archs dspark,dflash)
    and `without_head` (--archs dspark --markov-rank 0) on the same worlds."""
    temperatures = full["temperatures"]
    methods = [m.removeprefix("dspark:") for m in full["table"] if m.startswith("dspark:")]
    dspark = [f"dspark:{m}" for m in methods]
    parts = [markdown_table(full["table"], temperatures=temperatures, num_replicates=len(full["replicates"]))]
    parts.append("Markov head: DSpark drafters with it and without it (--markov-rank 0), the same worlds and recipe\n\n"
                 + markov_table(full["table"], without_head["table"], methods=dspark, temperatures=temperatures))  # fmt: skip
    for t in temperatures:
        parts.append(f"Confidence head at T = {t:g}: observed / predicted acceptance per slot (rounds that reached it)\n\n"
                     + calibration_table(full, methods=dspark, temperature=t))  # fmt: skip
    return "\n\n".join(parts)



def families_section(report: dict) -> str:
    """docs/results.md's drafter-family tables from one run's methods.json (--archs of several
    families, the same caches): per method, each family's tau (mean ± SD) at each temperature, and
    each family's training seconds per step (mean over methods and replicates)."""
    table, temperatures = report["table"], report["temperatures"]
    archs = list(dict.fromkeys(m.rpartition(":")[0] or "dflash" for m in table))
    methods = list(dict.fromkeys(m.rpartition(":")[2] for m in table))
    row = lambda arch, method: method if arch == "dflash" else f"{arch}:{method}"  # noqa: E731
    parts = []
    for t in temperatures:
        key = f"T{t:g}"
        lines = [f"T = {t:g}: tau (mean ± SD over {len(report['replicates'])} replicates)", "",
                 "| method | " + " | ".join(archs) + " |", "|---|" + "---|" * len(archs)]  # fmt: skip
        for method in methods:
            cells = [f"{table[row(a, method)][key]['tau_mean']:.3f} ± {table[row(a, method)][key]['tau_sd']:.3f}" for a in archs]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    per_step = {
        a: statistics.fmean(r["methods"][row(a, m)]["train_s"] / r["methods"][row(a, m)]["train_steps"]
                            for r in report["replicates"] for m in methods)
        for a in archs
    }  # fmt: skip
    parts.append("Training seconds per step as the runs took them (mean over methods and replicates; wall time "
                 "under the machine's load of the moment)\n\n| " + " | ".join(archs) + " |\n|"
                 + "---|" * len(archs) + "\n| " + " | ".join(f"{per_step[a]:.3f}" for a in archs) + " |")  # fmt: skip
    return "\n\n".join(parts)

if __name__ == "__main__":
    main()
