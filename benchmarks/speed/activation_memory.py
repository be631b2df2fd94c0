"""Train-step benchmark: `--activation-checkpointing` vs storing activations, side by side.

    .venv/bin/python -m benchmarks.speed.activation_memory [--quick] [--threads 2]

One drafter forward + backward over a training-shaped batch (sequences x blocks of 16 after a
shared corpus context, the training visibility mask), both ways on the same inputs. Memory is the
bytes autograd keeps for backward (saved tensors, parameters excluded), counted exactly with
saved_tensors_hooks, so it is the same on CPU and GPU; time is wall clock (median of repeats).
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
from drafter.masks import visibility_mask
from drafter.model import DFlashDrafter

FULL = dict(hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=4, batch=2, context=512, blocks=32, repeats=3)
QUICK = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, batch=2, context=64, blocks=8, repeats=2)
BLOCK_SIZE = 16


def training_batch(sizes: dict, config: DFlashConfig, generator: torch.Generator) -> dict:
    batch, context, blocks = sizes["batch"], sizes["context"], sizes["blocks"]
    positions = torch.arange(context).expand(batch, context)  # [B, C]
    anchors = torch.sort(torch.randint(1, context - BLOCK_SIZE, (batch, blocks), generator=generator), dim=1).values
    mask = visibility_mask(
        context_positions=positions,
        context_owner=torch.full((batch, context), -1),
        context_valid=torch.ones((batch, context), dtype=torch.bool),
        block_corpus_limit=anchors,
        block_valid=torch.ones((batch, blocks), dtype=torch.bool),
        block_size=BLOCK_SIZE,
    )
    return dict(
        context_features=torch.randn(batch, context, config.num_taps * config.hidden_size, generator=generator),
        context_positions=positions,
        block_embeds=torch.randn(batch, blocks * BLOCK_SIZE, config.hidden_size, generator=generator),
        block_positions=(anchors[:, :, None] + torch.arange(BLOCK_SIZE)).reshape(batch, -1),
        attention_mask=mask,
    )


def step(model: DFlashDrafter, inputs: dict) -> tuple[int, float]:
    """Saved-activation bytes and seconds of one forward + backward."""
    saved = 0

    def pack(t):
        nonlocal saved
        if not isinstance(t, nn.Parameter):
            saved += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    out.float().pow(2).mean().backward()
    return saved, time.perf_counter() - began


def main() -> None:
    args = bench_parser(__doc__, quick_help="tiny sizes, to smoke-test the script", threads=2).parse_args()
    sizes = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    rows = []
    for layers in (1, 3, 5):
        config = DFlashConfig(
            hidden_size=sizes["hidden_size"], intermediate_size=sizes["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_kv_heads"], head_dim=64,
            rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, vocab_size=1024, block_size=BLOCK_SIZE,
            num_target_layers=8, target_layer_ids=[1, 4, 6], mask_token_id=1023, dtype="float32",
        )  # fmt: skip
        torch.manual_seed(0)
        model = DFlashDrafter(config).train()
        inputs = training_batch(sizes, config, torch.Generator().manual_seed(1))
        results = {False: [], True: []}
        for checkpointing in (False, True):  # warm-up of each setting
            model.activation_checkpointing = checkpointing
            step(model, inputs)
        for _ in range(sizes["repeats"]):  # the settings take turns, so load spreads over both
            for checkpointing in (False, True):
                model.activation_checkpointing = checkpointing
                results[checkpointing].append(step(model, inputs))
        plain_bytes, ckpt_bytes = results[False][0][0], results[True][0][0]
        plain_s = statistics.median(s for _, s in results[False])
        ckpt_s = statistics.median(s for _, s in results[True])
        rows.append([
            str(layers), f"{plain_bytes / 2**20:.1f}", f"{ckpt_bytes / 2**20:.1f}", f"{plain_bytes / ckpt_bytes:.2f}x",
            f"{1000 * plain_s:.0f}", f"{1000 * ckpt_s:.0f}", f"{ckpt_s / plain_s:.2f}x",
        ])  # fmt: skip
    queries = sizes["blocks"] * BLOCK_SIZE
    print_table(
        f"forward + backward, {sizes['batch']} sequences x {sizes['blocks']} blocks of {BLOCK_SIZE} ({queries} queries) "
        f"over {sizes['context']} context positions, hidden {sizes['hidden_size']}, fp32, {args.threads} threads; "
        f"load average {os.getloadavg()[0]:.2f}",
        ["layers", "saved MiB", "saved MiB, ckpt", "memory ratio", "step ms", "step ms, ckpt", "time ratio"],
        rows,
    )


if __name__ == "__main__":
    main()
