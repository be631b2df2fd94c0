"""Caches that leave array groups out (--no-rollout-features, --no-rollouts): built on a local Ray
cluster with the tiny Qwen3, read, verified, and refused by the trainer for methods they cannot
serve before any step runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.shard_builder import ShardBuilder
from ray_jobs.cli import cache_cli
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, run_target_batch
from pipeline.target import load_target
from pipeline.train.config import TrainConfig
from pipeline.train.loop import train
from storage.format import ALL_GROUPS, MANIFEST_FILE, SHARD_DIR, record_array_names
from storage.manifest import load_manifest
from storage.reader import available_arrays, open_cache
from storage.shards import read_shard_records
from storage.verify import verify_cache

pytestmark = pytest.mark.slow

SMALL = dict(layers=[0, 2], anchors=6, top_k=4, max_length=128, shard_size=5, batch_tokens=512)
ROLLOUT_ARRAYS = {"rollout_tokens", "rollout_topk_ids", "rollout_topk_probs", "rollout_tail", "rollout_features"}
CORPUS_TOPK_ARRAYS = {"corpus_topk_ids", "corpus_topk_probs", "corpus_tail", "corpus_next_prob"}


def _config(target, corpus, out, **overrides) -> CacheBuildConfig:
    return CacheBuildConfig.from_flags(target=str(target), corpus=str(corpus), out=str(out), **{**SMALL, **overrides})


def _build(config: CacheBuildConfig):
    from ray_jobs.build import build_cache

    return build_cache(config, progress=False, log=lambda m: None)


@pytest.fixture(scope="module")
def caches(ray_address, toy_target, toy_corpus, tmp_path_factory) -> dict[str, Path]:
    """The toy corpus built with --no-rollout-features and with --no-rollouts."""
    root = tmp_path_factory.mktemp("contents")
    variants = {"no_rollout_features": dict(rollout_features=False), "no_rollouts": dict(rollouts=False)}
    for name, overrides in variants.items():
        _build(_config(toy_target, toy_corpus, root / name, **overrides))
    return {name: root / name for name in variants}


@pytest.fixture(scope="module")
def full_shards(caches, toy_target, toy_corpus, tmp_path_factory) -> tuple[int, list[dict]]:
    """(bytes, encoded records) of the full cache of the same corpus: the same shards, every array
    group, built in-process (a third Ray build would only repeat the worker start-up)."""
    partial = caches["no_rollouts"]
    out = tmp_path_factory.mktemp("contents-full") / "full"
    shutil.copytree(partial / "corpus", out / "corpus")  # the tokenized corpus shards are cut from
    config = _config(toy_target, toy_corpus, out)
    builder = ShardBuilder(config.with_taps(config.taps.layers))
    manifest = load_manifest(partial)
    num_bytes, records = 0, []
    for index in range(manifest.num_shards_planned):
        start = index * config.storage.shard_size
        stop = min(start + config.storage.shard_size, manifest.num_sequences)
        shard = builder.build(shard_index=index, start=start, stop=stop)
        num_bytes += shard.bytes
        records += read_shard_records(out / SHARD_DIR / shard.name, storage_format=config.storage.storage_format)
    return num_bytes, records


def _train_config(cache: Path, out: Path, method: str) -> TrainConfig:
    return TrainConfig.from_flags(
        cache=str(cache), out=str(out), method=method, epochs=1, max_steps=1, batch_size=2, num_workers=0, progress=False
    )


def test_config_contents():
    base = dict(target="t", corpus="c", out="o")
    assert CacheBuildConfig.from_flags(**base).contents == list(ALL_GROUPS)
    assert CacheBuildConfig.from_flags(**base, rollout_features=False).contents == ["corpus_topk", "rollouts"]
    # --no-rollouts implies no rollout features, whatever --rollout-features says.
    assert CacheBuildConfig.from_flags(**base, rollouts=False).contents == ["corpus_topk"]
    assert CacheBuildConfig.from_flags(**base, rollouts=False, corpus_topk=False).contents == []
    help_text = CliRunner().invoke(cache_cli, ["build", "--help"], terminal_width=200).output
    for flag in ("rollouts", "rollout-features", "corpus-topk"):
        assert f"--{flag} / --no-{flag}" in help_text


def test_runner_without_rollouts_skips_them_and_keeps_the_corpus_pass(toy_target):
    model = load_target(toy_target, dtype=torch.float32)
    rng = np.random.default_rng(0)
    sequences = []
    for row, length in enumerate([40, 27]):
        loss_mask = np.zeros(length, np.uint8)
        loss_mask[6:] = 1
        sequences.append(TargetSequence(source_row=row, input_ids=rng.integers(0, 200, length), loss_mask=loss_mask))
    config = TargetRunConfig(layer_ids=[0, 2], anchors_per_sequence=5, top_k=4, seed=1)
    with_rollouts = run_target_batch(model, sequences, config)
    without = run_target_batch(model, sequences, TargetRunConfig(**{**vars(config), "rollouts": False}))
    for a, b in zip(with_rollouts, without, strict=True):
        assert b.rollout_tokens is None and b.rollout_topk_probs is None and b.rollout_features is None
        assert torch.equal(a.anchor_pos, b.anchor_pos) and len(b.anchor_pos) == 5
        for name in ("input_ids", "features", "corpus_topk_ids", "corpus_topk_probs", "corpus_tail", "corpus_next_prob"):
            torch.testing.assert_close(getattr(b, name), getattr(a, name), atol=0, rtol=0, msg=name)


def test_partial_caches_hold_only_their_arrays(caches, full_shards):
    full_bytes, full_records = full_shards
    expected = {
        "no_rollout_features": set(record_array_names("bf16")) - {"rollout_features"},
        "no_rollouts": set(record_array_names("bf16")) - ROLLOUT_ARRAYS,
    }
    contents = {"no_rollout_features": ["corpus_topk", "rollouts"], "no_rollouts": ["corpus_topk"]}
    sizes = {}
    for name, names in expected.items():
        reader = open_cache(caches[name])
        assert reader.manifest.settings.contents == contents[name]
        assert available_arrays(reader) == names
        assert len(reader) == len(full_records) > 2
        for index in range(len(reader)):
            record, reference = reader.read(index, decode_features=False), full_records[index]
            assert set(reference) == set(record_array_names("bf16")) and set(record) == names
            for array in names:  # what is kept equals the full cache's
                np.testing.assert_array_equal(record[array], reference[array], err_msg=f"{name}: {array}")
        assert verify_cache(caches[name]) == []
        sizes[name] = sum(s.bytes for s in reader.manifest.shards)
    assert full_bytes > sizes["no_rollout_features"] > sizes["no_rollouts"]


def test_info_lists_the_methods_a_partial_cache_serves(caches):
    served = {}
    for name in ("no_rollout_features", "no_rollouts"):
        result = CliRunner().invoke(cache_cli, ["info", str(caches[name]), "--json"])
        assert result.exit_code == 0, result.output
        served[name] = json.loads(result.output)["trainable_methods"]
    assert served["no_rollout_features"] == ["dflash", "kd", "erase", "erase_hard", "alr", "alr_gate", "slot_control"]
    assert served["no_rollouts"] == ["dflash", "kd", "erase", "erase_hard"]


def test_trainer_refuses_a_method_the_cache_cannot_serve_before_any_step(caches, tmp_path):
    refusals = [("no_rollout_features", "alr_ira", "rollout_features"), ("no_rollouts", "alr", "rollout_tokens")]
    for cache, method, missing in refusals:
        run = tmp_path / f"{cache}-{method}"
        with pytest.raises(ValueError, match=rf"--method {method} needs cache arrays that are missing: .*{missing}"):
            train(_train_config(caches[cache], run, method))
        assert not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize(("cache", "method"), [("no_rollout_features", "alr"), ("no_rollouts", "kd")])
def test_trainer_runs_a_method_the_partial_cache_serves(caches, tmp_path, cache, method):
    run = tmp_path / method
    train(_train_config(caches[cache], run, method))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    loss = json.loads(lines[0])["loss"]
    assert loss > 0


def test_resume_with_changed_contents_is_refused(caches, toy_target, toy_corpus):
    out = caches["no_rollout_features"]
    before = (out / MANIFEST_FILE).read_bytes()
    added = r"contents: \['corpus_topk', 'rollouts'\] -> \['corpus_topk', 'rollout_features', 'rollouts'\]"
    with pytest.raises(ValueError, match=rf"{added}.*--overwrite"):
        _build(_config(toy_target, toy_corpus, out))
    with pytest.raises(ValueError, match=r"contents: \['corpus_topk', 'rollouts'\] -> \['rollouts'\]"):
        _build(_config(toy_target, toy_corpus, out, rollout_features=False, corpus_topk=False))
    assert (out / MANIFEST_FILE).read_bytes() == before
    assert load_manifest(out).settings.contents == ["corpus_topk", "rollouts"]
