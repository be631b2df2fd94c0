"""Plan, then run: everything a training run resolves before it builds anything, once, into one
frozen `TrainPlan` (docs/design.md, "A training step"). `plan_training` opens the cache and reads
what it fixes (K, the mask token, the taps, the target's hash, its evaluation split), looks the
drafter family up and resolves its options and shape for the cache (a `--drafter-init` read and
checked from its config.json), binds the objective, resolves `auto` (precision, attention kernel),
the data order (the epochs' steps, a stream's plan) and the resume decision (the checkpoint a
`--resume` continues, checked against this run). Every refusal happens here, but those of the
weights `setup` (pipeline/train/setup.py) loads (a damaged --drafter-init, a target head written
for another target), and all before --out is claimed (pipeline/train/run_dir.py); each check runs
once and each location is resolved from its flag once.
"""

from __future__ import annotations

import bisect
import itertools
import os
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist

from drafter.checkpoint import check_compatible, read_drafter_config
from drafter.config import DFlashConfig
from drafter.families import check_init, get_family
from drafter.family import BlockLayout, DrafterFamily
from pipeline.outputs import is_bookkeeping
from pipeline.precision import auto_bf16
from pipeline.train.batching import steps_per_epoch
from pipeline.train.checkpoints import (
    NoReadableCheckpoint,
    check_data_position,
    check_resume_settings,
    load_latest_checkpoint,
    restart_settings_check,
)
from pipeline.train.config import TrainConfig
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.methods import check_cache_serves, check_ira_parents_serve
from pipeline.train.streaming import StreamPlan, data_position, plan_stream, stream_epoch_steps
from storage.eval_split import (
    EvalSplit,
    SplitFit,
    check_same_split,
    logged_split_identities,
    read_eval_split,
    read_eval_split_record,
    split_identity,
)
from storage.location import Location, resolve
from storage.manifest import Manifest
from storage.reader import CacheReader, available_arrays, open_cache


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """This process's place in the run: its rank, the number of ranks, its device."""

    rank: int
    world_size: int
    device: torch.device

    def log(self, line: str) -> None:
        """Rank 0 says it; the other ranks stay quiet."""
        if self.rank == 0:
            print(line)


@dataclass(frozen=True, kw_only=True)
class DrafterPlan:
    """The drafter the run trains: its family, the family's options resolved for the cache, its block
    on the cache's labels, its config, and where its weights start (drafter/family.py)."""

    family: DrafterFamily
    options: object  # the family's options (None: it has none)
    layout: BlockLayout
    config: DFlashConfig  # the family's config class
    init: str | None  # --drafter-init: all its weights (its family's), or its backbone's (a family in `init_from`)
    init_family: DrafterFamily | None
    seed: int  # fresh weights: the run's seed
    activation_checkpointing: bool

    @cached_property
    def hf_config(self) -> dict:
        """The drafter's config.json form (its checkpoints record it)."""
        return self.config.to_hf_dict()


@dataclass(frozen=True, kw_only=True)
class TrainPlan:
    """Everything a run resolved before it starts (`plan_training`)."""

    config: TrainConfig  # the flags as given (a local --cache resolved to its absolute path)
    ranks: Ranks
    run: Location  # --out
    cache: Location  # --cache
    reader: CacheReader  # the cache's complete shards
    drafter: DrafterPlan
    objective: ObjectiveConfig  # bound to the cache: K, mask token, stop ids, the family's layout
    settings: dict  # the run's flat settings, defaults resolved: train_config.json, checkpoints, provenance
    compute_dtype: torch.dtype  # bf16 (autocast) or float32, `--precision` resolved on this machine
    attention: str  # "flex" or "sdpa"
    stream: StreamPlan | None  # --loader stream: which shards every rank and worker reads
    epoch_ends: tuple[int, ...]  # global step count at the end of each epoch (stream epochs can differ)
    last_step: int  # the run stops after this step count (--max-steps)
    resume: dict | None  # the checkpoint --resume continues (its state), None: the run starts at step 0
    eval_split: EvalSplit | None  # rank 0's: the cache's evaluation split (--eval-every), if it has one

    @property
    def manifest(self) -> Manifest:
        return self.reader.manifest

    @property
    def start_step(self) -> int:
        return self.resume["step"] if self.resume else 0

    @property
    def total_steps(self) -> int:
        return self.epoch_ends[-1]

    @property
    def epoch_steps(self) -> list[int]:
        return [end - start for start, end in zip((0, *self.epoch_ends), self.epoch_ends)]

    @property
    def num_slots(self) -> int:
        """Labelled slots per block: the family's layout."""
        return self.drafter.layout.num_labelled

    @property
    def block_size(self) -> int:
        return self.drafter.layout.block_size

    def epoch_of(self, step: int) -> int:
        return bisect.bisect_right(self.epoch_ends, step)

    def data_position(self, step: int) -> dict:
        """Where the data stands after `step` steps (stored in checkpoints, checked on resume)."""
        return data_position(step, epoch_ends=list(self.epoch_ends), plan=self.stream)

    @cached_property
    def inputs(self) -> dict:
        """What the run's drafter depends on besides its flags (checked on --resume): the cache by
        place and by what it was built from."""
        settings = self.manifest.settings
        return {"cache": self.config.cache, "target_hash": settings.target_hash, "corpus_hash": settings.corpus_hash,
                "cache_seed": settings.seed}  # fmt: skip


