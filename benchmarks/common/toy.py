"""The toy world the stage benchmarks measure on: a random Qwen3 target (pipeline/demo/toy.py) at
the benchmarks' sizes, a chat corpus in its words, and the settings of a cache built from them."""

from __future__ import annotations

import dataclasses
import json
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
