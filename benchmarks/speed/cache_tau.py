"""Cache settings vs tau: train and decode the demo recipe from caches built with different settings.

    .venv/bin/python -m benchmarks.speed.cache_tau --out results/cache-tau --seeds 0,1,2 --methods alr,alr_ira \\
        --row 'pool1x: --anchors 16' --row 'pool2x: --anchors 32' --row 'pool3x: --anchors 48'

A row is `LABEL[: BUILD FLAGS][ | TRAIN SETTINGS]`: flags appended to the demo's `alrira-cache
build` command (a repeated flag overrides the demo's value) and `name=value` training settings over
the demo's recipe (pipeline.demo.run.train_config; any TrainConfig flag name). For every seed
(world seed = drafter seed, as speed/methods.py) it builds the demo world once, each row's
cache, trains each method from it and decodes the held-out prompts at each temperature. The first
row (or --baseline) is the reference: per-seed (paired) differences of tau in % against it, and
their mean. Every phase is skipped when its output exists, so a run resumes, and a later run into
the same --out with a row of the same label reuses that row's runs (a label whose settings changed
is refused). `--in-process-cache` builds each cache in this process without Ray (the same shard
builder and flags; no cluster start to time out on a loaded machine). Outputs: NAME.json
(--report, every seed), NAME.md (the tables). See docs/benchmarks.md "Cache settings and tau".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from benchmarks.common.cli import float_list, int_list, run_record
from benchmarks.common.report import mean_sd, stamped_log
from pipeline.config import to_flags
from pipeline.demo.run import DemoSizes, build_demo_cache, evaluate_method, method_results, train_config, train_method
from pipeline.demo.world import build_world
from pipeline.train.config import TrainConfig


@dataclass(frozen=True)
class Row:
    label: str
    build_args: tuple[str, ...] = ()
    train_settings: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Row:
        """'LABEL[: BUILD FLAGS][ | name=value ...]'."""
        head, _, train = spec.partition("|")
        label, _, build = head.partition(":")
        label = label.strip()
        if not label or "/" in label or label.startswith("."):
            raise argparse.ArgumentTypeError(f"--row {spec!r}: the label must be a plain non-empty name")
        settings = {}
        for item in shlex.split(train):
            name, eq, value = item.partition("=")
            if not eq:
                raise argparse.ArgumentTypeError(f"--row {spec!r}: training settings are name=value, got {item!r}")
            try:
                settings[name.replace("-", "_")] = json.loads(value)
            except json.JSONDecodeError:
                settings[name.replace("-", "_")] = value
        return cls(label=label, build_args=tuple(shlex.split(build)), train_settings=settings)

    def spec(self) -> dict:
        return {"build_args": list(self.build_args), "train_settings": self.train_settings}


def row_dir(out: Path, seed: int, row: Row) -> Path:
    """out/world-SEED/rows/LABEL, holding row.json (its settings), runs/ and evals/. A label reused
    with other settings is refused rather than silently reusing the old runs."""
    path = out / f"world-{seed}" / "rows" / row.label
    spec_file = path / "row.json"
    if spec_file.is_file():
        old = json.loads(spec_file.read_text())
        if old != row.spec():
            raise SystemExit(f"{spec_file}: row {row.label!r} was run with {old}, not {row.spec()}; use a new label")
    else:
        path.mkdir(parents=True, exist_ok=True)
        spec_file.write_text(json.dumps(row.spec()) + "\n")
    return path


def cache_dir(out: Path, seed: int, row: Row) -> Path:
    """out/world-SEED/caches/KEY: one cache per distinct list of build flags, shared by the rows
    that differ only in training settings; KEY.json beside it names the flags."""
    flags = json.dumps(list(row.build_args))
    key = hashlib.sha256(flags.encode()).hexdigest()[:12]
    caches = out / f"world-{seed}" / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    (caches / f"{key}.json").write_text(flags + "\n")
    return caches / key


def row_train_config(*, row: Row, cache: Path, out: Path, method: str, seed: int, sizes: DemoSizes) -> TrainConfig:
    """The demo's recipe with the row's training settings on top."""
    config = train_config(cache=cache, out=out, method=method, seed=seed, sizes=sizes)
    return TrainConfig.from_flags(**{**to_flags(config), **row.train_settings})


def run_row(
    *, world, row: Row, out: Path, seed: int, sizes: DemoSizes, methods, temperatures, in_process_cache: bool, log
) -> dict:
    """{"methods": {method: method_results}, "cache_build_s", "cache_bytes"} for one row on one world."""
    path = row_dir(out, seed, row)
    started = time.time()
    cache = build_demo_cache(
        world, cache_dir(out, seed, row), sizes, log=log, extra_args=row.build_args, in_process=in_process_cache
    )  # fmt: skip
    results = {"cache_build_s": time.time() - started, "methods": {}}
    for method in methods:
        run = path / "runs" / method
        config = row_train_config(row=row, cache=cache, out=run, method=method, seed=seed, sizes=sizes)
        summary = train_method(config, log=log)
        evals = {
            t: evaluate_method(
                world=world, drafter=run / "drafter", out=path / "evals" / f"{method}-T{t:g}", temperature=t, seed=seed,
                sizes=sizes, log=log,
            )  # fmt: skip
            for t in temperatures
        }
        results["methods"][method] = method_results(train_summary=summary, evals=evals)
        taus = ", ".join(f"tau {results['methods'][method][f'T{t:g}']['tau']:.3f} (T={t:g})" for t in temperatures)
        log(f"seed {seed} {row.label} {method}: {taus}")
    results["cache_bytes"] = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    return results


def summarize(per_seed: dict, *, rows: list[Row], baseline: str, methods, temperatures) -> dict:
    """{label: {method: {"T0": {taus, tau_mean, tau_sd, diff_pct (per seed, vs baseline), diff_pct_mean, diff_pct_sd}}}}."""
    seeds = sorted(per_seed)
    table = {}
    for row in rows:
        table[row.label] = {}
        for method in methods:
            entry = {"train_s_mean": statistics.fmean(per_seed[s][row.label]["methods"][method]["train_s"] for s in seeds)}
            for t in temperatures:
                key = f"T{t:g}"
                taus = [per_seed[s][row.label]["methods"][method][key]["tau"] for s in seeds]
                base = [per_seed[s][baseline]["methods"][method][key]["tau"] for s in seeds]
                diffs = [100 * (a - b) / b for a, b in zip(taus, base, strict=True)]
                tau_mean, tau_sd = mean_sd(taus)
                diff_mean, diff_sd = mean_sd(diffs)
                entry[key] = {
                    "taus": taus, "tau_mean": tau_mean, "tau_sd": tau_sd,
                    "diff_pct": diffs, "diff_pct_mean": diff_mean, "diff_pct_sd": diff_sd,
                    "mean_diff_pct": 100 * (tau_mean - statistics.fmean(base)) / statistics.fmean(base),
                }  # fmt: skip
            table[row.label][method] = entry
    return table


def markdown_table(table: dict, *, rows: list[Row], baseline: str, seeds: list[int], temperatures) -> str:
    lines = []
    for t in temperatures:
        key = f"T{t:g}"
        lines += [
            f"T = {t:g}: tau mean ± SD over seeds {', '.join(map(str, seeds))}; per-seed tau; paired difference "
            f"vs `{baseline}` per seed and its mean, in %",
            "",
            "| row | build flags | method | tau | per seed | Δ vs " + baseline + " per seed | Δ mean | train s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            flags = " ".join(row.build_args) + "".join(f" {k}={v}" for k, v in row.train_settings.items())
            for method, entry in table[row.label].items():
                e = entry[key]
                per_seed = " / ".join(f"{x:.3f}" for x in e["taus"])
                diffs = " / ".join(f"{d:+.1f}" for d in e["diff_pct"])
                lines.append(
                    f"| {row.label} | `{flags.strip() or '(demo)'}` | {method} | {e['tau_mean']:.3f} ± {e['tau_sd']:.3f} | "
                    f"{per_seed} | {diffs} | {e['diff_pct_mean']:+.2f} ± {e['diff_pct_sd']:.2f} | {entry['train_s_mean']:.0f} |"
                )
        lines.append("")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/cache-tau", help="Output directory (resumable, shared by runs).")
    parser.add_argument(
        "--row", dest="rows", action="append", type=Row.parse, required=True,
        help="LABEL[: BUILD FLAGS][ | name=value ...]; repeat.",
    )  # fmt: skip
    parser.add_argument("--baseline", default=None, help="Label of the reference row (default: the first).")
    parser.add_argument("--seeds", type=int_list, default=[0, 1, 2], help="Comma-separated seeds (world = drafter seed).")
    parser.add_argument("--temperatures", type=float_list, default=[0.0, 1.0], help="Comma-separated decoding temperatures.")
    parser.add_argument("--methods", default="alr,alr_ira", help="Comma-separated methods.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads (tau is reproducible at a fixed count).")
    parser.add_argument("--report", default="cache_tau", help="Name of the report files NAME.json and NAME.md in --out.")
    parser.add_argument("--in-process-cache", action="store_true", help="Build caches in this process, no Ray (same shards).")
    parser.add_argument("--quick", action="store_true", help="The demo's --quick sizes (a smoke run, not a result).")
    args = parser.parse_args(argv)
    labels = [r.label for r in args.rows]
    if len(set(labels)) != len(labels):
        parser.error(f"--row: labels must be distinct, got {labels}")
    args.baseline = args.baseline or labels[0]
    if args.baseline not in labels:
        parser.error(f"--baseline {args.baseline!r} is not a row label ({', '.join(labels)})")
    args.methods = [m for m in args.methods.split(",") if m]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(args.out)
    started, log = time.time(), stamped_log()

    per_seed = {}
    for seed in args.seeds:
        sizes = DemoSizes.make(seed=seed, quick=args.quick)
        world = build_world(out / f"world-{seed}" / "world", sizes.world, log=log)
        per_seed[seed] = {
            row.label: run_row(
                world=world, row=row, out=out, seed=seed, sizes=sizes, methods=args.methods,
                temperatures=args.temperatures, in_process_cache=args.in_process_cache, log=log,
            )  # fmt: skip
            for row in args.rows
        }
    table = summarize(per_seed, rows=args.rows, baseline=args.baseline, methods=args.methods, temperatures=args.temperatures)
    markdown = markdown_table(table, rows=args.rows, baseline=args.baseline, seeds=args.seeds, temperatures=args.temperatures)
    report = {
        **run_record(__spec__.name, argv),
        "threads": args.threads,
        "wall_s": time.time() - started,
        "sizes": asdict(DemoSizes.make(seed=0, quick=args.quick)),
        "rows": {r.label: r.spec() for r in args.rows},
        "baseline": args.baseline,
        "table": table,
        "per_seed": per_seed,
    }
    (out / f"{args.report}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{args.report}.md").write_text(markdown + "\n")
    print()
    print(markdown)
    print(f"wall {report['wall_s']:.0f}s; {out / (args.report + '.json')}")
    return report


if __name__ == "__main__":
    main()
