"""The no-download demo: one cache, five objectives, real speculative decoding, on the CPU.

    python -m pipeline.demo [--out demo_out] [--quick] [--seed 0]

Phases (each skipped when its output already exists, so an interrupted demo resumes):
  1. world    pipeline.demo.world: a tiny Qwen3 target trained on source A, an off-policy chat
              corpus written by source B, held-out prompts in three groups
  2. cache    `alrira-cache build` (the Ray job, 2 workers) over the corpus
  3. train    one drafter per method (dflash, kd, erase, alr, alr_ira) from that cache, identical
              settings except the method
  4. eval     pipeline.eval.evaluate at T = 0 (and any other --temperatures) on the held-out prompts
Then it prints a table (method, tau, speedup, training time) and writes `results.json` and
`tau_by_method.png` into --out. 8 min 40 s measured on an idle 2-core machine (`--quick`: ~30 s);
results and what they mean: docs/results.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from drafter.checkpoint import WEIGHTS_FILE
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.cli import config_from_flags, config_options
from pipeline.demo.world import World, WorldConfig, build_world
from pipeline.eval.evaluate import EvalConfig, run_eval
from pipeline.precision import native_bf16_matmul
from pipeline.train.config import TrainConfig
from pipeline.outputs import LOCK_FILE, RECORD_FILE, output_lock
from pipeline.config import to_flags
from pipeline.corpus_source import file_sha256
from pipeline.train.checkpoints import check_resume_settings
from pipeline.train.loop import train
from storage.location import resolve
from storage.manifest import load_manifest

DEMO_METHODS = ("dflash", "kd", "erase", "alr", "alr_ira")
RESULTS_FILE = "results.json"
PLOT_FILE = "tau_by_method.png"


@dataclass(kw_only=True)
class DemoSizes:
    """Everything the demo's scale depends on; `quick` shrinks it to a ~1 minute smoke run."""

    world: WorldConfig
    anchors: int = 32  # cached anchor pool per sequence
    anchors_per_step: int = 16  # drawn from the pool per sequence and step
    shard_size: int = 100
    workers: int = 2
    # 6 epochs of 800 rows = 600 steps: enough for every method, dflash's noisy one-hot labels
    # the slowest, to leave the initial plateau of a drafter trained from scratch (docs/results.md).
    epochs: int = 6
    batch_size: int = 8
    lr: float = 3e-3
    max_new_tokens: int = 64

    @classmethod
    def make(cls, *, seed: int, quick: bool) -> DemoSizes:
        if not quick:
            return cls(world=WorldConfig(seed=seed))
        world = WorldConfig(
            seed=seed, num_words=32, num_corpus_rows=48, prompts_per_group=2, response_words=(32, 48), target_steps=20,
            target_batch_size=16,
        )  # fmt: skip
        return cls(world=world, anchors=16, anchors_per_step=8, shard_size=12, epochs=1, max_new_tokens=24)


def _log(message: str, *, started: float) -> None:
    print(f"[{time.time() - started:6.0f}s] {message}", flush=True)


def build_demo_cache(
    world: World, out: Path, sizes: DemoSizes, *, log, extra_args: tuple[str, ...] = (), in_process: bool = False
) -> Path:
    """Run `alrira-cache build` in a subprocess (only the CLI may import ray_jobs, and Ray's
    processes end with it). A complete cache is left as it is. `extra_args` go after the demo's
    own flags, so a repeated flag overrides the demo's value (benchmarks/speed/cache_tau.py).
    `in_process`: the same flags, the same shard builder, computed in this process without Ray
    (`run_shards_here`, as pipeline.demo.experiment does): no cluster start, which under heavy
    load can time out."""
    if (out / "manifest.json").is_file():
        manifest = load_manifest(out)
        if len(manifest.shards) == manifest.num_shards_planned and all(s.status == "complete" for s in manifest.shards):
            log(f"cache: reusing {out}")
            return out
    args = [
        "build", "--target", str(world.target), "--corpus", str(world.corpus), "--out", str(out),
        "--draft-layers", "2", "--anchors", str(sizes.anchors), "--shard-size", str(sizes.shard_size),
        "--workers", str(sizes.workers), "--cpus-per-worker", "1", "--target-dtype", "float32", "--no-progress", *extra_args,
    ]  # fmt: skip
    if in_process:
        log(f"cache (in process): alrira-cache {' '.join(args)}")
        build_cache(_build_config(args[1:]), run_shards=run_shards_here, progress=False, log=log)
        return out
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "TOKENIZERS_PARALLELISM": "false"}

    log(f"cache: alrira-cache {' '.join(args)}")
    subprocess.run([sys.executable, "-m", "ray_jobs", *args], check=True, env=env)
    return out


