"""Our DFlash2 drafter and loss against speculators 0.9's (`speculators/models/dflash2/`), on one tiny
Qwen3 shape, identical weights and one batch.

    ALRIRA_SPECULATORS_VENV=/work/venvs/speculators .venv/bin/python -m benchmarks.checks.dflash2_reference [--json OUT]

The virtualenv holds speculators==0.9.0 and hs-connectors==0.9.0 installed with --no-deps, sharing
this project's torch and transformers through a .pth file (as `benchmarks/peer_step.py
--make-peer-venvs` builds it); run under another interpreter, the module runs itself again under
that virtualenv's python, from the checkout (its sys.path first, so this checkout's alrira is the one
imported). Checks, each printed as one line (tests/test_dflash2_reference.py runs it
when ALRIRA_SPECULATORS_VENV is set):
  1. forward  every weight random (convolutions and norms too, so an identity or a swapped norm
              shows); speculators' `_backbone_forward` on a packed sequence with pinned anchors and
              our DFlash2Drafter on the same blocks give the same unary logits, and its
              `CandidateSelector.score_candidates` our selector scores on the same candidates;
  2. loss     its `DFlash2DraftModel.forward` loss (KL to the target's full softmax + the selector's
              K-way CE, exp(-(k-1)/4) weights, eager losses) equals our dflash2_head_loss given that
              softmax as the whole vocabulary (k = V, tail 0), divided by its denominator (the count
              of trained slots); and the drafter's gradients agree. Also with a TV term and with
              D-PACE weights (speculators' `tv` and `dpace` options).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from benchmarks.common import ROOT

VENV_VARIABLE = "ALRIRA_SPECULATORS_VENV"


def _rerun_in_reference_venv() -> None:
    """Run this module again under the speculators virtualenv's python when this one lacks it."""
    try:
        import speculators.models.dflash2  # noqa: F401
    except ImportError as error:
        venv = os.environ.get(VENV_VARIABLE)
        if not venv:
            raise SystemExit(f"speculators 0.9 is not importable here; set {VENV_VARIABLE} to its virtualenv") from None
        python = Path(venv) / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"{VENV_VARIABLE}={venv}: no {python}") from None
        if Path(sys.prefix).resolve() == Path(venv).resolve():  # already there: its own import fails
            raise SystemExit(f"{VENV_VARIABLE}={venv}: speculators does not import there ({error})") from None
        os.chdir(ROOT)
        os.execv(str(python), [str(python), "-m", __spec__.name, *sys.argv[1:]])


if __name__ == "__main__":
    _rerun_in_reference_venv()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from drafter.config import DFlashConfig  # noqa: E402
from drafter.dflash2 import DFlash2Options  # noqa: E402
from drafter.dflash2_loss import dflash2_head_loss  # noqa: E402
from drafter.dflash2_model import DFlash2Config, DFlash2Drafter  # noqa: E402
from drafter.family import SupervisedSlots  # noqa: E402
from drafter.masks import visibility_mask  # noqa: E402

# A tiny Qwen3 target: 2 query heads per kv head, 4 convolution groups of 16 channels.
TARGET = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=80, max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-6, hidden_act="silu",
)  # fmt: skip
BLOCK, SEQ, ANCHORS = 5, 29, (3, 9, 14, 20)
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=12, selector_top_k=6)
GAMMA = 4.0
# (name, speculators' loss spec, its per_position_loss_weight, our loss options)
LOSSES = (
    ("kl", '{"kl_div": 1.0}', "fixed-exp-decay", DFlash2Options()),
    ("kl+tv", '{"kl_div": 1.0, "tv": 0.5}', "fixed-exp-decay", DFlash2Options(tv_alpha=0.5)),
    ("kl+tv dpace", '{"kl_div": 1.0, "tv": 0.5}', "dpace", DFlash2Options(tv_alpha=0.5, dflash2_weighting="dpace")),
)


def _our_drafter(seed: int) -> DFlash2Drafter:
    """A DFlash2 drafter with every weight random: norms near 1, base kernels away from the identity."""
    torch.manual_seed(seed)
    backbone = DFlashConfig.from_target_config(TARGET, num_draft_layers=2, mask_token_id=TARGET["vocab_size"] - 1,
                                               target_layer_ids=[1, 4], block_size=BLOCK)  # fmt: skip
    drafter = DFlash2Drafter(DFlash2Config.from_dflash(backbone, **DFLASH2)).float()
    spread = {"norm.weight": (1.0, 0.25), "base_kernel": (0.5, 0.3), "kernel_projection.weight": (0.0, 0.05)}  # (mean, std)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            for suffix, (mean, std) in spread.items():
                if name.endswith(suffix):
                    param.normal_(mean, std)
    return drafter


