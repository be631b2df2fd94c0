"""How llama.cpp's rounds line up with `alrira-eval run`'s (docs/serving.md, "llama.cpp", how each counts).

alrira-eval (pipeline/eval/speculative.py): the prefill commits the first token; then every round
drafts (DFlash: K tokens; DSpark: B, or fewer where `--confidence-threshold` cuts, possibly 0),
verifies [anchor, drafts] in one target forward and commits the accepted drafts plus one target
token. A round cut by a stop token or by --max-new-tokens counts only what it committed
(`accepted = committed - 1`); a round whose draft is empty is a round with 0 accepted.

llama-server (tools/server/server-context.cpp): the prompt's processing samples the first token;
then every generation step asks for a draft of at most min(n_max, remaining budget - 1) tokens
(`get_n_draft_max`; the drafter always computes its whole block and the caller truncates,
common/speculative.cpp `common_speculative_draft`), verifies a non-empty draft
(`common_sampler_sample_and_accept_n`) and counts `accepted.size() - 1` before it looks for a
stop token; an empty draft is a plain decode step that no counter sees (`draft_n` and the
verification-step counter count verified drafts only).

So the harness asks llama.cpp for more tokens than alrira-eval (budget + block + 2: no draft of
the compared rounds is truncated by the budget), and reads llama.cpp's steps in alrira-eval's terms:
its steps in order, each committing `accepted + 1` tokens, cut where alrira-eval stopped (its
--max-new-tokens, or the stop token in the output); a plain step is a round with 0 drafts and 0
accepted. Then, per prompt, the rounds, the per-round accepted counts and the drafts verified per
round must be equal.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class Rounds:
    """One decoder's rounds over a prompt set, in alrira-eval's terms."""

    accepted: dict[int, list[int]]  # prompt id -> accepted drafts per round
    proposed: dict[int, list[int]] | None = None  # prompt id -> drafts verified per round (None: only totals known)
    total_proposed: int = 0
    rounds_with_drafts: int = 0  # rounds that verified at least one draft

    def totals(self) -> dict:
        rounds = sum(len(a) for a in self.accepted.values())
        accepted = sum(sum(a) for a in self.accepted.values())
        return {"rounds": rounds, "accepted": accepted, "proposed": self.total_proposed,
                "rounds_with_drafts": self.rounds_with_drafts, "tau": round((accepted + rounds) / rounds, 4) if rounds else None}  # fmt: skip


def committed_limit(tokens: list[int], *, max_new_tokens: int, stop_ids: set[int]) -> int:
    """How many of `tokens` alrira-eval would commit: up to its budget, the stop token kept."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stop_ids:
            return i + 1
    return min(len(tokens), max_new_tokens)


