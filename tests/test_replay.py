"""Greedy replay (pipeline/eval/replay.py, `alrira-eval replay`): the rounds of greedy speculative
decoding from one AR decode per prompt, checked against real decoding on the toy Qwen3 target."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import eval_cli
from pipeline.eval.evaluate import EvalConfig, load_prompts, load_target_and_stops, run_eval
from drafter.drafting import match_lengths, replay_rounds
from pipeline.eval.speculative import autoregressive_decode, speculative_decode
from tests.conftest import write_jsonl
from tests.test_analysis import PROMPTS, _drafter

pytestmark = pytest.mark.usefixtures("one_thread")
NUM_DRAFT = 15


def test_replay_rounds_walk_as_speculative_decoding_commits(toy_target):
    """A draft step that gets exactly m_j leading tokens right at response token j: real decoding's
    accepted drafts per round equal replay_rounds over the same m_j, end of the response included."""
    target, tokenizer, _ = load_target_and_stops(str(toy_target), device=torch.device("cpu"), dtype=torch.float32)
    prompt = load_prompts(write_jsonl(toy_target.parent / "replay_prompt.jsonl", PROMPTS[:1]), tokenizer)[0].input_ids
    response = autoregressive_decode(target, prompt, max_new_tokens=40, temperature=0.0, stop_token_ids=[], generator=None).tokens
    vocab = target.config.vocab_size
    right = torch.Generator().manual_seed(0)
    planned = torch.randint(0, NUM_DRAFT + 1, (len(response),), generator=right).tolist()  # m_j: leading drafts right at j
    drafts = torch.zeros((len(response) - 1, NUM_DRAFT), dtype=torch.long)
    for j in range(len(response) - 1):
        for i in range(NUM_DRAFT):
            truth = response[j + 1 + i] if j + 1 + i < len(response) else 0
            drafts[j, i] = truth if i < planned[j] else (truth + 1) % vocab

    def draft_fn(*, context_features, anchor_token, anchor_pos):
        return drafts[anchor_pos - len(prompt)]

    class Config:  # the drafter's settings speculative_decode reads; the drafts come from draft_fn
        block_size, target_layer_ids, num_drafts = NUM_DRAFT + 1, [0], NUM_DRAFT

    spec = speculative_decode(
        target, type("Drafter", (), {"config": Config})(), embed_tokens=None, lm_head=None, prompt_ids=prompt, max_new_tokens=40,
        temperature=0.0, stop_token_ids=[], generator=None, mask_token_id=0, draft_fn=draft_fn,
    )  # fmt: skip
    assert spec.tokens == response
    replayed = replay_rounds(match_lengths(drafts, response=response), num_tokens=len(response))
    assert spec.accepted_lengths == replayed
    assert sum(replayed) + len(replayed) == len(response) - 1 and max(replayed) > 3  # long accepts, cut at the end


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_replay_equals_real_decoding_and_feeds_compare(toy_target, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    drafters = {name: _drafter(toy_target, tmp_path / "runs" / name / "drafter", seed=seed) for name, seed in (("a", 0), ("b", 1))}
    args = ["replay", "--target", str(toy_target), "--prompts", str(prompts), "--out", str(tmp_path / "replay"), "--max-new-tokens", "24"]
    result = CliRunner().invoke(eval_cli, args + [arg for path in drafters.values() for arg in ("--drafter", str(path))])
    assert result.exit_code == 0, result.output
    assert "a: MAT" in result.output and "b: MAT" in result.output
    for name, drafter in drafters.items():
        real = tmp_path / "real" / name
        run_eval(EvalConfig(target=str(toy_target), drafter=str(drafter), prompts=str(prompts), out=str(real), max_new_tokens=24,
                            progress=False))  # fmt: skip
        replay = tmp_path / "replay" / name
        keep = ("prompt_id", "benchmark", "committed", "rounds", "accepted_tokens", "tau")
        assert [{k: r[k] for k in keep} for r in _rows(replay / "results.csv")] == [{k: r[k] for k in keep} for r in _rows(real / "results.csv")]
        assert _rows(replay / "rounds.csv") == _rows(real / "rounds.csv")
        summary = json.loads((replay / "summary.json").read_text())
        assert summary["mode"] == "greedy_replay" and summary["speedup_geomean"] is None
        # What produced it: the command, versions and the resolved settings, as alrira-eval run records.
        provenance = summary["provenance"]
        assert provenance["command"] and set(provenance["versions"]) >= {"torch", "transformers"}
        assert provenance["config"]["drafter"] == str(drafter) and provenance["config"]["dtype_resolved"] == "float32"
        assert summary["tau_geomean"] == json.loads((real / "summary.json").read_text())["tau_geomean"]
    # A replay folder is an evaluation `compare` reads (method names from the drafters' runs).
    result = CliRunner().invoke(eval_cli, ["compare", str(tmp_path / "replay" / "a"), str(tmp_path / "replay" / "b"), "--out",
                                           str(tmp_path / "compare"), "--label", "a", "--label", "b"])  # fmt: skip
    assert result.exit_code == 0, result.output


def test_replay_refuses_two_drafters_of_one_name(toy_target, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    one = _drafter(toy_target, tmp_path / "x" / "run" / "drafter", seed=0)
    other = _drafter(toy_target, tmp_path / "y" / "run" / "drafter", seed=1)
    args = ["replay", "--target", str(toy_target), "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--drafter", str(one), "--drafter", str(other)]
    result = CliRunner().invoke(eval_cli, args)
    assert result.exit_code != 0 and "also named 'run'" in result.output
