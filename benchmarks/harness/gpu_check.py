"""The GPU figures docs/benchmarks.md estimates, one section per run (harness/gpu_check.sh runs
each in its own process and time limit, so one failure or hang costs only its own table):

  attention  bf16 flex attention vs SDPA at the real shape: the 5-layer default drafter (H 2560,
             32 x 128 heads, 8 kv heads, I 9728, V 151,936), one alr_ira rank batch (3 sequences,
             the whole 128-anchor pool) of a synthetic real-shape cache (common/real_shape_cache.py):
             loss and gradients of one forward_loss + backward compared;
  step       that drafter's full training step (forward_loss + backward + clip + AdamW, fp32 master
             weights, bf16 autocast, frozen embed/lm_head in bf16) over batches of varying lengths:
             median step time, compile time (first steps over the steady ones), graphs compiled after
             the warm-up (recompiles), host syncs per step (CUDA sync debug mode), MFU, peak memory;
  loader     the map loader's rate on this node: sequences/s on one core for alr and alr_ira next
             to the bare decompression floor, a DataLoader with --num-workers' default, and the rate
             a rank needs at the step time measured by `step`;
  stage1     stage 1 through ShardBuilder with its writer (build_cache in this process) at
             --batch-tokens 8192 with a random Qwen3-4B-shaped target cut to 6 layers (taps 0..4)
             (F = 12,800, V = 151,936), built and saved by this script: sequences/s and MB/s written.

    .venv/bin/python -m benchmarks.harness.gpu_check --section step --work DIR           # needs CUDA
    .venv/bin/python -m benchmarks.harness.gpu_check --section step --work DIR --cpu-smoke  # toy sizes, CPU

Each section prints its table as soon as it has it and writes DIR/SECTION.json; exit 1 on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.common.loader import loader_and_floor
from benchmarks.common.real_shape_cache import FULL, QUICK, Shapes, drafter_config, objective, write_cache
from benchmarks.common.report import print_table
from benchmarks.common.toy import write_toy_corpus
from drafter.masks import visibility_mask
from drafter.model import DFlashDrafter
from pipeline.train.batching import CacheTrainDataset, collate
from pipeline.train.config import default_num_workers
from storage.reader import open_cache

SECTIONS = ("attention", "step", "loader", "stage1")
# Dense bf16 peak of the GPUs this is run on (FLOP/s); GPU_PEAK_TFLOPS overrides.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


@dataclass(frozen=True, kw_only=True)
class CheckSizes:
    cache: Shapes  # the synthetic cache and the drafter shape
    draft_layers: int  # the default drafter: one layer per tap
    rank_batch: int  # sequences per step (global batch 24 over 8 ranks)
    num_cache_sequences: int
    timed_steps: int
    loader_workers: int | None  # None: --num-workers' default
    # the stage-1 target (Qwen3-4B cut to its taps)
    target_hidden: int
    target_heads: int
    target_kv_heads: int
    target_head_dim: int
    target_intermediate: int
    target_sequences: int
    target_response_words: tuple[int, int]
    batch_tokens: int


GPU = CheckSizes(
    cache=FULL, draft_layers=5, rank_batch=3, num_cache_sequences=9, timed_steps=6, loader_workers=None,
    target_hidden=2560, target_heads=32, target_kv_heads=8, target_head_dim=128, target_intermediate=9728,
    target_sequences=24, target_response_words=(500, 650), batch_tokens=8192,
)  # fmt: skip
CPU_SMOKE = CheckSizes(
    cache=QUICK, draft_layers=2, rank_batch=2, num_cache_sequences=4, timed_steps=2, loader_workers=1,
    target_hidden=64, target_heads=2, target_kv_heads=1, target_head_dim=32, target_intermediate=128,
    target_sequences=3, target_response_words=(30, 60), batch_tokens=8192,
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


def real_shape_cache(sizes: CheckSizes, work: Path) -> Path:
    """The synthetic real-shape cache the sections share, written once per work directory."""
    cache = work / "cache"
    if not (cache / "manifest.json").exists():
        partial = work / f"cache.partial-{os.getpid()}"
        write_cache(partial, replace(sizes.cache, num_sequences=sizes.num_cache_sequences))
        os.replace(partial, cache)
    return cache


def rank_batches(sizes: CheckSizes, cache: Path, device: torch.device, *, method: str = "alr_ira") -> list:
    """The cache's sequences as collated rank batches on the device (lengths differ batch to batch)."""
    reader = open_cache(cache)
    dataset = CacheTrainDataset(reader, objective=objective(method, reader), seed=0)
    n = sizes.rank_batch
    batches = [collate([dataset[(0, i)] for i in range(s, s + n)]).to(device) for s in range(0, len(reader) - n + 1, n)]
    reader.close()
    return batches


