"""`alrira-train`'s settings: one typed config per component, nested; the CLI flattens them
(pipeline/config.py), so every flag's help is written once, here or beside its component."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass

from drafter.families import DEFAULT_FAMILY, families, get_family
from pipeline.config import from_flags, group, opt, to_flags
from pipeline.train.labels import ObjectiveConfig

PRECISIONS = ("auto", "bf16", "fp32")
ATTENTIONS = ("auto", "flex", "sdpa")
SAVE_DTYPES = ("bfloat16", "float32")
LOADERS = ("map", "stream")
LOCAL_CACHE_DIR = "alrira-local-cache"  # under $TMPDIR unless --local-cache-dir


@dataclass(kw_only=True)
class DrafterInit:
    """Which drafter family to train and where its weights start (docs/design.md, "Drafter families")."""

    arch: str = opt(
        f"The drafter family: {', '.join(f'{f.name} ({f.architecture})' for f in families())}. Its own settings are "
        "the flags whose help names it (docs/design.md, \"Drafter families\").",
        default=DEFAULT_FAMILY,
    )
    drafter_init: str | None = opt(
        "Initialise from this checkpoint directory: one of the --arch family (public release or ours), or one whose "
        "backbone starts it with fresh heads (the family's `init_from`: docs/design.md, \"Drafter families\").",
        default=None,
    )
    draft_layers: int | None = opt("Fresh drafter with this many layers (default: one per tapped target layer).", default=None)
    activation_checkpointing: bool = opt(
        "Recompute each drafter layer in backward instead of storing its activations (less memory, ~1 more forward).",
        default=False,
    )

    def __post_init__(self):
        get_family(self.arch)  # a ValueError naming the families for an unknown one
        if self.drafter_init is not None and self.draft_layers is not None:
            raise ValueError("give at most one of --drafter-init and --draft-layers")


def family_options_class() -> type:
    """One group of every registered family's own settings (`DrafterFamily.options_class`), a field
    per family named after it: each becomes flags of `alrira-train` (pipeline/config.py)."""
    fields = [(f.name, f.options_class, group(f.options_class)) for f in families() if f.options_class is not None]
    options = dataclasses.make_dataclass("FamilyOptions", fields, kw_only=True)
    options.__module__ = __name__  # found here by pickle: a config goes to a process pool (the paper's lanes)
    return options


FamilyOptions = family_options_class()


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW, the schedule (a function of the step), batching, precision and the attention kernel."""

    epochs: int = opt("Passes over the cache.", default=3)
    batch_size: int = opt("Global batch in sequences per optimizer step (all ranks, all micro-batches).", default=24)
    grad_accum: int = opt("Micro-batches per step on each rank.", default=1)
    lr: float = opt("Peak learning rate (AdamW, weight decay 0).", default=1.47e-3)
    warmup_frac: float = opt("Fraction of steps of linear warm-up before the cosine decay to 0.", default=0.04)
    grad_clip: float = opt("Gradient-norm clip.", default=1.0)
    precision: str = opt(
        "auto (bf16 autocast on GPU and on CPUs with bf16 matrix units, AMX or AVX512-BF16; else fp32), bf16 or fp32. "
        "Master weights stay fp32; under bf16 the frozen "
        "embed_tokens / lm_head are held in bf16 and the loss's lm_head GEMM runs in bf16, log-softmax and loss in fp32.",
        default="auto",
    )
    loss_chunk: int = opt("Supervised slots per lm_head chunk (bounds the [chunk, vocab] logits).", default=4096)
    attention: str = opt(
        "auto (flex on CUDA, sdpa on CPU), flex (compiled flex attention with a block-sparse mask; CUDA only, "
        "PyTorch has no flex backward on CPU) or sdpa (dense mask, [B, Q, C + Q] per step).",
        default="auto",
    )

    def __post_init__(self):
        for name in ("epochs", "batch_size", "grad_accum", "loss_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.warmup_frac < 1 or self.grad_clip <= 0:
            raise ValueError("--lr and --grad-clip must be > 0 and --warmup-frac in [0, 1)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"--attention must be auto, flex or sdpa, got {self.attention!r}")


def default_num_workers() -> int:
    """DataLoader workers per rank that this node's CPUs allow: the cores this process may use,
    split over the node's ranks (torchrun's LOCAL_WORLD_SIZE), less one for the rank's own loop
    (docs/design.md, "A training step")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(0, cores // ranks - 1)


@dataclass(kw_only=True)
class LoaderConfig:
    """DataLoader workers that read the cache and build labels (docs/design.md, "A training step")."""

    kind: str = opt(
        "map: random access to any cache, each epoch a seeded permutation of all sequences. stream: a wds cache "
        "read front to back through webdataset's pipeline (shards split over ranks and workers, then a shuffle "
        "buffer); its order also depends on --num-workers, which a resume must keep.",
        flag="loader",
        default="map",
    )
    num_workers: int | None = opt(
        "DataLoader worker processes reading the cache (default: the cores this process may run on, "
        "os.sched_getaffinity, split over the node's ranks, LOCAL_WORLD_SIZE, less one for the rank itself).",
        default=None,
    )
    prefetch: int = opt("Batches each worker prepares ahead.", default=2)
    shuffle_buffer: int = opt(
        "--loader stream: samples each worker holds to shuffle, compressed, with only the arrays the method reads "
        "(real shapes: tens of MB each).",
        default=32,
    )
    local_cache_gib: float = opt(
        "--loader stream from an object store: local disk (GiB per node) for tars downloaded ahead of the step, "
        "split evenly over the node's ranks and DataLoader workers; each copy is deleted once read. "
        "0 reads each tar straight from the store.",
        default=8.0,
    )
    local_cache_dir: str | None = opt("Where those copies go (default: $TMPDIR/alrira-local-cache).", default=None)
    prefetch_shards: int = opt("--loader stream from a store: tars each worker downloads ahead of the one it reads.", default=1)

    def __post_init__(self):
        if self.kind not in LOADERS:
            raise ValueError(f"--loader must be map or stream, got {self.kind!r}")
        if self.num_workers is None:
            self.num_workers = default_num_workers()
        if self.num_workers < 0:
            raise ValueError("--num-workers must be >= 0")
        if self.shuffle_buffer < 1:
            raise ValueError(f"--shuffle-buffer must be >= 1, got {self.shuffle_buffer}")
        if not self.local_cache_gib >= 0:
            raise ValueError(f"--local-cache-gib must be >= 0, got {self.local_cache_gib}")
        if self.prefetch_shards < 1:
            raise ValueError(f"--prefetch-shards must be >= 1, got {self.prefetch_shards}")

    @property
    def local_cache_root(self) -> str:
        return self.local_cache_dir or os.path.join(tempfile.gettempdir(), LOCAL_CACHE_DIR)


@dataclass(kw_only=True)
class CheckpointConfig:
    save_every: int = opt("Checkpoint every N steps (0: only at the end of each epoch).", default=0)
    resume: bool = opt("Continue from the latest checkpoint in --out.", default=False)
    overwrite: bool = opt("Replace an earlier training run in --out (without it or --resume: refused).", default=False)
    save_dtype: str = opt("dtype of the exported drafter weights: bfloat16 or float32.", default="bfloat16")

    def __post_init__(self):
        if self.save_every < 0:
            raise ValueError("--save-every must be >= 0")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out, --overwrite replaces it: give one of them")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"--save-dtype must be bfloat16 or float32, got {self.save_dtype!r}")


@dataclass(kw_only=True)
class TrainConfig:
    """`alrira-train`: train a drafter of any registered family from a cache."""

    cache: str = opt(
        "Stage-1 cache: a directory or an object-store URL (s3://bucket/prefix; credentials from the environment)."
    )
    out: str = opt(
        "Run directory (checkpoints, metrics.jsonl, the final drafter/): a local path or an object-store URL "
        "(each file one object; checkpoints committed by checkpoints/latest)."
    )
    objective: ObjectiveConfig = group(ObjectiveConfig)
    drafter: DrafterInit = group(DrafterInit)
    families: FamilyOptions = group(FamilyOptions)
    optim: OptimConfig = group(OptimConfig)
    loader: LoaderConfig = group(LoaderConfig)
    checkpoint: CheckpointConfig = group(CheckpointConfig)
    seed: int = opt("Seed of anchors, IRA splits and offsets, data order and fresh init.", default=0)
    max_steps: int | None = opt("Stop after this many steps (smoke tests, benchmarks).", default=None)
    allow_partial: bool = opt(
        "Train on a cache whose build did not finish (only its complete shards; says how many).", default=False
    )
    progress: bool = opt("Show a progress bar.", default=True)
    log_every: int = opt(
        "Read the metrics from the device and log them (metrics.jsonl, tensorboard, the bar) every N steps and at "
        "the last; each read waits for the device, the steps between never do.",
        default=10,
    )
    eval_every: int = opt(
        "Exact greedy tau of the drafter on the cache's evaluation split (alrira-cache build --eval-prompts), no target "
        "loaded, every N steps and at the end, logged with that step's metrics (equal to alrira-eval replay on the same "
        "prompts); 0: only at the end, when the cache has a split.",
        default=0,
    )

    def __post_init__(self):
        for family in families():
            # Another family's options that size its drafter (default None: resolved from the cache) name
            # a shape this run cannot have; its loss weights are recorded and never read (unused on resume).
            options = self.family_options(family)
            if family.name == self.drafter.arch or options is None:
                continue
            given = [flag for flag, value in to_flags(options).items() if family.option_flags()[flag] is None and value is not None]
            if given:
                flags = " and ".join("--" + flag.replace("_", "-") for flag in given)
                raise ValueError(f"{flags}: settings of --arch {family.name}, not of --arch {self.drafter.arch}")
        if self.log_every < 1:
            raise ValueError(f"--log-every must be >= 1, got {self.log_every}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0, got {self.eval_every}")

    def resolved_settings(self, *, objective: ObjectiveConfig, family, options) -> dict:
        """The flat flags with what the cache gave (`objective` bound to it: the depth, K - 1 by
        default; --dflash-gamma's default from the target kind; the family's `options`, their defaults
        from the cache or its init): what train_config.json and checkpoints record and compare."""
        resolved_objective = dataclasses.replace(self.objective, rollout_depth=objective.rollout_depth, dflash_gamma=objective.dflash_gamma)
        families = self.families if options is None else dataclasses.replace(self.families, **{family.name: options})
        return to_flags(dataclasses.replace(self, objective=resolved_objective, families=families))

    def family_options(self, family=None):
        """The settings of `family` (default: the --arch one), or None when it has none."""
        return getattr(self.families, self.drafter.arch if family is None else family.name, None)

    from_flags = classmethod(from_flags)