def _reference_drafter(ours: DFlash2Drafter, *, embed_tokens: torch.Tensor, lm_head: torch.Tensor):
    """speculators' DFlash2DraftModel with our weights, SDPA attention (its flex path has no CPU
    backward), the target's embedding and head."""
    from transformers import Qwen3Config

    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    layer_config = Qwen3Config(**{**TARGET, "num_hidden_layers": ours.config.num_hidden_layers}, attention_bias=False, tie_word_embeddings=False)
    layer_config._attn_implementation = "sdpa"
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=TARGET["vocab_size"], block_size=BLOCK,
        aux_hidden_state_layer_ids=list(ours.config.target_layer_ids), mask_token_id=ours.config.mask_token_id,
        sample_from_anchor=False, **DFLASH2,
    )  # fmt: skip
    model = DFlash2DraftModel(config).float()
    state = dict(ours.state_dict()) | {"embed_tokens.weight": embed_tokens, "lm_head.weight": lm_head, "verifier_lm_head.weight": lm_head}
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(("verifier_norm", "rotary"))]
    if missing or unexpected:
        raise SystemExit(f"speculators' DFlash2DraftModel: missing {missing}, unexpected {unexpected}")
    for module in (model.embed_tokens, model.lm_head, model.verifier_lm_head, model.verifier_norm):
        module.requires_grad_(False)
    return model


def _case(seed: int) -> dict:
    """One packed sequence: features of the tapped layers, tokens, a loss mask with holes, the
    target's last hidden states, the target's embedding and head."""
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = TARGET["hidden_size"], TARGET["vocab_size"]
    loss_mask = torch.ones(1, SEQ, dtype=torch.long)
    loss_mask[0, [7, 16, 17]] = 0
    return dict(
        features=torch.randn(1, SEQ, 2 * hidden, generator=generator),
        input_ids=torch.randint(0, vocab - 1, (1, SEQ), generator=generator),
        loss_mask=loss_mask,
        last_hidden=torch.randn(1, SEQ, hidden, generator=generator),
        embed_tokens=torch.randn(vocab, hidden, generator=generator) * 0.5,
        lm_head=torch.randn(vocab, hidden, generator=generator) * 0.3,
        anchors=torch.tensor(ANCHORS),
    )


def _our_hidden(drafter: DFlash2Drafter, case: dict) -> torch.Tensor:
    """Our drafter's final-normed hidden states [N * B, H] of the pinned anchors' blocks, one row."""
    anchors, num_blocks = case["anchors"], len(ANCHORS)
    block_tokens = torch.full((num_blocks, BLOCK), drafter.config.mask_token_id)
    block_tokens[:, 0] = case["input_ids"][0, anchors]
    positions = (anchors[:, None] + torch.arange(BLOCK)).reshape(1, -1)  # [1, N * B]
    mask = visibility_mask(
        context_positions=torch.arange(SEQ)[None], context_owner=torch.full((1, SEQ), -1),
        context_valid=torch.ones(1, SEQ, dtype=torch.bool), block_corpus_limit=anchors[None],
        block_valid=torch.ones(1, num_blocks, dtype=torch.bool), block_size=BLOCK,
    )  # fmt: skip
    hidden = drafter(
        context_features=case["features"], context_positions=torch.arange(SEQ)[None],
        block_embeds=F.embedding(block_tokens.reshape(1, -1), case["embed_tokens"]), block_positions=positions, attention_mask=mask,
    )  # fmt: skip
    return hidden[0]


def _pin_anchors(anchors: torch.Tensor) -> None:
    """speculators draws its anchors at random inside forward; pin them to the case's."""
    import speculators.models.dflash.core as core

    core.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors, torch.ones_like(anchors, dtype=torch.bool))


def check_forward(ours: DFlash2Drafter, reference, case: dict) -> dict:
    with torch.no_grad():
        their_hidden, their_logits, _, _, block_indices = reference._backbone_forward(
            case["features"], case["input_ids"], case["loss_mask"], case["last_hidden"], torch.zeros_like(case["input_ids"]),
            max_anchors=len(ANCHORS),
        )  # fmt: skip
        predecessors = reference._predecessor_ids(case["input_ids"], block_indices).reshape(1, -1)
        candidate_ids, their_scores = reference.candidate_selector.select(their_logits, their_hidden, predecessors)
        hidden = _our_hidden(ours, case)  # [N * B, H]
        logits = hidden @ case["lm_head"].T
        scores = logits.gather(-1, candidate_ids[0]) + ours.candidate_selector.transition_scores(hidden, predecessors[0], candidate_ids[0])
    return {
        "logits_max_abs_diff": (logits - their_logits[0]).abs().max().item(),
        "scores_max_abs_diff": (scores - their_scores[0]).abs().max().item(),
        "candidates_equal": bool(torch.equal(logits.topk(DFLASH2["selector_top_k"]).indices, candidate_ids[0])),
        "logits_max_abs": their_logits.abs().max().item(),
    }


