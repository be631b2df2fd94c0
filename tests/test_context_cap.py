"""Generation is capped by the target (pipeline.target.context_limit; docs/design.md, "Evaluation"):
`alrira-eval run` and `replay`, `alrira-eval hard`, the cache's evaluation split
(--eval-max-new-tokens) and regeneration never decode a prompt past the target's context
(max_position_embeddings, or the tokenizer's model_max_length when smaller); a cut budget is said
in one line, a prompt that fills the context is refused naming its row. The toy target with a
64-position context, real models and files."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from drafter.checkpoint import save_drafter
from drafter.config import DFlashConfig
from drafter.model import DFlashDrafter
from pipeline.target import context_limit, load_tokenizer
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = 64
HUGE = 10**6  # --max-new-tokens far past any context: it ran on for minutes
PROMPTS = [
    {"benchmark": "a", "prompt": "tell me a story about the river ."},
    {"benchmark": "b", "prompt": "write about the house , the door and the light and the city and the name ."},
]


def _with_config(toy_target: Path, out: Path, *, config: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A copy of the toy target with `config` / `tokenizer` entries changed in its JSON files."""
    shutil.copytree(toy_target, out, ignore=shutil.ignore_patterns(".alrira-*"))
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        if changes:
            path = out / name
            path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return out


@pytest.fixture(scope="module")
def short_target(toy_target, tmp_path_factory) -> Path:
    return _with_config(toy_target, tmp_path_factory.mktemp("short") / "target", config={"max_position_embeddings": CONTEXT})


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", PROMPTS)


@pytest.fixture(scope="module")
def drafter(toy_target, tmp_path_factory) -> Path:
    """An untrained drafter of the toy target: what it accepts does not matter here, what is decoded does."""
    tokenizer = load_tokenizer(toy_target)
    config = DFlashConfig.from_target_config(json.loads((toy_target / "config.json").read_text()), num_draft_layers=1,
                                             mask_token_id=len(tokenizer), target_layer_ids=[0, 2], block_size=5)  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    save_drafter(DFlashDrafter(config), out, dtype=torch.float32)
    return out


def _prompt_lengths(target: Path, prompts: Path) -> list[int]:
    from pipeline.eval.evaluate import load_prompts

    return [len(p.input_ids) for p in load_prompts(prompts, load_tokenizer(target))]


def test_the_context_is_the_smaller_of_the_config_and_the_tokenizer(toy_target, short_target, tmp_path):
    limit = context_limit(short_target, load_tokenizer(short_target))
    assert (limit.positions, limit.source) == (CONTEXT, "max_position_embeddings")
    by_tokenizer = _with_config(toy_target, tmp_path / "t", tokenizer={"model_max_length": 40})
    limit = context_limit(by_tokenizer, load_tokenizer(by_tokenizer))
    assert (limit.positions, limit.source) == (40, "the tokenizer's model_max_length")
    unlimited = _with_config(toy_target, tmp_path / "u", tokenizer={"model_max_length": int(1e30)})  # transformers' "no limit"
    assert context_limit(unlimited, load_tokenizer(unlimited)).positions == json.loads((toy_target / "config.json").read_text())[
        "max_position_embeddings"
    ]


def test_eval_run_is_capped_by_the_context(short_target, drafter, prompts, tmp_path):
    from pipeline.eval.evaluate import EvalConfig, run_eval

    logs: list[str] = []
    config = EvalConfig(target=str(short_target), drafter=str(drafter), prompts=str(prompts), out=str(tmp_path / "run"),
                        max_new_tokens=HUGE, progress=False, dtype="float32", reuse_ar_baseline=False)  # fmt: skip
    summary = run_eval(config, log=logs.append)
    lengths = _prompt_lengths(short_target, prompts)
    rows = list(csv.DictReader(open(tmp_path / "run" / "results.csv")))
    for row, length in zip(rows, lengths, strict=True):
        assert 0 < int(row["ar_tokens"]) <= CONTEXT - length and int(row["committed"]) <= CONTEXT - length, row
    assert summary["capped_prompts"] == len(PROMPTS) and summary["lossless_mismatches"] == 0
    assert any(line.startswith(f"--max-new-tokens {HUGE}: capped by the target's context ({CONTEXT} positions, max_position_embeddings)")
               for line in logs), logs  # fmt: skip


