"""The paper's analyses over evaluations and training runs (docs/design.md, "Analyses").

- `offset_profile`: MAT by round-start offset bucket (from each evaluation's rounds.csv) and the
  gain of each method over a baseline per bucket (`alrira-eval offsets`).
- `training_cost`: MAT against training time relative to a reference arm, training alone and with
  the stage-1 (cache build) time of the array groups each method reads (`alrira-eval cost`).
- `hard_offsets`: on held-out greedy responses, one drafted block per offset; the acceptance gain of
  one drafter over another grouped by an independent drafter's acceptance length there, with a
  seed control (`alrira-eval hard`).
Each writes a CSV and (with matplotlib) a PNG.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import torch

from drafter.drafting import block_drafts
from pipeline.eval.compare import analysis_inputs, analysis_output, load_replicate, load_replicates
from pipeline.eval.scores import ROUND_COLUMNS, write_csv_rows
from pipeline.eval.plots import legend, plot_figure
from pipeline.outputs import check_out_path, claim_output, differences, owns

OFFSET_BUCKETS = ((0, 15), (16, 63), (64, 127), (128, None))  # SPEC'd buckets of a round's start offset


def bucket_name(bucket: tuple[int, int | None]) -> str:
    low, high = bucket
    return f"{low}+" if high is None else f"{low}-{high}"


def bucket_of(offset: int) -> str:
    return bucket_name(next(b for b in OFFSET_BUCKETS if offset >= b[0] and (b[1] is None or offset <= b[1])))


def _mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _gain(ours: float | None, theirs: float | None) -> float | None:
    return 100.0 * (ours / theirs - 1.0) if ours and theirs else None


def _labelled(paths: list[str], labels: list[str] | None, *, allow_mixed: bool = False) -> list[tuple[str, Path]]:
    """(method, summary.json path) of each evaluation: `labels` in order, else the drafter's run;
    replicates of a method must be poolable (compare.check_replicates)."""
    replicates, _ = load_replicates(paths, labels=labels, allow_mixed=allow_mixed)
    return [(r.method, r.path) for r in replicates]


def _claimed_table(rows: list[dict], *, paths: list[str], labels: list[str] | None, out: str, command: str, names: tuple[str, ...],
                   extra_files: tuple[str, ...] = (), allow_mixed: bool, overwrite: bool, plot, **settings) -> None:  # fmt: skip
    """Write `rows` to OUT/names[0] and plot(path) to OUT/names[1], in a claimed --out recording the
    inputs (pipeline/outputs.py); rows pooled under --allow-mixed-replicates say what differed."""
    replicates, mixed = load_replicates(paths, labels=labels, allow_mixed=allow_mixed)
    for row in rows if mixed else []:
        row["mixed_replicates"] = "; ".join(mixed.get(row["method"], [])) or None
    inputs = analysis_inputs(replicates, extra_files=extra_files, allow_mixed_replicates=allow_mixed, **settings)
    with analysis_output(out, command=command, inputs=inputs, names=names, overwrite=overwrite) as output:
        _write_table(rows, output.path / names[0])
        plot(output.path / names[1])


# ----------------------------------------------------------------------------------------------
# Offset profile


def read_rounds(summary_path: Path) -> list[dict]:
    path = summary_path.parent / "rounds.csv"
    if not path.is_file():
        raise ValueError(f"{path}: missing; rerun `alrira-eval run` (it writes one row per round)")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and set(ROUND_COLUMNS) - set(rows[0]):
        raise ValueError(f"{path}: missing columns {sorted(set(ROUND_COLUMNS) - set(rows[0]))}")
    return rows


def bucket_mat(rounds: list[dict]) -> dict[str, float | None]:
    """MAT (accepted drafts + 1 per round, pooled over the rounds) per start-offset bucket and 'all'."""
    sums = {bucket_name(b): [0, 0] for b in OFFSET_BUCKETS} | {"all": [0, 0]}
    for row in rounds:
        accepted = int(row["accepted"])
        for name in (bucket_of(int(row["start_offset"])), "all"):
            sums[name][0] += accepted + 1
            sums[name][1] += 1
    return {name: (total / n if n else None) for name, (total, n) in sums.items()}


def offset_profile(paths: list[str], *, baseline: str | None, labels: list[str] | None = None, allow_mixed: bool = False) -> list[dict]:
    """One row per (method, bucket): replicates, rounds, MAT mean and sd over replicates, gain of the
    mean over the baseline's in percent."""
    per_method: dict[str, list[dict]] = {}
    rounds_of: dict[str, dict[str, int]] = {}
    for method, path in _labelled(paths, labels, allow_mixed=allow_mixed):
        rounds = read_rounds(path)
        per_method.setdefault(method, []).append(bucket_mat(rounds))
        counts = rounds_of.setdefault(method, {})
        for row in rounds:
            name = bucket_of(int(row["start_offset"]))
            counts[name] = counts.get(name, 0) + 1
    if baseline is not None and baseline not in per_method:
        raise ValueError(f"--baseline {baseline!r} is none of the compared methods ({', '.join(per_method)})")
    names = [bucket_name(b) for b in OFFSET_BUCKETS] + ["all"]
    means = {m: {n: _mean_sd([r[n] for r in reps if r[n] is not None]) for n in names} for m, reps in per_method.items()}
    rows = []
    for method, reps in per_method.items():
        for name in names:
            mean, sd = means[method][name]
            rounds = rounds_of[method].get(name, 0) if name != "all" else sum(rounds_of[method].values())
            gain = _gain(mean, means[baseline][name][0]) if baseline else None
            rows.append({"method": method, "bucket": name, "replicates": len(reps), "rounds": rounds, "mat": mean,
                         "mat_sd": sd, "gain_pct": gain})  # fmt: skip
    return rows


