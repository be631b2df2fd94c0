"""Compact caches: --ira-parents, --rollout-feature-codec and --compact built on a local
Ray cluster with the tiny Qwen3; --estimate against what the build writes; what alr_ira draws and
reads on such a cache; format version 2 next to version 1."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.shard_builder import ShardBuilder
from pipeline.train.batching import CacheTrainDataset, example_from_record
from pipeline.train.methods import check_ira_parents_serve
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.objectives import draw_ira_from_parents
from ray_jobs.cli import cache_cli
from storage.codecs import decode_features
from storage.format import MANIFEST_FILE, SHARD_DIR, ira_parent_rows
from storage.manifest import load_manifest
from storage.reader import open_cache
from storage.shards import read_shard_records
from storage.verify import verify_cache

pytestmark = pytest.mark.slow

SMALL = dict(layers=[0, 2], anchors=6, top_k=4, max_length=128, shard_size=5, batch_tokens=512, num_slots=7)
FLAGS = ["--layers", "0,2", "--anchors", "6", "--top-k", "4", "--max-length", "128", "--shard-size", "5",
         "--batch-tokens", "512", "--num-slots", "7"]  # fmt: skip


@pytest.fixture(scope="module")
def compact(ray_address, toy_target, toy_corpus, tmp_path_factory) -> dict:
    """--estimate's output, then the --compact build through the CLI (one Ray build), and the full
    cache's records of the same corpus built in-process (the same shards, every anchor, bf16)."""
    root = tmp_path_factory.mktemp("compact")
    args = ["build", "--target", str(toy_target), "--corpus", str(toy_corpus), "--out", str(root / "compact"), *FLAGS,
            "--compact", "--no-progress", "--ray-address", ray_address]  # fmt: skip
    estimate = CliRunner().invoke(cache_cli, [*args, "--estimate"])
    assert estimate.exit_code == 0, estimate.output
    assert not (root / "compact").exists()  # an estimate writes nothing
    built = CliRunner().invoke(cache_cli, args)
    assert built.exit_code == 0, built.output
    out = root / "full"
    shutil.copytree(root / "compact" / "corpus", out / "corpus")
    config = CacheBuildConfig.from_flags(target=str(toy_target), corpus=str(toy_corpus), out=str(out), **SMALL)
    builder = ShardBuilder(config.with_taps(config.taps.layers))
    manifest = load_manifest(root / "compact")
    full = []
    for index in range(manifest.num_shards_planned):
        start = index * config.storage.shard_size
        stop = min(start + config.storage.shard_size, manifest.num_sequences)
        shard = builder.build(shard_index=index, start=start, stop=stop)
        full += read_shard_records(out / SHARD_DIR / shard.name, storage_format="zarr")
    return {"cache": root / "compact", "estimate": estimate.output, "full": full}


def test_compact_keeps_everything_but_half_the_rollout_features_in_fp8(compact):
    reader = open_cache(compact["cache"])
    m = reader.manifest
    assert m.format_version == 2 and m.settings.profile == "compact"
    assert (m.settings.ira_parents, m.settings.rollout_feature_codec, m.settings.feature_codec) == (3, "fp8", "bf16")
    assert verify_cache(compact["cache"]) == []
    for index, reference in enumerate(compact["full"]):
        record = reader.read(index, decode_features=False)
        for name in set(reference) - {"rollout_features"}:  # everything else is the full cache's, bit for bit
            np.testing.assert_array_equal(record[name], reference[name], err_msg=name)
        parents = ira_parent_rows(len(record["anchor_pos"]), 3)
        assert record["rollout_features"].dtype == np.uint8 and len(record["rollout_features"]) == len(parents) == 3
        exact = decode_features(reference["rollout_features"][parents], None, codec="bf16")  # [P, K-2, F]
        got = reader.decode(record)["rollout_features"]
        amax = np.abs(exact).max(-1, keepdims=True)
        assert np.all(np.abs(got - exact) <= amax / 16 + 1e-6)  # e4m3: 3 mantissa bits, per-token scale
        assert not np.array_equal(got, exact)
    assert sum(s.parents for s in m.shards) == 3 * len(compact["full"])


