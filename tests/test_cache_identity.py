"""Every file of a cache belongs to the target in its manifest (docs/failure-modes.md)."""

from __future__ import annotations

import pytest
import torch

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.target import read_target_head, target_hash
from storage.manifest import load_manifest, load_target_head
from storage.verify import verify_cache

pytestmark = pytest.mark.slow


def _build(target, corpus, out):
    from ray_jobs.build import build_cache

    config = CacheBuildConfig.from_flags(
        target=str(target), corpus=str(corpus), out=str(out), layers=[0, 2], anchors=4, top_k=4, max_length=96,
        shard_size=8, num_slots=7,
    )  # fmt: skip
    return build_cache(config, progress=False, log=lambda m: None)


def test_a_lost_manifest_and_another_target_rewrite_the_head(ray_address, toy_target, toy_corpus, tmp_path):
    """Remove manifest.json, rerun with a target of the same config but other weights: the head
    must be the new target's (it used to keep the old one while verify said OK)."""
    from pipeline.demo.toy import make_toy_target

    other = make_toy_target(tmp_path / "other-target", seed=7, peaked=True)
    assert target_hash(other) != target_hash(toy_target)  # same config and tokenizer, other weights
    out = tmp_path / "cache"
    _build(toy_target, toy_corpus, out)
    (out / "manifest.json").unlink()
    manifest = _build(other, toy_corpus, out)
    assert manifest.settings.target_hash == target_hash(other)
    embed, lm_head = read_target_head(other)
    head = load_target_head(out, target_hash=load_manifest(out).settings.target_hash)
    assert torch.equal(head["lm_head.weight"], lm_head) and torch.equal(head["embed_tokens.weight"], embed)
    assert verify_cache(out) == []
