"""Everything a run works with, resolved once before the first step (`setup` -> `TrainState`):
ranks and device, the cache and what it fixes (K, the mask token, the DSpark block), the drafter
(fresh, from --drafter-init, or a DSpark drafter on a DFlash backbone), the optimizer, a resumed
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
from drafter.dspark import DSparkConfig, DSparkDrafter, default_markov_rank
from drafter.model import DFlashDrafter
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


def build_drafter(config: TrainConfig, manifest, *, dspark_block: int | None = None, markov_rank: int | None = None) -> DFlashDrafter:
    """The drafter to train: loaded from --drafter-init, or fresh from the cache's target config.
    `dspark_block` (B) and `markov_rank`, resolved for the cache, make it a DSpark drafter: a
    DSpark --drafter-init as it is, a DFlash one as the backbone of fresh heads."""
    settings, init = manifest.settings, config.drafter
    dspark = dspark_block is not None
    if init.drafter_init is not None:
        drafter = load_drafter(init.drafter_init, dtype=torch.float32)
        if drafter.config.mask_token_id != manifest.mask_token_id:  # its export would name the wrong one
            raise ValueError(
                f"--drafter-init {init.drafter_init}: its mask token {drafter.config.mask_token_id} is not the "
                f"cache's {manifest.mask_token_id}; build the cache with --mask-token {drafter.config.mask_token_id}"
            )
        if isinstance(drafter, DSparkDrafter) and not dspark:
            raise ValueError(f"--drafter-init {init.drafter_init} is a DSpark drafter: train it with --arch dspark")
        if dspark and not isinstance(drafter, DSparkDrafter):
            drafter = dspark_from_dflash(drafter, block_size=dspark_block, markov_rank=markov_rank,
                                         confidence_head=init.confidence_head, seed=config.seed)  # fmt: skip
    else:
        torch.manual_seed(config.seed)
        drafter_config = DFlashConfig.from_target_config(
            manifest.target_config,
            num_draft_layers=init.draft_layers or len(settings.layer_ids),
            mask_token_id=manifest.mask_token_id,
            target_layer_ids=settings.layer_ids,
            block_size=settings.num_slots + 1,
        )
        if dspark:
            drafter_config = DSparkConfig.from_dflash(
                drafter_config, block_size=dspark_block, markov_rank=markov_rank, enable_confidence_head=init.confidence_head
            )
            drafter = DSparkDrafter(drafter_config).float()
        else:
            drafter = DFlashDrafter(drafter_config).float()
    check_compatible(
        drafter.config,
        target_layer_ids=settings.layer_ids,
        hidden_size=manifest.hidden_size,
        vocab_size=manifest.vocab_size,
        block_size=dspark_block if dspark else settings.num_slots + 1,
    )
    drafter.activation_checkpointing = init.activation_checkpointing
    return drafter


def dspark_from_dflash(dflash: DFlashDrafter, *, block_size: int, markov_rank: int, confidence_head: bool, seed: int) -> DSparkDrafter:
    """A DSpark drafter whose backbone is `dflash`'s weights (its block size aside, which no weight
    depends on) and whose heads are fresh (seeded)."""
    torch.manual_seed(seed)
    config = DSparkConfig.from_dflash(dflash.config, block_size=block_size, markov_rank=markov_rank, enable_confidence_head=confidence_head)
    drafter = DSparkDrafter(config).float()
    missing, unexpected = drafter.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all(n.startswith(("markov_head.", "confidence_head.")) for n in missing), (missing, unexpected)
    return drafter


def resolve_dspark(config: TrainConfig, manifest) -> tuple[int | None, int | None]:
    """(B, Markov rank) of a DSpark run on this cache, or (None, None) for DFlash. B defaults to the
    cache's K predicted slots (one less than its DFlash block size) and may not exceed them: slot B - 1 needs
    the label of the cache's last slot (docs/dspark.md)."""
    init = config.drafter
    if init.arch != "dspark":
        return None, None
    num_slots = manifest.settings.num_slots
    block = num_slots if init.dspark_block is None else init.dspark_block
    if block > num_slots:
        raise ValueError(
            f"--dspark-block {block} is larger than this cache supports: it labels K = {num_slots} predicted slots per anchor "
            f"(DFlash block size {num_slots + 1}), so a DSpark block has at most B = {num_slots}; build a cache with --num-slots {block} or more"
        )
    vocab_size = manifest.vocab_size
    rank = default_markov_rank(vocab_size) if init.markov_rank is None else init.markov_rank
    if rank > vocab_size:
        raise ValueError(f"--markov-rank {rank} is larger than the vocabulary ({vocab_size})")
    return block, rank


@dataclass(kw_only=True)
class TrainState:
    """Everything the loop works with, built once by `setup`."""

    run: Location  # --out: a local directory or a prefix on an object store
    rank: int
    world_size: int
    device: torch.device
    num_slots: int  # label slots per block: K for DFlash, B for DSpark
    block_size: int  # the drafter's block: K + 1 for DFlash, B for DSpark
    drafter: DFlashDrafter
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
    dspark_block, markov_rank = resolve_dspark(config, manifest)
    check_cache_serves(config.objective.method, available_arrays(reader), config.cache, dspark=dspark_block is not None)
    if optim.batch_size % (world_size * optim.grad_accum):
        raise ValueError(f"--batch-size {optim.batch_size} must be a multiple of ranks x --grad-accum ({world_size * optim.grad_accum})")
    if len(reader) < optim.batch_size:
        raise ValueError(f"--batch-size {optim.batch_size} is larger than the cache ({len(reader)} sequences)")
    objective = config.objective.for_cache(
        num_slots=settings.num_slots, mask_token_id=manifest.mask_token_id, stop_token_ids=manifest.stop_token_ids,
        vision=settings.vision is not None, dspark_block=dspark_block,
    )
    # The flags with what the cache gave (the depth, K - 1 by default; --dflash-gamma's default from
    # the target kind; a DSpark block and Markov rank): what train_config.json and checkpoints record and compare.
    resolved = replace(config.objective, rollout_depth=objective.rollout_depth, dflash_gamma=objective.dflash_gamma)
    resolved_drafter = replace(config.drafter, dspark_block=dspark_block, markov_rank=markov_rank)
    run_settings = to_flags(replace(config, objective=resolved, drafter=resolved_drafter))
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
    drafter = build_drafter(config, manifest, dspark_block=dspark_block, markov_rank=markov_rank).to(device)
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
        num_slots=settings.num_slots if dspark_block is None else dspark_block,
        block_size=settings.num_slots + 1 if dspark_block is None else dspark_block,
        drafter=drafter,
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