def test_estimate_is_within_10_percent_of_the_build_and_info_prints_bytes_by_group(compact):
    lines = compact["estimate"].splitlines()
    assert "--profile compact" in lines[0] and "rollout features fp8" in lines[0]
    projected_mib = float(lines[1].split("projected: ")[1].split(" MiB")[0])
    written = sum(s.bytes for s in load_manifest(compact["cache"]).shards)
    assert abs(projected_mib * (1 << 20) / written - 1) < 0.10, (projected_mib, written)
    result = CliRunner().invoke(cache_cli, ["info", str(compact["cache"]), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    by_group = info["bytes_per_token_by_group"]
    assert abs(sum(by_group.values()) - info["bytes_per_token"]) < 1.0  # the groups add up to the whole
    assert by_group["corpus_features"] > by_group["rollout_features"] > 0
    assert info["profile"] == "compact" and "fp8 rollout features for 3 anchors" in info["format"]
    assert info["alr_ira_anchors_per_step"].startswith("any")  # 3 parents: the whole pool of 6 per step
    for line in lines[2:]:  # the estimate names the same groups
        assert line.split()[0] in by_group


def _objective(reader, method: str = "alr_ira", anchors_per_step=None) -> ObjectiveConfig:
    m = reader.manifest
    return ObjectiveConfig(method=method, anchors_per_step=anchors_per_step).for_cache(
        num_slots=m.settings.num_slots, mask_token_id=m.mask_token_id, stop_token_ids=m.stop_token_ids
    )


def test_alr_ira_draws_parents_from_the_kept_anchors_and_sees_their_features(compact):
    reader = open_cache(compact["cache"])
    dataset = CacheTrainDataset(reader, objective=_objective(reader), seed=3)
    secondaries = 0
    for index in range(len(reader)):
        example = dataset[(0, index)]
        t = example.targets
        pool = len(reader.read(index, arrays={"anchor_pos"})["anchor_pos"])
        parents = ira_parent_rows(pool, 3)
        assert t.num_blocks == pool and int(t.is_secondary.sum()) == pool // 2  # as many as a full cache's IRA
        assert set(t.private_parent[t.is_secondary].tolist()) <= set(parents.tolist())
        rows = reader.read_rollout_features(index, np.arange(len(parents)))  # decoded fp8 [P, K-2, F]
        context = (example.context_features.to(torch.int32) << 16).view(torch.float32)  # bf16 bits
        for block in torch.nonzero(t.is_secondary).flatten().tolist():
            mine = example.context_owner == block
            stored = rows[int(np.searchsorted(parents, int(t.private_parent[block])))][: int(t.private_len[block])]
            expected = torch.from_numpy(stored).to(torch.bfloat16).float()  # fp8 rows join bf16 corpus bits
            torch.testing.assert_close(context[mine], expected, atol=0, rtol=0)
            secondaries += 1
    assert secondaries >= len(reader)


def test_the_stream_builds_the_same_examples_from_whole_records(compact):
    """The wds stream hands example_from_record whole rollout_features arrays [P, K-2, F] and infers
    the parents from P < A: the same blocks and context as the map loader's reads."""
    reader = open_cache(compact["cache"])
    objective = _objective(reader)
    dataset = CacheTrainDataset(reader, objective=objective, seed=5)
    for index in range(len(reader)):
        record = reader.read(index, decode_features=False)
        features, scales = record["rollout_features"], record["rollout_feature_scales"]
        stream = example_from_record(
            record, epoch=1, index=index, objective=objective, seed=5, ira_parents=len(features),
            parent_rollout_features=lambda rows: (features[rows], scales[rows]),
        )  # fmt: skip
        mapped = dataset[(1, index)]
        assert torch.equal(stream.context_features, mapped.context_features)
        assert torch.equal(stream.targets.label_ids, mapped.targets.label_ids)


def test_too_few_parents_are_refused_in_one_line():
    objective = ObjectiveConfig(method="alr_ira").for_cache(num_slots=7, mask_token_id=0, stop_token_ids=[])
    check_ira_parents_serve(objective, ira_parents=64, anchors_per_sequence=128)
    check_ira_parents_serve(objective, ira_parents=None, anchors_per_sequence=128)
    with pytest.raises(ValueError, match=r"draws 64 IRA parents .* 32 anchors per sequence .* --anchors-per-step <= 65"):
        check_ira_parents_serve(objective, ira_parents=32, anchors_per_sequence=128)
    fewer = ObjectiveConfig(method="alr_ira", anchors_per_step=65).for_cache(num_slots=7, mask_token_id=0, stop_token_ids=[])
    check_ira_parents_serve(fewer, ira_parents=32, anchors_per_sequence=128)
    alr = ObjectiveConfig(method="alr").for_cache(num_slots=7, mask_token_id=0, stop_token_ids=[])
    check_ira_parents_serve(alr, ira_parents=1, anchors_per_sequence=128)  # alr reads no rollout features


def test_draw_ira_from_parents_keeps_ira_counts():
    candidates = torch.arange(10, 110, 5)  # 20 sorted positions
    parents = torch.from_numpy(ira_parent_rows(20, 10))
    for m in (None, 16, 9):
        drawn, split = draw_ira_from_parents(candidates, parents, num_anchors=m, num_slots=7, generator=torch.Generator().manual_seed(1))
        n = 20 if m is None else m
        assert len(drawn) == len(set(drawn.tolist())) == n and torch.all(candidates[drawn].diff() > 0)
        assert len(split.secondaries) == n // 2 and len(split.primaries) == n - n // 2
        assert set(drawn[split.parents].tolist()) <= set(parents.tolist()) and len(set(split.parents.tolist())) == n // 2
        assert not set(split.parents.tolist()) & set(split.secondaries.tolist())
        assert split.offsets.min() >= 2 and split.offsets.max() <= 6
    with pytest.raises(ValueError, match="IRA draws 10 parents among 20 anchors but this sequence keeps rollout features for 8"):
        draw_ira_from_parents(candidates, parents[:8], num_anchors=None, num_slots=7, generator=torch.Generator())


def test_a_version_1_manifest_cannot_claim_version_2_settings(compact, tmp_path):
    data = json.loads((compact["cache"] / MANIFEST_FILE).read_text())
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**data, "format_version": 1}))
    with pytest.raises(ValueError, match=r"format_version 1 cannot hold these settings .* need version 2"):
        load_manifest(tmp_path)