def distributed_ranks() -> Ranks:
    """This process's rank, world size and device; initialises the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return Ranks(rank=dist.get_rank() if world_size > 1 else 0, world_size=world_size, device=device)


@dataclass(frozen=True, kw_only=True)
class RunPlaces:
    """Where a run reads and writes, resolved once: --out, --cache and the cache's reader."""

    run: Location
    cache: Location
    reader: CacheReader


def open_run(config: TrainConfig) -> RunPlaces:
    """--cache opened (its manifest read and checked) and --out checked to be a run directory that is
    not the cache (`check_run_dir`), each location resolved from its flag once; what a run checks
    before it takes --out's lock (never a lock file in a cache or a stranger's folder)."""
    run, cache = resolve(config.out), resolve(config.cache)
    reader = open_cache(cache)
    check_run_dir(run, cache=cache)
    return RunPlaces(run=run, cache=cache, reader=reader)


def plan_training(config: TrainConfig, places: RunPlaces, *, ranks: Ranks | None = None) -> TrainPlan:
    """Resolve `config` for this cache and machine (module docstring); every refusal is one line.
    `places`: `open_run(config)`, which the caller runs first (before it takes --out's lock)."""
    ranks = ranks or distributed_ranks()
    run, cache, reader = places.run, places.cache, places.reader
    manifest, optim = reader.manifest, config.optim
    check_cache_complete(manifest, cache=cache, allow_partial=config.allow_partial, log=ranks.log)
    drafter = plan_drafter(config, manifest)
    for line in drafter.family.notes(drafter.config):  # an engine that serves this drafter only in part
        ranks.log(line)
    check_cache_serves(config.objective.method, available_arrays(reader), config.cache, arch=drafter.family.name,
                       distributions=drafter.layout.distributions)  # fmt: skip
    check_ira_parents_serve(config.objective, ira_parents=reader.ira_parents, anchors_per_sequence=manifest.settings.anchors_per_sequence)
    check_batch(optim.batch_size, grad_accum=optim.grad_accum, world_size=ranks.world_size, num_sequences=len(reader))
    settings = manifest.settings
    objective = config.objective.for_cache(
        num_slots=settings.num_slots, mask_token_id=manifest.mask_token_id, stop_token_ids=manifest.stop_token_ids,
        vision=settings.vision is not None, layout=drafter.layout,
    )  # fmt: skip
    compute_dtype = resolve_precision(optim.precision, device=ranks.device)
    run_settings = config.resolved_settings(objective=objective, family=drafter.family, options=drafter.options) | {
        "compute_dtype": str(compute_dtype).removeprefix("torch."), "device_kind": ranks.device.type,  # `auto` is part of the run
    }  # fmt: skip
    stream = plan_stream(config, reader, rank=ranks.rank, world_size=ranks.world_size) if config.loader.kind == "stream" else None
    epoch_steps = stream_epoch_steps(stream, optim.epochs) if stream else [steps_per_epoch(len(reader), batch_size=optim.batch_size)] * optim.epochs
    epoch_ends = tuple(itertools.accumulate(epoch_steps))
    last_step = min(epoch_ends[-1], config.max_steps) if config.max_steps else epoch_ends[-1]
    plan = TrainPlan(
        config=config, ranks=ranks, run=run, cache=cache, reader=reader, drafter=drafter, objective=objective, settings=run_settings,
        compute_dtype=compute_dtype, attention=resolve_attention(optim.attention, device=ranks.device), stream=stream,
        epoch_ends=epoch_ends, last_step=last_step, resume=None, eval_split=None,
    )  # fmt: skip
    split, identity = load_eval_split(plan)
    # The split a run's evaluation points measure is part of the run (train_config.json, provenance).
    return replace(plan, settings=run_settings | {"eval_split": identity}, resume=resume_state(plan), eval_split=split)


