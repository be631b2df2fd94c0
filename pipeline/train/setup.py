"""What a run works with, built from its plan (pipeline/train/plan.py) before the first step
(`setup` -> `TrainState`): the drafter (fresh, from --drafter-init, or one family's on another's
backbone) with a resumed checkpoint's weights, the frozen target head (read from the cache, and in
the compute dtype), the optimizer, and the batches. Nothing here decides (the plan did) or refuses
but what the weights' own loading refuses (a damaged --drafter-init, a target head written for
another target), and nothing is written to --out (pipeline/train/run_dir.py claims it once this is
built).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from drafter.checkpoint import load_drafter
from pipeline.train.data import make_batches
from pipeline.train.plan import DrafterPlan, TrainPlan
from storage.manifest import read_target_head


def adamw(params, *, lr: float, device: torch.device) -> torch.optim.AdamW:
    """The trainer's optimizer: AdamW, weight decay 0, as one fused kernel over every parameter
    where PyTorch has it (CPU, CUDA): the per-tensor loop of the default takes 7x longer on CPU,
    0.58 s against 0.08 s a step for a 1-layer drafter at hidden 1024 (docs/benchmarks.md,
    "Training step against the peers"). Same update, same state (checkpoints resume either way)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.type in ("cpu", "cuda"))


def build_drafter(plan: DrafterPlan) -> torch.nn.Module:
    """The planned drafter in float32: a --drafter-init of its family as it is, or the family's model
    of the planned config with fresh (seeded) weights, a --drafter-init's backbone loaded into it
    (every one of that checkpoint's weights has its place; the backbone's block size aside, which
    no weight depends on)."""
    family = plan.family
    if plan.init is not None and plan.init_family is family:
        drafter = load_drafter(plan.init, dtype=torch.float32)
    else:
        torch.manual_seed(plan.seed)
        drafter = family.model_class(plan.config).float()
        if plan.init is not None:
            _, unexpected = drafter.load_state_dict(load_drafter(plan.init, dtype=torch.float32).state_dict(), strict=False)
            assert not unexpected, unexpected
    drafter.activation_checkpointing = plan.activation_checkpointing
    return drafter


@dataclass(kw_only=True)
class TrainState:
    """What the loop works with besides its plan, built once by `setup`."""

    drafter: torch.nn.Module
    model: torch.nn.Module  # the drafter, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    embed_tokens: torch.Tensor  # frozen [V, H], in the compute dtype (bf16 under bf16 autocast)
    lm_head: torch.Tensor  # frozen [V, H]
    autocast: contextlib.AbstractContextManager
    batches: object  # iterator over this rank's micro-batches, from the plan's start step on
    head: dict  # the target's embed_tokens / lm_head as the cache stores them (CPU): the split's float32 drafting, the export


def setup(plan: TrainPlan) -> TrainState:
    ranks, dtype = plan.ranks, plan.compute_dtype
    drafter = build_drafter(plan.drafter).to(ranks.device)
    head = read_target_head(plan.cache, target_hash=plan.manifest.settings.target_hash)  # refused if written for another target
    optimizer = adamw(drafter.parameters(), lr=plan.config.optim.lr, device=ranks.device)
    if plan.resume is not None:
        drafter.load_state_dict(plan.resume["model"])
        optimizer.load_state_dict(plan.resume["optimizer"])
        torch.set_rng_state(plan.resume["rng"])
    return TrainState(
        drafter=drafter,
        model=torch.nn.parallel.DistributedDataParallel(drafter) if ranks.world_size > 1 else drafter,
        optimizer=optimizer,
        embed_tokens=head["embed_tokens.weight"].to(ranks.device, dtype),
        lm_head=head["lm_head.weight"].to(ranks.device, dtype),
        autocast=torch.autocast(ranks.device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext(),
        batches=iter(make_batches(plan)),  # the map loader's workers start here
        head=head,
    )
