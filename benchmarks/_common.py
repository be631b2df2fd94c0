"""What the benchmark scripts share: the toy target, corpus and cache they measure on, their
--quick / --out options, the table they print.

Imported as `from _common import ...`: the scripts run as `python benchmarks/NAME.py`, which puts
this folder first on sys.path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
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


@dataclass(kw_only=True)
class ToyCacheSizes:
    """A benchmark's toy cache: the random target it is built on, its chat corpus and the build's
    shape. A script's own sizes nest one as `sizes.cache`."""

    target: ToyShape  # the random Qwen3 measured on (make_bench_target)
    num_rows: int  # toy chat rows in the corpus
    response_words: tuple[int, int]
    max_turns: int
    max_length: int
    layer_ids: list[int]
    num_slots: int  # K
    top_k: int
    anchors: int  # anchor pool per sequence

    def write_inputs(self, work: Path) -> tuple[Path, Path]:
        """The target and the chat corpus on disk: (work/target, work/chat.jsonl)."""
        target = make_bench_target(work / "target", self.target)
        corpus = write_toy_corpus(
            work / "chat.jsonl", num_rows=self.num_rows, response_words=self.response_words, max_turns=self.max_turns
        )
        return target, corpus

    def build_flags(self) -> dict:
        """The `alrira-cache build` settings this cache fixes, keyed as CacheBuildConfig.from_flags takes them."""
        return dict(
            layers=self.layer_ids, num_slots=self.num_slots, top_k=self.top_k, anchors=self.anchors, max_length=self.max_length
        )


# The --quick cache: the toy target's default shape (hidden 64, 4 layers), a few short rows.
QUICK_CACHE = ToyCacheSizes(
    target=ToyShape(), num_rows=8, response_words=(30, 60), max_turns=1, max_length=256, layer_ids=[0, 2], num_slots=7,
    top_k=4, anchors=8,
)  # fmt: skip


def bench_parser(doc: str, *, out_help: str) -> argparse.ArgumentParser:
    """A script's parser, described by its docstring's first paragraph, with the two options the
    measuring scripts share: --quick (tiny sizes, a smoke run) and --out (the work directory)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (< 1 min), to smoke-test the script")
    parser.add_argument("--out", default=None, help=out_help)
    return parser


def work_directory(out: str | Path | None, *, temp_prefix: str) -> Path:
    """--out as an empty directory (empty_workdir), or without it a new temp directory, kept."""
    return empty_workdir(out) if out else Path(tempfile.mkdtemp(prefix=temp_prefix))


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
