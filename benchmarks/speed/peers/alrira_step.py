"""alrira's training step on speed/peers/case.py's step: the trainer's own `forward_loss`,
backward, clip and AdamW, as pipeline/train/loop.py runs them. fp32: everything fp32; bf16: the
trainer's bf16 mode (fp32 master weights under bf16 autocast, the frozen head in bf16).

    python -m benchmarks.speed.peers.alrira_step SHAPE_JSON fp32|bf16 STEPS   (run by speed/peer_step.py)
"""

from __future__ import annotations

import contextlib

import torch

from benchmarks.speed.peers.case import qwen3_fields, run_steps, slot_weights, worker_case
from drafter.config import DFlashConfig
from drafter.model import DFlashDrafter
from pipeline.train.batching import TrainBatch
from pipeline.train.setup import adamw
from pipeline.train.step import forward_loss


def main() -> None:
    shape, precision, steps, case = worker_case()
    config = DFlashConfig(
        **qwen3_fields(shape), block_size=shape.block, num_target_layers=2 * shape.taps,
        target_layer_ids=list(range(shape.taps)), mask_token_id=shape.mask_token_id,
    )  # fmt: skip
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(case.drafter)
    compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    embed_tokens, lm_head = case.embed_tokens.to(compute_dtype), case.lm_head.to(compute_dtype)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    batch = dflash_batch(shape, case)
    del case  # the trainer holds only its batch, its head and its drafter
    optimizer = adamw(drafter.parameters(), lr=shape.lr, device=torch.device("cpu"))

    def step() -> float:
        stats = forward_loss(
            drafter, batch, embed_tokens=embed_tokens, lm_head=lm_head, block_size=shape.block, loss_chunk=4096, autocast=autocast
        )
        loss = stats.loss_sum / (stats.weight_sum + 1e-6)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), shape.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    run_steps(step, steps=steps, name="alrira", precision=precision)


def dflash_batch(shape, case) -> TrainBatch:
    """The collate's batch for the DFlash method on this one sequence: the whole sequence as shared
    context, each block [anchor token, mask x (block - 1)] at positions a..a+block-1 seeing the
    context before a, one-hot labels x[a + k] weighted as case.slot_weights."""
    n, block, num_slots = len(case.anchors), shape.block, shape.block - 1
    offsets = torch.arange(block)
    block_tokens = torch.full((n, block), shape.mask_token_id)
    block_tokens[:, 0] = case.input_ids[0, case.anchors]
    label_positions = (case.anchors[:, None] + offsets[1:]).clamp(max=shape.seq - 1)  # [N, K]
    weights = slot_weights(shape, case)[:, 1:]  # [N, K]
    return TrainBatch(
        context_features=case.features, context_positions=torch.arange(shape.seq)[None],
        context_owner=torch.full((1, shape.seq), -1), context_valid=torch.ones(1, shape.seq, dtype=torch.bool),
        block_tokens=block_tokens.reshape(1, -1), block_positions=(case.anchors[:, None] + offsets).reshape(1, -1),
        block_corpus_limit=case.anchors[None], block_valid=torch.ones(1, n, dtype=torch.bool),
        label_ids=case.input_ids[0, label_positions][None, :, :, None], label_probs=torch.ones(1, n, num_slots, 1),
        slot_weights=weights[None], supervised_index=torch.nonzero(weights.flatten() > 0).flatten(),
        prev_tokens=torch.zeros(1, n, num_slots, dtype=torch.long), num_tokens=shape.seq, num_sequences=1,
    )  # fmt: skip


if __name__ == "__main__":
    main()
