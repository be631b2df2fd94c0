"""`--profile small` (docs/cache-format.md, "Cache profiles"): every feature array in e8m3, IRA
parents for a bounded draw, format version 3; built in process with the tiny Qwen3 beside the
lossless cache of the same corpus, read back, verified, estimated and trained from."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.estimate import estimate_build, estimate_lines
from pipeline.train.batching import CacheTrainDataset
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.step import decode_feature_bits
from storage.codecs import decode_features
from storage.format import MANIFEST_FILE, ira_parent_rows
from storage.manifest import load_manifest
from storage.reader import open_cache
from storage.verify import record_value_problems, verify_cache
from tests.conftest import write_jsonl
from tests.test_build_compute import _build, _config

FLAGS = {"anchors": 6, "shard_size": 3, "num_slots": 7}


@pytest.fixture(scope="module")
def caches(toy_target, toy_corpus, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("small")
    corpus = write_jsonl(root / "chat.jsonl", [json.loads(line) for line in toy_corpus.read_text().splitlines()[:6]])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ALRIRA_CPU_BF16", "0")
        small = _config(toy_target, corpus, root / "small", profile="small", **FLAGS)
        estimate = estimate_build(small, progress=False)
        _build(small)
        _build(_config(toy_target, corpus, root / "full", **FLAGS))
    return {"small": root / "small", "full": root / "full", "estimate": estimate}


def test_small_stores_rounded_bits_of_the_full_caches_features(caches):
    small, full = open_cache(caches["small"]), open_cache(caches["full"])
    m = small.manifest
    assert (m.format_version, m.settings.profile, m.settings.feature_codec, m.settings.rollout_feature_codec) == (3, "small", "e8m3", None)
    assert m.settings.ira_parents == 3  # min(16, anchors // 2)
    assert verify_cache(caches["small"]) == []
    for index in range(len(small)):
        got, want = small.read(index, decode_features=False), full.read(index, decode_features=False)
        parents = ira_parent_rows(len(want["anchor_pos"]), 3)
        for name in set(want) - {"features", "rollout_features"}:  # labels, tokens, anchors: lossless
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        for name, exact in (("features", want["features"]), ("rollout_features", want["rollout_features"][parents])):
            assert got[name].dtype == np.uint16 and got[name].shape == exact.shape
            assert not np.any(got[name] & 0xF)  # 3 of bf16's 7 mantissa bits are kept
            values, reference = decode_features(got[name], None, codec="e8m3"), decode_features(exact, None, codec="bf16")
            # within half an e8m3 ulp of the target's float32 value, which bf16 holds to half a bf16 ulp
            assert np.all(np.abs(values - reference) <= np.abs(reference) * (2.0**-4 + 2.0**-8) + 1e-30), name
            assert not np.array_equal(values, reference)


def test_verify_finds_bits_an_e8m3_codec_leaves_zero(caches):
    record = open_cache(caches["small"]).read(0, decode_features=False)
    codecs = {"features": "e8m3", "rollout_features": "e8m3"}
    assert record_value_problems(record, vocab_size=10**6, codecs=codecs) == []
    record["features"][0, 0] |= 1
    assert record_value_problems(record, vocab_size=10**6, codecs=codecs) == ["features have mantissa bits a e8m3 codec leaves zero"]


def test_the_estimate_is_within_20_percent_and_names_the_profile(caches):
    """Within 20% on the toy (low: its random-init activations compress ~1.75x in e8m3, real ones
    ~2.2x, and its labels less than the 1.2x assumed, which weigh more beside smaller features;
    at real shapes the projection is checked by benchmarks/speed/feature_codecs.py); never above
    the stated upper bound."""
    estimate = caches["estimate"]
    written = sum(s.bytes for s in load_manifest(caches["small"]).shards)
    assert abs(estimate["bytes"] / written - 1) < 0.20, (estimate["bytes"], written)
    assert written <= estimate["upper_bytes"]
    assert estimate["codecs"] == {"features": "e8m3", "rollout_features": "e8m3"}
    assert "--profile small" in estimate_lines(estimate)[0]


def test_alr_ira_context_is_the_stored_bits(caches):
    """The trainer takes e8m3 bits as bf16 bits: the secondaries' rollout rows join the corpus rows as stored."""
    reader = open_cache(caches["small"])
    m = reader.manifest
    objective = ObjectiveConfig(method="alr_ira").for_cache(num_slots=m.settings.num_slots, mask_token_id=m.mask_token_id, stop_token_ids=m.stop_token_ids)
    dataset = CacheTrainDataset(reader, objective=objective, seed=1)
    secondaries = 0
    for index in range(len(reader)):
        example, record = dataset[(0, index)], reader.read(index, decode_features=False)
        assert example.context_feature_scales is None and example.context_features.dtype == torch.uint16
        corpus = example.context_owner == -1
        assert torch.equal(example.context_features[corpus], torch.from_numpy(record["features"]))
        parents = ira_parent_rows(len(record["anchor_pos"]), 3)
        t = example.targets
        for block in torch.nonzero(t.is_secondary).flatten().tolist():
            row = int(np.searchsorted(parents, int(t.private_parent[block])))
            stored = torch.from_numpy(record["rollout_features"][row][: int(t.private_len[block])])
            assert torch.equal(example.context_features[example.context_owner == block], stored)
            secondaries += 1
        decoded = decode_feature_bits(example.context_features)
        assert torch.equal(decoded[corpus], torch.from_numpy(reader.decode(record)["features"]))
    assert secondaries > 0