def _write_table(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_csv_rows(path, rows, columns=tuple(rows[0]))


def plot_offset_profile(rows: list[dict], path: Path, *, baseline: str | None) -> bool:
    """MAT per bucket, one line per method."""

    def draw(axes) -> None:
        names = list(dict.fromkeys(r["bucket"] for r in rows if r["bucket"] != "all"))
        for method in dict.fromkeys(r["method"] for r in rows):
            mats = [next(r["mat"] for r in rows if r["method"] == method and r["bucket"] == n) for n in names]
            axes.plot(names, [m if m is not None else float("nan") for m in mats], marker="o", label=method)
        axes.set_xlabel("round start offset (response tokens before the round)")
        axes.set_ylabel("MAT")
        axes.set_title("offset profile" + (f" (gains over {baseline} in the CSV)" if baseline else ""))
        legend(axes)

    return plot_figure(path, draw, size=(6.0, 3.5))


def run_offset_profile(paths: list[str], *, out: str, baseline: str | None, labels: list[str] | None = None,
                       allow_mixed: bool = False, overwrite: bool = False) -> list[dict]:  # fmt: skip
    rows = offset_profile(paths, baseline=baseline, labels=labels, allow_mixed=allow_mixed)
    _claimed_table(
        rows, paths=paths, labels=labels, out=out, command="alrira-eval offsets", names=("offset_profile.csv", "offset_profile.png"),
        extra_files=("rounds.csv",), allow_mixed=allow_mixed, overwrite=overwrite, baseline=baseline,
        plot=lambda path: plot_offset_profile(rows, path, baseline=baseline),
    )  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------
# Training cost


def stage1_seconds(cache_dir: Path, *, arrays: frozenset[str]) -> float | None:
    """Build time of the parts of the cache a method reads: the corpus pass always, the rollouts
    when it reads rollout arrays; None for a cache whose manifest recorded no part times."""
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    parts = [s.get("build_seconds") for s in manifest.get("shards", [])]
    if not parts or any(p is None for p in parts):
        return None
    reads_rollouts = any(name.startswith("rollout_") for name in arrays)
    return sum(p["corpus"] + (p["rollouts"] if reads_rollouts else 0.0) for p in parts)


def training_run(summary_path: Path) -> tuple[dict, dict]:
    """(train_config.json, the training summary.json) of the run whose drafter an evaluation used;
    the config's --cache as a path that exists from here (recorded_cache)."""
    drafter = Path(json.loads(summary_path.read_text())["drafter"])
    run = drafter.parent
    config_path, summary = run / "train_config.json", run / "summary.json"
    if not config_path.is_file() or not summary.is_file():
        raise ValueError(f"{summary_path}: its drafter {drafter} has no training run beside it (train_config.json, summary.json)")
    config = json.loads(config_path.read_text())
    config["cache"] = str(recorded_cache(config, config_path=config_path))
    return config, json.loads(summary.read_text())


def recorded_cache(config: dict, *, config_path: Path) -> Path:
    """The cache a run's train_config.json names. Runs record it resolved; an older run's relative
    path was relative to where it was started, tried from here and then from the run's folder and
    the folders above it; none holding a manifest is one line naming the file."""
    cache = Path(str(config.get("cache", "")))
    if cache.is_absolute() or (cache / "manifest.json").is_file():
        if not (cache / "manifest.json").is_file():
            raise ValueError(f"{config_path}: its --cache {cache} holds no manifest.json (moved or deleted?)")
        return cache
    for folder in config_path.resolve().parents:
        if (folder / cache / "manifest.json").is_file():
            return folder / cache
    raise ValueError(
        f"{config_path}: its --cache {cache} is relative to the directory the run was started in, and no manifest.json is "
        "found from here or from the run's folders; run from that directory"
    )


def training_cost(paths: list[str], *, reference: str, labels: list[str] | None = None, allow_mixed: bool = False) -> list[dict]:
    """One row per method: MAT (mean over replicates), training seconds, and both relative to the
    reference method's mean: training alone (`train_over_c`) and training + the stage-1 time of the
    arrays it reads (`with_stage1_over_c`)."""
    from pipeline.train.methods import RECIPES

    per_method: dict[str, list[tuple[float | None, float, float | None]]] = {}
    for method, path in _labelled(paths, labels, allow_mixed=allow_mixed):
        config, summary = training_run(path)
        if config.get("method") not in RECIPES:
            raise ValueError(f"{path}: its drafter's train_config.json names method {config.get('method')!r}, none of {', '.join(RECIPES)}")
        recipe = RECIPES[config["method"]]
        stage1 = stage1_seconds(Path(config["cache"]), arrays=recipe.arrays)
        mat = load_replicate(path).tau["geomean"]
        per_method.setdefault(method, []).append((mat, float(summary["elapsed_s"]), stage1))
    if reference not in per_method:
        raise ValueError(f"--reference {reference!r} is none of the compared methods ({', '.join(per_method)})")

    def means(method: str) -> tuple[float | None, float, float | None]:
        reps = per_method[method]
        stage1 = [r[2] for r in reps]
        total = statistics.fmean(r[1] + r[2] for r in reps) if all(s is not None for s in stage1) else None
        return _mean_sd([r[0] for r in reps if r[0] is not None])[0], statistics.fmean(r[1] for r in reps), total

    _, ref_train, ref_total = means(reference)
    rows = []
    for method, reps in per_method.items():
        mat, train_s, total = means(method)
        rows.append({
            "method": method, "replicates": len(reps), "mat": mat, "train_s": train_s, "train_over_c": train_s / ref_train if ref_train else None,
            "train_plus_stage1_s": total, "with_stage1_over_c": total / ref_total if total and ref_total else None,
        })  # fmt: skip
    return rows


def plot_training_cost(rows: list[dict], path: Path, *, reference: str) -> bool:
    def draw(axes) -> None:
        for key, marker, label in (("train_over_c", "o", "training"), ("with_stage1_over_c", "s", "training + stage 1")):
            points = [(r[key], r["mat"], r["method"]) for r in rows if r[key] is not None and r["mat"] is not None]
            axes.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, label=label)
            for x, y, name in points:
                axes.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        axes.set_xlabel(f"time relative to {reference} (C)")
        axes.set_ylabel("MAT")
        legend(axes)

    return plot_figure(path, draw, size=(6.0, 4.0))


