"""The paper's experiments on the real target (SmolLM2-135M-Instruct, pipeline/demo/real.py), end to end.

    python -m pipeline.demo --real [--quick] [--out real_out]     (also: bash .ci/demo --real)

Phases (each reuses its finished output, so an interrupted run resumes):
  1. prepare     install the packages, convert the GGUF, write the prompt files: chatterbot prompts
                 split into the corpus's and the initial head's (disjoint), MT-Bench first turns
                 (grouped by category) for evaluation, a subset of them for real decoding, and
                 held-out ones for the hard-offsets analysis
  2. regenerate  the regeneration driver (`alrira-cache regenerate`'s, in this process): the off-policy
                 corpus (the corpus prompts answered at T = 1, one seed per row, --batched-sampling),
                 the two references (greedy regeneration of the SAME prompts, --length-control
                 truncate / window, lengths of the off-policy turns) and the head's corpus (greedy
                 answers to the head prompts)
  3. caches      the cache build of each corpus (the driver in this process), one recipe (mask
                 token, anchors, taps); rollouts only in the off-policy cache (the references train kd)
  4. head        the "public-style" initial head: dflash on the head cache; every arm starts from it
  5. arms        ARMS below, from the one off-policy cache (the references from theirs), same recipe,
                 `lanes` trainings side by side
  6. replay      T = 0 MAT of the head and every run by greedy replay (pipeline/eval/replay.py): the
                 exact rounds of greedy speculative decoding, one target decode per prompt for all
  7. decode      real speculative decoding (`alrira-eval run`) of the decoded arms: every seed at
                 T = 1 (its MAT), seed 0 at T = 0 (speedups, losslessness); then replay of the same
                 prompts checked against it round for round
  8. analyses    compare, offset profile, training cost, hard offsets (pipeline/eval/analysis.py)
Writes OUT/paper.json: every number with the run directory it came from. benchmarks/speed/paper.py
turns it into docs/results.md's real-model section.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import click
import numpy as np

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.demo import real
from pipeline.demo.run import train_method
from pipeline.eval.analysis import run_hard_offsets, run_offset_profile, run_training_cost
from pipeline.eval.compare import run_compare
from pipeline.eval.evaluate import EvalConfig, run_eval
from pipeline.eval.scores import _read_rows
from pipeline.eval.replay import run_replay
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.driver import regenerate_corpus, summary_line
from pipeline.train.config import TrainConfig
from storage.atomic import atomic_write_text
from storage.reader import open_cache


@dataclass(frozen=True, kw_only=True)
class Arm:
    """One trained drafter: a method on a cache, with its own recipe knobs (none tuned per method)."""

    name: str
    method: str
    cache: str = "offpolicy"  # which corpus's cache: offpolicy, truncate, window
    epochs: int | None = None  # None: the recipe's
    rollout_depth: int = 14
    arch: str = "dflash"  # dspark, dflash2: that family's drafter, its backbone from the DFlash head


# The target's dtype for regeneration and stage 1: the fastest where it runs (bf16 on CUDA and on a
# CPU with bf16 matrix units, docs/benchmarks.md "bf16 on the CPU"; pipeline/precision.py). The
# training's precision is auto too; evaluation stays fp32 (the exact lossless check).
TARGET_DTYPE = "auto"

FAMILY_METHODS = ("dflash", "erase", "alr", "alr_ira")  # each drafter family's arms (the families table's rows)

# The paper's arms (docs/results.md, "The real target"): three epochs unless said.
ARMS = (
    Arm(name="dflash", method="dflash"),
    Arm(name="kd", method="kd"),
    Arm(name="erase", method="erase"),
    Arm(name="alr", method="alr"),
    Arm(name="alr_r4", method="alr", rollout_depth=4),
    Arm(name="alr_gate", method="alr_gate"),
    Arm(name="alr_ira", method="alr_ira"),
    Arm(name="slot_control", method="slot_control"),
    Arm(name="ref_truncate", method="kd", cache="truncate"),
    Arm(name="ref_window", method="kd", cache="window"),
    Arm(name="erase_1ep", method="erase", epochs=1),
    Arm(name="alr_r4_1ep", method="alr", rollout_depth=4, epochs=1),
    Arm(name="alr_ira_1ep", method="alr_ira", epochs=1),
    # The other drafter families (docs/design.md, "Drafter families"), four methods each; the
    # backbone starts from the DFlash head, the family's own parts fresh (docs/dspark.md, docs/dflash2.md).
    *(Arm(name=f"{arch}_{method}", method=method, arch=arch) for arch in ("dspark", "dflash2") for method in FAMILY_METHODS),
)  # fmt: skip
MAIN_ARMS = ("dflash", "kd", "erase", "alr", "alr_ira")  # trained with every seed
FAMILY_ARMS = (*FAMILY_METHODS, *(a.name for a in ARMS if a.arch != "dflash"))
QUICK_ARMS = ("dflash", "erase", "alr", "alr_ira", "ref_window", "dspark_alr_ira", "dflash2_alr_ira")


@dataclass(kw_only=True)
class PaperSizes:
    """The experiment's scale and where it runs (PROFILES). The full run is sized for about 2 hours
    on 2 CPU cores (docs/results.md, "The real target"); `quick` is the CI smoke run (with vLLM);
    `gpu` is sized for about 8 minutes on one H200 (docs/benchmarks.md, "GPU check"); `gpu-smoke`
    is the gpu profile's code at toy sizes on CPU (`gpu_check.sh --cpu-smoke`)."""

    corpus_prompts: int = 160
    head_prompts: int | None = 400  # None: every chatterbot prompt the corpus does not take
    head_samples: int = 0  # sampled (T = 1) answers per head prompt, besides its greedy one
    head_batch_size: int | None = None  # None: batch_size
    eval_per_category: int = 3  # MT-Bench first turns per category, scored by greedy replay at T = 0
    eval_categories: int = 8  # the first N of MT-Bench's 8 categories
    regen_max_new_tokens: int = 96
    regen_backend: str = "hf"
    eval_max_new_tokens: int = 96
    decode_per_category: int = 1  # prompts of the real speculative decoding (T = 1, and the T = 0 replay check)
    decode_max_new_tokens: int = 48
    decode_arms: tuple[str, ...] = ("dflash", "kd", "erase", "alr", "alr_ira")  # decoded for real: T = 0 seed 0, T > 0 every seed
    anchors: int = 24
    min_supervised_tokens: int = 32  # the build's default (2 blocks)
    anchors_per_step: int = 8
    epochs: int = 3
    head_epochs: int = 12
    batch_size: int = 8
    lr: float = 1.47e-3  # the paper's
    max_steps: int | None = None
    seeds: tuple[int, ...] = (0, 1, 2)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    arms: tuple[str, ...] = tuple(a.name for a in ARMS)
    hard_prompts: int = 8  # held-out prompts of the hard-offsets analysis
    lanes: int = 2  # trainings and decodes run side by side, one torch thread each
    seed: int = 0  # prompt split and regeneration seed
    device: str = "cpu"  # cpu, or cuda: the target in regeneration, stage 1, replay and decoding, the training
    install: bool = True  # pip-install missing packages; False: they must be there (a machine with no index)
    batch_tokens: int = 8192  # the target's padded-token budget per batch (regeneration, stage 1)
    num_workers: int = 1  # the trainer's loader processes

    @classmethod
    def make(cls, profile: str = "full") -> PaperSizes:
        if profile not in PROFILES:
            raise ValueError(f"--profile must be one of {', '.join(PROFILES)}, got {profile!r}")
        return PROFILES[profile]()


