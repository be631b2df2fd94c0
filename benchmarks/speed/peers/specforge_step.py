"""SpecForge 0.2's DFlash training step on speed/peers/case.py's step, run in SpecForge's own
virtualenv: `OnlineDFlashModel` (its offline-hidden-states path: target features in, no target
model) with the frozen target head, its DFlash loss (decay gamma, chunked and checkpointed
objective), backward, then the optimizer as SpecForge trains: fp32: AdamW with
clip_grad_norm_; bf16: its pure-bf16 model with `BF16Optimizer` (fp32 master weights, clipped).
The anchors are pinned to the case's (SpecForge samples its own otherwise). SDPA attention: its
flex path has no backward on CPU.

    PEER_PYTHON -m benchmarks.speed.peers.specforge_step SHAPE_JSON fp32|bf16 STEPS   (run by speed/peer_step.py)
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.speed.peers.case import hf_qwen3_config, run_steps, worker_case


def main() -> None:
    shape, precision, steps, case = worker_case()
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.optimizer import BF16Optimizer

    config = hf_qwen3_config(shape)
    config.block_size = shape.block
    config.num_target_layers = 2 * shape.taps
    config.dflash_config = {"mask_token_id": shape.mask_token_id, "target_layer_ids": list(range(shape.taps))}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    draft = DFlashDraftModel(config)
    missing, unexpected = draft.load_state_dict(case.drafter, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise SystemExit(f"SpecForge's DFlashDraftModel: missing {missing}, unexpected {unexpected}")
    draft = draft.to(dtype)
    lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False, dtype=dtype)
    embed = nn.Embedding(shape.vocab, shape.hidden, dtype=dtype)
    with torch.no_grad():
        lm_head.weight.copy_(case.lm_head)
        embed.weight.copy_(case.embed_tokens)
    lm_head.requires_grad_(False)
    embed.requires_grad_(False)
    model = OnlineDFlashModel(
        draft, lm_head, embed, mask_token_id=shape.mask_token_id, block_size=shape.block, attention_backend="sdpa",
        num_anchors=shape.anchors, loss_decay_gamma=shape.gamma,
    )  # fmt: skip
    anchors = case.anchors[None]
    model._sample_anchor_positions = lambda seq_len, loss_mask, device: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    input_ids, features, loss_mask = case.input_ids, case.features.to(dtype), case.loss_mask.to(dtype)
    del case
    if precision == "bf16":
        optimizer = BF16Optimizer(draft, lr=shape.lr, weight_decay=0.0, max_grad_norm=shape.grad_clip, lr_scheduler="constant", warmup_ratio=0.0)
    else:
        optimizer = torch.optim.AdamW(draft.parameters(), lr=shape.lr, weight_decay=0.0)

    def step() -> float:
        loss, _accuracy, _metrics = model(input_ids=input_ids, hidden_states=features, loss_mask=loss_mask)
        loss.backward()
        if precision == "bf16":
            optimizer.step()  # clips, steps the fp32 masters, copies them back, clears the grads
        else:
            torch.nn.utils.clip_grad_norm_(draft.parameters(), shape.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    run_steps(step, steps=steps, name="specforge", precision=precision)


if __name__ == "__main__":
    main()