def _build_config(args: list[str]) -> CacheBuildConfig:
    """The CacheBuildConfig `alrira-cache build ARGS` would run, parsed by the same click options."""

    @click.command()
    @config_options(CacheBuildConfig)
    @click.option("--progress/--no-progress", default=True)
    def flags(**kwargs):
        pass

    params = flags.make_context("build", list(args)).params
    return config_from_flags(CacheBuildConfig, {k: v for k, v in params.items() if k != "progress"})


def train_config(
    *, cache: Path, out: Path, method: str, seed: int, sizes: DemoSizes, arch: str = "dflash", markov_rank: int | None = None
) -> TrainConfig:
    """The one training recipe every method gets; only `method` differs (and `arch`: a DSpark drafter
    drafts as many tokens per round as the DFlash one, B = the cache's K)."""
    return TrainConfig.from_flags(
        cache=str(cache), out=str(out), method=method, arch=arch, markov_rank=markov_rank, epochs=sizes.epochs,
        batch_size=sizes.batch_size, lr=sizes.lr,
        anchors_per_step=sizes.anchors_per_step,
        gamma=2.0, dflash_gamma=2.0,  # the text recipe: one slot envelope for every method
        seed=seed, num_workers=1, resume=True, save_dtype="float32", progress=False,
        precision="fp32",  # the documented recipe on every CPU, AMX or not (docs/results.md)
    )  # fmt: skip


def train_method(config: TrainConfig, *, log) -> dict:
    """Train (or reuse a finished run); the run's summary.json."""
    run = Path(config.out)
    if (run / "summary.json").is_file() and (run / "drafter" / "config.json").is_file():
        # Only a run of these settings (the world and so the cache are checked when they are reused).
        saved = json.loads((run / "train_config.json").read_text())
        # A setting left to the cache (None: --rollout-depth) was recorded resolved from this same cache.
        current = {k: saved.get(k) if v is None else v for k, v in to_flags(config).items()}
        check_resume_settings(saved, current, run=resolve(run))
        log(f"train {config.objective.method}: reusing {run} (same settings)")
        return json.loads((run / "summary.json").read_text())
    optim = config.optim
    log(f"train {config.objective.method}: {optim.epochs} epochs, batch {optim.batch_size}, lr {optim.lr}, seed {config.seed}")
    summary = train(config)
    acc = " ".join(f"{a:.2f}" for a in summary["slot_acc_last_10pct"][:8])
    log(f"train {config.objective.method}: {summary['elapsed_s']:.0f}s, loss {summary['final_loss']:.3f}, slot acc {acc} ...")
    return summary


def evaluate_method(*, world: World, drafter: Path, out: Path, temperature: float, seed: int, sizes: DemoSizes, log) -> dict:
    """Speculative decoding of the held-out prompts (an earlier run's summary when its recorded
    inputs are the same: run_eval keeps it)."""
    summary = run_eval(
        EvalConfig(
            target=str(world.target), drafter=str(drafter), prompts=str(world.prompts), out=str(out),
            temperature=temperature, max_new_tokens=sizes.max_new_tokens, seed=seed, progress=False,
        )
    )  # fmt: skip
    if summary["lossless_mismatches"]:
        log(f"WARNING: {summary['lossless_mismatches']} prompts decoded differently from the target alone")
    return summary


