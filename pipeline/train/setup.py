"""Everything a run works with, resolved once before the first step (`setup` -> `TrainState`):
ranks and device, the cache and what it fixes (K, the mask token, the family's block), the drafter
(fresh, from --drafter-init, or one family's on another's backbone), the optimizer, a resumed
checkpoint, precision and attention kernel, the run folder's claim, and the batches.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist

from drafter.checkpoint import check_compatible, load_drafter
from drafter.config import DFlashConfig
from drafter.families import family_of, get_family
from pipeline.config import to_flags
from pipeline.precision import auto_bf16
from pipeline.train.batching import steps_per_epoch
from pipeline.train.checkpoints import (
    NoReadableCheckpoint,
    check_data_position,
    check_resume_settings,
    claim_run,
    load_latest_checkpoint,
    restart_settings_check,
    run_inputs,
)
from pipeline.train.config import TrainConfig
from pipeline.train.data import data_position, make_batches, stream_epoch_steps
from pipeline.train.methods import check_cache_serves
from pipeline.train.preflight import check_cache_complete, check_run_dir
from pipeline.train.streaming import stream_plan
from storage.eval_split import EvalSplit, read_eval_split, read_eval_split_record
from storage.location import Location, resolve
from storage.manifest import load_target_head
from storage.reader import available_arrays, open_cache


def _distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device); initialises the process group under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return (dist.get_rank() if world_size > 1 else 0), world_size, device


def adamw(params, *, lr: float, device: torch.device) -> torch.optim.AdamW:
    """The trainer's optimizer: AdamW, weight decay 0, as one fused kernel over every parameter
    where PyTorch has it (CPU, CUDA): the per-tensor loop of the default takes 7x longer on CPU,
    0.58 s against 0.08 s a step for a 1-layer drafter at hidden 1024 (docs/benchmarks.md,
    "Training step against the peers"). Same update, same state (checkpoints resume either way)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.type in ("cpu", "cuda"))


def resolve_family(config: TrainConfig, manifest):
    """(family, its options resolved for this cache, its block layout): --arch looked up, its
    options' defaults filled in from the cache's K and vocabulary (drafter/family.py)."""
    family = get_family(config.drafter.arch)
    num_slots = manifest.settings.num_slots
    options = config.family_options(family)
    if options is not None:
        options = family.resolve_options(options, num_slots=num_slots, vocab_size=manifest.vocab_size)
    return family, options, family.layout(options, num_slots=num_slots)


def build_drafter(config: TrainConfig, manifest, *, resolved=None):
    """The drafter to train: loaded from --drafter-init, or fresh from the cache's target config,
    in the --arch family (`resolved`: resolve_family's answer, computed here when not given)."""
    family, options, layout = resolved or resolve_family(config, manifest)
    settings, init = manifest.settings, config.drafter
    if init.drafter_init is not None:
        drafter = drafter_from_init(init.drafter_init, family=family, options=options, mask_token_id=manifest.mask_token_id, seed=config.seed)
    else:
        torch.manual_seed(config.seed)
        backbone = DFlashConfig.from_target_config(
            manifest.target_config,
            num_draft_layers=init.draft_layers or len(settings.layer_ids),
            mask_token_id=manifest.mask_token_id,
            target_layer_ids=settings.layer_ids,
            block_size=settings.num_slots + 1,
        )
        drafter = family.model_class(family.new_config(backbone, options)).float()
    check_compatible(
        drafter.config, target_layer_ids=settings.layer_ids, hidden_size=manifest.hidden_size, vocab_size=manifest.vocab_size,
        block_size=layout.block_size,
    )  # fmt: skip
    drafter.activation_checkpointing = init.activation_checkpointing
    return drafter


def drafter_from_init(path: str, *, family, options, mask_token_id: int, seed: int):
    """--drafter-init: a checkpoint of the family as it is (its settings checked against the run's),
    or one of a family it may start from (`init_from`): that checkpoint's backbone with this family's
    fresh (seeded) parts, the backbone's block size aside, which no weight depends on."""
    loaded = load_drafter(path, dtype=torch.float32)
    if loaded.config.mask_token_id != mask_token_id:  # its export would name the wrong one
        raise ValueError(
            f"--drafter-init {path}: its mask token {loaded.config.mask_token_id} is not the cache's {mask_token_id}; build the "
            f"cache with --mask-token {loaded.config.mask_token_id}"
        )
    init_family = family_of(loaded)
    if init_family is family:
        family.check_init(loaded.config, options, init=path)
        return loaded
    if init_family.name not in family.init_from:
        raise ValueError(f"--drafter-init {path} is a {init_family.title} drafter: train it with --arch {init_family.name}")
    torch.manual_seed(seed)
    drafter = family.model_class(family.new_config(loaded.config, options)).float()
    _, unexpected = drafter.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected, unexpected  # every backbone weight has its place
    return drafter


