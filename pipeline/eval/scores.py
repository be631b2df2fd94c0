"""What an evaluation's numbers are and how they are aggregated (docs/design.md, "Evaluation"):
a prompt's row and its rounds, tau per group (pooled over the group's rounds), pooled over every
round (vLLM's and SGLang's figure) and as the mean per request, speedup as total time over total
time, acceptance per draft position and per slot (with a confidence head's prediction),
the histogram, and the files that hold them (results.csv, rounds.csv, accept_hist.*). Shared by
`alrira-eval run`, `replay` and `score`.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from drafter.drafting import position_acceptance
from pipeline.eval.plots import legend, plot_figure
from pipeline.eval.speculative import DecodeResult

RESULT_COLUMNS = (
    "prompt_id",
    "benchmark",
    "prompt_tokens",
    "committed",
    "ar_tokens",
    "rounds",
    "accepted_tokens",
    "tau",
    "ar_ms",
    "draft_ms",
    "ar_ms_per_token",
    "spec_ms_per_token",
)


ROUND_COLUMNS = ("prompt_id", "benchmark", "round", "start_offset", "accepted")


def _ms_per_token(decode_s: float, num_tokens: int) -> float | None:
    # The prefill produces the first token; the decode phase produces the rest.
    return 1000.0 * decode_s / (num_tokens - 1) if num_tokens > 1 else None


def result_row(prompt, *, ar: DecodeResult, spec: DecodeResult) -> dict:
    accepted = sum(spec.accepted_lengths)
    return {
        "prompt_id": prompt.prompt_id,
        "benchmark": prompt.benchmark,
        "prompt_tokens": len(prompt.input_ids),
        "committed": len(spec.tokens),
        "ar_tokens": len(ar.tokens),
        "rounds": spec.rounds,
        "accepted_tokens": accepted,
        "tau": (accepted + spec.rounds) / spec.rounds if spec.rounds else None,
        "ar_ms": 1000.0 * ar.decode_s,
        "draft_ms": 1000.0 * spec.decode_s,
        "ar_ms_per_token": _ms_per_token(ar.decode_s, len(ar.tokens)),
        "spec_ms_per_token": _ms_per_token(spec.decode_s, len(spec.tokens)),
    }


def round_start_offsets(accepted_lengths: list[int]) -> list[int]:
    """Response tokens committed before each round: the prefill commits the first token, round i
    commits accepted_i + 1 (docs/design.md, "Evaluation")."""
    offsets, committed = [], 1
    for accepted in accepted_lengths:
        offsets.append(committed)
        committed += accepted + 1
    return offsets


def round_rows(prompt, accepted_lengths: list[int]) -> list[dict]:
    starts = round_start_offsets(accepted_lengths)
    return [
        {"prompt_id": prompt.prompt_id, "benchmark": prompt.benchmark, "round": i, "start_offset": start, "accepted": accepted}
        for i, (start, accepted) in enumerate(zip(starts, accepted_lengths, strict=True))
    ]


def slot_acceptance(results: list[DecodeResult], *, num_drafts: int) -> list[dict]:
    """Per draft slot k (0-based): the rounds that verified it with every slot before it accepted
    (`reached`), the share of those that accepted it (the conditional acceptance a confidence head
    predicts), and for a drafter that predicts it (a confidence head) the mean predicted acceptance
    of the same slots (its calibration; docs/dspark.md, "Evaluation")."""
    reached, accepted, predicted, num_predicted = ([0] * num_drafts for _ in range(4))
    for result in results:
        proposed = result.proposed_lengths or [num_drafts] * len(result.accepted_lengths)
        confidences = result.confidences or [None] * len(result.accepted_lengths)
        for num_accepted, num_proposed, confidence in zip(result.accepted_lengths, proposed, confidences, strict=True):
            for k in range(min(num_accepted + 1, num_proposed)):
                reached[k] += 1
                accepted[k] += int(k < num_accepted)
                if confidence:
                    predicted[k] += confidence[k]
                    num_predicted[k] += 1
    return [
        {
            "slot": k,
            "reached": reached[k],
            "acceptance": round(accepted[k] / reached[k], 5) if reached[k] else None,
            "predicted": round(predicted[k] / num_predicted[k], 5) if num_predicted[k] else None,
        }
        for k in range(num_drafts)
    ]


def geometric_mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    if not values or any(v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _decode_totals(rows: list[dict]) -> tuple[float, int, float, int]:
    """(AR decode ms, AR decode tokens, speculative decode ms, speculative decode tokens) summed
    over the rows; the prefill and the first token it yields are outside every figure."""
    ar_ms = ar_tokens = spec_ms = spec_tokens = 0
    for r in rows:
        ar_ms += float(r["ar_ms"])
        spec_ms += float(r["draft_ms"])
        ar_tokens += int(r["ar_tokens"]) - 1
        spec_tokens += int(r["committed"]) - 1
    return ar_ms, ar_tokens, spec_ms, spec_tokens


def _tau_aggregates(rows: list[dict]) -> dict:
    """tau two ways (docs/design.md, "Evaluation", how tau is aggregated): pooled over every round
    of the rows, (accepted + rounds) / rounds, as vLLM's and SGLang's counters report it; and the
    mean of each request's own tau, which weighs a short response as much as a long one."""
    rounds = sum(int(r["rounds"]) for r in rows)
    accepted = sum(int(r["accepted_tokens"]) for r in rows)
    per_request = [float(r["tau"]) for r in rows if r.get("tau") not in (None, "")]
    return {
        "tau_pooled": (accepted + rounds) / rounds if rounds else None,
        "tau_mean_per_request": sum(per_request) / len(per_request) if per_request else None,
    }


