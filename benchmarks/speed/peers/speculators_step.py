"""speculators 0.9's DFlash training step on speed/peers/case.py's step, run in speculators'
own virtualenv: `DFlashDraftModel.forward` (anchored blocks, its verifier-logit targets from the
target's last hidden state, its default KL loss with DFlash's decay) with the same drafter weights
and frozen head, backward, clip_grad_norm_ and AdamW, as its Trainer runs them: fp32, or the fp32
model under bf16 autocast. CPU paths: SDPA attention (its flex path has no backward on CPU) and
the eager loss (its fused loss is a Triton kernel). The anchors are pinned to the case's. Its loss
is a KL to the verifier's distribution, not the corpus token's cross-entropy: only its time and
memory are compared.

    PEER_PYTHON -m benchmarks.speed.peers.speculators_step SHAPE_JSON fp32|bf16 STEPS   (run by speed/peer_step.py)
"""

from __future__ import annotations

import contextlib

import torch

from benchmarks.speed.peers.case import hf_qwen3_config, run_steps, worker_case


def main() -> None:
    shape, precision, steps, case = worker_case()
    import speculators.models.dflash.core as core
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash.config import DFlashSpeculatorConfig

    layer_config = hf_qwen3_config(shape)
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=shape.vocab, block_size=shape.block,
        aux_hidden_state_layer_ids=list(range(shape.taps)), mask_token_id=shape.mask_token_id, sample_from_anchor=False,
    )  # fmt: skip
    model = DFlashDraftModel(config)
    with torch.no_grad():
        state = dict(case.drafter)
        state |= {"embed_tokens.weight": case.embed_tokens, "lm_head.weight": case.lm_head, "verifier_lm_head.weight": case.lm_head}
        missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith(("verifier_norm", "rotary"))]:
        raise SystemExit(f"speculators' DFlashDraftModel: missing {missing}, unexpected {unexpected}")
    for module in (model.embed_tokens, model.lm_head, model.verifier_lm_head, model.verifier_norm):
        module.requires_grad_(False)
    anchors = case.anchors
    core.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors, torch.ones_like(anchors, dtype=torch.bool))
    inputs = dict(
        hidden_states=case.features, input_ids=case.input_ids, loss_mask=case.loss_mask,
        verifier_last_hidden_states=case.last_hidden, document_ids=torch.zeros_like(case.input_ids),
    )  # fmt: skip
    del case, state
    call = dict(loss_config=resolve_loss_config("kl_div", "eager"), gamma=shape.gamma, max_anchors=shape.anchors)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=shape.lr, weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    model.train()

    def step() -> float:
        with autocast:
            _drafts, loss, _metrics = model(**inputs, **call)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), shape.grad_clip)
        optimizer.step()
        return loss.item()

    run_steps(step, steps=steps, name="speculators", precision=precision)


if __name__ == "__main__":
    main()
