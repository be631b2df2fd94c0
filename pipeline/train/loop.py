"""`alrira-train`: train a DFlash or DSpark drafter from a stage-1 cache, never loading the target.

Every method (dflash, kd, erase, erase_hard, alr, alr_gate, alr_ira, slot_control) runs the same
loop; what differs is only `pipeline.train.labels.build_block_targets`, called in the data workers.
Data parallel under torchrun (gloo on CPU, nccl on GPU):

    torchrun --nproc-per-node 8 -m pipeline.train --cache CACHE --method alr_ira --out runs/x

The step loss is one weighted mean over every supervised slot of the global batch,
sum(w * l) / (sum(w) + 1e-6), so the weight total is all-reduced BEFORE the backward passes and
each micro-batch contributes its weighted sum divided by that total: the result is the same for
any number of ranks and micro-batches (docs/design.md, "A training step").
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from drafter.checkpoint import CONFIG_FILE, check_compatible, load_drafter, save_drafter
from drafter.config import DFlashConfig
from drafter.dspark import DSparkConfig, DSparkDrafter, default_markov_rank
from drafter.masks import flex_block_mask, visibility_mask
from drafter.model import DFlashDrafter
from pipeline.config import to_flags
from pipeline.precision import auto_bf16
from pipeline.train.batching import (
    CacheTrainDataset,
    ReadFailure,
    StepSampler,
    TrainBatch,
    collate,
    decode_feature_bits,
    steps_per_epoch,
)
from pipeline.outputs import output_lock
from pipeline.train.checkpoints import (
    NoReadableCheckpoint,
    check_data_position,
    check_resume_settings,
    claim_run,
    load_latest_checkpoint,
    restart_settings_check,
    run_inputs,
    save_checkpoint,
)
from pipeline.train.config import DSparkLossConfig, TrainConfig
from pipeline.train.methods import check_cache_serves
from pipeline.train.preflight import check_cache_complete, check_run_dir
from pipeline.train.streaming import (
    StreamTrainDataset,
    stream_batches,
    stream_plan,
    stream_position,
)
from pipeline.train.objectives import dspark_slot_losses, topk_tail_loss
from storage.atomic import atomic_write_text, remove_path_tolerant
from storage.errors import DISK_FULL_ERRNOS
from storage.local_cache import sweep_orphans
from storage.location import Location, is_url, resolve
from storage.manifest import load_target_head
from storage.reader import available_arrays, open_cache


def lr_at(step: int, *, total_steps: int, peak_lr: float, warmup_frac: float) -> float:
    """Linear warm-up over ceil(warmup_frac * total) steps, then cosine from peak to 0."""
    warmup = math.ceil(warmup_frac * total_steps)
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


# ----------------------------------------------------------------------------------------------
# The loss of one micro-batch


@dataclass(kw_only=True)
class StepStats:
    """Sums over the supervised slots of a micro-batch (or, added up, of a step on every rank)."""

    loss_sum: torch.Tensor  # [] weighted loss sum (carries the graph until detached)
    weight_sum: torch.Tensor  # [] sum of slot weights
    slot_correct: torch.Tensor  # [K] supervised slots where draft argmax == label argmax
    slot_count: torch.Tensor  # [K] supervised slots

    def detached(self) -> StepStats:
        return StepStats(**{name: value.detach().double() for name, value in vars(self).items()})

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(**{name: value + getattr(other, name) for name, value in vars(self).items()})

    def all_reduced(self, *, device: torch.device, world_size: int) -> StepStats:
        """Summed over ranks (one collective; the tensors stay on the training device)."""
        flat = torch.cat([self.loss_sum[None], self.weight_sum[None], self.slot_correct, self.slot_count])
        flat = all_reduce_on(flat, device=device, world_size=world_size)
        num_slots = self.slot_count.numel()
        return StepStats(loss_sum=flat[0], weight_sum=flat[1], slot_correct=flat[2 : 2 + num_slots], slot_count=flat[2 + num_slots :])


def forward_loss(
    model, batch: TrainBatch, *, embed_tokens, lm_head, block_size: int, loss_chunk: int, autocast, attention: str = "sdpa",
    dspark: DSparkLossConfig | None = None,
) -> StepStats:
    """Draft every block of the batch and score the supervised slots against their labels.

    attention: "flex" (compiled block mask and flex attention) or "sdpa" (dense mask). Under bf16
    autocast the drafter and the lm_head GEMM run in bf16; the residual stream, log-softmax and
    loss stay fp32 (docs/design.md, "A training step"). `dspark`: the model is a DSpark drafter,
    scored with DeepSpec's loss (objectives.dspark_slot_losses) on its Markov-corrected logits."""
    mask_inputs = dict(
        context_positions=batch.context_positions,
        context_owner=batch.context_owner,
        context_valid=batch.context_valid,
        block_corpus_limit=batch.block_corpus_limit,
        block_valid=batch.block_valid,
        block_size=block_size,
    )
    if attention == "flex":
        attention_mask = flex_block_mask(**mask_inputs, compile=True)
    else:
        attention_mask = visibility_mask(**mask_inputs)  # [B, 1, Q, C + Q]
    with autocast:
        hidden = model(
            context_features=decode_feature_bits(batch.context_features, batch.context_feature_scales),  # on the device
            context_positions=batch.context_positions,
            block_embeds=F.embedding(batch.block_tokens, embed_tokens).float(),  # fp32 residual stream
            block_positions=batch.block_positions,
            attention_mask=attention_mask,
        )  # [B, Q, H]
    num_slots, top_k = batch.label_ids.shape[-2:]
    # The supervised slots' flat indices come from the collate (computed on the CPU by the worker):
    # a boolean mask here would wait on the device for its count, once per tensor and micro-batch.
    supervised = batch.supervised_index  # [M] into [B * N * K]
    slot_index = supervised % num_slots  # [M]: the label's column (DFlash slot k - 1, DSpark slot k)
    # Label column i of block (b, n) is query row (b * N + n) * block_size + i + offset of the
    # drafter's output: offset 1 for DFlash (slot 0 is the anchor), 0 for DSpark (every slot drafts).
    offset = block_size - num_slots
    rows = (supervised // num_slots) * block_size + slot_index + offset  # [M]
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # [M, H]
    weights = batch.slot_weights.reshape(-1).index_select(0, supervised)  # [M]
    label_ids = batch.label_ids.reshape(-1, top_k).index_select(0, supervised)  # [M, k]
    label_probs = batch.label_probs.reshape(-1, top_k).index_select(0, supervised)  # [M, k]
    extras = ()
    if dspark is not None:
        heads = getattr(model, "module", model)  # the DSpark drafter (DDP wraps it)
        prev_tokens = batch.prev_tokens.reshape(-1).index_select(0, supervised)  # [M]
        dist_ids, dist_probs = label_ids, label_probs
        if batch.dist_ids is not None:
            dist_k = batch.dist_ids.shape[-1]
            dist_ids = batch.dist_ids.reshape(-1, dist_k).index_select(0, supervised)  # [M, k']
            dist_probs = batch.dist_probs.reshape(-1, dist_k).index_select(0, supervised)
        extras = (prev_tokens, dist_ids, dist_probs)

    def chunk_loss(h, ids, probs, w, *dspark_inputs):
        with autocast:
            logits = F.linear(h, lm_head)  # [chunk, V]: a bf16 GEMM under autocast, else fp32
            if dspark is not None:
                prev, d_ids, d_probs = dspark_inputs
                bias = heads.markov_bias(prev)  # [chunk, V] or None
                confidence = heads.confidence_logits(h, prev)  # [chunk] or None
        logits = logits.float()
        if dspark is None:
            loss_sum, _ = topk_tail_loss(draft_logits=logits, label_ids=ids, label_probs=probs, weights=w)
            return loss_sum, (logits.argmax(-1) == ids[:, 0])
        if bias is not None:
            logits = logits + bias.float()
        losses, _ = dspark_slot_losses(
            draft_logits=logits, confidence_logits=confidence, label_ids=ids, label_probs=probs, dist_ids=d_ids,
            dist_probs=d_probs, ce_alpha=dspark.ce_alpha, l1_alpha=dspark.l1_alpha, confidence_alpha=dspark.confidence_alpha,
            confidence_target=dspark.confidence_target,
        )  # fmt: skip
        return (w.float() * losses).sum(), (logits.argmax(-1) == ids[:, 0])

    loss_sum = hidden.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(len(slot_index), dtype=torch.bool, device=hidden.device)
    for i in range(0, len(weights), loss_chunk):
        part = slice(i, i + loss_chunk)
        # Recompute the [chunk, vocab] logits in backward instead of keeping them.
        chunk_sum, chunk_correct = checkpoint(
            chunk_loss, hidden[part], label_ids[part], label_probs[part], weights[part], *(t[part] for t in extras),
            use_reentrant=False,
        )
        loss_sum = loss_sum + chunk_sum
        correct[part] = chunk_correct
    slot_correct = torch.zeros(num_slots, device=hidden.device).index_add_(0, slot_index, correct.float())
    slot_count = torch.zeros(num_slots, device=hidden.device).index_add_(0, slot_index, torch.ones_like(weights))
    return StepStats(loss_sum=loss_sum, weight_sum=weights.sum(), slot_correct=slot_correct, slot_count=slot_count)


# ----------------------------------------------------------------------------------------------
# Set-up


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


def all_reduce_on(t: torch.Tensor, *, device: torch.device, world_size: int) -> torch.Tensor:
    """Sum t over ranks in place; every collective of the loop goes through here. t must be on the
    training device: NCCL cannot reduce a CPU tensor, so the check runs on one process too."""
    if t.device != torch.device(device):
        raise RuntimeError(f"collective on a {t.device} tensor while training on {device}")
    if world_size > 1:
        dist.all_reduce(t)
    return t


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

    def epoch_of(self, step: int) -> int:
        return bisect.bisect_right(self.epoch_ends, step)


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
    per_epoch = steps_per_epoch(len(reader), batch_size=optim.batch_size)
    epoch_steps = _stream_epoch_steps(plan, optim.epochs) if stream else [per_epoch] * optim.epochs
    epoch_ends = list(itertools.accumulate(epoch_steps))
    data_position = partial(_data_position, epoch_ends=epoch_ends, plan=plan)

    head = load_target_head(config.cache, target_hash=settings.target_hash)
    drafter = build_drafter(config, manifest, dspark_block=dspark_block, markov_rank=markov_rank).to(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=optim.lr, weight_decay=0.0)
    start_step = 0
    try:
        state = load_latest_checkpoint(run) if config.checkpoint.resume else None
    except NoReadableCheckpoint as error:
        restart_settings_check(run, run_settings, error)
        state = None
    if state is not None:
        check_resume_settings(state["config"], run_settings, run=run)
        check_data_position(state, data_position(state["step"]), run=run)
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        start_step = state["step"]
    use_bf16 = optim.precision == "bf16" or (optim.precision == "auto" and auto_bf16(device.type, stage="train"))
    compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
    attention = "flex" if optim.attention == "flex" or (optim.attention == "auto" and device.type == "cuda") else "sdpa"
    if attention == "flex" and device.type != "cuda":
        raise ValueError(f"--attention flex needs a CUDA device (PyTorch has no flex-attention backward on {device.type}); use sdpa or auto")
    if rank == 0:  # after every refusal above: a refused run leaves nothing in --out
        claim_run(run, inputs=run_inputs(manifest, cache=config.cache), resume=config.checkpoint.resume,
                  overwrite=config.checkpoint.overwrite, log=log)  # fmt: skip

    batches = _batches(
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
        data_position=data_position,
        total_steps=total_steps,
        last_step=min(total_steps, config.max_steps) if config.max_steps else total_steps,
        settings=run_settings,
    )  # fmt: skip


def _batches(config: TrainConfig, reader, objective, *, plan, epoch_steps: list[int], start_step: int, rank: int,
             world_size: int, device: torch.device):  # fmt: skip
    """Iterator over this rank's micro-batches from `start_step` on: the map loader (a sampler of
    (epoch, index) keys) or the stream (one webdataset pipeline per epoch), as --loader says."""
    optim = config.optim
    if plan is not None:
        dataset = StreamTrainDataset(plan, objective=objective, feature_codec=reader.feature_codec)
        make_loader = partial(_data_loader, config=config, device=device, batch_size=None, collate_fn=_as_is)
        return stream_batches(dataset, epoch_steps=epoch_steps, start_step=start_step, make_loader=make_loader)
    sampler = StepSampler(
        len(reader), batch_size=optim.batch_size, grad_accum=optim.grad_accum, epochs=optim.epochs,
        seed=config.seed, rank=rank, world_size=world_size, start_step=start_step,
    )  # fmt: skip
    dataset = CacheTrainDataset(reader, objective=objective, seed=config.seed)
    return iter(_data_loader(dataset, config=config, device=device, batch_sampler=sampler, collate_fn=collate))


def _data_position(step: int, *, epoch_ends: list[int], plan) -> dict:
    """Where the data stands after `step` steps (stored in checkpoints, checked on resume)."""
    epoch = bisect.bisect_right(epoch_ends, step)
    done = step - (epoch_ends[epoch - 1] if epoch else 0)
    if plan is None or done == 0:  # (at an epoch's start no worker has delivered anything yet)
        return {"loader": "map" if plan is None else "stream", "epoch": epoch, "steps_into_epoch": done}
    # Rank 0's: the one every rank computes alike (each checks a resume against what rank 0 stored).
    return {"loader": "stream", **stream_position(plan, epoch=epoch, steps_done=done, rank=0)}


def _stream_epoch_steps(plan, num_epochs: int) -> list[int]:
    steps = [plan.epoch_steps(epoch) for epoch in range(num_epochs)]
    if min(steps) == 0:
        epoch = steps.index(0)
        raise ValueError(
            f"--loader stream: epoch {epoch} has no full step on some rank ({len(plan.shards)} shards split over "
            f"{plan.world_size} rank(s) x {plan.num_streams} stream(s), micro-batches of {plan.micro_batch}); "
            "use fewer --num-workers, a smaller --batch-size or more, smaller shards"
        )
    return steps


def _data_loader(dataset, *, config: TrainConfig, device: torch.device, **kwargs) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        num_workers=config.loader.num_workers,
        prefetch_factor=config.loader.prefetch if config.loader.num_workers else None,
        pin_memory=device.type == "cuda",
        worker_init_fn=_single_threaded_worker,
        **kwargs,
    )