def method_results(*, train_summary: dict, evals: dict[float, dict]) -> dict:
    """The numbers the table, the plot and the benchmark use, for one trained drafter."""
    result = {
        "train_s": train_summary["elapsed_s"],
        "final_loss": train_summary["final_loss"],
        "slot_acc": train_summary["slot_acc_last_10pct"],
    }
    for temperature, summary in evals.items():
        key = f"T{temperature:g}"
        result[key] = {
            "tau": summary["tau_geomean"],
            "speedup": summary["speedup_geomean"],
            "tau_by_group": {g: v["tau"] for g, v in summary["groups"].items()},
            "lossless_mismatches": summary["lossless_mismatches"],
        }
    return result


def environment() -> dict:
    """What the demo's numbers depend on besides its seeds: every tau and loss is the same on
    another run with the same torch threads and CPU kind, whatever the core count; another thread
    count, instruction set (AVX2, AVX512, AMX) or CPU model rounds fp32 sums in another order
    (docs/results.md, "The demo")."""
    return {
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16_matmul": native_bf16_matmul(),
        "cpu": cpu_model(),
    }  # fmt: skip


def cpu_model() -> str:
    """Vendor, family, model, name and the matrix-unit flags of /proc/cpuinfo's first CPU
    (`platform.processor()` elsewhere): MKL and oneDNN choose their fp32 kernels by these, not only
    by the instruction set torch reports (docs/results.md, "The demo")."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    units = [flag for flag in fields.get("flags", "").split() if flag.startswith(("amx", "avx512_bf16", "avx512_fp16", "avx512_vnni"))]
    name = f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model {fields.get('model', '?')} ({fields.get('model name', '?')})"
    return " ".join([name, *sorted(units)])


def format_table(results: dict[str, dict], *, temperatures: list[float]) -> str:
    header = ["method"]
    for t in temperatures:
        header += [f"tau T={t:g}", f"speedup T={t:g}"]
    header += ["train s", "loss"]
    lines = [header]
    for method, r in results.items():
        row = [method]
        for t in temperatures:
            row += [f"{r[f'T{t:g}']['tau']:.3f}", f"{r[f'T{t:g}']['speedup']:.2f}x"]
        row += [f"{r['train_s']:.0f}", f"{r['final_loss']:.3f}"]
        lines.append(row)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    cells = [[c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))] for line in lines]
    return "\n".join("  ".join(row) for row in cells)


def plot_taus(
    taus: dict[str, list[float]], path: Path, *, labels: list[str], title: str, errors: dict[str, list[float]] | None = None
) -> bool:
    """Bar chart of tau per method ({method: [tau per label]}), one bar per label (e.g. temperature)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)  # Agg canvas directly: the process-wide pyplot backend is left alone
    ax = fig.add_subplot()
    methods = list(taus)
    num_bars = len(next(iter(taus.values())))
    width = 0.8 / num_bars
    for j in range(num_bars):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(methods))]
        ys = [taus[m][j] for m in methods]
        yerr = [errors[m][j] for m in methods] if errors else None
        bars = ax.bar(xs, ys, width=width, yerr=yerr, capsize=3, label=labels[j])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(methods)), methods)
    if num_bars > 1:
        ax.legend()
    ax.set_ylabel("mean acceptance length tau")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


DEMO_COMMAND = "python -m pipeline.demo"
DEMO_NAMES = ("world", "cache", "runs", "evals", RESULTS_FILE, PLOT_FILE)  # what the demo writes in --out


def run_demo(*, out: Path, seed: int, quick: bool, temperatures: list[float], methods: tuple[str, ...] = DEMO_METHODS) -> dict:
    """The demo in --out, held under its lock (a second demo on the same --out refuses) and only in
    a directory that holds nothing but the demo's own names (pipeline/outputs.py)."""
    with output_lock(out, command=DEMO_COMMAND):
        foreign = sorted(n for n in os.listdir(out) if n not in DEMO_NAMES and n not in (LOCK_FILE, RECORD_FILE))
        if foreign:
            raise ValueError(f"--out {out}: holds files the demo did not write ({', '.join(foreign[:3])}); use another --out")
        return _run_demo(out=out, seed=seed, quick=quick, temperatures=temperatures, methods=methods)


