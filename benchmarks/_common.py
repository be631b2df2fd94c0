"""What the benchmark scripts share: the toy target and corpus they measure on, the table they print.

Imported as `from _common import ...`: the scripts run as `python benchmarks/NAME.py`, which puts
this folder first on sys.path.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from pipeline.demo.toy import ToyShape, make_toy_target, toy_chat_rows


def wide_target(*, num_hidden_layers: int) -> ToyShape:
    """The benchmarks' full-size target: hidden 256, 4 heads x 64 (2 kv heads), MLP 512."""
    return ToyShape(
        hidden_size=256, num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512,
    )  # fmt: skip


def make_bench_target(path: Path, shape: ToyShape) -> Path:
    """A tiny random Qwen3 of `shape` (peaked, so greedy rollouts are not uniform noise); the same
    seed in every benchmark."""
    return make_toy_target(path, **dataclasses.asdict(shape), seed=0, peaked=True)


def timed(fn) -> tuple[float, object]:
    """(seconds, fn())."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def write_toy_corpus(path: Path, *, num_rows: int, response_words: tuple[int, int], max_turns: int) -> Path:
    """A ShareGPT-style JSONL chat corpus in the toy tokenizer's words."""
    rows = toy_chat_rows(num_rows, seed=1, response_words=response_words, max_turns=max_turns)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def empty_workdir(out: str | Path) -> Path:
    """--out as a directory that exists and is empty (a benchmark never mixes its files with old ones)."""
    work = Path(out)
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise SystemExit(f"error: --out {work} is not empty; give a new or empty directory")
    return work


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """Labels left-aligned in the first column, numbers right-aligned in the others."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