def _quick_sizes() -> PaperSizes:
    return PaperSizes(
        corpus_prompts=6, head_prompts=4, eval_per_category=1, eval_categories=2, regen_max_new_tokens=48,
        eval_max_new_tokens=16,
        decode_max_new_tokens=16, decode_arms=("alr_ira",), anchors=16, min_supervised_tokens=16, epochs=1, head_epochs=1,
        batch_size=2, max_steps=2, seeds=(0,), temperatures=(0.0,), arms=QUICK_ARMS, hard_prompts=1, lanes=1,
    )  # fmt: skip


def _gpu_sizes() -> PaperSizes:
    """One H200, about 7-8 minutes (docs/benchmarks.md, "GPU check", the estimate). The corpus, the
    arms' recipe and the evaluation prompts are the CPU run's; the head has ~20x its data and
    sequence-steps: greedy + 8 sampled answers to each of the 883 chatterbot prompts the corpus does
    not take (7,947 sequences vs 400), 12 epochs of batch 32 (~2,980 steps, 20 x 600 steps of 8).
    The main five arms with 3 seeds; T = 0 by replay, T = 1 decoding on 8 prompts of 32 tokens. One
    lane: one process holds the GPU and compiles the flex kernels once for every training."""
    return PaperSizes(
        head_prompts=None, head_samples=8, head_epochs=12, head_batch_size=32, decode_max_new_tokens=32,
        arms=MAIN_ARMS, lanes=1, device="cuda", install=False, batch_tokens=65536, num_workers=4,
    )  # fmt: skip