@dataclass(kw_only=True)
class TrainState:
    """Everything the loop works with, built once by `setup`."""

    run: Location  # --out: a local directory or a prefix on an object store
    rank: int
    world_size: int
    device: torch.device
    num_slots: int  # labelled slots per block (the family's layout, drafter/family.py)
    block_size: int  # the drafter's block (the family's layout)
    drafter: torch.nn.Module
    family_options: object  # the --arch family's options, resolved for the cache (None: it has none)
    model: torch.nn.Module  # the drafter, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    embed_tokens: torch.Tensor  # frozen [V, H], in the compute dtype (bf16 under bf16 autocast)
    lm_head: torch.Tensor  # frozen [V, H]
    autocast: contextlib.AbstractContextManager
    attention: str  # "flex" or "sdpa"
    batches: object  # iterator over this rank's micro-batches, from start_step on
    start_step: int
    epoch_ends: list[int]  # global step count at the end of each epoch (stream epochs can differ)
    data_position: object  # step -> where the data stream stands after it (stored in checkpoints)
    total_steps: int
    last_step: int
    settings: dict  # the run's flat settings, --rollout-depth resolved for the cache (train_config.json, checkpoints)
    eval_split: EvalSplit | None = None  # rank 0's: the cache's evaluation split (--eval-every), if it has one
    head: dict | None = None  # the target's embed_tokens / lm_head as stored (CPU), for the split's float32 drafting

    def epoch_of(self, step: int) -> int:
        return bisect.bisect_right(self.epoch_ends, step)


def load_eval_split(config: TrainConfig, settings, *, rank: int) -> EvalSplit | None:
    """Rank 0's evaluation split of the cache (--eval-every), checked in full before step 1 (its
    record, target and taps, counts against its tensors, token ids against the vocabulary, feature
    widths against the taps: storage/eval_split.py); None on the other ranks or without one
    (refused with --eval-every). A resume whose earlier evaluation points measured another split is
    refused on every rank: one tau curve never joins two splits."""
    from storage.eval_split import SplitFit, check_same_split, logged_split_identities, split_identity
    from storage.manifest import load_manifest

    cache = resolve(config.cache)
    record = read_eval_split_record(cache)
    if record is None:
        if config.eval_every:
            raise ValueError(f"--eval-every: {config.cache} has no evaluation split; build the cache with --eval-prompts FILE")
        return None
    run = resolve(config.out)
    if config.checkpoint.resume and run.is_file("metrics.jsonl"):
        earlier = logged_split_identities(run.read_bytes("metrics.jsonl"))
        check_same_split(earlier, split_identity(record), run=str(run))
    if rank != 0:
        return None
    return read_eval_split(cache, SplitFit.of(load_manifest(cache)))


def resume_from_checkpoint(config: TrainConfig, *, run: Location, settings: dict, position_after, last_step: int, drafter,
                           optimizer) -> int:  # fmt: skip
    """Load --resume's latest readable checkpoint into the drafter and optimizer after checking it
    continues this run (settings, data position, a --max-steps not below it); its step, or 0."""
    try:
        state = load_latest_checkpoint(run) if config.checkpoint.resume else None
    except NoReadableCheckpoint as error:
        restart_settings_check(run, settings, error)
        state = None
    if state is None:
        return 0
    check_resume_settings(state["config"], settings, run=run)
    check_data_position(state, position_after(state["step"]), run=run)
    if state["step"] > last_step:  # the weights there are a later step's than this run would end at
        raise ValueError(
            f"{run}: --max-steps {config.max_steps} is below the latest checkpoint's step {state['step']}; its weights are "
            f"step {state['step']}'s: resume with --max-steps {state['step']} or more, or train step {config.max_steps} in a new --out"
        )
    drafter.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"]


