"""`alrira-eval compare`: the paper-style table of several runs' summaries.

Each summary.json (written by `alrira-eval run`) is one replicate of one method; summaries whose
drafter checkpoint carries the same method (RUN/train_config.json next to RUN/drafter) or the
same `--label` are pooled as mean +- sd over replicates. Per benchmark group: tau and speedup;
then their geometric means across groups, and the gain over a baseline method in percent.
"""

from __future__ import annotations

import contextlib
import csv
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from pipeline.eval.scores import geometric_mean
from pipeline.eval.plots import legend, plot_figure
from pipeline.outputs import claim_output, differences, log_line, owns


@dataclass(kw_only=True)
class Replicate:
    method: str
    path: Path
    tau: dict[str, float]  # per group, plus "geomean"
    speedup: dict[str, float]
    conditions: dict  # what must be equal to pool it with another replicate (replicate_conditions)
    drafter: str | None  # the drafter's hash (or path, for a summary without one)


# Recorded settings two replicates of a method share: all but the drafter (its training seed).
POOLED_KEYS = ("mode", "target_hash", "prompts_sha256", "max_prompts", "temperature", "max_new_tokens", "dtype", "device",
               "verify", "vision_input")  # fmt: skip


def replicate_conditions(summary: dict) -> dict:
    """What a summary's numbers were computed under, besides the drafter: its recorded inputs
    (pipeline/outputs.py), else (a summary written before inputs were recorded) its own fields,
    paths in place of hashes. The sampling seed counts at T > 0 only."""
    inputs = summary.get("inputs")
    if not isinstance(inputs, dict):
        inputs = {"mode": summary.get("mode", "decode"), "target_hash": summary.get("target"),
                  "prompts_sha256": summary.get("prompts"), **{k: summary.get(k) for k in POOLED_KEYS[3:]}}  # fmt: skip
    conditions = {key: inputs.get(key) for key in POOLED_KEYS}
    if conditions["temperature"]:
        conditions["seed"] = inputs.get("seed")
    return conditions


def check_replicates(replicates: list[Replicate], *, allow_mixed: bool, log=None) -> dict[str, list[str]]:
    """Refuse (one line naming the difference) to pool replicates of a method that differ in more
    than the drafter, or that are the same drafter twice; with `allow_mixed`, pool them and return
    {method: differences} for the output to record."""
    mixed: dict[str, list[str]] = {}
    first: dict[str, Replicate] = {}
    drafters: dict[tuple[str, str], Path] = {}
    for replicate in replicates:
        if replicate.drafter is not None:
            seen = drafters.get((replicate.method, replicate.drafter))
            if seen is not None:
                raise ValueError(f"{replicate.method}: {seen} and {replicate.path} evaluated the same drafter; "
                                 "one drafter is not two replicates")  # fmt: skip
            drafters[(replicate.method, replicate.drafter)] = replicate.path
        base = first.setdefault(replicate.method, replicate)
        changed = differences(base.conditions, replicate.conditions)
        if not changed:
            continue
        if not allow_mixed:
            raise ValueError(
                f"{replicate.method}: {base.path} and {replicate.path} cannot be pooled as replicates ({'; '.join(changed)}); "
                "give them different --label names, or pass --allow-mixed-replicates to pool them anyway (recorded in the output)"
            )
        mixed.setdefault(replicate.method, []).extend(c for c in changed if c not in mixed.get(replicate.method, []))
        if log:
            log(f"--allow-mixed-replicates: pooling {replicate.path} into {replicate.method} although {'; '.join(changed)}")
    return mixed


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
    inputs = summary.get("inputs") if isinstance(summary.get("inputs"), dict) else {}
    return Replicate(
        method=method or method_of(path, summary), path=path, tau=tau, speedup=speedup, conditions=replicate_conditions(summary),
        drafter=inputs.get("drafter_hash") or summary.get("drafter"),
    )  # fmt: skip


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


def load_replicates(summaries: list[str], *, labels: list[str] | None, allow_mixed: bool) -> tuple[list[Replicate], dict]:
    """The summaries as replicates (method from `labels` in order, else the drafter's run), checked
    poolable (check_replicates); and the mixed pools allowed."""
    if labels is not None and len(labels) != len(summaries):
        raise ValueError(f"--label was given {len(labels)} times for {len(summaries)} summaries")
    replicates = [load_replicate(s, method=labels[i] if labels else None) for i, s in enumerate(summaries)]
    return replicates, check_replicates(replicates, allow_mixed=allow_mixed, log=log_line)


def analysis_inputs(replicates: list[Replicate], *, extra_files: tuple[str, ...] = (), **settings) -> dict:
    """The recorded inputs of an analysis output: each summary (and the files beside it that it
    reads) by content, the methods, and its settings."""
    from pipeline.corpus_source import file_sha256

    files = {}
    for r in replicates:
        for name in ("summary.json", *extra_files):
            path = r.path.parent / name
            files[str(path.resolve())] = file_sha256(path) if path.is_file() else None
    return {"files": files, "methods": [r.method for r in replicates], **settings}


@contextlib.contextmanager
def analysis_output(out: str, *, command: str, inputs: dict, names: tuple[str, ...], overwrite: bool):
    """The claimed --out of `compare`, `offsets` or `cost` (pipeline/outputs.py): recomputed when the
    inputs are the same, refused when they differ unless --overwrite."""
    with claim_output(out, command=command, inputs=inputs, own=owns(*names), overwrite=overwrite, keep=False) as output:
        yield output
        output.finish()


def run_compare(summaries: list[str], *, out: str, baseline: str | None, labels: list[str] | None = None,
                allow_mixed: bool = False, overwrite: bool = False) -> str:  # fmt: skip
    """Load, compare, write OUT/compare.csv (+ compare_gain.png with a baseline); return the table."""
    replicates, mixed = load_replicates(summaries, labels=labels, allow_mixed=allow_mixed)
    rows = compare(replicates, baseline=baseline)
    for row in rows if mixed else []:  # pooled under --allow-mixed-replicates: the CSV says what differed
        row["mixed_replicates"] = "; ".join(mixed.get(row["method"], [])) or None
    inputs = analysis_inputs(replicates, baseline=baseline, allow_mixed_replicates=allow_mixed)
    with analysis_output(out, command="alrira-eval compare", inputs=inputs, names=("compare.csv", "compare_gain.png"),
                         overwrite=overwrite) as output:  # fmt: skip
        write_csv(rows, output.path / "compare.csv")
        if baseline is not None:
            plot_gains(rows, output.path / "compare_gain.png", baseline=baseline)
    return format_table(rows)