def _gpu_smoke_sizes() -> PaperSizes:
    """The gpu profile's code (no install, sampled head answers, the main five, T = 0 and 1, one
    process) at toy sizes on CPU: what `gpu_check.sh --cpu-smoke` and CI run."""
    return replace(
        _gpu_sizes(), corpus_prompts=3, head_prompts=3, head_samples=1, head_epochs=1, head_batch_size=2, batch_size=2,
        max_steps=1, epochs=1, anchors=16, min_supervised_tokens=16, regen_max_new_tokens=24, eval_per_category=1,
        eval_categories=1, eval_max_new_tokens=20, decode_max_new_tokens=8, hard_prompts=1, seeds=(0,), device="cpu",
        batch_tokens=8192, num_workers=0, decode_arms=("alr_ira",),
    )  # fmt: skip


def _families_sizes() -> PaperSizes:
    """The full run's corpus, head, recipe and evaluation, for the drafter families alone: DFlash,
    DSpark and DFlash2 with dflash, erase, alr and alr_ira, seed 0, MAT at T = 0 by replay (about
    45 minutes on 2 CPU cores: no reference corpora, one seed, one decoded arm)."""
    return PaperSizes(arms=FAMILY_ARMS, seeds=(0,), temperatures=(0.0,), decode_arms=("alr_ira",))


PROFILES = {"full": PaperSizes, "quick": _quick_sizes, "gpu": _gpu_sizes, "gpu-smoke": _gpu_smoke_sizes,
            "families": _families_sizes}  # fmt: skip


@dataclass(kw_only=True)
class Paths:
    out: Path
    target: Path
    files: dict[str, Path] = field(default_factory=dict)

    def corpus(self, name: str) -> Path:
        return self.out / "corpora" / name

    def cache(self, name: str) -> Path:
        return self.out / "caches" / name


def code_paths(sizes: PaperSizes) -> dict:
    """Which device paths this profile takes, from the settings the phases are given: stage 1 and
    regeneration on `device_and_dtype` (on CUDA: device-side finite checks and pinned copies in the
    shard builder), the trainer's auto precision and attention (bf16 autocast and compiled flex
    attention on CUDA, pinned loader batches; pipeline/train/setup.py `setup`), replay and decoding."""
    import torch

    from pipeline.cache_build.config import WorkerConfig

    from pipeline.precision import auto_bf16

    cuda = sizes.device.startswith("cuda") and torch.cuda.is_available()
    target_device, target_dtype = WorkerConfig(gpus_per_worker=1 if cuda else 0, target_dtype=TARGET_DTYPE).device_and_dtype()
    cpu_training = "cpu: bf16 autocast, sdpa" if auto_bf16("cpu", stage="train") else "cpu: fp32, sdpa"
    return {
        "target": f"{target_device} {str(target_dtype).removeprefix('torch.')} (regeneration, stage 1)",
        "training": "cuda: bf16 autocast, compiled flex attention, pinned batches" if cuda else cpu_training,
        "evaluation": f"{sizes.device} float32 (replay and decoding)",
    }


def check_device(sizes: PaperSizes) -> None:
    """The gpu profile on a machine without CUDA: one line, before anything runs."""
    import torch

    if sizes.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"this profile runs on {sizes.device} but torch.cuda.is_available() is False (torch {torch.__version__})")