def test_replay_and_hard_are_capped_by_the_context(short_target, drafter, prompts, tmp_path, capsys):
    from pipeline.eval.analysis import hard_offsets
    from pipeline.eval.replay import run_replay

    logs: list[str] = []
    summary = run_replay(target=str(short_target), drafters={"d": str(drafter)}, prompts=str(prompts), out=str(tmp_path / "replay"),
                         max_new_tokens=HUGE, log=logs.append)["d"]  # fmt: skip
    lengths = _prompt_lengths(short_target, prompts)
    rows = list(csv.DictReader(open(tmp_path / "replay" / "d" / "results.csv")))
    assert [int(r["ar_tokens"]) <= CONTEXT - n for r, n in zip(rows, lengths, strict=True)] == [True] * len(PROMPTS)
    assert summary["capped_prompts"] == len(PROMPTS) and any(f"--max-new-tokens {HUGE}: capped" in line for line in logs)
    raw = hard_offsets(target_dir=str(short_target), prompts=str(prompts), drafters={"drafter": str(drafter)}, max_new_tokens=HUGE,
                       max_prompts=None)  # fmt: skip
    assert raw and max(r["offset"] for r in raw) < CONTEXT - min(lengths)
    assert f"--max-new-tokens {HUGE}: capped" in capsys.readouterr().err


def test_a_prompt_that_fills_the_context_is_refused_naming_its_row(toy_target, drafter, prompts, tmp_path):
    from pipeline.eval.replay import run_replay

    lengths = _prompt_lengths(toy_target, prompts)
    tiny = _with_config(toy_target, tmp_path / "tiny", config={"max_position_embeddings": max(lengths) - 1})
    with pytest.raises(ValueError, match=rf"prompts.jsonl:2: the prompt has {lengths[1]} tokens, the target's context is {lengths[1] - 1}"):
        run_replay(target=str(tiny), drafters={"d": str(drafter)}, prompts=str(prompts), out=str(tmp_path / "r"), max_new_tokens=8)


def test_the_eval_split_is_capped_by_the_context(short_target, prompts, toy_corpus, tmp_path):
    """--eval-max-new-tokens: the plan says the cut in one line and every stored sequence fits."""
    from pipeline.eval.split import build_eval_split, plan_eval_split
    from storage.eval_split import EVAL_SPLIT_RECORD, SplitFit
    from storage.location import resolve

    logs: list[str] = []
    plan = plan_eval_split(str(prompts), target=str(short_target), tokenizer=load_tokenizer(short_target), max_new_tokens=HUGE,
                           max_prompts=None, corpus=toy_corpus, log=logs.append)  # fmt: skip
    assert any(line.startswith(f"--eval-max-new-tokens {HUGE}: capped by the target's context ({CONTEXT} positions") for line in logs)
    assert plan.max_tokens == CONTEXT * len(PROMPTS)
    out = tmp_path / "cache"
    out.mkdir()
    fit = SplitFit(target_hash="sha256:x", layer_ids=[0, 2], vocab_size=10**6, feature_width=2 * 64)
    record = build_eval_split(resolve(out), plan, target=str(short_target), fit=fit, log=logs.append)
    assert record["num_tokens"] <= CONTEXT * len(PROMPTS) and json.loads((out / EVAL_SPLIT_RECORD).read_text()) == record


def test_regeneration_is_capped_by_the_context_and_says_so(short_target, tmp_path):
    from pipeline.demo.toy import toy_chat_rows
    from pipeline.regenerate.config import RegenerateConfig
    from pipeline.regenerate.driver import regenerate_corpus

    corpus = write_jsonl(tmp_path / "chat.jsonl", toy_chat_rows(2, seed=1, min_turns=1, max_turns=1, response_words=(3, 6)))
    logs: list[str] = []
    config = RegenerateConfig.from_flags(target=str(short_target), corpus=str(corpus), out=str(tmp_path / "out"), max_new_tokens=HUGE)
    manifest = regenerate_corpus(config, log=logs.append)
    assert any(line.startswith(f"--max-new-tokens {HUGE}: capped by the target's context ({CONTEXT} positions") for line in logs), logs
    part = manifest["parts"][0]
    assert part["written"] == 2 and 0 < part["generated_tokens"] < 2 * CONTEXT
