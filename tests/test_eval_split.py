"""Exact greedy tau during training (`alrira-cache build --eval-prompts`, `alrira-train --eval-every`):
the cache keeps the target's greedy responses and features of held-out prompts, checksummed; the
trainer's tau on them equals `alrira-eval replay` of the exported drafter on the same prompts, for a
DFlash, a DSpark and a DFlash2 drafter, with no target loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.train.config import TrainConfig
from storage.eval_split import EVAL_SPLIT_FILE, EVAL_SPLIT_RECORD, SplitFit, read_eval_split
from storage.location import resolve
from storage.manifest import load_manifest
from tests.conftest import write_jsonl

PROMPTS = [
    {"benchmark": "alpha", "prompt": "tell me a story about the river ."},
    {"benchmark": "alpha", "prompt": "what is the name of the city ?"},
    {"benchmark": "beta", "prompt": "write about the house , the door and the light ."},
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def split_cache(ray_address, toy_target, toy_corpus, tmp_path_factory) -> tuple[Path, Path]:
    from ray_jobs.build import build_cache

    root = tmp_path_factory.mktemp("eval-split")
    prompts = write_jsonl(root / "held_out.jsonl", PROMPTS)
    cache = root / "cache"
    config = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(toy_corpus), out=str(cache), layers=[0, 2], anchors=16, top_k=4, max_length=128,
        shard_size=10, num_slots=7, eval_prompts=str(prompts), eval_max_new_tokens=NEW_TOKENS,
    )  # fmt: skip
    build_cache(config, progress=False, log=lambda m: None)
    return cache, prompts


def _train(cache: Path, out: Path, **overrides):
    from pipeline.train.loop import train

    flags = dict(cache=str(cache), out=str(out), method="alr", epochs=2, batch_size=2, num_workers=0, progress=False,
                 log_every=100, lr=3e-3, save_dtype="float32", eval_every=3)  # fmt: skip
    return train(TrainConfig.from_flags(**{**flags, **overrides}))


def test_the_split_holds_replays_greedy_responses_and_is_kept_by_a_rebuild(split_cache, toy_target):
    from ray_jobs.build import build_cache

    cache, prompts = split_cache
    split = read_eval_split(resolve(cache), SplitFit.of(load_manifest(cache)))
    record = json.loads((cache / EVAL_SPLIT_RECORD).read_text())
    assert split.num_prompts == record["num_prompts"] == len(PROMPTS) and split.features.shape[1] == 2 * 64
    assert all(len(split.sequence(i)[0]) > split.sequence(i)[1] for i in range(split.num_prompts))  # a response follows
    logs = []
    config = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(json.loads((cache / "manifest.json").read_text())["corpus_path"]), out=str(cache),
        layers=[0, 2], anchors=16, top_k=4, max_length=128, shard_size=10, num_slots=7, eval_prompts=str(prompts),
        eval_max_new_tokens=NEW_TOKENS,
    )  # fmt: skip
    build_cache(config, progress=False, log=logs.append)
    assert any("eval split: kept" in line for line in logs)
    # What produced the cache: one entry per build invocation, with the resolved settings.
    invocations = json.loads((cache / "build_provenance.json").read_text())["invocations"]
    assert len(invocations) == 2 and invocations[-1]["config"]["layers"] == [0, 2] and invocations[-1]["config"]["compute"]["dtype"]
    from click.testing import CliRunner

    from ray_jobs.cli import cache_cli

    result = CliRunner().invoke(cache_cli, ["info", str(cache)])
    assert result.exit_code == 0 and f"{len(PROMPTS)} prompts, {record['num_tokens']} tokens (max new tokens {NEW_TOKENS})" in result.output


@pytest.mark.parametrize("arch", ["dflash", "dspark", "dflash2"])
def test_training_time_tau_equals_replay_of_the_exported_drafter(split_cache, toy_target, tmp_path, arch):
    from pipeline.eval.replay import run_replay

    cache, prompts = split_cache
    run = tmp_path / "run"
    summary = _train(cache, run, arch=arch)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval" in r]
    assert [r["step"] for r in evaluated][:2] == [3, 6] and evaluated[-1]["step"] == summary["steps"]
    final = summary["final_eval"]
    assert final == evaluated[-1]["eval"] and final["prompts"] == len(PROMPTS)
    replayed = run_replay(target=str(toy_target), drafters={"d": str(run / "drafter")}, prompts=str(prompts),
                          out=str(tmp_path / "replay"), max_new_tokens=NEW_TOKENS)["d"]  # fmt: skip
    assert final["tau_pooled"] == pytest.approx(replayed["tau_pooled"], abs=1e-12)
    assert final["tau_mean_per_request"] == pytest.approx(replayed["tau_mean_per_request"], abs=1e-12)
    assert final["acceptance_per_position"] == replayed["acceptance_per_position"]
    assert final["rounds"] == replayed["rounds"]
    assert final["acceptance_per_position"][0] > 0  # drafts were accepted: the equality is not 1.0 == 1.0


def test_training_time_tau_equals_replay_in_the_default_precision(split_cache, toy_target, tmp_path):
    """bf16 training (on this CPU `auto` is bf16, as on every GPU) and the default bf16 export: the
    tau logged at the last step is the export's under replay, to the last digit, on a world where
    drafts are accepted; the record says what it scored."""
    from pipeline.eval.replay import run_replay

    cache, prompts = split_cache
    run = tmp_path / "run"
    final = _train(cache, run, precision="bf16", save_dtype="bfloat16", epochs=3)["final_eval"]
    assert (final["weights_dtype"], final["compute_dtype"]) == ("bfloat16", "float32")
    replayed = run_replay(target=str(toy_target), drafters={"d": str(run / "drafter")}, prompts=str(prompts),
                          out=str(tmp_path / "replay"), max_new_tokens=NEW_TOKENS)["d"]  # fmt: skip
    assert final["tau_pooled"] == replayed["tau_pooled"] and final["rounds"] == replayed["rounds"]
    assert final["acceptance_per_position"] == replayed["acceptance_per_position"]
    assert final["acceptance_per_position"][0] > 0  # drafts were accepted: the equality is not 1.0 == 1.0


def test_a_changed_split_is_refused_and_eval_every_needs_one(split_cache, k7_cache, tmp_path):
    import shutil

    cache, _ = split_cache
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    data = bytearray((copy / EVAL_SPLIT_FILE).read_bytes())
    data[-5] ^= 0xFF
    (copy / EVAL_SPLIT_FILE).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"eval_split.safetensors: does not match its record's sha256"):
        _train(copy, tmp_path / "run")
    from storage.verify import verify_cache

    assert any("eval_split.safetensors: does not match its record's sha256" in p for p in verify_cache(copy))
    assert verify_cache(cache) == []
    with pytest.raises(ValueError, match=r"--eval-every: .* has no evaluation split; build the cache with --eval-prompts"):
        _train(k7_cache, tmp_path / "plain")