def _run_demo(*, out: Path, seed: int, quick: bool, temperatures: list[float], methods: tuple[str, ...]) -> dict:
    started = time.time()

    def log(message: str) -> None:
        _log(message, started=started)

    sizes = DemoSizes.make(seed=seed, quick=quick)
    out.mkdir(parents=True, exist_ok=True)
    log(f"phase 1/4: world (seed {seed}{', quick' if quick else ''}) in {out / 'world'}")
    world = build_world(out / "world", sizes.world, log=log)
    log(f"phase 2/4: cache (Ray, {sizes.workers} workers)")
    cache = build_demo_cache(world, out / "cache", sizes, log=log)
    log(f"phase 3/4: train {len(methods)} drafters from {cache}")
    train_summaries = {}
    for method in methods:
        config = train_config(cache=cache, out=out / "runs" / method, method=method, seed=seed, sizes=sizes)
        train_summaries[method] = train_method(config, log=log)
    log(f"phase 4/4: speculative decoding of {world.prompts.name} at T = {', '.join(f'{t:g}' for t in temperatures)}")
    results = {}
    for method in methods:
        evals = {}
        for temperature in temperatures:
            evals[temperature] = evaluate_method(
                world=world, drafter=out / "runs" / method / "drafter", out=out / "evals" / f"{method}-T{temperature:g}",
                temperature=temperature, seed=seed, sizes=sizes, log=log,
            )  # fmt: skip
        results[method] = method_results(train_summary=train_summaries[method], evals=evals)
        # The trained weights' bytes: the finest record of what training computed, compared by
        # tests/test_demo.py with docs/demo/quick-seed0.json (docs/results.md, "The demo").
        results[method]["drafter_sha256"] = file_sha256(out / "runs" / method / "drafter" / WEIGHTS_FILE)
        log(f"eval {method}: " + ", ".join(f"tau {results[method][f'T{t:g}']['tau']:.3f} at T={t:g}" for t in temperatures))

    report = {
        "seed": seed,
        "quick": quick,
        "temperatures": temperatures,
        "sizes": json.loads(json.dumps(asdict(sizes))),
        "world": {k: v for k, v in world.stats.items() if k != "config"},
        "methods": results,
        "wall_s": time.time() - started,
        "environment": environment(),
    }
    (out / RESULTS_FILE).write_text(json.dumps(report, indent=2) + "\n")
    temps = ", ".join(f"{t:g}" for t in temperatures)
    plotted = plot_taus(
        {m: [r[f"T{t:g}"]["tau"] for t in temperatures] for m, r in results.items()}, out / PLOT_FILE,
        labels=[f"T = {t:g}" for t in temperatures], title=f"demo world seed {seed}: tau at T = {temps}",
    )  # fmt: skip
    print()
    print(format_table(results, temperatures=temperatures))
    print()
    stats = world.stats
    print(
        f"target accuracy on source A {stats['target_accuracy_on_a']:.3f} (best possible {stats['source_a_bayes_accuracy']:.3f}); "
        f"corpus agreement with the target's greedy token {stats['corpus_agreement']:.3f}"
    )
    print(f"results: {out / RESULTS_FILE}" + (f", plot: {out / PLOT_FILE}" if plotted else " (no matplotlib: no plot)"))
    log("done")
    return report


@click.command(help="No-download demo: a trained toy target, an off-policy corpus, five drafters, real speculative decoding.")
@click.option("--out", default="demo_out", show_default=True, type=click.Path(file_okay=False), help="Output directory (resumable).")
@click.option("--quick", is_flag=True, help="Shrink everything to a ~1 minute smoke run.")
@click.option("--seed", default=0, show_default=True, help="Seed of the world and of the drafters' training.")
@click.option("--temperatures", default="0", show_default=True, help="Comma-separated decoding temperatures.")
@click.option("--threads", default=1, show_default=True, help="Torch threads of the training and decoding process.")
def main(out: str, quick: bool, seed: int, temperatures: str, threads: int):
    try:
        temps = [float(t) for t in temperatures.split(",") if t.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {temperatures!r}", param_hint="--temperatures") from None
    if not temps or any(t < 0 for t in temps):
        raise click.BadParameter("give at least one temperature, all >= 0", param_hint="--temperatures")
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        run_demo(out=Path(out), seed=seed, quick=quick, temperatures=temps)
    except ValueError as error:  # bad input (--out in use, another world's directory): one line
        raise click.ClickException(str(error)) from None