class Trainer:
    """The default drafter, its optimizer and the frozen head, stepping the way the loop does."""

    def __init__(self, sizes: CheckSizes, device: torch.device, *, attention: str):
        from pipeline.train.step import forward_loss

        shapes = sizes.cache
        torch.manual_seed(0)
        self.config = replace(drafter_config(shapes), num_hidden_layers=sizes.draft_layers)
        self.model = DFlashDrafter(self.config).float().to(device)  # fp32 master weights
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=6e-4, weight_decay=0.0)
        head = torch.Generator(device=device).manual_seed(1)
        shape = (shapes.vocab_size, shapes.hidden_size)
        self.embed_tokens = (torch.randn(shape, device=device, generator=head) * 0.02).to(torch.bfloat16)
        self.lm_head = (torch.randn(shape, device=device, generator=head) * 0.02).to(torch.bfloat16)
        self.loss = lambda batch: forward_loss(
            self.model, batch, embed_tokens=self.embed_tokens, lm_head=self.lm_head, block_size=shapes.num_slots + 1,
            loss_chunk=4096, autocast=torch.autocast(device.type, dtype=torch.bfloat16), attention=attention,
        )  # fmt: skip

    def backward(self, batch) -> torch.Tensor:
        stats = self.loss(batch)
        loss = stats.loss_sum / (stats.weight_sum + 1e-6)
        loss.backward()
        return loss.detach()

    def step(self, batch) -> torch.Tensor:
        loss = self.backward(batch)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def attention_section(sizes: CheckSizes, work: Path, device: torch.device) -> dict:
    """bf16 flex vs SDPA: one forward_loss + backward each from the same weights."""
    batch = rank_batches(sizes, real_shape_cache(sizes, work), device)[0]
    # No CPU flex backward in PyTorch 2.13: the smoke run exercises the comparison with SDPA twice.
    names = ("sdpa", "flex") if device.type == "cuda" else ("sdpa", "sdpa")
    results = {}
    for name in names:
        trainer = Trainer(sizes, device, attention=name)
        reset_peak(device)
        loss = float(trainer.backward(batch))
        grads = {n: p.grad.float() for n, p in trainer.model.named_parameters()}
        results[name] = (loss, grads, peak_memory_gib(device))
        del trainer
    (ref_loss, ref_grads, ref_peak), (loss, grads, peak) = results[names[0]], results[names[1]]
    worst = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in ref_grads.items())
    out = {"sdpa_loss": ref_loss, "flex_loss": loss, "loss_rel_diff": abs(loss - ref_loss) / abs(ref_loss),
           "worst_grad_rel_diff": worst, "sdpa_peak_gib": ref_peak, "flex_peak_gib": peak, "compared": list(names)}  # fmt: skip
    print_table(
        f"attention: bf16 {names[1]} vs {names[0]}, {sizes.draft_layers}-layer drafter, one alr_ira batch of "
        f"{batch.num_sequences} x {sizes.cache.num_anchors} anchors, C {batch.context_features.shape[1]}, on {device.type}",
        ["path", "loss", "loss rel diff", "worst grad rel diff (norm)", "peak GiB"],
        [[names[0], f"{ref_loss:.5f}", "-", "-", f"{ref_peak:.2f}"],
         [names[1], f"{loss:.5f}", f"{out['loss_rel_diff']:.2e}", f"{worst:.2e}", f"{peak:.2f}"]],
    )  # fmt: skip
    # bf16 rounds each GEMM to ~3 significant digits; the kernels differ in summation order only.
    if out["loss_rel_diff"] > 1e-2 or worst > 5e-2:
        raise RuntimeError(f"flex and SDPA differ: loss {out['loss_rel_diff']:.2e}, gradients {worst:.2e}")
    return out