def summarize(rows: list[dict], *, group: str = "benchmark") -> dict:
    """Per group: prompts, rounds, tau pooled over the group's rounds and the mean of its requests'
    tau, ms/token of each decoder as total decode time over total decode tokens, and speedup =
    their ratio (the same committed tokens at T = 0, so total AR time / total speculative time);
    geometric means of tau and speedup across groups; over all rows, tau pooled over every round
    and the mean per request. Rows with no decode tokens are left out of the speed figures, so a
    prompt that stops after one token cannot decide the mean (docs/design.md, "Evaluation")."""
    groups: dict[str, dict] = {}
    for name in dict.fromkeys(str(r[group]) for r in rows):
        members = [r for r in rows if str(r[group]) == name]
        rounds = sum(int(r["rounds"]) for r in members)
        accepted = sum(int(r["accepted_tokens"]) for r in members)
        # Replayed rows (pipeline/eval/replay.py) carry no speculative time: no speed figure.
        timed = [r for r in members if int(r["ar_tokens"]) > 1 and int(r["committed"]) > 1 and r["draft_ms"] not in (None, "")]
        ar_ms, ar_tokens, spec_ms, spec_tokens = _decode_totals(timed)
        ar_per_token = ar_ms / ar_tokens if ar_tokens else None
        spec_per_token = spec_ms / spec_tokens if spec_tokens else None
        groups[name] = {
            "prompts": len(members),
            "rounds": rounds,
            "accepted_tokens": accepted,
            "tau": (accepted + rounds) / rounds if rounds else None,
            "tau_mean_per_request": _tau_aggregates(members)["tau_mean_per_request"],
            "ar_ms_per_token": ar_per_token,
            "spec_ms_per_token": spec_per_token,
            "speedup": ar_per_token / spec_per_token if ar_per_token and spec_per_token else None,
        }
    return {
        "groups": groups,
        "tau_geomean": geometric_mean([g["tau"] for g in groups.values()]),
        "speedup_geomean": geometric_mean([g["speedup"] for g in groups.values()]),
        **_tau_aggregates(rows),
    }


def _read_rows(csv_path: str | os.PathLike) -> list[dict]:
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    needed = ("rounds", "accepted_tokens", "committed", "ar_tokens", "ar_ms", "draft_ms")
    missing = [c for c in needed if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"{csv_path}: missing columns {missing}")
    return rows