def plan_drafter(config: TrainConfig, manifest: Manifest) -> DrafterPlan:
    """The --arch family with its options resolved for the cache, its layout, and the drafter's
    config: a --drafter-init's (read from its config.json, checked against the family and the
    cache), that init's backbone in the family's shape, or a fresh one on the target's shape."""
    options, settings, init = config.family_options(), manifest.settings, config.drafter.drafter_init
    family, init_family, init_config = get_family(config.drafter.arch), None, None
    if init is not None:
        init_family, init_config = read_drafter_config(init)
        check_init(init, family=family, init_family=init_family, init_config=init_config, mask_token_id=manifest.mask_token_id)
    if options is not None:
        options = family.resolve_options(options, num_slots=settings.num_slots, vocab_size=manifest.vocab_size,
                                         init=(init, init_config) if init_family is family else None)  # fmt: skip
    layout = family.layout(options, num_slots=settings.num_slots)
    if init is not None:
        drafter_config = replace(init_config, dtype="float32")  # its weights load in float32 (master weights)
        if init_family is not family:
            drafter_config = family.new_config(drafter_config, options)
    else:
        drafter_config = family.new_config(DFlashConfig.from_target_config(
            manifest.target_config, num_draft_layers=config.drafter.draft_layers or len(settings.layer_ids),
            mask_token_id=manifest.mask_token_id, target_layer_ids=settings.layer_ids, block_size=settings.num_slots + 1,
        ), options)  # fmt: skip
    check_compatible(drafter_config, target_layer_ids=settings.layer_ids, hidden_size=manifest.hidden_size,
                     vocab_size=manifest.vocab_size, block_size=layout.block_size)  # fmt: skip
    return DrafterPlan(family=family, options=options, layout=layout, config=drafter_config, init=init, init_family=init_family,
                       seed=config.seed, activation_checkpointing=config.drafter.activation_checkpointing)  # fmt: skip


def check_batch(batch_size: int, *, grad_accum: int, world_size: int, num_sequences: int) -> None:
    if batch_size % (world_size * grad_accum):
        raise ValueError(f"--batch-size {batch_size} must be a multiple of ranks x --grad-accum ({world_size * grad_accum})")
    if num_sequences < batch_size:
        raise ValueError(f"--batch-size {batch_size} is larger than the cache ({num_sequences} sequences)")


def resolve_precision(precision: str, *, device: torch.device) -> torch.dtype:
    """--precision on this machine: bf16, fp32, or `auto` (bf16 where the device has bf16 matrix units)."""
    use_bf16 = precision == "bf16" or (precision == "auto" and auto_bf16(device.type, stage="train"))
    return torch.bfloat16 if use_bf16 else torch.float32


def resolve_attention(attention: str, *, device: torch.device) -> str:
    """--attention on this device: `auto` is flex on CUDA and sdpa elsewhere; flex needs CUDA."""
    resolved = "flex" if attention == "flex" or (attention == "auto" and device.type == "cuda") else "sdpa"
    if resolved == "flex" and device.type != "cuda":
        raise ValueError(f"--attention flex needs a CUDA device (PyTorch has no flex-attention backward on {device.type}); use sdpa or auto")
    return resolved