def stop_map_loader_workers(batches) -> None:
    """Stop the map loader's DataLoader workers once the last step has its batches. They would live
    on until the interpreter exits, and one that dies then (killed, out of memory) makes torch's
    SIGCHLD handler raise wherever the main thread is: in the final save, or in an atexit hook as a
    traceback after the run ended (found by benchmarks/chaos.py; docs/failure-modes.md). Stopped,
    their pids are no longer watched. The stream loader stops its own (`close`)."""
    with contextlib.suppress(Exception):  # never hides the run's own error
        getattr(batches, "_shutdown_workers", lambda: None)()


def _as_is(item):
    return item


# ----------------------------------------------------------------------------------------------
# The loop


@dataclass(kw_only=True)
class StepResult:
    """One step's figures, left on the device; only a logged step reads them (`step_record`)."""

    step: int  # 0-based
    lr: float
    totals: StepStats  # this rank's sums, detached
    grad_norm: torch.Tensor  # [] the clipped gradients' norm before clipping
    num_tokens: int  # this rank's corpus tokens


def train_step(s: TrainState, config: TrainConfig, step: int) -> StepResult:
    """One optimizer step over this rank's micro-batches. Nothing here waits on the device: the
    supervised slots' indices come with the batch and the metrics stay where they are."""
    micro_batches = [_next_batch(s) for _ in range(config.optim.grad_accum)]
    weight_total = all_reduce_on(sum(b.slot_weights.sum() for b in micro_batches).double(), device=s.device, world_size=s.world_size)
    lr = lr_at(step, total_steps=s.total_steps, peak_lr=config.optim.lr, warmup_frac=config.optim.warmup_frac)
    for param_group in s.optimizer.param_groups:
        param_group["lr"] = lr
    totals = None
    for i, batch in enumerate(micro_batches):
        sync = s.world_size == 1 or i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else s.model.no_sync():
            stats = forward_loss(
                s.model, batch, embed_tokens=s.embed_tokens, lm_head=s.lm_head, block_size=s.block_size,
                loss_chunk=config.optim.loss_chunk, autocast=s.autocast, attention=s.attention,
                dspark=config.dspark if config.drafter.arch == "dspark" else None,
            )  # fmt: skip
            # DDP averages gradients over ranks; scaling by world_size makes that the global mean.
            (stats.loss_sum * (s.world_size / (weight_total.float() + 1e-6))).backward()
        totals = stats.detached() if totals is None else totals + stats.detached()
    grad_norm = torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), config.optim.grad_clip)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return StepResult(step=step, lr=lr, totals=totals, grad_norm=grad_norm.detach(), num_tokens=sum(b.num_tokens for b in micro_batches))


