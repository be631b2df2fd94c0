"""A real engine on this CPU checks every drafter export: llama.cpp (docs/serving.md, "llama.cpp").

    .venv/bin/python -m benchmarks.checks.llama_cpp [--out results/llama_cpp] [--small] [--tools-dir DIR] [--cases a,b] [--thresholds 0.1,0.2]

1. Builds llama.cpp's CPU `llama-server` once from the pinned llama-cpp-python sdist into a tools
   folder outside the repository (llama_cpp_tools.py; --tools-dir, $ALRIRA_LLAMA_CPP, else
   ~/.cache/alrira/llama-cpp); a rerun reuses it.
2. Targets: SmolLM2-135M-Instruct (Llama family; the real demo's HF folder, pipeline/demo/real.py)
   and a tiny Qwen3 with Qwen's real tokenizer (qwen_target.py). Each converts with llama.cpp's own
   converter (f32).
3. Per target: a corpus of the target's greedy answers to chatterbot prompts (`alrira-cache
   regenerate`), a cache (`alrira-cache build`), and per case a drafter (`alrira-train`, 1 layer
   unless said), converted with `--target-model-dir TARGET`.
4. Decodes held-out chatterbot prompts (token ids, T = 0) with llama-server, the target alone and
   with each drafter (`--spec-type draft-dflash` / `draft-dspark`, `--spec-draft-n-max` = the
   drafter's drafts per block, `--spec-draft-p-min` = the confidence threshold), and runs `alrira-eval
   run` on the same prompts; then per case: lossless (llama.cpp with the drafter == llama.cpp alone,
   token for token), the two engines' targets agree, and rounds / accepted per round / drafts per
   round equal (how each side counts: llama_cpp_compare.py).
Writes OUT/llama_cpp.json (every number and the exact commands) and prints the table. Cases that
llama.cpp refuses are reported with its one-line error; cases that alrira cannot express today are
listed with the reason (SKIPPED).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from benchmarks.checks.llama_cpp_compare import compare, comparison_json
from benchmarks.checks.llama_cpp_tools import Completion, Server, Tools, convert, default_tools_dir, ensure_tools

BIN = Path(sys.executable).parent  # the alrira-* commands of this environment


@dataclass(frozen=True, kw_only=True)
class Sizes:
    corpus_prompts: int = 48  # chatterbot prompts whose greedy answers make each target's corpus
    eval_prompts: int = 8  # held-out chatterbot prompts decoded by both engines
    regen_max_new_tokens: int = 64
    max_new_tokens: int = 40  # alrira-eval's budget; llama.cpp gets max_new_tokens + block + 3
    num_slots: int = 7  # K of the caches (DFlash block 8; DSpark B <= K)
    anchors: int = 32
    epochs: int = 8
    max_steps: int | None = None
    batch_size: int = 8
    thresholds: tuple[float, ...] = (0.2, 0.4, 0.6)  # --spec-draft-p-min / --confidence-threshold of the confidence case
    cases: tuple[str, ...] = ()  # () = every case


SIZES = {
    "full": Sizes(),
    # tests/test_llama_cpp.py: two drafters on SmolLM2 (the DSpark one also as a bf16 GGUF), one threshold, a few minutes.
    "small": Sizes(corpus_prompts=16, eval_prompts=3, regen_max_new_tokens=40, max_new_tokens=24, anchors=16, epochs=8,
                   thresholds=(0.4,), cases=("smollm2-dflash", "smollm2-dspark", "smollm2-dspark-bf16")),  # fmt: skip
}


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    target: str  # smollm2 (Llama family) or qwen3
    arch: str = "dflash"
    train_flags: tuple[str, ...] = ()
    outtype: str = "f32"  # the drafter GGUF's type (--outtype)
    drafter_of: str | None = None  # another case's trained drafter, converted differently
    thresholds: bool = False  # also decode at Sizes.thresholds
    probe: bool = False  # a case alrira writes that llama.cpp may refuse: reported, never a failure
    max_steps: int | None = None  # a probe only needs an export: a couple of steps
    note: str = ""


CASES = (
    Case(name="smollm2-dflash", target="smollm2"),
    Case(name="smollm2-dflash-2layers", target="smollm2", train_flags=("--draft-layers", "2")),
    Case(name="smollm2-dflash-bf16", target="smollm2", drafter_of="smollm2-dflash", outtype="bf16"),
    Case(name="smollm2-dspark", target="smollm2", arch="dspark", thresholds=True),
    Case(name="smollm2-dspark-noconf", target="smollm2", arch="dspark", train_flags=("--no-confidence-head",)),
    Case(name="smollm2-dspark-b4", target="smollm2", arch="dspark", train_flags=("--dspark-block", "4")),
    Case(name="smollm2-dspark-2layers", target="smollm2", arch="dspark", train_flags=("--draft-layers", "2")),
    Case(name="smollm2-dspark-bf16", target="smollm2", arch="dspark", drafter_of="smollm2-dspark", outtype="bf16"),
    Case(name="smollm2-dspark-noconf-pmin", target="smollm2", arch="dspark", drafter_of="smollm2-dspark-noconf", thresholds=True,
         probe=True, note="a confidence threshold without a confidence head: llama-server drops the drafter, alrira-eval refuses"),
    Case(name="smollm2-dspark-gated", target="smollm2", arch="dspark", probe=True, train_flags=("--markov-head-type", "gated"),
         max_steps=2, note="DeepSpec's gated Markov head: vLLM and llama.cpp serve only vanilla"),
    Case(name="smollm2-dspark-export-head", target="smollm2", arch="dspark", probe=True, train_flags=("--export-head",),
         max_steps=2, note="the target's embed_tokens and lm_head in the export (DeepSpec's eval.py reads them)"),
    Case(name="smollm2-dflash2", target="smollm2", arch="dflash2"),  # docs/dflash2.md, "Serving"
    Case(name="qwen3-dflash", target="qwen3"),
    Case(name="qwen3-dspark", target="qwen3", arch="dspark", train_flags=("--markov-rank", "32")),
)  # fmt: skip
CASE_BY_NAME = {c.name: c for c in CASES}
# Contract variants alrira does not write today: listed in the table with the reason, not run.
SKIPPED = {
    "--markov-rank 0": "alrira-train refuses it: no engine serves a DSpark drafter without a Markov head (vLLM has no "
    "rank-0 path, SGLang refuses it; llama.cpp would auto-detect draft-dflash, whose layout is not DSpark's)",
    "confidence_head_with_markov: false": "alrira trains no such head (it came only with --markov-rank 0) and refuses a "
    "--drafter-init with one: llama.cpp reads the confidence head H + r wide (src/models/dflash.cpp)",
    "sample_from_anchor: false": "alrira writes sample_from_anchor: true and refuses a config with false (the speculators "
    "layout)",
}


@dataclass(kw_only=True)
class Context:
    out: Path
    sizes: Sizes
    tools: Tools
    cache_dir: Path
    threads: int
    commands: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, command: list[str], *, what: str) -> None:
        """Run an alrira command (its output to OUT/logs/WHAT.log), recorded for the report."""
        self.commands.append(shlex.join(str(c) for c in command))
        log_path = self.out / "logs" / f"{what}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(log_path, "w") as log_file:
            result = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT)
        self.timings[what] = round(time.monotonic() - started, 1)
        if result.returncode != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise ValueError(f"{what}: {command[0]} exited {result.returncode}: {tail[0]} (log: {log_path})")


# ----------------------------------------------------------------------------------------------
# Targets, prompts, corpora, caches, drafters


@dataclass(kw_only=True)
class Target:
    name: str
    path: Path
    mask_token: str | None
    gguf: Path | None = None
    stop_ids: set[int] = field(default_factory=set)
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # prompt id -> alrira-eval's input ids


def prepare_prompts(ctx: Context) -> tuple[Path, Path]:
    """Chatterbot prompts split into the corpus's (answered by each target) and held-out
    evaluation prompts (pipeline/demo/real.py); both files under OUT/prompts."""
    from pipeline.demo import real

    split = real.split_chatterbot(num_corpus=ctx.sizes.corpus_prompts, num_head=ctx.sizes.eval_prompts, seed=0)
    corpus = real.write_jsonl([real.chat_row(p, a) for p, a in split.corpus], ctx.out / "prompts" / "corpus_source.jsonl")
    prompts = real.write_jsonl([{"prompt": p, "benchmark": "chatterbot"} for p, _ in split.head], ctx.out / "prompts" / "eval.jsonl")
    return corpus, prompts


def prepare_target(ctx: Context, name: str, prompts: Path) -> Target:
    from pipeline.demo import real
    from pipeline.eval.evaluate import load_prompts
    from pipeline.target import load_tokenizer, read_generation_config, stop_token_ids
    from benchmarks.checks.qwen_target import make_qwen3_target

    if name == "smollm2":
        real.check_packages()
        target = Target(name=name, path=real.convert_gguf(ctx.cache_dir, log=print), mask_token=real.MASK_TOKEN)
    else:
        path = ctx.out / "targets" / "qwen3"
        if not (path / "model.safetensors").is_file():
            make_qwen3_target(path, cache_dir=ctx.tools.root)
        target = Target(name=name, path=path, mask_token=None)  # Qwen3's first unused embedding row
    tokenizer = load_tokenizer(target.path)
    target.stop_ids = set(stop_token_ids(tokenizer, read_generation_config(target.path)))
    target.prompt_ids = {p.prompt_id: p.input_ids for p in load_prompts(prompts, tokenizer)}
    converted = convert(ctx.tools, target.path, ctx.out / "gguf" / f"{name}.gguf")
    ctx.commands.append(shlex.join(converted.command))
    if converted.gguf is None:
        raise ValueError(f"llama.cpp's converter refused the target {target.path}: {converted.error}")
    target.gguf = converted.gguf
    return target


def build_cache(ctx: Context, target: Target, corpus_source: Path) -> Path:
    corpus, cache = ctx.out / "corpora" / target.name, ctx.out / "caches" / target.name
    s = ctx.sizes
    common = ["--target", str(target.path), "--workers", "1", "--cpus-per-worker", str(ctx.threads), "--no-progress"]
    if not (corpus / "manifest.json").is_file():
        ctx.run([str(BIN / "alrira-cache"), "regenerate", *common, "--corpus", str(corpus_source), "--out", str(corpus),
                 "--temperature", "0", "--max-new-tokens", str(s.regen_max_new_tokens)], what=f"regenerate-{target.name}")  # fmt: skip
    if not (cache / "manifest.json").is_file():
        mask = ["--mask-token", target.mask_token] if target.mask_token else []
        ctx.run([str(BIN / "alrira-cache"), "build", *common, "--corpus", str(corpus), "--out", str(cache), *mask,
                 "--draft-layers", "1", "--num-slots", str(s.num_slots), "--anchors", str(s.anchors),
                 "--min-supervised-tokens", str(2 * (s.num_slots + 1)), "--no-rollouts"], what=f"cache-{target.name}")  # fmt: skip
    return cache


def train(ctx: Context, case: Case, cache: Path) -> Path:
    run = ctx.out / "runs" / case.name
    if not (run / "drafter" / "config.json").is_file():
        s = ctx.sizes
        max_steps = min(n for n in (case.max_steps, s.max_steps, 10**9) if n)
        steps = ["--max-steps", str(max_steps)] if max_steps else []
        layers = [] if "--draft-layers" in case.train_flags else ["--draft-layers", "1"]
        ctx.run([str(BIN / "alrira-train"), "--cache", str(cache), "--out", str(run), "--method", "dflash", "--arch", case.arch,
                 *layers, *case.train_flags, "--epochs", str(s.epochs), *steps, "--batch-size", str(s.batch_size),
                 "--save-dtype", "float32", "--threads", str(ctx.threads), "--no-progress", "--overwrite"],
                what=f"train-{case.name}")  # fmt: skip
    return run / "drafter"


def drafts_per_block(drafter: Path) -> int:
    """What --spec-draft-n-max gets: K = block_size - 1 for DFlash, B = block_size for DSpark."""
    config = json.loads((drafter / "config.json").read_text())
    return config["block_size"] if "Qwen3DSparkModel" in config.get("architectures", []) else config["block_size"] - 1


# ----------------------------------------------------------------------------------------------
# Decoding on both engines


def llama_decode(ctx: Context, target: Target, *, label: str, drafter: Path | None = None, spec_type: str | None = None,
                 n_max: int = 0, p_min: float = 0.0) -> dict[int, dict]:  # fmt: skip
    """llama-server's greedy completion of every prompt: {prompt id: {"tokens", "steps"}}, kept in
    OUT/llama/LABEL.json (reused on a rerun)."""
    saved = ctx.out / "llama" / f"{label}.json"
    if saved.is_file():
        return {int(k): v for k, v in json.loads(saved.read_text()).items()}
    budget = ctx.sizes.max_new_tokens + ctx.sizes.num_slots + 3  # past alrira-eval's: no compared draft is cut (llama_cpp_compare.py)
    server = Server(ctx.tools, target.gguf, log_path=ctx.out / "llama" / f"{label}.log", drafter=drafter, spec_type=spec_type,
                    n_max=n_max, p_min=p_min, threads=ctx.threads)  # fmt: skip
    ctx.commands.append(shlex.join(server.command))
    started = time.monotonic()
    with server:
        results: dict[int, Completion] = {pid: server.complete(ids, n_predict=budget) for pid, ids in target.prompt_ids.items()}
    ctx.timings[f"llama-{label}"] = round(time.monotonic() - started, 1)
    data = {pid: asdict(c) for pid, c in results.items()}
    saved.write_text(json.dumps({str(k): v for k, v in data.items()}) + "\n")
    return data


def alrira_eval(ctx: Context, target: Target, drafter: Path, prompts: Path, *, label: str, threshold: float) -> Path:
    out = ctx.out / "evals" / label
    if not (out / "summary.json").is_file():
        ctx.run([str(BIN / "alrira-eval"), "run", "--target", str(target.path), "--drafter", str(drafter), "--prompts", str(prompts),
                 "--out", str(out), "--max-new-tokens", str(ctx.sizes.max_new_tokens), "--temperature", "0", "--dtype", "float32",
                 "--device", "cpu", "--confidence-threshold", f"{threshold:g}", "--ar-baseline-from", str(ctx.out / "evals"),
                 "--no-progress"], what=f"eval-{label}")  # fmt: skip
    return out


def check_case(ctx: Context, case: Case, target: Target, drafter: Path, prompts: Path, alone: dict) -> list[dict]:
    """Convert the drafter, decode it on both engines at threshold 0 (and the thresholds), compare."""
    gguf_path = ctx.out / "gguf" / f"{case.name}.gguf"
    converted = convert(ctx.tools, drafter, gguf_path, outtype=case.outtype, target_dir=target.path)
    ctx.commands.append(shlex.join(converted.command))
    base = {"case": case.name, "target": case.target, "arch": case.arch, "outtype": case.outtype, "note": case.note,
            "train_flags": list(case.train_flags), "probe": case.probe}  # fmt: skip
    if converted.gguf is None:
        return [{**base, "status": "refused", "refused_by": "convert_hf_to_gguf.py", "error": converted.error}]
    spec_type = "draft-dspark" if case.arch == "dspark" else "draft-dflash"
    n_max = drafts_per_block(drafter)
    eval_of = case.drafter_of or case.name
    rows = []
    for threshold in (0.0, *(ctx.sizes.thresholds if case.thresholds else ())):
        label = f"{case.name}-t{threshold:g}"
        try:
            spec = llama_decode(ctx, target, label=label, drafter=converted.gguf, spec_type=spec_type, n_max=n_max, p_min=threshold)
        except ValueError as error:
            rows.append({**base, "threshold": threshold, "status": "refused", "refused_by": "llama-server", "error": str(error)})
            continue
        eval_dir = alrira_eval(ctx, target, drafter, prompts, label=f"{eval_of}-t{threshold:g}", threshold=threshold)
        result = comparison_json(compare(spec=spec, alone=alone, eval_dir=eval_dir, max_new_tokens=ctx.sizes.max_new_tokens,
                                         stop_ids=target.stop_ids))  # fmt: skip
        rows.append({**base, "threshold": threshold, "status": "ran", "n_max": n_max, **result})
    return rows


# ----------------------------------------------------------------------------------------------
# The run and its report


def run_check(ctx: Context) -> dict:
    """Every chosen case, target by target; OUT/llama_cpp.json is rewritten after each case, so an
    interrupted run leaves what it checked (and a rerun reuses every output it finds)."""
    started = time.monotonic()
    corpus_source, prompts = prepare_prompts(ctx)
    chosen = [CASE_BY_NAME[name] for name in ctx.sizes.cases] if ctx.sizes.cases else list(CASES)  # in the order asked
    stamp = json.loads(ctx.tools.stamp.read_text())
    report = {"sizes": asdict(ctx.sizes), "tools_dir": str(ctx.tools.root), "llama_cpp_python": stamp["version"],
              "build_s": stamp.get("build_s"), "results": [], "skipped": SKIPPED, "commands": ctx.commands, "timings": ctx.timings}  # fmt: skip
    for target_name in dict.fromkeys(c.target for c in chosen):
        target = prepare_target(ctx, target_name, prompts)
        cache = build_cache(ctx, target, corpus_source)
        alone = llama_decode(ctx, target, label=f"{target_name}-alone")
        for case in (c for c in chosen if c.target == target_name):
            drafter = train(ctx, CASE_BY_NAME[case.drafter_of or case.name], cache)
            report["results"].extend(check_case(ctx, case, target, drafter, prompts, alone))
            ctx.timings["total"] = round(time.monotonic() - started, 1)
            (ctx.out / "llama_cpp.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def table(report: dict) -> str:
    header = "case  threshold  lossless  engines agree  equal  llama.cpp rounds/accepted/drafts  alrira-eval rounds/accepted/drafts  tau"
    lines = [header, "-" * len(header)]
    for r in report["results"]:
        if r["status"] != "ran":
            lines.append(f"{r['case']}  {r.get('threshold', 0):g}  REFUSED by {r['refused_by']}: {r['error']}")
            continue
        ll, al = r["llama"], r["alrira"]
        lines.append(
            f"{r['case']}  {r['threshold']:g}  {'yes' if r['lossless'] else 'NO'}  {'yes' if r['engines_agree'] else 'NO'}  "
            f"{'yes' if r['equal_rounds'] else 'NO'}  {ll['rounds']}/{ll['accepted']}/{ll['proposed']}  "
            f"{al['rounds']}/{al['accepted']}/{al['proposed']}  {ll['tau']}"
        )
    lines += [f"{name}  SKIPPED: {why}" for name, why in report["skipped"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/llama_cpp", help="Output folder (kept: a rerun reuses what it holds).")
    parser.add_argument("--tools-dir", default=None, help="llama.cpp tools folder (default: $ALRIRA_LLAMA_CPP, else ~/.cache/alrira/llama-cpp).")
    parser.add_argument("--small", action="store_true", help="The test's variant: two SmolLM2 drafters (and a bf16 GGUF of one), three prompts.")
    parser.add_argument("--cases", default=None, help="Comma-separated case names, run in this order (default: every case).")
    parser.add_argument("--threads", type=int, default=1, help="Threads of llama-server, the trainer and the target workers.")
    parser.add_argument("--jobs", type=int, default=2, help="Parallel jobs of the llama.cpp build.")
    parser.add_argument("--max-steps", type=int, default=None, help="Cap every training at N steps (a quick look; acceptance stays low).")
    parser.add_argument("--thresholds", default=None, help="Comma-separated confidence thresholds in (0, 1) of the cases that decode at thresholds (default: 0.2,0.4,0.6; --small 0.4).")
    parser.add_argument("--build-only", action="store_true", help="Build the tools (once) and exit.")
    args = parser.parse_args(argv)
    sizes = SIZES["small" if args.small else "full"]
    if args.cases:
        names = tuple(n.strip() for n in args.cases.split(",") if n.strip())
        unknown = sorted(set(names) - {c.name for c in CASES})
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(c.name for c in CASES)}")
        sizes = replace(sizes, cases=names)
    if args.max_steps is not None:
        if args.max_steps < 1:
            parser.error(f"--max-steps must be >= 1, got {args.max_steps}")
        sizes = replace(sizes, max_steps=args.max_steps)
    if args.thresholds is not None:
        try:
            thresholds = tuple(float(t) for t in args.thresholds.split(",") if t.strip())
        except ValueError:
            parser.error(f"--thresholds takes comma-separated numbers, got {args.thresholds!r}")
        if not thresholds or not all(0 < t < 1 for t in thresholds):
            parser.error(f"--thresholds must be numbers in (0, 1), got {args.thresholds!r}")
        sizes = replace(sizes, thresholds=thresholds)
    from pipeline.demo import real

    tools = ensure_tools(Path(args.tools_dir) if args.tools_dir else default_tools_dir(), jobs=args.jobs)
    if args.build_only:
        print(f"llama.cpp tools ready in {tools.root}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=out, sizes=sizes, tools=tools, cache_dir=real.DEFAULT_CACHE_DIR, threads=args.threads)
    report = run_check(ctx)
    print(table(report))
    print(f"wrote {out / 'llama_cpp.json'}")
    failed = [r for r in report["results"] if not r["probe"] and not (r["status"] == "ran" and r["lossless"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