def _our_loss(ours: DFlash2Drafter, case: dict, options: DFlash2Options) -> torch.Tensor:
    """sum(w * l) of our head loss over the trained slots, the target's softmax given as k = V."""
    anchors, vocab = case["anchors"], TARGET["vocab_size"]
    hidden = _our_hidden(ours, case).view(len(ANCHORS), BLOCK, -1)[:, 1:]  # [N, K, H]: drafting slots 1..B-1
    label_pos = anchors[:, None] + torch.arange(1, BLOCK)  # [N, K]: the token slot k predicts, x[a + k]
    last = case["last_hidden"][0, label_pos - 1]  # the target's state one position before it
    probs = torch.softmax(F.rms_norm(last, (last.shape[-1],), eps=TARGET["rms_norm_eps"]) @ case["lm_head"].T, dim=-1)
    label_probs, label_ids = probs.sort(dim=-1, descending=True)  # [N, K, V]: the whole vocabulary, tail 0
    trained = case["loss_mask"][0, label_pos].bool()  # [N, K]
    slot = torch.arange(1, BLOCK).expand_as(label_pos)
    envelope = torch.exp(-(slot - 1) / GAMMA) if options.dflash2_weighting == "exp-decay" else torch.ones_like(slot, dtype=torch.float)
    prev = case["input_ids"][0, label_pos - 1]  # the corpus token before each label
    pick = trained.reshape(-1)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, *t.shape[2:])[pick]

    slots = SupervisedSlots(
        hidden=flat(hidden), label_ids=flat(label_ids), label_probs=flat(label_probs), weights=flat(envelope),
        prev_tokens=flat(prev), dist_ids=flat(label_ids), dist_probs=flat(label_probs),
        block_index=flat(torch.arange(len(ANCHORS))[:, None].expand_as(slot)), label_column=flat(slot - 1),
    )  # fmt: skip
    loss_sum, _ = dflash2_head_loss(ours, slots, lm_head=case["lm_head"], options=options, loss_chunk=7, autocast=contextlib.nullcontext())
    return loss_sum / (pick.sum() + 1e-5)  # speculators' denominator: the trained slots (+ its eps)


def check_loss(ours: DFlash2Drafter, reference, case: dict) -> dict:
    from speculators.losses import resolve_loss_config
    from speculators.losses.eager import tv_loss  # its default, the fused one, is a Triton kernel

    results = {}
    for name, spec, weighting, options in LOSSES:
        reference.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        _, their_loss, _ = reference(
            case["features"], case["input_ids"], case["loss_mask"], case["last_hidden"], torch.zeros_like(case["input_ids"]),
            loss_config=resolve_loss_config(spec, "eager"), tv_loss_fn=tv_loss, gamma=GAMMA, max_anchors=len(ANCHORS),
            selector_loss_alpha=1.0, per_position_loss_weight=weighting, dpace_alpha=options.dpace_alpha,
        )  # fmt: skip
        their_loss.backward()
        our_loss = _our_loss(ours, case, options)
        our_loss.backward()
        theirs = dict(reference.named_parameters())
        grad_diff = max((p.grad - theirs[n].grad).abs().max().item() for n, p in ours.named_parameters())
        grad_scale = max(p.grad.abs().max().item() for p in ours.parameters())
        results[name] = {"ours": our_loss.item(), "theirs": their_loss.item(), "loss_abs_diff": abs(our_loss.item() - their_loss.item()),
                         "grad_max_abs_diff": grad_diff, "grad_max_abs": grad_scale}  # fmt: skip
    return results


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    from importlib.metadata import version

    case = _case(seed=1)
    ours = _our_drafter(seed=0)
    reference = _reference_drafter(ours, embed_tokens=case["embed_tokens"], lm_head=case["lm_head"])
    _pin_anchors(case["anchors"])
    results = {"speculators": version("speculators"), "torch": torch.__version__, "forward": check_forward(ours, reference, case),
               "loss": check_loss(ours, reference, case)}  # fmt: skip
    forward = results["forward"]
    print(f"forward: unary logits max |diff| {forward['logits_max_abs_diff']:.2e} (of {forward['logits_max_abs']:.2f}), "
          f"selector scores {forward['scores_max_abs_diff']:.2e}, same top-{DFLASH2['selector_top_k']} candidates: {forward['candidates_equal']}")  # fmt: skip
    for name, r in results["loss"].items():
        print(f"loss {name}: ours {r['ours']:.6f} speculators {r['theirs']:.6f} |diff| {r['loss_abs_diff']:.2e}; "
              f"gradients max |diff| {r['grad_max_abs_diff']:.2e} (of {r['grad_max_abs']:.2e})")  # fmt: skip
    print(json.dumps(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
