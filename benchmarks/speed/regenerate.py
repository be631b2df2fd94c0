"""Regeneration throughput (`alrira-cache regenerate`): generated tokens per second of the same rows
written three ways, turn by turn as the command does (pipeline/regenerate/parts.py PartWriter):

- hf batched: the HF backend as it runs (greedy requests of a round batched, left padded);
- hf per row: the same backend with one `generate()` per request (what a per-row script does);
- vllm: the vLLM backend (one engine, every request of a round submitted together).

All greedy, fp32, on a tiny random Qwen3 (peaked, the toy target of the tests, larger) and the
toy chat corpus: the numbers compare backends on this machine, not a real model's speed. Each arm
writes one part of every row; the time is the part's wall clock after the model is loaded (the vLLM
engine start is printed apart), the fastest of --repeats. The script also counts the rows whose
text differs between arms (logit ties and batch-shape rounding can flip a greedy token).

    python -m benchmarks.speed.regenerate [--quick] [--rows N] [--max-new-tokens N] [--threads N] [--no-vllm]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: vLLM's CPU worker and HF get the same threads
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB

import importlib.util
import time
from pathlib import Path

import torch

from benchmarks.common.cli import bench_parser, scratch_directory
from benchmarks.common.report import print_table
from benchmarks.common.toy import make_bench_target, write_toy_corpus
from pipeline.demo.toy import ToyShape
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.parts import PartSpec, PartWriter, part_name


def time_arm(writer: PartWriter, spec: PartSpec, *, repeats: int) -> tuple[float, dict]:
    """(fastest wall-clock seconds of writing the part, its record)."""
    best, record = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        record = writer.write(spec)
        best = min(best, time.perf_counter() - start)
    return best, record


def main() -> None:
    parser = bench_parser(__doc__, quick_help="4 rows, 16 new tokens, one repeat", threads=1)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM arm")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.max_new_tokens, args.repeats = 4, 16, 1
    torch.set_num_threads(args.threads)
    with_vllm = not args.no_vllm and importlib.util.find_spec("vllm") is not None

    with scratch_directory(None, temp_prefix="bench-regenerate-") as work:
        run_arms(args, work, with_vllm=with_vllm)


def run_arms(args, work: Path, *, with_vllm: bool) -> None:
    target = make_bench_target(work / "target", ToyShape(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512))
    corpus = write_toy_corpus(work / "chat.jsonl", num_rows=args.rows, response_words=(40, 90), max_turns=2)
    spec = PartSpec(index=0, start=0, stop=args.rows)
    results, texts = [], {}
    arms = [("hf batched", "hf", False), ("hf per row", "hf", True)] + ([("vllm", "vllm", False)] if with_vllm else [])
    for label, backend, per_row in arms:
        out = work / label.replace(" ", "-")
        out.mkdir()
        config = RegenerateConfig.from_flags(
            target=str(target), corpus=str(corpus), out=str(out), max_new_tokens=args.max_new_tokens, backend=backend,
            target_dtype="float32", batch_tokens=1 << 16,
        )  # fmt: skip
        start = time.perf_counter()
        writer = PartWriter(config)
        load_s = time.perf_counter() - start
        if per_row:
            generator = writer.generator
            generator.generate = lambda requests, g=generator: [g.generate_one(r) for r in requests]
        seconds, record = time_arm(writer, spec, repeats=args.repeats)
        writer.close()
        texts[label] = (out / part_name(0)).read_text().splitlines()
        results.append([label, f"{load_s:.1f}", record["turns"], record["generated_tokens"], f"{seconds:.2f}",
                        f"{record['generated_tokens'] / seconds:,.0f}"])  # fmt: skip
    base = float(results[0][-1].replace(",", ""))
    for row in results:
        row.append(f"{float(row[-1].replace(',', '')) / base:.2f}x")
    print_table(
        f"regeneration, {args.rows} rows, max {args.max_new_tokens} new tokens per turn, {args.threads} thread(s)",
        ["arm", "load s", "turns", "tokens", "seconds", "tokens/s", "vs hf batched"], results,
    )  # fmt: skip
    print()
    reference = texts["hf batched"]
    for label, lines in texts.items():
        if label != "hf batched":
            differing = sum(a != b for a, b in zip(reference, lines)) + abs(len(reference) - len(lines))
            print(f"rows differing from hf batched: {label} {differing}/{len(reference)}")


if __name__ == "__main__":
    main()