def prepare(out: Path, sizes: PaperSizes, *, cache_dir: Path, log) -> Paths:
    if sizes.install:
        real.install_packages(log=log)
    else:
        real.check_packages()
    paths = Paths(out=out, target=real.convert_gguf(cache_dir, log=log))
    split = real.split_chatterbot(num_corpus=sizes.corpus_prompts, num_head=sizes.head_prompts, seed=sizes.seed)
    prompts = out / "prompts"
    paths.files["corpus_source"] = real.write_jsonl([real.chat_row(p, a) for p, a in split.corpus], prompts / "corpus_source.jsonl")
    paths.files["head_source"] = real.write_jsonl([real.chat_row(p, a) for p, a in split.head], prompts / "head_source.jsonl")
    # Each head prompt head_samples more times: answered at T = 1 with per-row seeds, several answers each.
    sampled = [real.chat_row(p, a) for p, a in split.head for _ in range(sizes.head_samples)]
    paths.files["head_sampled_source"] = real.write_jsonl(sampled, prompts / "head_sampled_source.jsonl")
    per_category: dict[str, list[dict]] = {}
    for row in real.mtbench_first_turns():
        per_category.setdefault(row["benchmark"], []).append(row)
    eval_rows = [r for rows in list(per_category.values())[: sizes.eval_categories] for r in rows[: sizes.eval_per_category]]
    held_out = [r for rows in per_category.values() for r in rows[max(sizes.eval_per_category, sizes.decode_per_category) :]]
    paths.files["eval"] = real.write_jsonl(eval_rows, prompts / "mtbench.jsonl")
    decode_rows = [r for rows in list(per_category.values())[: sizes.eval_categories] for r in rows[: sizes.decode_per_category]]
    paths.files["decode"] = real.write_jsonl(decode_rows, prompts / "mtbench_decode.jsonl")
    # Hard offsets use MT-Bench questions the evaluation does not (held out from it and from training).
    paths.files["hard"] = real.write_jsonl(held_out[:: max(1, len(held_out) // sizes.hard_prompts)][: sizes.hard_prompts],
                                           prompts / "mtbench_held_out.jsonl")  # fmt: skip
    return paths


def needed_corpora(sizes: PaperSizes) -> list[str]:
    """The corpora (and caches) the chosen arms and the head read, in build order."""
    wanted = {a.cache for a in ARMS if a.name in sizes.arms} | {"offpolicy", "head"}
    return [name for name in ("offpolicy", "head", "truncate", "window") if name in wanted]


def head_corpus(paths: Paths, sizes: PaperSizes) -> Path:
    """The head's training corpus: its greedy answers, and with head_samples its sampled ones too
    (the two regenerated corpora's rows in one JSONL, written once)."""
    if not sizes.head_samples:
        return paths.corpus("head")
    merged = paths.out / "corpora" / "head_all.jsonl"
    if not merged.is_file():
        lines = [line for name in ("head", "head_sampled") for part in sorted(paths.corpus(name).glob("part-*.jsonl"))
                 for line in part.read_text().splitlines() if line.strip()]  # fmt: skip
        atomic_write_text(merged, "".join(line + "\n" for line in lines))
    return merged


def regenerate(paths: Paths, sizes: PaperSizes, *, log) -> dict[str, str]:
    """The off-policy corpus (T = 1, per-row seeds), the head's corpus (greedy answers to its
    prompts), and the two greedy references of the SAME prompts as the off-policy corpus, whose
    turns they replace (so their supervised length is that corpus's). Two lanes: the off-policy
    corpus then its references, beside the head's corpus (about equal token counts); a rerun keeps
    the parts already written. Returns each corpus's summary line."""
    jobs = {
        "offpolicy": (paths.files["corpus_source"], 1.0, "none"),
        "head": (paths.files["head_source"], 0.0, "none"),
        "head_sampled": (paths.files["head_sampled_source"], 1.0, "none"),
        "truncate": (paths.corpus("offpolicy"), 0.0, "truncate"),
        "window": (paths.corpus("offpolicy"), 0.0, "window"),
    }
    configs = {}
    for name in needed_corpora(sizes) + (["head_sampled"] if sizes.head_samples else []):
        source, temperature, control = jobs[name]
        configs[name] = RegenerateConfig.from_flags(
            target=str(paths.target), corpus=str(source), out=str(paths.corpus(name)), temperature=temperature,
            seed=sizes.seed, max_new_tokens=sizes.regen_max_new_tokens, length_control=control, cpus_per_worker=1,
            backend=sizes.regen_backend, batched_sampling=temperature > 0, target_dtype=TARGET_DTYPE,
            gpus_per_worker=1 if sizes.device.startswith("cuda") else 0, batch_tokens=sizes.batch_tokens,
        )  # fmt: skip
        log(f"regenerate {name}: T = {temperature:g}, length control {control}, from {source}")
    chains = [c for c in ([n for n in ("offpolicy", "truncate", "window") if n in configs], [n for n in ("head", "head_sampled") if n in configs]) if c]
    manifests = run_chains([[(regenerate_corpus, (configs[n],), {"log": print}) for n in chain] for chain in chains], lanes=sizes.lanes)
    lines = {}
    for chain, results in zip(chains, manifests, strict=True):
        for name, manifest in zip(chain, results, strict=True):
            lines[name] = summary_line(manifest)
            log(f"regenerate {name}: {lines[name]}")
    return lines


def build_caches(paths: Paths, sizes: PaperSizes, *, log) -> None:
    """One build recipe for every corpus: SmolLM2's mask token, the same anchors and one tap. Two
    lanes: the off-policy cache (it alone has rollouts) beside the other three. Each build driver
    runs in its lane's process (one machine; no Ray start per cache); a rerun keeps the shards that
    verify (docs/design.md, "A cache build")."""
    configs = {}
    for name in needed_corpora(sizes):
        configs[name] = CacheBuildConfig.from_flags(
            target=str(paths.target), corpus=str(head_corpus(paths, sizes) if name == "head" else paths.corpus(name)),
            out=str(paths.cache(name)), mask_token=real.MASK_TOKEN, draft_layers=1, anchors=sizes.anchors,
            min_supervised_tokens=sizes.min_supervised_tokens, cpus_per_worker=1, target_dtype=TARGET_DTYPE,
            rollouts=name == "offpolicy",  # the head trains dflash, the references kd: corpus arrays only
            gpus_per_worker=1 if sizes.device.startswith("cuda") else 0, batch_tokens=sizes.batch_tokens,
        )  # fmt: skip
        log(f"cache {name}: {configs[name].out}")
    chains = [c for c in (["offpolicy"], [n for n in ("head", "truncate", "window") if n in configs]) if c]
    build = functools.partial(build_cache, run_shards=run_shards_here, progress=False, log=print)
    run_chains([[(build, (configs[n],), {}) for n in chain] for chain in chains], lanes=sizes.lanes)


def corpus_greedy_agreement(cache: Path) -> float:
    """Share of supervised corpus tokens equal to the target's greedy choice at the position before
    them (corpus_topk_ids[:, 0] is the target's argmax): 1.0 would be an on-policy greedy corpus."""
    reader = open_cache(cache)
    equal = total = 0
    for index in range(len(reader)):
        record = reader.read(index, decode_features=False, arrays={"input_ids", "loss_mask", "corpus_topk_ids"})
        ids, mask, top1 = record["input_ids"], record["loss_mask"].astype(bool), record["corpus_topk_ids"][:, 0]
        scored = mask[1:]
        equal += int(np.sum((top1[:-1] == ids[1:]) & scored))
        total += int(scored.sum())
    reader.close()
    return equal / total if total else float("nan")


def arm_config(arm: Arm, *, paths: Paths, sizes: PaperSizes, seed: int, head: Path | None) -> TrainConfig:
    """The one recipe: only the method, its rollout depth and (for the one-epoch arms) epochs differ."""
    return TrainConfig.from_flags(
        cache=str(paths.cache(arm.cache)), out=str(paths.out / "runs" / f"{arm.name}-s{seed}"), method=arm.method, arch=arm.arch,
        rollout_depth=arm.rollout_depth, epochs=arm.epochs or sizes.epochs, lr=sizes.lr,
        batch_size=(sizes.head_batch_size or sizes.batch_size) if arm.name == "head" else sizes.batch_size,
        anchors_per_step=sizes.anchors_per_step, gamma=2.0, dflash_gamma=2.0, seed=seed, max_steps=sizes.max_steps,
        drafter_init=None if head is None else str(head), draft_layers=None if head is not None else 1,
        num_workers=sizes.num_workers, resume=True, save_dtype="float32", progress=False,
    )  # fmt: skip


@contextlib.contextmanager
def torch_threads(count: int):
    """torch on `count` threads inside the block: a phase that runs alone takes every lane's core."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_head(paths: Paths, sizes: PaperSizes, *, log) -> Path:
    """The initial head every arm starts from: dflash on greedy target answers to prompts disjoint
    from the corpus and the evaluation, as the paper's arms start from the released DFlash head."""
    head = Arm(name="head", method="dflash", cache="head", epochs=sizes.head_epochs)
    config = arm_config(head, paths=paths, sizes=sizes, seed=sizes.seed, head=None)
    with torch_threads(sizes.lanes):
        train_method(config, log=log)
    return Path(config.out) / "drafter"


def _in_lane(fn, *args, **kwargs):
    """Run `fn` in a lane process: one torch thread, as the main process."""
    import torch

    torch.set_num_threads(1)
    return fn(*args, **kwargs)


def run_lanes(jobs: list[tuple], *, lanes: int) -> list:
    """`fn(*args, **kwargs)` of each (fn, args, kwargs) job, `lanes` at a time in fresh processes
    (spawned: no torch or Ray state is forked); in this process when lanes is 1. Results in job order."""
    if lanes <= 1:
        return [fn(*args, **kwargs) for fn, args, kwargs in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=lanes, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_in_lane, fn, *args, **kwargs) for fn, args, kwargs in jobs]
        return [f.result() for f in futures]


def _in_order(jobs: list[tuple]) -> list:
    return [fn(*args, **kwargs) for fn, args, kwargs in jobs]


def run_chains(chains: list[list[tuple]], *, lanes: int) -> list[list]:
    """Each chain's jobs in order, the chains `lanes` at a time (run_lanes); results per chain."""
    return run_lanes([(_in_order, (chain,), {}) for chain in chains], lanes=lanes)


def train_arms(runs: list[tuple[Arm, int]], *, paths: Paths, sizes: PaperSizes, head: Path, log) -> dict:
    """Every (arm, seed) run, `sizes.lanes` side by side; the training seconds of each."""
    jobs = [(train_method, (arm_config(arm, paths=paths, sizes=sizes, seed=seed, head=head),), {"log": print}) for arm, seed in runs]
    log(f"arms: {len(jobs)} trainings, {sizes.lanes} at a time")
    summaries = run_lanes(jobs, lanes=sizes.lanes)
    return {(arm.name, seed): summary["elapsed_s"] for (arm, seed), summary in zip(runs, summaries, strict=True)}


def drafter_of(paths: Paths, name: str, seed: int) -> Path:
    return paths.out / "runs" / f"{name}-s{seed}" / "drafter"


def replay_all(runs: list[tuple[Arm, int]], *, paths: Paths, sizes: PaperSizes, head: Path, prompts: str, out: str,
               max_new_tokens: int, log) -> dict:  # fmt: skip
    """Greedy replay (pipeline/eval/replay.py) of the head and every run on `prompts`: the exact T = 0
    rounds of each drafter at the price of one target decode per prompt. Summaries by run name."""
    drafters = {f"{arm.name}-s{seed}": str(drafter_of(paths, arm.name, seed)) for arm, seed in runs}
    drafters = {f"head-s{sizes.seed}": str(head)} | drafters
    with torch_threads(sizes.lanes):
        summaries = run_replay(target=str(paths.target), drafters=drafters, prompts=prompts, out=out, max_new_tokens=max_new_tokens,
                               log=log, device=sizes.device)  # fmt: skip
    for name, summary in summaries.items():
        log(f"replay {name}: MAT {summary['tau_geomean']:.3f}")
    return summaries


def decode_config(name: str, *, paths: Paths, sizes: PaperSizes, temperature: float, seed: int = 0) -> EvalConfig:
    """Real speculative decoding (`alrira-eval run`) of one (arm, drafter seed) on the decode prompts;
    the sampling seed is the experiment's, so every drafter meets the same draws."""
    return EvalConfig(
        target=str(paths.target), drafter=str(drafter_of(paths, name, seed)), prompts=str(paths.files["decode"]),
        out=str(paths.out / "evals" / "decode" / f"{name}-s{seed}-T{temperature:g}"), temperature=temperature,
        max_new_tokens=sizes.decode_max_new_tokens, seed=sizes.seed, progress=False, device=sizes.device, dtype="float32",
    )  # fmt: skip


def decode_keys(sizes: PaperSizes) -> list[tuple[str, int, float]]:
    """(arm, drafter seed, temperature) of every real decoding: T = 0 for seed 0 only (greedy replay
    gives every seed's T = 0 MAT exactly; this is its check and the speedups), T > 0 for every seed
    (replay cannot sample)."""
    return [(name, seed, t) for name in sizes.decode_arms for t in sizes.temperatures
            for seed in (sizes.seeds if t > 0 else sizes.seeds[:1])]  # fmt: skip


def decode_arms(paths: Paths, sizes: PaperSizes, *, log) -> dict:
    """`alrira-eval run` of every decode_keys entry, `sizes.lanes` side by side; a finished
    evaluation is kept only when its recorded inputs equal these (run_eval, pipeline/outputs.py:
    else refused naming what differs). Summaries by (arm, seed, temperature)."""
    configs = {k: decode_config(k[0], paths=paths, sizes=sizes, seed=k[1], temperature=k[2]) for k in decode_keys(sizes)}
    todo = [c for c in configs.values() if not (Path(c.out) / "summary.json").is_file()]
    log(f"decode: {len(configs)} real speculative decodings ({len(todo)} to run), {sizes.lanes} at a time")
    finished = [c for c in configs.values() if c not in todo]
    run_lanes([(run_eval, (c,), {}) for c in finished + todo], lanes=sizes.lanes)
    summaries = {}
    for (name, seed, t), config in configs.items():
        summary = json.loads((Path(config.out) / "summary.json").read_text())
        log(f"decode {name}-s{seed} T={t:g}: tau {summary['tau_geomean']:.3f}, speedup {summary['speedup_geomean']:.2f}x, "
            f"lossless mismatches {summary['lossless_mismatches']}")  # fmt: skip
        summaries[(name, seed, t)] = summary
    return summaries


def replay_check(paths: Paths, sizes: PaperSizes, *, decoded: dict, log) -> dict:
    """Greedy replay against real decoding on the same prompts and token budget: per (arm, prompt),
    are the rounds and accepted drafts equal? Both from results.csv."""
    replayed = run_replay(
        target=str(paths.target), drafters={f"{n}-s0": str(drafter_of(paths, n, 0)) for n in sizes.decode_arms},
        prompts=str(paths.files["decode"]), out=str(paths.out / "evals" / "replay-check-T0"), max_new_tokens=sizes.decode_max_new_tokens,
        device=sizes.device,
    )  # fmt: skip
    equal = total = 0
    for name in sizes.decode_arms:
        real_rows = _read_rows(Path(decode_config(name, paths=paths, sizes=sizes, temperature=0.0).out) / "results.csv")
        replay_rows = _read_rows(paths.out / "evals" / "replay-check-T0" / f"{name}-s0" / "results.csv")
        for a, b in zip(real_rows, replay_rows, strict=True):
            total += 1
            equal += (a["rounds"], a["accepted_tokens"]) == (b["rounds"], b["accepted_tokens"])
    check = {
        "prompts": total, "equal": equal,
        "replay_tau": {n: replayed[f"{n}-s0"]["tau_geomean"] for n in sizes.decode_arms},
        "decoded_tau": {n: decoded[(n, 0, 0.0)]["tau_geomean"] for n in sizes.decode_arms if (n, 0, 0.0) in decoded},
    }  # fmt: skip
    log(f"replay check: {equal}/{total} (arm, prompt) pairs with the same rounds and accepted drafts as real decoding")
    return check


def _arm_runs(sizes: PaperSizes) -> list[tuple[Arm, int]]:
    arms = [a for a in ARMS if a.name in sizes.arms]
    return [(a, s) for a in arms for s in (sizes.seeds if a.name in MAIN_ARMS else sizes.seeds[:1])]


def run_paper(*, out: Path, profile: str = "full", cache_dir: Path = real.DEFAULT_CACHE_DIR, sizes: PaperSizes | None = None,
              log=print) -> dict:  # fmt: skip
    started = time.time()
    sizes = sizes or PaperSizes.make(profile)
    check_device(sizes)
    paths_taken = code_paths(sizes)
    log("code paths: " + "; ".join(f"{k} {v}" for k, v in paths_taken.items()))
    out.mkdir(parents=True, exist_ok=True)
    phase_s: dict[str, float] = {}

    def timed(name: str, fn):
        t = time.time()
        result = fn()
        phase_s[name] = time.time() - t
        log(f"phase {name}: {phase_s[name]:.0f}s")
        return result

    paths = timed("prepare", lambda: prepare(out, sizes, cache_dir=cache_dir, log=log))
    regenerated = timed("regenerate", lambda: regenerate(paths, sizes, log=log))
    timed("caches", lambda: build_caches(paths, sizes, log=log))
    agreement = corpus_greedy_agreement(paths.cache("offpolicy"))
    log(f"off-policy corpus: greedy agreement {agreement:.3f} (must be <= 0.6)")
    head = timed("head", lambda: train_head(paths, sizes, log=log))
    runs = _arm_runs(sizes)
    trained = timed("arms", lambda: train_arms(runs, paths=paths, sizes=sizes, head=head, log=log))
    replayed = timed("replay", lambda: replay_all(
        runs, paths=paths, sizes=sizes, head=head, prompts=str(paths.files["eval"]), out=str(out / "evals" / "replay-T0"),
        max_new_tokens=sizes.eval_max_new_tokens, log=log,
    ))  # fmt: skip
    decoded = timed("decode", lambda: decode_arms(paths, sizes, log=log))
    check = timed("replay_check", lambda: replay_check(paths, sizes, decoded=decoded, log=log))
    analyses = timed("analyses", lambda: run_analyses(paths, sizes, runs=runs, head=head))
    report = {
        "profile": profile, "quick": profile == "quick", "sizes": asdict(sizes), "target": str(paths.target), "out": str(out),
        "head_prompts": len(paths.files["head_source"].read_text().splitlines()), "code_paths": paths_taken,
        "corpus_greedy_agreement": agreement, "regenerated": regenerated,
        "train_s": {f"{a}-s{s}": v for (a, s), v in trained.items()},
        "evals": {f"{name}-T0": {"dir": str(out / "evals" / "replay-T0" / name), "tau": e["tau_geomean"], "speedup": None,
                                  "mode": "greedy_replay", "lossless_mismatches": 0}
                  for name, e in replayed.items()},
        "decoded": {f"{n}-s{s}-T{t:g}": {"dir": str(Path(decode_config(n, paths=paths, sizes=sizes, seed=s, temperature=t).out)),
                                          "tau": e["tau_geomean"], "speedup": e["speedup_geomean"],
                                          "lossless_mismatches": e["lossless_mismatches"]}
                    for (n, s, t), e in decoded.items()},
        "replay_check": check, "analyses": analyses, "phase_s": phase_s, "wall_s": time.time() - started,
    }  # fmt: skip
    (out / "paper.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def run_analyses(paths: Paths, sizes: PaperSizes, *, runs: list[tuple[Arm, int]], head: Path) -> dict:
    """At T = 0 (greedy replay, every run): compare, the offset profile (alr_ira over alr), the
    training cost (relative to erase); at T = 1 (real decoding, every seed): compare; hard offsets
    (alr_ira over alr grouped by kd, seed control alr seed 1). CSV + PNG each."""
    root = paths.out / "analyses"
    results = {}
    summaries = [str(paths.out / "evals" / "replay-T0" / f"{a.name}-s{s}") for a, s in runs]
    labels = [a.name for a, _ in runs]
    results["compare_T0"] = run_compare(summaries, out=str(root / "compare-T0"), baseline="dflash", labels=labels)
    baseline = "alr" if "alr" in labels else None
    results["offsets_T0"] = run_offset_profile(summaries, out=str(root / "offsets-T0"), baseline=baseline, labels=labels)
    reference = next((n for n in ("erase", "dflash") if n in labels), labels[0])
    results["cost_T0"] = run_training_cost(summaries, out=str(root / "cost-T0"), reference=reference, labels=labels)
    for t in sizes.temperatures:
        keys = [k for k in decode_keys(sizes) if k[2] == t]
        decoded = [str(Path(decode_config(n, paths=paths, sizes=sizes, seed=s, temperature=t).out)) for n, s, _ in keys]
        results[f"compare_decode_T{t:g}"] = run_compare(decoded, out=str(root / f"compare-decode-T{t:g}"),
                                                        baseline=sizes.decode_arms[0], labels=[n for n, _, _ in keys])  # fmt: skip
    drafter = lambda name, seed=0: str(drafter_of(paths, name, seed))  # noqa: E731
    names = {a.name for a, _ in runs}
    independent = "kd" if "kd" in names else "erase"
    control = drafter("alr", 1) if 1 in sizes.seeds else None
    results["hard"] = run_hard_offsets(
        target=str(paths.target), prompts=str(paths.files["hard"]), drafter=drafter("alr_ira"), baseline=drafter("alr"),
        independent=drafter(independent) if independent in names else str(head), control=control, out=str(root / "hard"),
        max_new_tokens=sizes.eval_max_new_tokens, max_prompts=None,
    )  # fmt: skip
    return results


@click.command(help="The paper's experiments on SmolLM2-135M-Instruct from the package index (python -m pipeline.demo --real).")
@click.option("--out", default="real_out", show_default=True, type=click.Path(file_okay=False), help="Output directory (resumable).")
@click.option("--quick", is_flag=True, help="A few rows, a few steps, two prompts: the CI smoke run (--profile quick).")
@click.option("--profile", type=click.Choice(list(PROFILES)), default="full", show_default=True,
              help="full (CPU, ~2 h), quick, gpu (one H200, ~8 min), gpu-smoke (the gpu profile's code at toy sizes on CPU), "
                   "families (DFlash, DSpark, DFlash2 at the full run's setup, seed 0, ~45 min).")
@click.option("--cache-dir", default=str(real.DEFAULT_CACHE_DIR), show_default=True, help="Where the converted target is kept.")
def main(out: str, quick: bool, profile: str, cache_dir: str):
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)  # the real model: one thread (two are slower on a shared machine)
    hf_logging.disable_progress_bar()
    report = run_paper(out=Path(out), profile="quick" if quick else profile, cache_dir=Path(cache_dir))
    print(f"results: {report['out']}/paper.json ({report['wall_s']:.0f}s); docs/results.md: benchmarks/speed/paper.py")