def test_flags_are_checked():
    base = dict(target="t", corpus="c", out="o")
    with pytest.raises(ValueError, match="--compact sets --rollout-feature-codec and --ira-parents"):
        CacheBuildConfig.from_flags(**base, compact=True, ira_parents=4)
    with pytest.raises(ValueError, match="fp8 corpus features take fp8 rollout features"):
        CacheBuildConfig.from_flags(**base, feature_codec="fp8", rollout_feature_codec="bf16")
    with pytest.raises(ValueError, match="--ira-parents must be an int >= 1"):
        CacheBuildConfig.from_flags(**base, ira_parents=0)
    # The same codec twice, or every anchor a parent, is a version-1 layout.
    same = CacheBuildConfig.from_flags(**base, rollout_feature_codec="bf16", ira_parents=500).layout
    assert same == {"feature_codec": "bf16", "rollout_feature_codec": None, "ira_parents": None, "profile": None}
    assert CacheBuildConfig.from_flags(**base, compact=True, anchors=128).layout == {
        "feature_codec": "bf16", "rollout_feature_codec": "fp8", "ira_parents": 64, "profile": "compact"
    }


def test_a_compact_record_round_trips_through_a_tar(compact, tmp_path):
    """The WebDataset form of a version-2 shard: the same records, fp8 rollout rows for the parents only."""
    from storage.shards import write_shard

    reader = open_cache(compact["cache"])
    records = [reader.read(i, decode_features=False) for i in range(3)]
    shard = write_shard(
        tmp_path, shard_index=0, records=records, storage_format="wds", feature_codec="bf16", rollout_feature_codec="fp8",
        ira_parents=3,
    )  # fmt: skip
    assert shard.parents == 9
    back = list(read_shard_records(tmp_path / SHARD_DIR / shard.name, storage_format="wds"))
    for record, got in zip(records, back, strict=True):
        assert set(got) == set(record)
        for name in record:
            np.testing.assert_array_equal(got[name], record[name], err_msg=name)
    with pytest.raises(ValueError, match=r"array rollout_features has shape \(3, 5, 128\), expected \(6, 5, 128\)"):
        write_shard(tmp_path / "all", shard_index=0, records=records, storage_format="wds", feature_codec="bf16",
                    rollout_feature_codec="fp8")  # fmt: skip