def resume_state(plan: TrainPlan) -> dict | None:
    """The checkpoint --resume continues: the newest readable one, checked to continue this run
    (settings, data position, a --max-steps not below it); None without --resume or without one."""
    run, config = plan.run, plan.config
    if not config.checkpoint.resume:
        return None
    try:
        state = load_latest_checkpoint(run)
    except NoReadableCheckpoint as error:
        restart_settings_check(run, plan.settings, error)
        return None
    if state is None:
        return None
    check_resume_settings(state["config"], plan.settings, run=run)
    check_data_position(state, plan.data_position(state["step"]), run=run)
    if state["step"] > plan.last_step:  # the weights there are a later step's than this run would end at
        raise ValueError(
            f"{run}: --max-steps {config.max_steps} is below the latest checkpoint's step {state['step']}; its weights are "
            f"step {state['step']}'s: resume with --max-steps {state['step']} or more, or train step {config.max_steps} in a new --out"
        )
    return state


def load_eval_split(plan: TrainPlan) -> tuple[EvalSplit | None, dict | None]:
    """(rank 0's evaluation split of the cache, its identity) for --eval-every: the split checked in
    full before step 1 (its record, target and taps, counts against its tensors, token ids against
    the vocabulary, feature widths against the taps: storage/eval_split.py); None on the other ranks,
    and (None, None) without one (refused with --eval-every). A resume whose earlier evaluation points
    measured another split is refused on every rank: one tau curve never joins two splits."""
    config, run = plan.config, plan.run
    record = read_eval_split_record(plan.cache)
    if record is None:
        if config.eval_every:
            raise ValueError(f"--eval-every: {config.cache} has no evaluation split; build the cache with --eval-prompts FILE")
        return None, None
    identity = split_identity(record)
    if config.checkpoint.resume and run.is_file("metrics.jsonl"):
        check_same_split(logged_split_identities(run.read_bytes("metrics.jsonl")), identity, run=str(run))
    if plan.ranks.rank != 0:
        return None, identity
    return read_eval_split(plan.cache, SplitFit.of(plan.manifest)), identity


# ----------------------------------------------------------------------------------------------
# What a run checks before it writes anything: --out is a run directory (new, empty, or a run's) and
# not the cache, and the cache is whole unless --allow-partial (docs/failure-modes.md).

RUN_MARKERS = ("train_config.json", "checkpoints")  # what every run directory holds from its first step on


def _same_or_inside(inner: Location, outer: Location) -> bool:
    """Whether `inner` is `outer` or lies under it (local paths resolved, store URLs compared as prefixes)."""
    if inner.is_local != outer.is_local:
        return False
    if inner.is_local:
        a, b = Path(os.path.realpath(inner.local_path)), Path(os.path.realpath(outer.local_path))
        return a == b or b in a.parents
    a, b = str(inner).rstrip("/"), str(outer).rstrip("/")
    return a == b or a.startswith(b + "/")


def check_run_dir(run: Location, *, cache: Location) -> None:
    """Refuse an --out that is (or is inside) the cache, a file, or a non-empty directory that is
    not a training run: a run writes metrics.jsonl, train_config.json and drafter/ there, and
    would overwrite a user's files of those names."""
    if _same_or_inside(run, cache):
        raise ValueError(f"--out {run}: is the cache (--cache {cache}) or inside it; give the run its own directory")
    if run.is_local and run.exists() and not run.is_dir():
        raise ValueError(f"--out {run}: is a file, not a directory")
    names = [n for n in run.names() if not is_bookkeeping(n)]  # the lock and record: pipeline/outputs.py's
    if names and not any(marker in names for marker in RUN_MARKERS):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"--out {run}: not empty and not a training run (no {' or '.join(RUN_MARKERS)}; holds {shown}); "
            "use an empty or new directory"
        )


def check_cache_complete(manifest: Manifest, *, cache: Location, allow_partial: bool, log=print) -> None:
    """A cache whose build stopped early (some planned shards not complete) trains only with
    --allow-partial, which then says how much of it is used."""
    done, planned = len(manifest.complete_shards), manifest.num_shards_planned
    if done >= planned:
        return
    used = f"{done} of {planned} planned shards ({manifest.num_sequences} sequences)"
    if not allow_partial:
        raise ValueError(
            f"--cache {cache}: the build did not finish: {used} are complete; rerun the build to finish it, "
            "or pass --allow-partial to train on what is there"
        )
    log(f"--allow-partial: training on {used} of {cache}")
