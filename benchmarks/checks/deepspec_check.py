"""Our DSpark drafter against DeepSpec's reference code (deepseek-ai/DeepSpec), on one tiny Qwen3 shape.

    ALRIRA_DEEPSPEC=/path/to/DeepSpec .venv/bin/python -m benchmarks.checks.deepspec_check [--json OUT]

Checks, each printed as one line and returned as a dict (tests/test_dspark_reference.py runs it when
ALRIRA_DEEPSPEC names a checkout):
  1. load     our export's config.json and model.safetensors load into DeepSpec's Qwen3DSparkModel
              with no unexpected weights, and as missing only embed_tokens / lm_head, which DeepSpec
              too takes from the target (`initialize_embeddings_and_head`) and vLLM shares from it;
  2. drafts   for the same context features and anchor, DeepSpec's backbone + `sample_draft_tokens`
              (the Markov head slot by slot) + `predict_confidence_step` give our tokens, our
              Markov-corrected logits and our confidences (drafter/dspark.py `dspark_draft`);
  3. loss     on one batch of blocks (draft logits, confidence logits, labels, a loss mask with holes),
              DeepSpec's `compute_dspark_loss` equals sum(w * l) / sum(w) of our
              `dspark_slot_losses` with w = exp(-k / 4) x mask, where the inputs coincide: DeepSpec
              compares with the target's FULL softmax; ours reads a top-k + tail, here given as the
              whole vocabulary (k = V, tail 0), where our L1 lower bound is exact. With a real cache
              (k = 8 of 151k) our L1 is a lower bound and the confidence target an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter.checkpoint import WEIGHTS_FILE, save_drafter
from drafter.config import DFlashConfig
from drafter.dspark import dspark_slot_losses
from drafter.dspark_model import DSparkConfig, DSparkDrafter, dspark_draft

TARGET = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    vocab_size=96, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
)  # fmt: skip
BLOCK, RANK, NUM_CONTEXT = 5, 16, 11
LOSS = dict(ce_alpha=0.1, l1_alpha=0.9, confidence_alpha=1.0, gamma=4.0)


def _our_drafter(seed: int) -> tuple[DSparkDrafter, torch.Tensor, torch.Tensor]:
    """A DSpark drafter with every weight random (norms too, so a swapped norm shows), and a
    target's embed_tokens / lm_head."""
    torch.manual_seed(seed)
    backbone = DFlashConfig.from_target_config(TARGET, num_draft_layers=2, mask_token_id=TARGET["vocab_size"] - 1, target_layer_ids=[0, 2])
    config = DSparkConfig.from_dflash(backbone, block_size=BLOCK, markov_rank=RANK, enable_confidence_head=True)
    drafter = DSparkDrafter(config).float().eval()
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
        drafter.markov_head.markov_w1.weight.mul_(50)  # a bigram strong enough to change drafts
        drafter.markov_head.markov_w2.weight.mul_(20)
        drafter.confidence_head.proj.bias.fill_(0.3)
    embed = torch.randn(TARGET["vocab_size"], TARGET["hidden_size"])
    head = torch.randn(TARGET["vocab_size"], TARGET["hidden_size"]) * 0.5
    return drafter, embed, head


def _deepspec_model(export: Path, *, embed: torch.Tensor, head: torch.Tensor):
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    from deepspec.modeling.dspark.qwen3.modeling import Qwen3DSparkModel

    config = Qwen3Config.from_pretrained(export)
    config._attn_implementation = "eager"
    model = Qwen3DSparkModel(config).float().eval()
    missing, unexpected = model.load_state_dict(load_file(export / WEIGHTS_FILE), strict=False)
    model.initialize_embeddings_and_head(
        embed_tokens=torch.nn.Embedding.from_pretrained(embed), lm_head=_linear(head), freeze=True
    )
    return model, sorted(missing), sorted(unexpected)


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data.copy_(weight)
    return layer