def step_flops(batch, config) -> float:
    """Matmul FLOPs of one training step (3 x forward) on the batch's real rows: fc over the
    context, per layer q/o/MLP on the block tokens, k/v on context + block, attention over the
    visible pairs only, and the lm_head on the supervised slots."""
    H, F, I, V = config.hidden_size, config.num_taps * config.hidden_size, config.intermediate_size, config.vocab_size
    q_width, kv_width = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    context = float(batch.context_valid.sum())
    queries = float(batch.block_valid.sum()) * config.block_size
    visible = float(visibility_mask(
        context_positions=batch.context_positions, context_owner=batch.context_owner, context_valid=batch.context_valid,
        block_corpus_limit=batch.block_corpus_limit, block_valid=batch.block_valid, block_size=config.block_size,
    ).sum())  # fmt: skip
    per_layer = 2 * queries * H * q_width * 2 + 2 * (context + queries) * H * kv_width * 2 + 2 * queries * H * I * 3
    per_layer += 4 * visible * q_width  # QK^T and PV over the visible (query, key) pairs, every head
    forward = 2 * context * F * H + config.num_hidden_layers * per_layer + 2 * len(batch.supervised_index) * H * V
    return 3 * forward


def peak_flops(device: torch.device) -> float | None:
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def host_syncs(device: torch.device, fn) -> int | None:
    """Synchronizing CUDA calls fn makes (torch.cuda's sync debug mode warns once per call)."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    return sum("synchroniz" in str(w.message) for w in caught)


def step_section(sizes: CheckSizes, work: Path, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    attention = "flex" if device.type == "cuda" else "sdpa"
    batches = rank_batches(sizes, real_shape_cache(sizes, work), device)
    reset_peak(device)
    trainer = Trainer(sizes, device, attention=attention)
    graphs_before = counters["stats"]["unique_graphs"]
    first = []
    for batch in batches:  # every batch once: the compiles happen here
        start = time.perf_counter()
        trainer.step(batch)
        synchronize(device)
        first.append(time.perf_counter() - start)
    warm_graphs = counters["stats"]["unique_graphs"]
    seconds, flops = [], []
    for i in range(sizes.timed_steps):
        batch = batches[i % len(batches)]
        start = time.perf_counter()
        trainer.step(batch)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        flops.append(step_flops(batch, trainer.config))
    syncs = host_syncs(device, lambda: trainer.step(batches[0]))
    step_s = statistics.median(seconds)
    peak = peak_flops(device)
    out = {
        "attention": attention, "step_s": step_s, "compile_s": sum(first) - len(first) * step_s,
        "graphs_warm_up": warm_graphs - graphs_before, "recompiles_after_warm_up": counters["stats"]["unique_graphs"] - warm_graphs,
        "context_lengths": sorted({int(b.context_valid.sum(1).max()) for b in batches}),
        "padded_contexts": sorted({b.context_features.shape[1] for b in batches}),
        "tflops_per_step": statistics.mean(flops) / 1e12, "mfu": (statistics.mean(flops) / step_s / peak) if peak else None,
        "host_syncs_per_step": syncs, "peak_gib": peak_memory_gib(device),
        "sequences_per_s": sizes.rank_batch / step_s, "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
    }  # fmt: skip
    print_table(
        f"step: {sizes.draft_layers}-layer drafter ({out['params_m']:.0f} M), {attention}, bf16 autocast, AdamW, "
        f"{sizes.rank_batch} sequences x {sizes.cache.num_anchors} anchors, longest contexts {out['context_lengths']} "
        f"-> padded {out['padded_contexts']}, on {device.type}",
        ["step s", "seq/s", "compile s", "graphs (warm-up)", "recompiles after", "TFLOP/step", "MFU", "host syncs/step", "peak GiB"],
        [[f"{step_s:.3f}", f"{out['sequences_per_s']:.1f}", f"{out['compile_s']:.1f}", out["graphs_warm_up"],
          out["recompiles_after_warm_up"], f"{out['tflops_per_step']:.2f}", "n/a" if out["mfu"] is None else f"{out['mfu']:.1%}",
          "n/a" if syncs is None else syncs, f"{out['peak_gib']:.2f}"]],
    )  # fmt: skip
    return out


def loader_section(sizes: CheckSizes, work: Path, device: torch.device) -> dict:
    """The map loader on this node's CPUs: one core, its floor, and the default DataLoader."""
    cache = real_shape_cache(sizes, work)
    cores = len(os.sched_getaffinity(0))
    workers = sizes.loader_workers if sizes.loader_workers is not None else default_num_workers()
    step_file = work / "step.json"
    step_s = json.loads(step_file.read_text())["step_s"] if step_file.exists() else None
    rows, out = [], {"cores": cores, "workers": workers, "step_s": step_s, "methods": {}}
    torch.set_num_threads(1)
    for method in ("alr", "alr_ira"):
        reader = open_cache(cache)
        one_core, floor = loader_and_floor(reader, cache, method=method, shapes=replace(sizes.cache, rank_batch=sizes.rank_batch))
        reader.close()
        node = _data_loader_rate(cache, method=method, sizes=sizes, workers=workers, pin=device.type == "cuda")
        demand = sizes.rank_batch / step_s if step_s else None
        out["methods"][method] = {"one_core": one_core, "floor": floor, "data_loader": node, "rank_demand": demand}
        rows.append([method, f"{one_core:.2f}", f"{floor:.2f}", f"{floor / one_core:.2f}x", workers, f"{node:.2f}",
                     "n/a" if demand is None else f"{demand:.1f}"])  # fmt: skip
    print_table(
        f"loader: map loader at real shapes on this node ({cores} cores; --num-workers default {workers} for one rank)",
        ["method", "seq/s one core", "decode floor seq/s", "floor / loader", "workers", "DataLoader seq/s", "rank needs seq/s"],
        rows,
    )
    return out


