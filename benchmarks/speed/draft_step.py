"""Draft-step benchmark: the evaluator's drafter with its context keys/values kept across rounds
(`cached_draft_fn`) vs recomputing the whole context every round (`drafter_draft`), side by side.

    .venv/bin/python -m benchmarks.speed.draft_step [--quick] [--threads 2]

For each context length p, a decode-like sequence of rounds: each round commits `--tau` tokens
(their features are appended) and drafts one block of 16 after them. The cached path projects
only the new positions; the uncached one projects all p. Both get the same features and must
propose the same tokens (checked). Timings: wall clock per round, median over the rounds, after
one warm-up decode; the drafter is randomly initialised (speed does not depend on the weights).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

from benchmarks.common.cli import bench_parser
from benchmarks.common.report import print_table
from drafter.config import DFlashConfig
from drafter.model import DFlashDrafter
from pipeline.eval.speculative import cached_draft_fn, drafter_draft

FULL = dict(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, vocab=4096, lengths=(256, 1024, 4096))
QUICK = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, vocab=512, lengths=(64, 256))


def make_drafter(sizes: dict, *, num_layers: int) -> tuple[DFlashDrafter, nn.Embedding, nn.Linear]:
    config = DFlashConfig(
        hidden_size=sizes["hidden_size"], intermediate_size=sizes["intermediate_size"], num_hidden_layers=num_layers,
        num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_kv_heads"], head_dim=64,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192, vocab_size=sizes["vocab"] + 1, block_size=16,
        num_target_layers=8, target_layer_ids=[1, 4, 6], mask_token_id=sizes["vocab"], dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return DFlashDrafter(config).eval(), embed, lm_head


@torch.inference_mode()
def time_rounds(draft_fn, *, features: torch.Tensor, start: int, tau: int, num_rounds: int) -> tuple[list[float], list]:
    """Seconds per round and the drafts, for rounds with anchors at start, start + tau, ..."""
    seconds, drafts = [], []
    for r in range(num_rounds):
        anchor_pos = start + r * tau
        began = time.perf_counter()
        draft = draft_fn(context_features=features[:anchor_pos], anchor_token=7, anchor_pos=anchor_pos)
        seconds.append(time.perf_counter() - began)
        drafts.append(draft.tolist())
    return seconds, drafts


def main() -> None:
    parser = bench_parser(__doc__, quick_help="tiny sizes, to smoke-test the script", threads=2)
    parser.add_argument("--layers", type=int, default=1, help="drafter layers (DFlash releases use 1-5)")
    parser.add_argument("--tau", type=int, default=4, help="tokens committed per round")
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    drafter, embed, lm_head = make_drafter(sizes, num_layers=args.layers)
    cfg = drafter.config
    kwargs = dict(embed_tokens=embed, lm_head=lm_head, mask_token_id=cfg.mask_token_id)
    print(
        f"drafter: {args.layers} layer(s), hidden {cfg.hidden_size}, {cfg.num_attention_heads}x{cfg.head_dim} heads, "
        f"{cfg.num_taps} taps; {args.rounds} rounds of tau {args.tau} per context length; torch {torch.__version__}, "
        f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}"
    )
    rows = []
    for length in sizes["lengths"]:
        features = torch.randn(length + args.rounds * args.tau, cfg.num_taps * cfg.hidden_size)
        results = {}
        for _ in range(2):  # each path twice, alternating: the first pass is the warm-up
            for cached in (False, True):
                if cached:
                    fn = cached_draft_fn(drafter, **kwargs)  # a fresh decode: its cache starts empty
                else:
                    fn = lambda **call: drafter_draft(drafter, **kwargs, **call)  # noqa: E731
                results[cached] = time_rounds(fn, features=features, start=length, tau=args.tau, num_rounds=args.rounds)
        (uncached_s, uncached_drafts), (cached_s, cached_drafts) = results[False], results[True]
        same = sum(a == b for a, b in zip(uncached_drafts, cached_drafts, strict=True))
        # The cached path's first round projects the whole prompt (the prefill); later rounds are steady state.
        uncached_ms = 1000 * statistics.median(uncached_s[1:])
        cached_ms = 1000 * statistics.median(cached_s[1:])
        rows.append([
            str(length), f"{uncached_ms:.2f}", f"{cached_ms:.2f}", f"{uncached_ms / cached_ms:.2f}x",
            f"{1000 * cached_s[0]:.2f}", f"{same}/{args.rounds}",
        ])  # fmt: skip
    print_table(
        "draft step per round (ms, median of rounds 2..N)",
        ["context p", "recompute context", "cached K/V", "ratio", "cached round 1 (prompt)", "same drafts"],
        rows,
    )
    print(f"\nload average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
