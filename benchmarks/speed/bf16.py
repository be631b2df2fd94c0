"""fp32 against bf16 on this CPU, side by side in one run: the stage-1 target pass (build), the
regeneration's batched greedy decode, one drafter training step, and evaluation (AR and speculative
decoding), each with 1 and 2 torch threads; then a profile of where a bf16 training step's time goes
outside the lm_head GEMM.

    python -m benchmarks.speed.bf16 [--quick] [--out DIR] [--repeats 3]

The target is a random Qwen3 shaped like SmolLM2-135M's blocks (hidden 576, 9 heads x 64, 3 kv heads,
MLP 1536; --layers of them, default 8) over an 8,192-word vocabulary, so the lm_head GEMM weighs as
in a real model. Each measurement is the median of --repeats timed runs after one warm-up; the two
dtypes run alternately (fp32, bf16, fp32, ...) so a burst of load from other jobs hits both. The
ratios, not the seconds, are what carry to another machine of the same CPU family
(docs/benchmarks.md, "bf16 on the CPU").
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.cli import bench_parser, work_directory
from benchmarks.common.report import print_table
from benchmarks.common.toy import write_toy_corpus
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, run_target_batch
from pipeline.demo.toy import DEFAULT_WORDS, ToyShape
from pipeline.eval.speculative import autoregressive_decode, speculative_decode
from pipeline.precision import native_bf16_matmul
from pipeline.regenerate.backends import HfGenerator, TurnRequest
from pipeline.regenerate.config import SamplingConfig
from pipeline.target import load_target, load_tokenizer
from pipeline.train.batching import CacheTrainDataset, StepSampler, collate
from pipeline.train.config import TrainConfig
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.plan import plan_drafter
from pipeline.train.setup import build_drafter
from pipeline.train.step import forward_loss
from storage.manifest import load_target_head
from storage.reader import open_cache

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
THREADS = (1, 2)
VOCAB_WORDS = 8192


def smollm2_like(num_layers: int) -> ToyShape:
    return ToyShape(hidden_size=576, num_hidden_layers=num_layers, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536)  # fmt: skip


def make_target(work: Path, shape: ToyShape) -> Path:
    """The random target, its vocabulary the toy words plus filler words up to VOCAB_WORDS."""
    from pipeline.demo.toy import make_toy_target

    words = DEFAULT_WORDS + [f"w{i:05d}" for i in range(max(0, VOCAB_WORDS - len(DEFAULT_WORDS)))]
    return make_toy_target(work / "target", words=words, **vars(shape), seed=0, peaked=True)


class Stages:
    """Every measured stage as fn(dtype, threads) -> seconds of one run, sharing one target and cache."""

    def __init__(self, work: Path, *, shape: ToyShape, quick: bool):
        self.quick = quick
        self.target_dir = make_target(work, shape)
        corpus = write_toy_corpus(work / "chat.jsonl", num_rows=8 if quick else 16, response_words=(40, 80), max_turns=1)
        self.cache = work / "cache"
        config = CacheBuildConfig.from_flags(
            target=str(self.target_dir), corpus=str(corpus), out=str(self.cache), layers=[0, 2], anchors=16,
            num_slots=15, top_k=8, max_length=256, shard_size=8,
        )  # fmt: skip
        build_cache(config, run_shards=run_shards_here, progress=False, log=lambda line: None)
        self.reader = open_cache(self.cache)
        manifest = self.reader.manifest
        self.sequences = [self._sequence(i) for i in range(min(len(self.reader), 4 if quick else 8))]
        self.run_config = TargetRunConfig(layer_ids=manifest.settings.layer_ids, num_slots=15, top_k=8, anchors_per_sequence=16, seed=0)
        self.tokenizer = load_tokenizer(self.target_dir)
        self.targets = {name: load_target(self.target_dir, dtype=dtype) for name, dtype in DTYPES.items()}
        self.manifest, self.head = manifest, load_target_head(self.cache)
        objective = ObjectiveConfig(method="alr_ira", num_slots=15, rollout_depth=14, mask_token_id=manifest.mask_token_id,
                                    stop_token_ids=tuple(manifest.stop_token_ids))  # fmt: skip
        dataset = CacheTrainDataset(self.reader, objective=objective, seed=0)
        sampler = StepSampler(len(self.reader), batch_size=4, grad_accum=1, epochs=1, seed=0, rank=0, world_size=1)
        self.batch = collate([dataset[key] for key in next(iter(sampler.steps()))[2][0]])
        self.prompts = [s.input_ids[:48].tolist() for s in self.sequences[:2]]
        self.train_config = TrainConfig.from_flags(cache=str(self.cache), out="-", method="alr_ira", seed=0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.drafter = build_drafter(plan_drafter(self.train_config, manifest)).eval()  # random: evaluate's drafts are its cost, not its tau

    def _sequence(self, index: int) -> TargetSequence:
        record = self.reader.read(index, decode_features=False)
        return TargetSequence(source_row=int(record["source_row"]), input_ids=record["input_ids"], loss_mask=record["loss_mask"])

    def build(self, dtype: str) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            run_target_batch(self.targets[dtype], self.sequences, self.run_config)
        return time.perf_counter() - start

    def regenerate(self, dtype: str) -> float:
        """HfGenerator's batched greedy decode (regeneration at T = 0) of 4 turns."""
        requests = [TurnRequest(prompt_ids=p, max_new_tokens=16 if self.quick else 32, seed=0) for p in self.prompts * 2]
        generator = self._generator(dtype)
        start = time.perf_counter()
        generator.generate(requests)
        return time.perf_counter() - start

    def _generator(self, dtype: str) -> HfGenerator:
        if not hasattr(self, "_generators"):
            self._generators = {}
        if dtype not in self._generators:
            self._generators[dtype] = HfGenerator(
                str(self.target_dir), sampling=SamplingConfig(), device="cpu", dtype=DTYPES[dtype], batch_tokens=8192
            )
        return self._generators[dtype]

    def train_step(self, dtype: str, *, profile: bool = False):
        """One trainer step as pipeline/train/loop.py runs it at --precision fp32 / bf16."""
        drafter = build_drafter(plan_drafter(self.train_config, self.manifest))
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3, weight_decay=0.0)
        compute = DTYPES[dtype]
        embed, lm_head = self.head["embed_tokens.weight"].to(compute), self.head["lm_head.weight"].to(compute)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

        def step() -> None:
            stats = forward_loss(drafter, self.batch, embed_tokens=embed, lm_head=lm_head, block_size=16, loss_chunk=4096, autocast=autocast)
            (stats.loss_sum / (stats.weight_sum + 1e-6)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up: first-call costs
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                step()
            return prof
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    def evaluate(self, dtype: str) -> float:
        """AR then speculative decoding of the prompts (both in `dtype`: the lossless check stays like for like)."""
        target = self.targets[dtype]
        drafter = self.drafter.to(DTYPES[dtype])
        stops = list(self.manifest.stop_token_ids)
        start = time.perf_counter()
        with torch.inference_mode():
            for prompt in self.prompts:
                autoregressive_decode(target, prompt, max_new_tokens=24, temperature=0.0, stop_token_ids=stops, generator=None)
                speculative_decode(
                    target, drafter, embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings(),
                    prompt_ids=prompt, max_new_tokens=24, temperature=0.0, stop_token_ids=stops, generator=None,
                    mask_token_id=self.manifest.mask_token_id,
                )  # fmt: skip
        return time.perf_counter() - start


def measure(stages: Stages, *, repeats: int) -> list[list]:
    """[stage, threads, fp32 s, bf16 s, fp32 / bf16] rows, the dtypes alternating within each repeat."""
    rows = []
    for name in ("build", "regenerate", "train_step", "evaluate"):
        fn = getattr(stages, name)
        for threads in THREADS:
            torch.set_num_threads(threads)
            for dtype in DTYPES:  # warm-up
                fn(dtype)
            runs = {dtype: [] for dtype in DTYPES}
            for _ in range(repeats):
                for dtype in DTYPES:
                    runs[dtype].append(fn(dtype))
            fp32, bf16 = statistics.median(runs["fp32"]), statistics.median(runs["bf16"])
            rows.append([name, threads, f"{fp32:.3f}", f"{bf16:.3f}", f"{fp32 / bf16:.2f}x"])
            print(f"  {name}, {threads} thread(s): fp32 {fp32:.3f}s, bf16 {bf16:.3f}s", flush=True)
    return rows


def profile_rows(stages: Stages, *, vocab: int, threads: int) -> tuple[list[list], float]:
    """The bf16 step's ops by self CPU time; the lm_head GEMM (an mm with the vocabulary in a shape) apart."""
    torch.set_num_threads(threads)
    prof = stages.train_step("bf16", profile=True)
    by_op: dict[str, float] = {}
    lm_head_us = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        if any(vocab in shape for shape in event.input_shapes if isinstance(shape, list)) and event.key in (
            "aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "aten::bmm"
        ):  # fmt: skip
            lm_head_us += event.self_cpu_time_total
            continue
        by_op[event.key] = by_op.get(event.key, 0.0) + event.self_cpu_time_total
    total = lm_head_us + sum(by_op.values())
    top = sorted(by_op.items(), key=lambda item: -item[1])[:12]
    rows = [["lm_head GEMM (mm with the vocabulary)", f"{lm_head_us / 1e3:.1f}", f"{100 * lm_head_us / total:.1f}%"]]
    rows += [[name, f"{us / 1e3:.1f}", f"{100 * us / total:.1f}%"] for name, us in top]
    return rows, total / 1e3


def main() -> None:
    parser = bench_parser(__doc__, quick_help="4 layers, fewer sequences: smoke-tests the script",
                          out_help="workspace directory (default: a new temp dir)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=8, help="target layers (SmolLM2-135M has 30)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement after one warm-up")
    args = parser.parse_args()
    work = work_directory(args.out, temp_prefix="alrira-bench-bf16-")
    shape = smollm2_like(4 if args.quick else args.layers)
    print(f"native bf16 matmul on this CPU: {native_bf16_matmul()}; torch {torch.__version__}", flush=True)
    stages = Stages(work, shape=shape, quick=args.quick)
    vocab = stages.head["lm_head.weight"].shape[0]
    for threads in THREADS:
        top, total_ms = profile_rows(stages, vocab=vocab, threads=threads)
        print_table(f"bf16 training step, {threads} thread(s): self CPU time by op ({total_ms:.0f} ms in all)", ["op", "ms", "share"], top)
    rows = measure(stages, repeats=args.repeats)
    print_table("fp32 vs bf16 (median seconds of one run; ratio > 1: bf16 faster)", ["stage", "threads", "fp32 s", "bf16 s", "fp32 / bf16"], rows)


if __name__ == "__main__":
    main()