def run_training_cost(paths: list[str], *, out: str, reference: str, labels: list[str] | None = None,
                      allow_mixed: bool = False, overwrite: bool = False) -> list[dict]:  # fmt: skip
    rows = training_cost(paths, reference=reference, labels=labels, allow_mixed=allow_mixed)
    _claimed_table(
        rows, paths=paths, labels=labels, out=out, command="alrira-eval cost", names=("training_cost.csv", "training_cost.png"),
        allow_mixed=allow_mixed, overwrite=overwrite, reference=reference,
        plot=lambda path: plot_training_cost(rows, path, reference=reference),
    )  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------
# Where drafting is hard

HARD_GROUPS = ("1", "2", "3", "4", "5", "6+")  # the independent drafter's acceptance length at an offset


def acceptance_lengths(drafts: torch.Tensor, *, sequence: list[int], anchors: list[int]) -> list[int]:
    """1 + the leading slots of each anchor's drafts [N, K] equal to sequence[a + 1 .. a + K]
    (every anchor needs K tokens after it)."""
    num_draft = drafts.shape[1]
    truth = torch.as_tensor(sequence)[torch.as_tensor(anchors)[:, None] + torch.arange(1, num_draft + 1)]  # [N, K]
    return (torch.cumprod((drafts.cpu() == truth).long(), dim=1).sum(dim=1) + 1).tolist()


