"""The GPU figures docs/benchmarks.md estimates, measured on one CUDA device (run by benchmarks/gpu_check.sh):

(1) a bf16 training step at the Qwen3-4B DFlash shape (1 layer, H 2560, 32 x 128 heads, 8 kv heads,
    I 9728, V 151,936; fp32 master weights, bf16 autocast, frozen embed/lm_head held in bf16):
    forward_loss + backward + clip + AdamW on per-rank batches (3 sequences, the whole 128-anchor
    pool, alr_ira) of a synthetic real-shape cache (benchmarks/real_shapes.py), SDPA and flex
    attention: seconds per step, corpus tokens/s, peak CUDA memory;
(2) a stage-1 batch through a random Qwen3-4B-shaped target cut to 5 of its 36 layers (built from
    its config in bf16 on the device): `run_target_batch` on 4 sequences of ~700 tokens, 128 anchors,
    K = 15: anchors/s and peak CUDA memory.

    .venv/bin/python benchmarks/gpu_check.py            # needs CUDA
    .venv/bin/python benchmarks/gpu_check.py --cpu-smoke  # the same code at toy sizes on CPU
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from drafter.model import DFlashDrafter
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, run_target_batch
from pipeline.train.batching import CacheTrainDataset, collate
from storage.reader import open_cache

from _common import print_table
from real_shapes import FULL, QUICK, Shapes, drafter_config, objective, write_cache


@dataclass(frozen=True, kw_only=True)
class CheckSizes:
    cache: Shapes  # the synthetic cache and the drafter shape
    rank_batch: int  # sequences per step (global batch 24 over 8 ranks)
    num_cache_sequences: int
    warmup_steps: int
    timed_steps: int
    # the stage-1 target
    target_hidden: int
    target_layers: int
    target_heads: int
    target_kv_heads: int
    target_head_dim: int
    target_intermediate: int
    target_sequences: int
    target_seq_len: int
    target_repeats: int


GPU = CheckSizes(
    cache=FULL, rank_batch=3, num_cache_sequences=6, warmup_steps=2, timed_steps=6,
    target_hidden=2560, target_layers=5, target_heads=32, target_kv_heads=8, target_head_dim=128,
    target_intermediate=9728, target_sequences=4, target_seq_len=700, target_repeats=3,
)  # fmt: skip
CPU_SMOKE = CheckSizes(
    cache=QUICK, rank_batch=2, num_cache_sequences=4, warmup_steps=1, timed_steps=2,
    target_hidden=64, target_layers=3, target_heads=2, target_kv_heads=1, target_head_dim=32,
    target_intermediate=128, target_sequences=2, target_seq_len=64, target_repeats=1,
)  # fmt: skip


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / (1 << 30) if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def train_step_check(sizes: CheckSizes, *, work: Path, device: torch.device, attention: str) -> dict:
    """(1) with one attention path: median seconds per full step over the timed steps."""
    from pipeline.train.loop import forward_loss

    shapes = replace(sizes.cache, num_sequences=sizes.num_cache_sequences)
    cache = work / "cache"
    if not cache.exists():
        write_cache(cache, shapes)
    reader = open_cache(cache)
    dataset = CacheTrainDataset(reader, objective=objective("alr_ira", reader), seed=0)
    indices = list(range(len(reader)))
    batches = [
        collate([dataset[(0, i)] for i in indices[s : s + sizes.rank_batch]]).to(device)
        for s in range(0, len(indices) - sizes.rank_batch + 1, sizes.rank_batch)
    ]
    reset_peak(device)
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_config(shapes)).float().to(device)  # fp32 master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.0)
    compute_dtype = torch.bfloat16
    embed_tokens = torch.empty(shapes.vocab_size, shapes.hidden_size, device=device, dtype=compute_dtype).normal_(0.0, 0.02)
    lm_head = torch.empty(shapes.vocab_size, shapes.hidden_size, device=device, dtype=compute_dtype).normal_(0.0, 0.02)

    def step(batch) -> float:
        stats = forward_loss(
            model, batch, embed_tokens=embed_tokens, lm_head=lm_head, block_size=shapes.num_slots + 1, loss_chunk=4096,
            autocast=torch.autocast(device.type, dtype=compute_dtype), attention=attention,
        )  # fmt: skip
        loss = stats.loss_sum / (stats.weight_sum + 1e-6)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    for i in range(max(sizes.warmup_steps, len(batches))):  # every batch shape once (compiles)
        step(batches[i % len(batches)])
    synchronize(device)
    seconds, losses = [], []
    for i in range(sizes.timed_steps):
        batch = batches[i % len(batches)]
        start = time.perf_counter()
        losses.append(step(batch))  # float() synchronizes
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    tokens = statistics.mean(b.num_tokens for b in batches)
    reader.close()
    return {
        "attention": attention,
        "step_s": statistics.median(seconds),
        "tokens_per_s": tokens / statistics.median(seconds),
        "sequences": batches[0].num_sequences,
        "context_tokens": int(batches[0].context_valid.sum()),
        "blocks": int(batches[0].block_valid.sum()),
        "supervised_slots": int((batches[0].slot_weights > 0).sum()),
        "peak_gib": peak_memory_gib(device),
        "finite": all(np.isfinite(losses)),
    }


def stage1_check(sizes: CheckSizes, *, device: torch.device) -> dict:
    """(2): anchors/s of run_target_batch through a random Qwen3-4B-shaped (cut) target in bf16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shapes = sizes.cache
    config = Qwen3Config(
        vocab_size=shapes.vocab_size, hidden_size=sizes.target_hidden, intermediate_size=sizes.target_intermediate,
        num_hidden_layers=sizes.target_layers, num_attention_heads=sizes.target_heads,
        num_key_value_heads=sizes.target_kv_heads, head_dim=sizes.target_head_dim, max_position_embeddings=40_960,
        rope_theta=1_000_000.0, tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    reset_peak(device)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    rng = np.random.default_rng(0)
    sequences = []
    for i in range(sizes.target_sequences):
        loss_mask = np.ones(sizes.target_seq_len, dtype=np.uint8)
        loss_mask[: sizes.target_seq_len // 8] = 0  # the prompt
        input_ids = rng.integers(0, shapes.vocab_size, size=sizes.target_seq_len)
        sequences.append(TargetSequence(source_row=i, input_ids=input_ids, loss_mask=loss_mask))
    run_config = TargetRunConfig(
        layer_ids=list(range(sizes.target_layers)), num_slots=shapes.num_slots, top_k=shapes.top_k,
        anchors_per_sequence=shapes.num_anchors, seed=0, rollouts=True,
    )  # fmt: skip
    with torch.inference_mode():
        outputs = run_target_batch(model, sequences, run_config)  # warm-up
        synchronize(device)
        seconds = []
        for _ in range(sizes.target_repeats):
            start = time.perf_counter()
            outputs = run_target_batch(model, sequences, run_config)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
    num_anchors = sum(len(o.anchor_pos) for o in outputs)
    return {
        "batch_s": statistics.median(seconds),
        "anchors": num_anchors,
        "anchors_per_s": num_anchors / statistics.median(seconds),
        "tokens_per_s": sizes.target_sequences * sizes.target_seq_len / statistics.median(seconds),
        "peak_gib": peak_memory_gib(device),
        "feature_dim": int(outputs[0].features.shape[-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="the same code at toy sizes on CPU (no CUDA needed)")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, sizes, attentions = torch.device("cpu"), CPU_SMOKE, ("sdpa",)  # no CPU flex backward in torch 2.13
    else:
        if not torch.cuda.is_available():
            sys.exit("error: gpu_check.py needs a CUDA device (torch.cuda.is_available() is False); use --cpu-smoke on CPU")
        device, sizes, attentions = torch.device("cuda"), GPU, ("sdpa", "flex")
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    began = time.perf_counter()
    failures = []
    with tempfile.TemporaryDirectory(prefix="alrira-gpu-check-") as tmp:
        steps = []
        for attention in attentions:
            try:
                steps.append(train_step_check(sizes, work=Path(tmp), device=device, attention=attention))
            except Exception as error:  # one line per failed path; the other figures still print
                failures.append(f"training step, {attention}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
                print(f"FAILED {failures[-1]}", flush=True)
        shapes = sizes.cache
        print_table(
            f"(1) training step: alr_ira, 1 layer H{shapes.hidden_size} I{shapes.intermediate_size} V{shapes.vocab_size}, "
            f"bf16 autocast, {sizes.rank_batch} sequences x {shapes.num_anchors} anchors, on {device.type}",
            ["attention", "step s", "tokens/s", "context tokens", "blocks", "supervised slots", "peak GiB", "loss finite"],
            [[s["attention"], f"{s['step_s']:.3f}", f"{s['tokens_per_s']:.0f}", s["context_tokens"], s["blocks"],
              s["supervised_slots"], f"{s['peak_gib']:.2f}", s["finite"]] for s in steps],
        )  # fmt: skip
    try:
        target = stage1_check(sizes, device=device)
        print_table(
            f"(2) stage-1 batch: random Qwen3 H{sizes.target_hidden} x {sizes.target_layers} layers, V{shapes.vocab_size}, "
            f"{sizes.target_sequences} x {sizes.target_seq_len} tokens, A={shapes.num_anchors}, K={shapes.num_slots}",
            ["F", "batch s", "anchors", "anchors/s", "tokens/s", "peak GiB"],
            [[target["feature_dim"], f"{target['batch_s']:.3f}", target["anchors"], f"{target['anchors_per_s']:.0f}",
              f"{target['tokens_per_s']:.0f}", f"{target['peak_gib']:.2f}"]],
        )  # fmt: skip
    except Exception as error:
        failures.append(f"stage-1 batch: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
        print(f"FAILED {failures[-1]}", flush=True)
    print(f"\nwall {time.perf_counter() - began:.0f} s")
    if failures:
        sys.exit(f"error: {len(failures)} check(s) failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
