"""`alrira-eval compare`: the paper-style table of several runs' summaries.

Each summary.json (written by `alrira-eval run`) is one replicate of one method; summaries whose
drafter checkpoint carries the same method (RUN/train_config.json next to RUN/drafter) or the
same `--label` are pooled as mean +- sd over replicates. Per benchmark group: tau and speedup;
then their geometric means across groups, and the gain over a baseline method in percent.
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from pipeline.eval.evaluate import geometric_mean
from pipeline.eval.plots import legend, plot_figure


@dataclass(kw_only=True)
class Replicate:
    method: str
    path: Path
    tau: dict[str, float]  # per group, plus "geomean"
    speedup: dict[str, float]


def method_of(summary_path: Path, summary: dict) -> str:
    """The method a summary evaluated: from the drafter's run directory when it has one, else the
    summary's folder name."""
    drafter = Path(summary.get("drafter", ""))
    train_config = drafter.parent / "train_config.json"
    if train_config.is_file():
        return json.loads(train_config.read_text()).get("method", drafter.parent.name)
    return summary_path.parent.name


def load_replicate(path: str | Path, *, method: str | None = None) -> Replicate:
    path = Path(path)
    path = path / "summary.json" if path.is_dir() else path
    try:
        summary = json.loads(path.read_text())
        groups = summary["groups"]
    except (OSError, json.JSONDecodeError, KeyError) as error:
        raise ValueError(f"{path}: not an alrira-eval summary.json ({type(error).__name__}: {error})") from None
    tau = {name: g["tau"] for name, g in groups.items()}
    speedup = {name: g["speedup"] for name, g in groups.items()}
    tau["geomean"], speedup["geomean"] = geometric_mean(list(tau.values())), geometric_mean(list(speedup.values()))
    return Replicate(method=method or method_of(path, summary), path=path, tau=tau, speedup=speedup)


def _mean_sd(values: list[float | None]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def compare(replicates: list[Replicate], *, baseline: str | None = None) -> list[dict]:
    """One row per method (in first-seen order): n, and per column (group or geomean) the mean
    and sd of tau and speedup over its replicates, and the tau gain over `baseline` in percent."""
    methods = list(dict.fromkeys(r.method for r in replicates))
    if baseline is not None and baseline not in methods:
        raise ValueError(f"--baseline {baseline!r} is none of the compared methods ({', '.join(methods)})")
    columns = list(dict.fromkeys(name for r in replicates for name in r.tau if name != "geomean")) + ["geomean"]
    rows = []
    for method in methods:
        mine = [r for r in replicates if r.method == method]
        row = {"method": method, "n": len(mine)}
        for column in columns:
            row[f"tau {column}"] = _mean_sd([r.tau.get(column) for r in mine])
            row[f"speedup {column}"] = _mean_sd([r.speedup.get(column) for r in mine])
        rows.append(row)
    if baseline is not None:
        base = next(r for r in rows if r["method"] == baseline)
        for row in rows:
            for column in columns:
                ours, theirs = row[f"tau {column}"][0], base[f"tau {column}"][0]
                row[f"tau gain {column}"] = 100.0 * (ours / theirs - 1.0) if ours and theirs else None
    return rows


def _cell(value) -> str:
    if isinstance(value, tuple):
        mean, sd = value
        return "-" if mean is None else (f"{mean:.3f}" if not sd else f"{mean:.3f} ± {sd:.3f}")
    if isinstance(value, float):
        return f"{value:+.1f}%"
    return "-" if value is None else str(value)


def format_table(rows: list[dict]) -> str:
    header = list(rows[0])
    cells = [header] + [[_cell(row[key]) for key in header] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells)


def write_csv(rows: list[dict], path: Path) -> None:
    """Flat CSV: mean and sd as separate columns."""
    fields = []
    for key, value in rows[0].items():
        fields += [f"{key} mean", f"{key} sd"] if isinstance(value, tuple) else [key]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for row in rows:
            flat = []
            for value in row.values():
                flat += list(value) if isinstance(value, tuple) else [value]
            writer.writerow(["" if v is None else (round(v, 5) if isinstance(v, float) else v) for v in flat])


def plot_gains(rows: list[dict], path: Path, *, baseline: str) -> bool:
    """Bar chart of the tau gain over the baseline per benchmark group (one bar per method)."""
    columns = [key.removeprefix("tau gain ") for key in rows[0] if key.startswith("tau gain ")]
    others = [r for r in rows if r["method"] != baseline]

    def draw(axes) -> None:
        width = 0.8 / max(1, len(others))
        for i, row in enumerate(others):
            gains = [row[f"tau gain {c}"] or 0.0 for c in columns]
            axes.bar([j + i * width for j in range(len(columns))], gains, width=width, label=row["method"])
        axes.set_xticks([j + width * (len(others) - 1) / 2 for j in range(len(columns))], columns)
        axes.axhline(0.0, color="black", linewidth=0.8)
        axes.set_ylabel(f"tau gain over {baseline} (%)")
        legend(axes)

    return plot_figure(path, draw, size=(max(4.0, 1.2 * len(columns) * max(1, len(others))), 3.5))


def run_compare(summaries: list[str], *, out: str, baseline: str | None, labels: list[str] | None = None) -> str:
    """Load, compare, write OUT/compare.csv (+ compare_gain.png with a baseline); return the table."""
    if labels is not None and len(labels) != len(summaries):
        raise ValueError(f"--label was given {len(labels)} times for {len(summaries)} summaries")
    replicates = [load_replicate(s, method=labels[i] if labels else None) for i, s in enumerate(summaries)]
    rows = compare(replicates, baseline=baseline)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out_dir / "compare.csv")
    if baseline is not None:
        plot_gains(rows, out_dir / "compare_gain.png", baseline=baseline)
    return format_table(rows)