def hard_offset_table(raw: list[dict], *, roles: list[str]) -> list[dict]:
    """Per independent-acceptance group: offsets, each role's mean acceptance length, the gain of
    `drafter` over `baseline` and of `control` (the baseline's method, another seed) over `baseline`."""
    rows = []
    for name in HARD_GROUPS + ("all",):
        members = [r for r in raw if name == "all" or min(int(r["independent"]), 6) == int(name.rstrip("+"))]
        row = {"independent_accept": name, "offsets": len(members)}
        for role in roles:
            row[f"{role}_mean"] = statistics.fmean(r[role] for r in members) if members else None
        row["gain_pct"] = _gain(row.get("drafter_mean"), row.get("baseline_mean"))
        if "control" in roles:
            row["control_gain_pct"] = _gain(row.get("control_mean"), row.get("baseline_mean"))
        rows.append(row)
    return rows


def plot_hard_offsets(rows: list[dict], path: Path) -> bool:
    def draw(axes) -> None:
        groups = [r for r in rows if r["independent_accept"] != "all"]
        names = [r["independent_accept"] for r in groups]
        keys = [("gain_pct", "drafter over baseline")] + ([("control_gain_pct", "seed control")] if "control_gain_pct" in rows[0] else [])
        width = 0.8 / len(keys)
        for i, (key, label) in enumerate(keys):
            axes.bar([j + i * width for j in range(len(names))], [r[key] or 0.0 for r in groups], width=width, label=label)
        axes.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(names))], names)
        axes.axhline(0.0, color="black", linewidth=0.8)
        axes.set_xlabel("independent drafter's acceptance length at the offset")
        axes.set_ylabel("acceptance gain (%)")
        legend(axes)

    return plot_figure(path, draw, size=(6.0, 3.5))


HARD_RAW_COLUMNS = ("prompt_id", "benchmark", "offset", "independent", "drafter", "baseline", "control")


@torch.inference_mode()
def greedy_sequence(target, prompt_ids: list[int], *, max_new_tokens: int, stops: list[int]) -> tuple[list[int], tuple]:
    """prompt + the target's greedy response, and the hidden states of one forward over it all."""
    from pipeline.eval.speculative import autoregressive_decode

    response = autoregressive_decode(
        target, prompt_ids, max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stops, generator=None
    ).tokens
    sequence = list(prompt_ids) + response
    device = next(target.parameters()).device
    out = target(input_ids=torch.as_tensor([sequence], device=device), output_hidden_states=True, logits_to_keep=1)
    return sequence, out.hidden_states


def hard_offsets(*, target_dir: str, prompts: str, drafters: dict[str, str], max_new_tokens: int,
                 max_prompts: int | None) -> list[dict]:  # fmt: skip
    """One raw row per (prompt, response offset with K tokens after it): each role's acceptance length."""
    from drafter.checkpoint import load_drafter
    from pipeline.eval.evaluate import check_drafter_fits, context_budgets, load_prompts, load_target_and_stops
    from pipeline.target import tapped_features

    target, tokenizer, stops = load_target_and_stops(target_dir, device=torch.device("cpu"), dtype=torch.float32)
    models = {role: load_drafter(path, dtype=torch.float32, device=torch.device("cpu")).eval() for role, path in drafters.items()}
    for role, model in models.items():
        try:
            check_drafter_fits(target, model)
        except ValueError as error:
            raise ValueError(f"--{role} {drafters[role]}: {error}") from None
    drafts_per_block = {m.config.num_drafts for m in models.values()}  # the family's: K for DFlash's K + 1 slots
    if len(drafts_per_block) != 1:
        raise ValueError(
            f"the drafters have different block sizes (drafts per block {sorted(drafts_per_block)}): one offset grid cannot serve them"
        )
    num_draft = drafts_per_block.pop()
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    raw = []
    rows = load_prompts(prompts, tokenizer, max_prompts=max_prompts)
    budgets = context_budgets(target_dir, tokenizer, rows, max_new_tokens=max_new_tokens, flag="--max-new-tokens", path=prompts)
    for prompt in rows:
        sequence, hidden_states = greedy_sequence(target, prompt.input_ids, max_new_tokens=budgets[prompt.prompt_id], stops=stops)
        start = len(prompt.input_ids)
        anchors = list(range(start, len(sequence) - num_draft))  # response token at offset o sits at start + o
        if not anchors:
            continue
        lengths = {}
        for role, model in models.items():
            features = tapped_features(hidden_states, list(model.config.target_layer_ids))[0]  # [S, F]
            drafts = block_drafts(
                model, embed_tokens=embed_tokens, lm_head=lm_head, mask_token_id=model.config.mask_token_id,
                features=features, sequence=sequence, anchors=anchors,
            )  # fmt: skip
            lengths[role] = acceptance_lengths(drafts, sequence=sequence, anchors=anchors)
        for i, anchor in enumerate(anchors):
            row = {"prompt_id": prompt.prompt_id, "benchmark": prompt.benchmark, "offset": anchor - start}
            raw.append(row | {role: lengths[role][i] for role in models})
    if not raw:
        raise ValueError(f"{prompts}: no greedy response is longer than one block ({num_draft} tokens); raise --max-new-tokens")
    return raw


