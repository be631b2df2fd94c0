"""`alrira-cache regenerate --batched-sampling` (pipeline/regenerate/backends.py `RowSampler`): sampled
rows decoded in batches, each from its own seeded generator, on the real toy Qwen3 target."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.chat import iter_corpus_rows
from pipeline.demo.toy import toy_chat_rows
from pipeline.regenerate.backends import RowSampler
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.driver import regenerate_corpus
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def answers(out) -> list[str]:
    return [row["conversations"][-1]["value"] for _, row in iter_corpus_rows(out)]


def test_row_sampler_draws_each_row_from_its_own_seed_with_the_top_p_law():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    draws = {b: [] for b in range(3)}
    sampler = RowSampler([7, 8, 7], temperature=1.0, top_p=0.75)
    for _ in range(400):
        scores = sampler(None, logits.clone())
        assert bool((torch.isfinite(scores).sum(dim=-1) == 1).all())  # one token left per row
        for b in range(3):
            draws[b].append(int(scores[b].argmax()))
    assert draws[0] == draws[2] != draws[1]  # a row's draws depend on its seed only
    # top-p 0.75 keeps {0, 1} (0.5 + 0.3 reaches it) and renormalises: 0.625 / 0.375.
    assert set(draws[0]) == {0, 1} and abs(draws[0].count(0) / 400 - 0.625) < 4 * math.sqrt(0.625 * 0.375 / 400)


def test_batched_sampling_is_seeded_per_row_and_recorded(toy_target, tmp_path):
    corpus = write_jsonl(tmp_path / "chat.jsonl", toy_chat_rows(6, seed=2, min_turns=1, max_turns=1, response_words=(3, 8)))

    def run(out, **flags):
        config = RegenerateConfig.from_flags(target=str(toy_target), corpus=str(corpus), out=str(tmp_path / out), max_new_tokens=10,
                                             rows_per_part=6, **flags)  # fmt: skip
        return regenerate_corpus(config, log=lambda m: None)

    manifest = run("a", temperature=1.0, seed=3, batched_sampling=True)
    assert manifest["provenance"]["settings"]["batched_sampling"] is True
    run("b", temperature=1.0, seed=3, batched_sampling=True)
    run("c", temperature=1.0, seed=4, batched_sampling=True)
    run("greedy")
    a, b, c, greedy = (answers(tmp_path / name) for name in ("a", "b", "c", "greedy"))
    assert a == b  # the same seed, the same text
    assert a != c and a != greedy  # another seed, or greedy, writes other text


def test_an_output_from_before_a_setting_existed_resumes_at_its_default(toy_target, tmp_path):
    """A manifest written before --batched-sampling existed has no such setting: a rerun at the
    default resumes it (no part rewritten), a rerun with the setting on is a named difference."""
    import json

    corpus = write_jsonl(tmp_path / "chat.jsonl", toy_chat_rows(3, seed=4, min_turns=1, max_turns=1, response_words=(3, 6)))

    def config(**flags):
        return RegenerateConfig.from_flags(target=str(toy_target), corpus=str(corpus), out=str(tmp_path / "out"), max_new_tokens=6, **flags)

    regenerate_corpus(config(), log=lambda m: None)
    manifest_path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["provenance"]["settings"]["batched_sampling"]
    manifest_path.write_text(json.dumps(manifest))
    part = (tmp_path / "out" / "part-00000.jsonl").stat().st_mtime_ns
    regenerate_corpus(config(), log=lambda m: None)
    assert (tmp_path / "out" / "part-00000.jsonl").stat().st_mtime_ns == part
    with pytest.raises(ValueError, match=r"settings\.batched_sampling: (None|False) -> True"):
        regenerate_corpus(config(batched_sampling=True), log=lambda m: None)