def is_logged(step: int, *, log_every: int, last_step: int) -> bool:
    """Whether 0-based `step` is read and logged: every log_every-th step and the run's last."""
    return (step + 1) % log_every == 0 or step + 1 == last_step


def step_record(s: TrainState, window: list[StepResult], *, seconds: float) -> dict:
    """The metrics record of the last step of `window` (the steps since the previous logged one),
    summed over ranks, with the window's corpus tokens/s. Every rank calls it on the same steps
    (one collective); its one copy to the host is the only sync of the step."""
    last = window[-1]
    totals = last.totals.all_reduced(device=s.device, world_size=s.world_size)
    num_tokens = torch.tensor([float(sum(r.num_tokens for r in window))], dtype=torch.float64, device=s.device)
    num_tokens = all_reduce_on(num_tokens, device=s.device, world_size=s.world_size)
    loss = totals.loss_sum / (totals.weight_sum + 1e-6)
    flat = torch.cat([loss[None], last.grad_norm.double()[None], num_tokens, totals.slot_correct, totals.slot_count])
    loss, grad_norm, tokens, *counts = flat.tolist()  # the host sync
    correct, count = counts[: s.num_slots], counts[s.num_slots :]
    return {
        "step": last.step + 1,
        "epoch": s.epoch_of(last.step),
        "loss": loss,
        "lr": last.lr,
        "grad_norm": grad_norm,
        "slot_acc": [round(c / max(n, 1.0), 5) for c, n in zip(correct, count)],
        "supervised_slots": int(sum(count)),
        "tokens_per_s": tokens / max(seconds, 1e-9),
    }