def _data_loader_rate(cache: Path, *, method: str, sizes: CheckSizes, workers: int, pin: bool) -> float:
    from pipeline.train.data import single_threaded_worker as _single_threaded_worker

    reader = open_cache(cache)
    dataset = CacheTrainDataset(reader, objective=objective(method, reader), seed=0)
    keys = [[(epoch, i) for i in range(s, s + sizes.rank_batch)] for epoch in range(3)
            for s in range(0, len(reader) - sizes.rank_batch + 1, sizes.rank_batch)]  # fmt: skip
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=keys, collate_fn=collate, num_workers=workers, pin_memory=pin,
        prefetch_factor=2 if workers else None, worker_init_fn=_single_threaded_worker,
    )  # fmt: skip
    it = iter(loader)
    next(it)  # the workers started and one batch made
    start, sequences = time.perf_counter(), 0
    for batch in it:
        sequences += batch.num_sequences
    return sequences / (time.perf_counter() - start)


def qwen3_4b_cut_target(sizes: CheckSizes, path: Path, *, num_layers: int, device: torch.device) -> Path:
    """A random Qwen3-4B-shaped target (V 151,936) of `num_layers` layers, with the toy tokenizer
    (its ids are all below V), saved in bf16 where it runs on CUDA."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.demo.toy import make_toy_target

    make_toy_target(path, hidden_size=64, num_hidden_layers=1, head_dim=32)  # tokenizer files
    toy = Qwen3Config.from_pretrained(path)
    config = Qwen3Config(
        vocab_size=sizes.cache.vocab_size, hidden_size=sizes.target_hidden, intermediate_size=sizes.target_intermediate,
        num_hidden_layers=num_layers, num_attention_heads=sizes.target_heads, num_key_value_heads=sizes.target_kv_heads,
        head_dim=sizes.target_head_dim, max_position_embeddings=40_960, rope_parameters=toy.rope_parameters,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=toy.bos_token_id, eos_token_id=toy.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.save_pretrained(path)
    del model
    return path


def stage1_section(sizes: CheckSizes, work: Path, device: torch.device) -> dict:
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    shapes = sizes.cache
    taps = list(range(shapes.num_taps))
    target = qwen3_4b_cut_target(sizes, work / "stage1-target", num_layers=shapes.num_taps + 1, device=device)  # taps < L - 1
    corpus = write_toy_corpus(work / "stage1-corpus.jsonl", num_rows=sizes.target_sequences,
                              response_words=sizes.target_response_words, max_turns=1)  # fmt: skip
    out = work / "stage1-cache"
    config = CacheBuildConfig.from_flags(
        target=str(target), corpus=str(corpus), out=str(out), layers=taps, num_slots=shapes.num_slots, top_k=shapes.top_k,
        anchors=shapes.num_anchors, max_length=shapes.seq_len[1], shard_size=sizes.target_sequences,
        batch_tokens=sizes.batch_tokens, workers=1, gpus_per_worker=1 if device.type == "cuda" else 0,
        feature_codec="bf16", storage_format="zarr",
    )  # fmt: skip
    reset_peak(device)
    start = time.perf_counter()
    manifest = build_cache(config, run_shards=run_shards_here, progress=False, log=lambda message: None)
    seconds = time.perf_counter() - start
    written = sum(f.stat().st_size for f in (out / "shards").rglob("*") if f.is_file())
    result = {
        "sequences": manifest.num_sequences, "tokens": manifest.num_tokens, "anchors": manifest.num_anchors,
        "feature_dim": manifest.feature_dim, "build_s": seconds, "sequences_per_s": manifest.num_sequences / seconds,
        "written_mb_per_s": written / seconds / 1e6, "peak_gib": peak_memory_gib(device),
    }  # fmt: skip
    print_table(
        f"stage1: build_cache (ShardBuilder + its writer) at --batch-tokens {sizes.batch_tokens}, random Qwen3 "
        f"H{sizes.target_hidden} x {shapes.num_taps + 1} layers (taps {taps}), V{shapes.vocab_size}, A={shapes.num_anchors}, "
        f"K={shapes.num_slots}, zarr bf16, on {device.type}",
        ["sequences", "tokens", "F", "build s (incl. tokenizing, loading)", "seq/s", "MB/s written", "peak GiB"],
        [[result["sequences"], result["tokens"], result["feature_dim"], f"{seconds:.1f}", f"{result['sequences_per_s']:.2f}",
          f"{result['written_mb_per_s']:.0f}", f"{result['peak_gib']:.2f}"]],
    )  # fmt: skip
    return result


RUN = {"attention": attention_section, "step": step_section, "loader": loader_section, "stage1": stage1_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=SECTIONS, required=True)
    parser.add_argument("--work", required=True, help="directory the sections share (the synthetic cache, results)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the same code at toy sizes on CPU (no CUDA needed)")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, sizes = torch.device("cpu"), CPU_SMOKE
    elif not torch.cuda.is_available():
        sys.exit("error: gpu_check.py needs a CUDA device (torch.cuda.is_available() is False); use --cpu-smoke on CPU")
    else:
        device, sizes = torch.device("cuda"), GPU
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    try:
        result = RUN[args.section](sizes, work, device)
    except Exception as error:
        traceback.print_exc()
        sys.exit(f"FAILED {args.section}: {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}")
    (work / f"{args.section}.json").write_text(json.dumps(result, indent=1))
    print(f"{args.section}: {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