def provenance_line(csv_path: str | os.PathLike) -> str | None:
    """What a results.csv was computed from, by the recorded inputs of the summary.json beside it
    (None for a CSV without one): what `alrira-eval score` prints above its table."""
    summary_path = Path(csv_path).parent / "summary.json"
    try:
        inputs = json.loads(summary_path.read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(inputs, dict):
        return None
    shown = ("mode", "target_hash", "drafter_hash", "prompts_sha256", "temperature", "max_new_tokens", "max_prompts", "dtype")
    return f"{csv_path}: " + ", ".join(f"{key} {str(inputs.get(key))[:19]}" for key in shown if key in inputs)


def score_table(csv_path: str | os.PathLike, *, group: str = "benchmark") -> str:
    """A printable table of a results.csv: per group prompts, tau, speedup; then the geometric means."""
    rows = _read_rows(csv_path)
    if rows and group not in rows[0]:
        raise ValueError(f"{csv_path}: no column {group!r} to group by")
    summary = summarize(rows, group=group)

    def fmt(value: float | None, suffix: str = "") -> str:
        return "-" if value is None else f"{value:.3f}{suffix}"

    # tau: pooled over the group's rounds; per-request: the mean of its requests' own tau.
    lines = [(group, "prompts", "tau", "speedup", "per-request")]
    for name, g in summary["groups"].items():
        lines.append((name, str(g["prompts"]), fmt(g["tau"]), fmt(g["speedup"], "x"), fmt(g["tau_mean_per_request"])))
    lines.append(("geomean", str(len(rows)), fmt(summary["tau_geomean"]), fmt(summary["speedup_geomean"], "x"), "-"))
    lines.append(("all", str(len(rows)), fmt(summary["tau_pooled"]), "-", fmt(summary["tau_mean_per_request"])))
    width = max(len(line[0]) for line in lines)
    table = [f"{a:<{width}}  {b:>7}  {c:>7}  {d:>8}  {e:>11}" for a, b, c, d, e in lines]
    rounds_csv = Path(csv_path).parent / "rounds.csv"
    if rounds_csv.is_file():  # acceptance per draft position, from the rounds beside the results
        with open(rounds_csv, newline="") as f:
            accepted = [int(r["accepted"]) for r in csv.DictReader(f)]
        num_drafts = _num_drafts(Path(csv_path).parent, accepted)
        rates = position_acceptance(accepted, num_drafts=num_drafts)
        table.append("acceptance per position: " + " ".join("-" if r is None else f"{r:.2f}" for r in rates))
    return "\n".join(table)


def _num_drafts(out: Path, accepted: list[int]) -> int:
    """Drafts per round of an evaluation folder: its accept_hist.json's, else the most accepted."""
    try:
        return int(json.loads((out / "accept_hist.json").read_text())["num_draft_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return max(accepted, default=0)


def accept_histogram(accepted_lengths: list[int], *, num_draft: int) -> list[int]:
    """Counts of each accepted length 0..K."""
    counts = [0] * (num_draft + 1)
    for n in accepted_lengths:
        counts[n] += 1
    return counts


def _plot_histogram(hist: dict, path: Path) -> bool:
    groups = hist["groups"]
    lengths = list(range(len(hist["all"])))
    width = 0.8 / max(len(groups), 1)

    def draw(ax) -> None:
        for i, (name, counts) in enumerate(groups.items()):
            total = sum(counts) or 1
            ax.bar([x - 0.4 + width * (i + 0.5) for x in lengths], [c / total for c in counts], width=width, label=name)
        ax.set_xlabel("accepted draft tokens per round")
        ax.set_ylabel("fraction of rounds")
        ax.set_xticks(lengths)
        legend(ax)

    return plot_figure(path, draw, size=(8, 4))


def _csv_value(value):
    if value is None:
        return ""
    return round(value, 4) if isinstance(value, float) else value


def write_csv_rows(path: Path, rows: list[dict], *, columns: tuple[str, ...]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_rows_and_histogram(out: Path, rows: list[dict], accepted_by_group: dict[str, list[int]], *, num_draft: int) -> bool:
    """results.csv, accept_hist.json and (if matplotlib is there) accept_hist.png; True if plotted."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv_rows(out / "results.csv", rows, columns=RESULT_COLUMNS)

    all_accepted = [n for lengths in accepted_by_group.values() for n in lengths]
    hist = {
        "num_draft_tokens": num_draft,
        "all": accept_histogram(all_accepted, num_draft=num_draft),
        "groups": {g: accept_histogram(v, num_draft=num_draft) for g, v in accepted_by_group.items()},
    }
    _write_json(out / "accept_hist.json", hist)
    plotted = _plot_histogram(hist, out / "accept_hist.png")

    return plotted