def llama_rounds(steps: list[tuple[int, int]], tokens: list[int], *, max_new_tokens: int, stop_ids: set[int]) -> list[tuple[int, int]]:
    """llama.cpp's steps (drafts verified, accepted) as alrira-eval's rounds over the same budget."""
    limit = committed_limit(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    committed, rounds = 1, []  # the first token comes from the prompt's processing on both sides
    for verified, accepted in steps:
        if committed >= limit:
            break
        new = min(accepted + 1, limit - committed)
        rounds.append((verified, new - 1))
        committed += new
    return rounds


def llama_side(completions: dict[int, dict], *, max_new_tokens: int, stop_ids: set[int]) -> Rounds:
    per_prompt = {pid: llama_rounds([tuple(s) for s in c["steps"]], c["tokens"], max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                  for pid, c in completions.items()}  # fmt: skip
    return Rounds(
        accepted={pid: [a for _, a in r] for pid, r in per_prompt.items()},
        proposed={pid: [p for p, _ in r] for pid, r in per_prompt.items()},
        total_proposed=sum(p for r in per_prompt.values() for p, _ in r),
        rounds_with_drafts=sum(1 for r in per_prompt.values() for p, _ in r if p > 0),
    )


def alrira_side(eval_dir: Path) -> Rounds:
    """rounds.csv (accepted per round) and summary.json (drafts verified: K or B per round for an
    uncut drafter, mean_proposed x rounds where a confidence threshold cuts, and the rounds that
    verified slot 0) of one `alrira-eval run`."""
    summary = json.loads((eval_dir / "summary.json").read_text())
    accepted: dict[int, list[int]] = {}
    with open(eval_dir / "rounds.csv", newline="") as f:
        for row in sorted(csv.DictReader(f), key=lambda r: (int(r["prompt_id"]), int(r["round"]))):
            accepted.setdefault(int(row["prompt_id"]), []).append(int(row["accepted"]))
    rounds = summary["rounds"]
    cut = summary.get("confidence_threshold", 0.0) > 0
    proposed = None if cut else {pid: [summary["num_drafts"]] * len(a) for pid, a in accepted.items()}
    total = round(summary["mean_proposed"] * rounds) if cut else summary["num_drafts"] * rounds
    return Rounds(accepted=accepted, proposed=proposed, total_proposed=total,
                  rounds_with_drafts=summary["slot_acceptance"][0]["reached"] if cut else rounds)  # fmt: skip


def ar_tokens(eval_dir: Path) -> dict[int, list[int]]:
    """The HF target's own greedy tokens per prompt (alrira-eval's AR baseline)."""
    data = json.loads((eval_dir / "ar_baseline.json").read_text())
    return {int(pid): r["tokens"] for pid, r in data["results"].items()}


@dataclass(kw_only=True)
class Comparison:
    lossless: bool  # llama.cpp with the drafter == llama.cpp's target alone, token for token
    engines_agree: bool  # llama.cpp's target alone == the HF target (alrira-eval's AR baseline)
    equal_rounds: bool  # per prompt: rounds, accepted per round, drafts per round (or their totals) equal
    llama: dict
    alrira: dict
    first_difference: str = ""
    prompts_differing: list[int] = field(default_factory=list)


def compare(*, spec: dict[int, dict], alone: dict[int, dict], eval_dir: Path, max_new_tokens: int, stop_ids: set[int]) -> Comparison:
    """One case: llama.cpp's completions with the drafter (`spec`) and without (`alone`), by prompt
    id, against the `alrira-eval run` in EVAL_DIR."""

    def cut(tokens: list[int]) -> list[int]:
        return tokens[: committed_limit(tokens, max_new_tokens=max_new_tokens, stop_ids=stop_ids)]

    hf = ar_tokens(eval_dir)
    lossless = all(cut(spec[p]["tokens"]) == cut(alone[p]["tokens"]) for p in spec)
    agree = all(cut(alone[p]["tokens"]) == cut(hf[p]) for p in spec)
    ours, theirs = llama_side(spec, max_new_tokens=max_new_tokens, stop_ids=stop_ids), alrira_side(eval_dir)
    differing = sorted(p for p in spec if ours.accepted[p] != theirs.accepted.get(p)
                       or (theirs.proposed is not None and ours.proposed[p] != theirs.proposed[p]))  # fmt: skip
    totals_equal = all(ours.totals()[k] == theirs.totals()[k] for k in ("proposed", "rounds_with_drafts"))
    first = ""
    if differing:
        p = differing[0]
        first = f"prompt {p}: llama.cpp accepted {ours.accepted[p]} drafts {ours.proposed[p]}; alrira-eval accepted {theirs.accepted.get(p)}"
    elif not totals_equal:
        first = f"totals: llama.cpp {ours.totals()}; alrira-eval {theirs.totals()}"
    return Comparison(
        lossless=lossless, engines_agree=agree, equal_rounds=not differing and totals_equal, llama=ours.totals(),
        alrira=theirs.totals(), first_difference=first, prompts_differing=differing,
    )  # fmt: skip


def comparison_json(comparison: Comparison) -> dict:
    return asdict(comparison)