@torch.no_grad()
def check_drafts(ours: DSparkDrafter, theirs, *, embed: torch.Tensor, head: torch.Tensor, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(1, NUM_CONTEXT, 2 * TARGET["hidden_size"], generator=generator)
    anchor = torch.tensor([int(torch.randint(0, 90, (1,), generator=generator))])
    block_ids = torch.full((1, BLOCK), ours.config.mask_token_id)
    block_ids[0, 0] = anchor
    # Ours: the cached decoding path (context keys/values, then the block).
    cache = ours.extend_context_cache(None, context_features=features, context_positions=torch.arange(NUM_CONTEXT)[None])
    hidden = ours.forward_cached(
        cache=cache, block_embeds=F.embedding(block_ids, embed), block_positions=torch.arange(NUM_CONTEXT, NUM_CONTEXT + BLOCK)[None]
    )  # [1, B, H]
    tokens, logits, confidence = dspark_draft(ours, base_logits=hidden @ head.T, hidden=hidden, anchor_tokens=anchor)
    # DeepSpec: its backbone over [context; block] with no mask (the block sees all of the context,
    # which is exactly the positions before the anchor), then its Markov and confidence heads.
    their_hidden = theirs._forward_backbone(
        position_ids=torch.arange(NUM_CONTEXT + BLOCK)[None], attention_mask=None,
        noise_embedding=theirs.embed_tokens(block_ids), target_hidden_states=features, is_causal=False,
    )  # fmt: skip
    their_tokens, their_logits = theirs.sample_draft_tokens(
        theirs.compute_logits(their_hidden), first_prev_token_ids=anchor, temperature=0.0, hidden_states=their_hidden
    )
    prev = torch.cat([anchor[:, None], their_tokens[:, :-1]], dim=1)
    their_confidence = theirs.predict_confidence_step(their_hidden, prev_token_ids=prev).sigmoid()
    return {
        "tokens_equal": bool(torch.equal(tokens, their_tokens)),
        "tokens": tokens[0].tolist(),
        "max_abs_hidden": float((hidden - their_hidden).abs().max()),
        "max_abs_logits": float((logits - their_logits).abs().max()),
        "max_abs_confidence": float((confidence - their_confidence).abs().max()),
        "markov_changed_a_draft": bool(not torch.equal(tokens, (hidden @ head.T).argmax(-1))),
    }


def check_loss(*, seed: int) -> dict:
    import torch.distributed as dist

    from deepspec.modeling.dspark.common import DSparkForwardOutput
    from deepspec.modeling.dspark.loss import compute_dspark_loss

    if not dist.is_initialized():  # DeepSpec's loss all-reduces its denominators
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    generator = torch.Generator().manual_seed(seed)
    num_blocks, vocab = 6, TARGET["vocab_size"]
    draft_logits = torch.randn(1, num_blocks, BLOCK, vocab, generator=generator) * 2
    target_logits = torch.randn(1, num_blocks, BLOCK, vocab, generator=generator) * 2
    confidence = torch.randn(1, num_blocks, BLOCK, generator=generator)
    target_ids = torch.randint(0, vocab, (1, num_blocks, BLOCK), generator=generator)
    valid = torch.rand(1, num_blocks, BLOCK, generator=generator) > 0.2
    eval_mask = valid.int().cumprod(dim=-1).bool()  # DeepSpec supervises a contiguous prefix per block
    outputs = DSparkForwardOutput(
        draft_logits=draft_logits, target_ids=target_ids, eval_mask=eval_mask, block_keep_mask=torch.ones(1, num_blocks, dtype=torch.bool),
        confidence_pred=confidence, aligned_target_logits=target_logits,
    )  # fmt: skip
    theirs = float(compute_dspark_loss(
        outputs=outputs, loss_decay_gamma=LOSS["gamma"], ce_loss_alpha=LOSS["ce_alpha"], l1_loss_alpha=LOSS["l1_alpha"],
        confidence_head_alpha=LOSS["confidence_alpha"],
    ))  # fmt: skip
    # Ours: the target's full distribution as a "top-k" of k = V, sorted; one-hot labels.
    p = target_logits.softmax(-1).reshape(-1, vocab)
    dist_probs, dist_ids = p.sort(dim=-1, descending=True)
    losses, _ = dspark_slot_losses(
        draft_logits=draft_logits.reshape(-1, vocab), confidence_logits=confidence.reshape(-1),
        label_ids=target_ids.reshape(-1, 1), label_probs=torch.ones(target_ids.numel(), 1), dist_ids=dist_ids,
        dist_probs=dist_probs, ce_alpha=LOSS["ce_alpha"], l1_alpha=LOSS["l1_alpha"], confidence_alpha=LOSS["confidence_alpha"],
    )  # fmt: skip
    weights = (eval_mask.float() * torch.exp(-torch.arange(BLOCK).float() / LOSS["gamma"])).reshape(-1)
    ours = float((weights * losses).sum() / (weights.sum() + 1e-6))
    # With k < V (a real cache's top-8), the L1 term is a lower bound of DeepSpec's.
    top8 = dspark_slot_losses(
        draft_logits=draft_logits.reshape(-1, vocab), confidence_logits=None, label_ids=target_ids.reshape(-1, 1),
        label_probs=torch.ones(target_ids.numel(), 1), dist_ids=dist_ids[:, :8], dist_probs=dist_probs[:, :8],
        ce_alpha=0.0, l1_alpha=1.0, confidence_alpha=0.0,
    )[0]  # fmt: skip
    full = (draft_logits.softmax(-1).reshape(-1, vocab) - p).abs().sum(-1)
    return {
        "deepspec_loss": theirs, "our_loss": ours, "abs_diff": abs(theirs - ours),
        "top8_l1_is_lower_bound": bool(torch.all(top8 <= full + 1e-6)),
        "top8_l1_mean_gap": float((full - top8).mean()),
    }  # fmt: skip


def run_check(deepspec: str | os.PathLike, *, seed: int = 0) -> dict:
    if str(deepspec) not in sys.path:
        sys.path.insert(0, str(deepspec))
    ours, embed, head = _our_drafter(seed)
    with tempfile.TemporaryDirectory(prefix="alrira-deepspec-") as tmp:
        export = Path(tmp) / "drafter"
        save_drafter(ours, export, dtype=torch.float32)
        theirs, missing, unexpected = _deepspec_model(export, embed=embed, head=head)
    report = {
        "load": {"missing": missing, "unexpected": unexpected},
        "drafts": check_drafts(ours, theirs, embed=embed, head=head, seed=seed),
        "loss": check_loss(seed=seed),
    }
    report["ok"] = (
        missing == ["embed_tokens.weight", "lm_head.weight"] and not unexpected and report["drafts"]["tokens_equal"]
        and report["drafts"]["markov_changed_a_draft"]
        and report["drafts"]["max_abs_logits"] < 1e-4 and report["drafts"]["max_abs_confidence"] < 1e-5
        and report["loss"]["abs_diff"] < 1e-5 and report["loss"]["top8_l1_is_lower_bound"]
    )  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspec", default=os.environ.get("ALRIRA_DEEPSPEC"), help="A DeepSpec checkout (default: $ALRIRA_DEEPSPEC).")
    parser.add_argument("--json", help="Write the report here.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.deepspec:
        parser.error("name a DeepSpec checkout with --deepspec or ALRIRA_DEEPSPEC")
    report = run_check(args.deepspec, seed=args.seed)
    for name in ("load", "drafts", "loss"):
        print(f"{name:7s}{json.dumps(report[name])}")
    print("ok" if report["ok"] else "MISMATCH")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
