"""`--estimate` states its band (pipeline/cache_build/estimate.py, docs/cache-format.md "Size"): the
exact uncompressed bytes of every array are the ones the build writes (compared array by array with
a real build), and what the build writes lies below the stated upper bound; its header says what
the cache holds (no rollout features claimed where none are stored). In-process builds of the toy
target, Zarr and tar."""

from __future__ import annotations

import json

import pytest

from pipeline.cache_build.estimate import estimate_build, estimate_lines
from storage.manifest import load_manifest
from storage.reader import BYTE_GROUPS, open_cache
from tests.conftest import write_jsonl
from tests.test_build_compute import _build, _config


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"storage_format": "wds", "rollout_features": False},
        {"compact": True},
        {"profile": "small"},
        {"rollouts": False, "anchors": 12},  # no rollouts: the top-k arrays weigh more
    ],
)
def test_the_band_holds_the_build_and_its_raw_bytes_are_exact(toy_target, toy_corpus, tmp_path, monkeypatch, flags):
    monkeypatch.setenv("ALRIRA_CPU_BF16", "0")
    corpus = write_jsonl(tmp_path / "chat.jsonl", [json.loads(line) for line in toy_corpus.read_text().splitlines()[:5]])
    config = _config(toy_target, corpus, tmp_path / "cache", **flags)
    estimate = estimate_build(config, progress=False)
    _build(config)
    reader = open_cache(tmp_path / "cache")
    stored = dict.fromkeys(BYTE_GROUPS, 0)
    group_of = {name: group for group, names in BYTE_GROUPS.items() for name in names}
    for index in range(len(reader)):
        for name, array in reader.read(index, decode_features=False).items():
            if name in group_of:
                stored[group_of[name]] += array.nbytes
    assert stored == {g: b for g, b in estimate["raw_bytes_by_group"].items() if g != "index"}
    written = sum(s.bytes for s in load_manifest(tmp_path / "cache").shards)
    assert written <= estimate["upper_bytes"], (written, estimate["upper_bytes"])
    lines = estimate_lines(estimate)
    assert f"at most {estimate['upper_bytes'] / (1 << 20):,.1f} MiB ({estimate['raw_bytes']:,} bytes of arrays uncompressed, exact" in lines[1]
    if "rollout_features" in config.contents:
        assert "with rollout features" in lines[0]
    else:
        assert "with rollout features" not in lines[0] and "rollout features " not in lines[0] and estimate["ira_parents"] == 0
        assert ("no rollouts" if flags.get("rollouts") is False else "no rollout features") in lines[0]