def test_profile_flags_are_checked(tmp_path):
    base = dict(target="t", corpus="c", out="o")
    assert CacheBuildConfig.from_flags(**base, profile="small", anchors=128).layout == {
        "feature_codec": "e8m3", "rollout_feature_codec": None, "ira_parents": 16, "profile": "small"
    }  # fmt: skip
    assert CacheBuildConfig.from_flags(**base, profile="small", anchors=128, ira_parents=32).layout["ira_parents"] == 32
    assert CacheBuildConfig.from_flags(**base, profile="compact", anchors=16).layout == CacheBuildConfig.from_flags(**base, compact=True, anchors=16).layout
    for flags, message in (
        ({"profile": "tiny"}, "--profile must be one of compact, small"),
        ({"profile": "small", "feature_codec": "fp8"}, "--profile small sets --feature-codec"),
        ({"profile": "small", "compact": True}, "--compact is --profile compact"),
        ({"feature_codec": "e8m9"}, "--feature-codec must be one of bf16, fp8, e8m2"),
        ({"feature_codec": "fp8", "rollout_feature_codec": "e8m3"}, "fp8 corpus features take fp8 rollout features"),
    ):
        with pytest.raises(ValueError, match=message):
            CacheBuildConfig.from_flags(**base, **flags)


def test_an_older_version_cannot_claim_an_e8m_codec(caches, tmp_path):
    data = json.loads((caches["small"] / MANIFEST_FILE).read_text())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**data, "format_version": 2}))
    with pytest.raises(ValueError, match=r"format_version 2 cannot hold these settings .* need version 3"):
        load_manifest(tmp_path)


def test_the_codec_benchmark_measures_what_it_reports(caches, tmp_path):
    """benchmarks/speed/feature_codecs.py on the lossless toy cache: every codec's error within its
    bound (e8mM: 2^-(M+1) per value), bytes ordered by mantissa bits, and every Qwen3-4B-shaped
    cache it writes within the estimate's upper bound."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "codecs"
    result = subprocess.run(
        [sys.executable, "benchmarks/speed/feature_codecs.py", "--cache", str(caches["full"]), "--out", str(out),
         "--sequences", "1", "--timing-rows", "64"],
        cwd=root, capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    rows = {r["codec"]: r for r in report["codecs"]}
    e8m = {m: rows[f"e8m{m} (bf16 bits, {m} mantissa bits)"] for m in (2, 3, 4, 5)}
    for name in ("bf16 (lossless, today)", "bf16 exponent planes (lossless)"):
        assert all(e["l2"] == 0 for e in rows[name]["errors"]), name
    for m, row in e8m.items():
        assert all(0 < e["l2"] <= 2.0 ** -(m + 1) and e["channel"] <= 2.0 ** -(m + 1) for e in row["errors"])
    sizes = [row["bytes_per_element"] for row in e8m.values()] + [rows["bf16 (lossless, today)"]["bytes_per_element"]]
    assert sizes == sorted(sizes) and sizes[-1] <= 2.0
    assert all(r["within_upper"] for r in report["shaped"])
    small = next(r for r in report["shaped"] if r["setting"].startswith("--profile small"))
    full = next(r for r in report["shaped"] if r["setting"].startswith("full"))
    assert small["kib_per_token"] < full["kib_per_token"] / 2


def test_real_cache_agreement_finds_the_same_computation_and_the_codecs_error(caches):
    """benchmarks/speed/real_cache.py's check of a profile against the lossless cache: every array
    the codec leaves alone agrees exactly, the features differ by e8m3's error and by nothing else."""
    from benchmarks.speed.real_cache import agreement

    found = agreement(caches["full"], caches["small"])
    assert found["sequences"] == len(open_cache(caches["full"]))
    assert set(found["equal_share"]) >= {"input_ids", "anchor_pos", "rollout_tokens", "corpus_topk_probs"}
    assert all(share == 1.0 for share in found["equal_share"].values()), found["equal_share"]
    for name in ("features", "rollout_features"):
        assert 2.0**-8 < found["feature_relative_error"][name] < 2.0**-4, found
    same = agreement(caches["full"], caches["full"])
    assert same["feature_relative_error"] == {"features": 0.0, "rollout_features": 0.0}


def test_real_cache_common_loss_scores_without_updating(caches, tmp_path):
    """benchmarks/speed/real_cache.py's paired loss: a drafter trained on the profile, scored on one
    epoch of a cache's blocks through the trainer's own path, repeatably, with its weights unchanged,
    and differently on the two caches (their features differ by the codec)."""
    from benchmarks.speed.real_cache import common_loss
    from pipeline.train.config import TrainConfig
    from pipeline.train.loop import train

    run = tmp_path / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ALRIRA_CPU_BF16", "0")
        train(TrainConfig.from_flags(cache=str(caches["small"]), out=str(run), method="alr_ira", draft_layers=1, batch_size=2,
                                     max_steps=2, anchors_per_step=2, num_workers=0, progress=False, precision="fp32"))  # fmt: skip
        weights = {p.name: p.read_bytes() for p in (run / "drafter").iterdir()}
        scores = [common_loss(run / "drafter", cache=caches[name], method="alr_ira", arch="dflash", seed=0, batch_size=2)
                  for name in ("full", "full", "small")]  # fmt: skip
    assert scores[0] == scores[1] and np.isfinite(scores[0]) and scores[0] > 0
    assert scores[2] != scores[0]
    assert {p.name: p.read_bytes() for p in (run / "drafter").iterdir()} == weights
