"""Every shard records its layout and the reader believes only what matches the manifest
(storage/layout.py): a shard copied in from a cache built with other settings is refused in one
line by the reader (the trainer's map loader), the stream loader, `info` and `verify`, before a
row is read. Real shards of real (in-process) builds of the toy target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.train.streaming import _read_shards, stream_plan
from ray_jobs.cli import cache_cli
from storage.format import SHARD_DIR
from storage.formats.wds import WdsBody
from storage.formats.zarr import ZarrBody
from storage.layout import REBUILD_HINT
from storage.reader import open_cache
from storage.verify import verify_cache

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(layers=[0, 2], anchors=6, top_k=4, max_length=128, shard_size=3, batch_tokens=512)
BUILDS = {
    "zarr": {}, "zarr_fp8": dict(feature_codec="fp8"), "zarr_ira": dict(ira_parents=2), "zarr_topk8": dict(top_k=8),
    "zarr_no_rollout_features": dict(rollout_features=False),
    "wds": dict(storage_format="wds"), "wds_fp8": dict(storage_format="wds", feature_codec="fp8"),
    "wds_ira": dict(storage_format="wds", ira_parents=2),
}  # fmt: skip
# (cache, the cache a shard is copied from, what the refusal names)
SWAPS = [
    ("zarr", "zarr_fp8", "written with feature_codec 'fp8', this cache's manifest says 'bf16'"),
    ("zarr_fp8", "zarr", "written with feature_codec 'bf16', this cache's manifest says 'fp8'"),
    ("zarr", "zarr_ira", "written with ira_parents 2, this cache's manifest says None"),  # read silently before
    ("zarr_ira", "zarr", "written with ira_parents None, this cache's manifest says 2"),  # read silently before
    ("zarr", "zarr_topk8", "array corpus_topk_ids is <i4 rows of shape (8,) in the shard, <i4 rows of shape (4,)"),
    ("zarr", "zarr_no_rollout_features", "written with contents ['corpus_topk', 'rollouts'], this cache's manifest"),
    ("wds", "wds_fp8", "written with feature_codec 'fp8', this cache's manifest says 'bf16'"),
    ("wds", "wds_ira", "written with ira_parents 2, this cache's manifest says None"),  # read silently before
    ("wds_ira", "wds", "written with ira_parents None, this cache's manifest says 2"),
]


def _build(target: Path, corpus: Path, out: Path, **overrides) -> Path:
    config = CacheBuildConfig.from_flags(target=str(target), corpus=str(corpus), out=str(out), **{**SMALL, **overrides})
    build_cache(config, run_shards=run_shards_here, progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def caches(toy_target, toy_corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: _build(toy_target, toy_corpus, root / name, **overrides) for name, overrides in BUILDS.items()}


def _swap_in(cache: Path, donor: Path, out: Path) -> tuple[Path, Path]:
    """A copy of `cache` with its shard 0 replaced by `donor`'s, the manifest entry copied with it
    (as a user copying the shard would): sizes and checksum agree, only the layout differs."""
    shutil.copytree(cache, out)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["shards"][0]
    shard = out / SHARD_DIR / entry["name"]
    shutil.rmtree(shard) if shard.is_dir() else shard.unlink()
    source = donor / SHARD_DIR / entry["name"]
    shutil.copytree(source, shard) if source.is_dir() else shutil.copy(source, shard)
    donor_entry = json.loads((donor / "manifest.json").read_text())["shards"][0]
    entry.update({key: donor_entry.get(key) for key in ("bytes", "checksum", "tokens", "anchors", "parents")})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out, shard


@pytest.mark.parametrize("cache_name, donor_name, named", SWAPS, ids=[f"{d}-in-{c}" for c, d, _ in SWAPS])
def test_a_shard_of_other_settings_is_refused_in_one_line(caches, tmp_path, cache_name, donor_name, named):
    cache, shard = _swap_in(caches[cache_name], caches[donor_name], tmp_path / "cache")
    line = f"{shard}: {named}"

    reader = open_cache(cache)  # the trainer's map loader
    with pytest.raises(ValueError) as refused:
        reader.read(0)
    assert str(refused.value).startswith(line) and str(refused.value).endswith(REBUILD_HINT)
    assert "\n" not in str(refused.value)

    result = CliRunner().invoke(cache_cli, ["info", str(cache)])
    assert result.exit_code == 1 and result.output.startswith(f"Error: {line}") and result.output.count("\n") == 1

    problems = verify_cache(cache)
    assert [p for p in problems if p.startswith(shard.name)] == [f"{shard.name}: {named}" + str(refused.value).split(named, 1)[1]]

    if cache_name.startswith("wds"):  # the stream loader checks the tar's record before its first sample
        plan = stream_plan(open_cache(cache), seed=0, rank=0, world_size=1, num_workers=0, micro_batch=1, grad_accum=1, shuffle_buffer=1)
        first = plan.shards[0]
        with pytest.raises(ValueError, match="^" + line.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            next(_read_shards(iter([first.url]), expected=[first], stubbed=set(), select=None))


@pytest.mark.parametrize("name", ["zarr", "wds_ira"])
def test_a_cache_of_matching_shards_reads_and_verifies(caches, name):
    reader = open_cache(caches[name])
    assert all(reader.read(i)["input_ids"].size for i in range(len(reader)))
    assert verify_cache(caches[name]) == []
    assert CliRunner().invoke(cache_cli, ["info", str(caches[name])]).exit_code == 0


def test_shards_written_before_layouts_were_recorded_still_read_and_are_checked_as_before(
    toy_target, toy_corpus, tmp_path, monkeypatch
):  # fmt: skip
    """A shard without a layout record reads as before; what its own metadata says (Zarr
    attributes and array metadata, a tar's member names) is still compared with the manifest."""
    monkeypatch.setattr(ZarrBody, "start", lambda self, layout: None)
    monkeypatch.setattr(WdsBody, "start", lambda self, layout: None)
    old = {name: _build(toy_target, toy_corpus, tmp_path / name, **BUILDS[name]) for name in ("zarr", "zarr_fp8", "wds", "wds_fp8")}
    for name in old:
        shard = open_cache(old[name])._handle(0)
        assert "layout" not in getattr(shard, "attrs", {}) and getattr(shard, "_layout", None) is None
        assert verify_cache(old[name]) == []
    for cache_name, donor_name in (("zarr", "zarr_fp8"), ("wds", "wds_fp8")):
        cache, shard = _swap_in(old[cache_name], old[donor_name], tmp_path / f"{donor_name}-in-{cache_name}")
        with pytest.raises(ValueError, match=f"^{shard}: .*{REBUILD_HINT}$"):
            open_cache(cache).read(0)