HARD_FILES = ("hard_offsets_raw.csv", "hard_offsets.csv", "hard_offsets.png")
# Training settings a seed control may differ in from the baseline's run: its seed, where it went, how it ran.
CONTROL_MAY_DIFFER = frozenset({"seed", "out", "resume", "progress", "num_workers", "prefetch", "save_every", "log_every",
                                "local_cache_gib", "local_cache_dir", "prefetch_shards", "attention"})  # fmt: skip


def check_control(control: str, baseline: str, *, allow_mixed: bool) -> list[str]:
    """The seed control must be the baseline's recipe with another seed (their runs' train_config.json,
    where both have one): anything else differing is refused unless `allow_mixed` (then returned)."""
    configs = [Path(path).resolve().parent / "train_config.json" for path in (baseline, control)]
    if not all(path.is_file() for path in configs):
        return []
    base, other = (json.loads(path.read_text()) for path in configs)
    changed = [c for c in differences(base, other) if c.split(":")[0] not in CONTROL_MAY_DIFFER]
    if base.get("seed") == other.get("seed"):
        changed.append(f"seed: both {base.get('seed')!r} (a control needs another seed)")
    if changed and not allow_mixed:
        raise ValueError(f"--control {control}: not the --baseline's recipe with another seed ({'; '.join(changed)}); "
                         "pass --allow-mixed-replicates to use it anyway (recorded in the output)")  # fmt: skip
    return changed


def run_hard_offsets(*, target: str, prompts: str, drafter: str, baseline: str, independent: str, control: str | None,
                     out: str, max_new_tokens: int, max_prompts: int | None, allow_mixed: bool = False,
                     overwrite: bool = False) -> list[dict]:  # fmt: skip
    """hard_offsets_raw.csv, hard_offsets.csv and hard_offsets.png in `out`; the table's rows. An
    earlier output of the same inputs is kept (its rows read back), of other inputs refused unless
    `overwrite` (pipeline/outputs.py)."""
    from drafter.checkpoint import drafter_hash
    from pipeline.eval.evaluate import replay_inputs

    drafters = {"independent": independent, "drafter": drafter, "baseline": baseline} | ({"control": control} if control else {})
    mixed = check_control(control, baseline, allow_mixed=allow_mixed) if control else []
    check_out_path(out)
    inputs = replay_inputs(target=target, prompts=prompts, max_new_tokens=max_new_tokens, max_prompts=max_prompts) | {
        "mode": "hard_offsets", "drafters": {role: drafter_hash(path) for role, path in drafters.items()},
        "control_mixed": mixed or None,
    }  # fmt: skip
    with claim_output(out, command="alrira-eval hard", inputs=inputs, own=owns(*HARD_FILES), overwrite=overwrite) as output:
        if output.kept:
            return read_table(output.path / "hard_offsets.csv")
        raw = hard_offsets(target_dir=target, prompts=prompts, drafters=drafters, max_new_tokens=max_new_tokens, max_prompts=max_prompts)
        write_csv_rows(output.path / "hard_offsets_raw.csv", raw, columns=tuple(c for c in HARD_RAW_COLUMNS if c in raw[0]))
        rows = hard_offset_table(raw, roles=[r for r in ("independent", "drafter", "baseline", "control") if r in drafters])
        _write_table(rows, output.path / "hard_offsets.csv")
        plot_hard_offsets(rows, output.path / "hard_offsets.png")
        output.finish()
    return rows


def read_table(path: Path) -> list[dict]:
    """The rows of a table an analysis wrote (numbers back as numbers, empty cells as None)."""

    def value(text: str):
        if text == "":
            return None
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return text

    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def format_rows(rows: list[dict]) -> str:
    """A printable table of an analysis's rows (numbers to 3 decimals, gains in %)."""

    def cell(key: str, value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:+.1f}%" if key.endswith("_pct") else f"{value:.3f}"
        return str(value)

    header = list(rows[0])
    lines = [header] + [[cell(k, r[k]) for k in header] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))) for line in lines)