def setup(config: TrainConfig) -> TrainState:
    rank, world_size, device = _distributed()
    run, optim, stream = resolve(config.out), config.optim, config.loader.kind == "stream"
    reader = open_cache(config.cache)
    check_run_dir(run, cache=resolve(config.cache))
    manifest = reader.manifest
    settings = manifest.settings
    log = print if rank == 0 else (lambda line: None)
    check_cache_complete(manifest, cache=resolve(config.cache), allow_partial=config.allow_partial, log=log)
    # --loader stream: which shards every rank and worker streams (a Zarr cache is refused here).
    plan = stream_plan(
        reader, seed=config.seed, rank=rank, world_size=world_size, num_workers=config.loader.num_workers,
        micro_batch=optim.batch_size // (world_size * optim.grad_accum), grad_accum=optim.grad_accum,
        shuffle_buffer=config.loader.shuffle_buffer, local_cache_gib=config.loader.local_cache_gib,
        local_cache_dir=config.loader.local_cache_root, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        prefetch_shards=config.loader.prefetch_shards,
    ) if stream else None  # fmt: skip
    family, options, layout = resolved = resolve_family(config, manifest)
    check_cache_serves(config.objective.method, available_arrays(reader), config.cache, arch=family.name, distributions=layout.distributions)
    if optim.batch_size % (world_size * optim.grad_accum):
        raise ValueError(f"--batch-size {optim.batch_size} must be a multiple of ranks x --grad-accum ({world_size * optim.grad_accum})")
    if len(reader) < optim.batch_size:
        raise ValueError(f"--batch-size {optim.batch_size} is larger than the cache ({len(reader)} sequences)")
    objective = config.objective.for_cache(
        num_slots=settings.num_slots, mask_token_id=manifest.mask_token_id, stop_token_ids=manifest.stop_token_ids,
        vision=settings.vision is not None, layout=layout,
    )
    # The flags with what the cache gave (the depth, K - 1 by default; --dflash-gamma's default from
    # the target kind; the family's options, their defaults from the cache): what train_config.json
    # and checkpoints record and compare.
    resolved_objective = replace(config.objective, rollout_depth=objective.rollout_depth, dflash_gamma=objective.dflash_gamma)
    resolved_families = config.families if options is None else replace(config.families, **{family.name: options})
    run_settings = to_flags(replace(config, objective=resolved_objective, families=resolved_families))
    # What `auto` resolved to on this machine is part of the run (a resume elsewhere must match it).
    use_bf16 = optim.precision == "bf16" or (optim.precision == "auto" and auto_bf16(device.type, stage="train"))
    compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
    run_settings |= {"compute_dtype": str(compute_dtype).removeprefix("torch."), "device_kind": device.type}
    per_epoch = steps_per_epoch(len(reader), batch_size=optim.batch_size)
    epoch_steps = stream_epoch_steps(plan, optim.epochs) if stream else [per_epoch] * optim.epochs
    epoch_ends = list(itertools.accumulate(epoch_steps))
    position_after = partial(data_position, epoch_ends=epoch_ends, plan=plan)

    head = load_target_head(config.cache, target_hash=settings.target_hash)
    split = load_eval_split(config, settings, rank=rank)
    drafter = build_drafter(config, manifest, resolved=resolved).to(device)
    optimizer = adamw(drafter.parameters(), lr=optim.lr, device=device)
    last_step = min(epoch_ends[-1], config.max_steps) if config.max_steps else epoch_ends[-1]
    start_step = resume_from_checkpoint(
        config, run=run, settings=run_settings, position_after=position_after, last_step=last_step, drafter=drafter, optimizer=optimizer
    )  # fmt: skip
    attention = "flex" if optim.attention == "flex" or (optim.attention == "auto" and device.type == "cuda") else "sdpa"
    if attention == "flex" and device.type != "cuda":
        raise ValueError(f"--attention flex needs a CUDA device (PyTorch has no flex-attention backward on {device.type}); use sdpa or auto")
    if rank == 0:  # after every refusal above: a refused run leaves nothing in --out
        claim_run(run, inputs=run_inputs(manifest, cache=config.cache), resume=config.checkpoint.resume,
                  overwrite=config.checkpoint.overwrite, log=log)  # fmt: skip

    batches = make_batches(
        config, reader, objective, plan=plan, epoch_steps=epoch_steps, start_step=start_step, rank=rank,
        world_size=world_size, device=device,
    )  # fmt: skip
    total_steps = epoch_ends[-1]
    return TrainState(
        run=run, rank=rank, world_size=world_size, device=device,
        num_slots=layout.num_labelled,
        block_size=layout.block_size,
        drafter=drafter,
        family_options=options,
        model=torch.nn.parallel.DistributedDataParallel(drafter) if world_size > 1 else drafter,
        optimizer=optimizer,
        embed_tokens=head["embed_tokens.weight"].to(device, compute_dtype),
        lm_head=head["lm_head.weight"].to(device, compute_dtype),
        autocast=torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext(),
        attention=attention,
        batches=batches,
        start_step=start_step,
        epoch_ends=epoch_ends,
        data_position=position_after,
        total_steps=total_steps,
        last_step=last_step,
        eval_split=split,
        head=head if split is not None else None,
        settings=run_settings,
    )  # fmt: skip