def _next_batch(s: TrainState) -> TrainBatch:
    batch = next(s.batches)
    if isinstance(batch, ReadFailure):
        raise ValueError(batch.message)
    return batch.to(s.device)


def train(config: TrainConfig) -> dict:
    """Train a drafter into --out. A local --cache is recorded resolved (train_config.json is read
    from other directories: `alrira-eval cost`); rank 0 holds --out's lock (pipeline/outputs.py)
    for the whole run, so a second process on the same --out refuses."""
    if not is_url(config.cache):
        config = replace(config, cache=str(Path(config.cache).resolve()))
    if int(os.environ.get("RANK", "0")) != 0 or is_url(config.out):
        return _train(config)
    if resolve(config.cache).is_file("manifest.json"):  # before the lock: never a lock file in a cache
        check_run_dir(resolve(config.out), cache=resolve(config.cache))
    with output_lock(config.out, command="alrira-train"):
        return _train(config)


def _train(config: TrainConfig) -> dict:
    s = setup(config)  # the map loader's workers run from here on: every exit below stops them (finally)
    settings, logs, method = s.settings, None, config.objective.method
    history, started = [], time.time()
    try:
        if s.rank == 0:  # first: what marks --out as a run (pipeline/train/preflight.py) for the other ranks' checks
            s.run.make_dirs()
            atomic_write_text(s.run.join("train_config.json"), json.dumps(settings, indent=2))
        logs = RunLogs.open(s.run, start_step=s.start_step) if s.rank == 0 else None
        bar = tqdm(total=s.last_step, initial=s.start_step, unit="step", desc=method, disable=s.rank != 0 or not config.progress)
        window, window_start = [], time.time()
        for step in range(s.start_step, s.last_step):
            window.append(train_step(s, config, step))
            if is_logged(step, log_every=config.log_every, last_step=s.last_step):
                record = step_record(s, window, seconds=time.time() - window_start)
                window, window_start = [], time.time()
                history.append(record)
                if logs is not None:
                    logs.add(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", acc1=f"{record['slot_acc'][0]:.3f}")
            if s.rank != 0:
                continue
            bar.update(1)
            end_of_epoch = (step + 1) in s.epoch_ends
            if end_of_epoch or (config.checkpoint.save_every and (step + 1) % config.checkpoint.save_every == 0):
                logs.publish()  # on a store: the metrics up to this step, before the checkpoint commits
                save_checkpoint(
                    s.run, step=step + 1, model=s.drafter, optimizer=s.optimizer, settings=settings,
                    data_position=s.data_position(step + 1),
                )  # fmt: skip
        stop_map_loader_workers(s.batches)
        bar.close()
        summary = {"run": str(s.run), "method": method, "steps": s.last_step, "elapsed_s": time.time() - started}
        if logs is not None:
            logs.close()
            save_drafter_to(s.run, s.drafter, dtype=getattr(torch, config.checkpoint.save_dtype))
            summary.update(_summarize(history, num_slots=s.num_slots))
            atomic_write_text(s.run.join("summary.json"), json.dumps(summary, indent=2))  # last: the run is done
    finally:
        if logs is not None:
            logs.discard()
        stop_map_loader_workers(s.batches)
        if config.loader.kind == "stream":
            with contextlib.suppress(Exception):  # never hides the run's own error
                getattr(s.batches, "close", lambda: None)()  # stops the last epoch's workers
            with contextlib.suppress(OSError):
                sweep_orphans(config.loader.local_cache_root)  # copies of workers stopped at an epoch's end
    if s.world_size > 1:
        dist.barrier()
    return summary


class RunLogs:
    """Rank 0's metrics.jsonl and tensorboard events. A local run appends them in place; a run on
    an object store writes them to a node-local staging directory and `publish` uploads them, one
    whole object per file, before each checkpoint and at the end. A resume from a checkpoint keeps
    the metrics of the steps up to it (a crash may have logged later steps) and appends."""

    def __init__(self, run: Location, staging: Path):
        self.run, self.staging = run, staging
        self.metrics = open(staging / "metrics.jsonl", "a")
        self.writer = _tensorboard(staging)

    @classmethod
    def open(cls, run: Location, *, start_step: int) -> RunLogs:
        if run.is_local:
            staging = run.local_path
            staging.mkdir(parents=True, exist_ok=True)
        else:
            staging = Path(tempfile.mkdtemp(prefix="alrira-run-"))
        # The metrics of this run: none at step 0 (a new run, or a resume with no checkpoint yet).
        kept = []
        if start_step and run.is_file("metrics.jsonl"):
            kept = [line for line in run.read_bytes("metrics.jsonl").decode().splitlines() if _step_of(line) <= start_step]
        atomic_write_text(staging / "metrics.jsonl", "".join(line + "\n" for line in kept))
        return cls(run, staging)

    def add(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.writer.add_scalar(f"train/{key}", record[key], record["step"])

    def publish(self) -> None:
        if self.run.is_local:
            return
        if self.writer is not None:
            self.writer.flush()
        for path in sorted(self.staging.rglob("*")):
            if path.is_file():
                self.run.put_file(path, path.relative_to(self.staging).as_posix())

    def close(self) -> None:
        self.metrics.close()
        if self.writer is not None:
            self.writer.close()
        self.publish()

    def discard(self) -> None:
        """Close the files; a store run's staging directory goes (what matters is on the store)."""
        if not self.metrics.closed:
            self.metrics.close()
        if self.writer is not None:
            self.writer.close()  # idempotent; its thread writes into the staging directory
        if not self.run.is_local:
            with contextlib.suppress(OSError):
                remove_path_tolerant(self.staging)


def _step_of(line: str) -> float:
    """A metrics line's step; a torn line (a crash mid-write) sorts after every step, so it is dropped."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def save_drafter_to(run: Location, drafter, *, dtype: torch.dtype) -> None:
    """RUN/drafter/: written in place locally; on a store, written locally and uploaded file by file.
    A full disk is one line: the checkpoints are kept, a rerun with --resume writes it again."""
    try:
        _save_drafter_to(run, drafter, dtype=dtype)
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        raise ValueError(
            f"{error.filename or run.join('drafter')}: {error.strerror}; the checkpoints are kept: free space and rerun the same "
            "command with --resume"
        ) from None


def _save_drafter_to(run: Location, drafter, *, dtype: torch.dtype) -> None:
    if run.is_local:
        save_drafter(drafter, run.local_path / "drafter", dtype=dtype)
        return
    with tempfile.TemporaryDirectory(prefix="alrira-drafter-") as tmp:
        save_drafter(drafter, tmp, dtype=dtype)
        # config.json last, as save_drafter writes it: a drafter/ whose config is new has new weights.
        for path in sorted(Path(tmp).iterdir(), key=lambda p: (p.name == CONFIG_FILE, p.name)):
            run.put_file(path, f"drafter/{path.name}")


def _single_threaded_worker(worker_id: int) -> None:
    # Data workers build labels with small tensor ops and decode Blosc chunks; several
    # multi-threaded workers next to the training process would oversubscribe the cores (the
    # default --num-workers already takes one per core) and stall the training step.
    from numcodecs import blosc

    torch.set_num_threads(1)
    blosc.set_nthreads(1)


def _tensorboard(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(directory / "tensorboard"))


def _summarize(history: list[dict], *, num_slots: int) -> dict:
    if not history:
        return {}
    tail = history[-max(1, len(history) // 10) :]
    return {
        "final_loss": history[-1]["loss"],
        "mean_loss_last_10pct": sum(h["loss"] for h in tail) / len(tail),
        "slot_acc_last_10pct": [round(sum(h["slot_acc"][k] for h in tail) / len(tail), 4) for k in range(num_slots)],
        "mean_tokens_per_s": sum(h["tokens_per_s"] for h in history) / len(history),
    }


def format_summary(summary: dict) -> str:
    lines = [f"run        {summary['run']}", f"method     {summary['method']}", f"steps      {summary['steps']}  ({summary['elapsed_s']:.1f}s)"]
    if "final_loss" in summary:
        lines += [
            f"loss       final {summary['final_loss']:.4f}, mean of last 10% {summary['mean_loss_last_10pct']:.4f}",
            f"tokens/s   {summary['mean_tokens_per_s']:.0f}",
            "slot acc   " + " ".join(f"{a:.2f}" for a in summary["slot_acc_last_10pct"]),
            f"drafter    {resolve(summary['run']).join('drafter')}",
        ]
    return "\n".join(lines)
