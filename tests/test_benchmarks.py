"""Every benchmark script still runs: each at its --quick size, checked for the numbers it must print.

Timings are not asserted (they belong in docs/benchmarks.md, measured on a quiet machine); what is
asserted is what a broken script or a broken pipeline would get wrong.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.waits import run_to_end

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run_benchmark(script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # scripts start their own Ray
    result = run_to_end([sys.executable, "-m", f"benchmarks.{script}", *args], cwd=ROOT, env=env)
    assert result.returncode == 0, f"{script}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def table_rows(output: str, header_start: str) -> list[list[str]]:
    """Rows of the table whose header line starts with header_start (cells split on 2+ spaces)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:  # skip the header and the dashes
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_draft_step_cached_and_uncached_propose_the_same_drafts():
    rows = table_rows(run_benchmark("speed.draft_step", "--quick", "--threads", "1"), "context p")
    assert len(rows) == 2
    for row in rows:
        same, total = row[-1].split("/")
        assert same == total, row


def test_activation_memory_checkpointing_saves_memory():
    rows = table_rows(run_benchmark("speed.activation_memory", "--quick", "--threads", "1"), "layers")
    assert [row[0] for row in rows] == ["1", "3", "5"]
    assert all(float(row[3].rstrip("x")) > 1 for row in rows), rows


def test_cache_build_batched_rollouts_match_generate(tmp_path):
    output = run_benchmark("speed.cache_build", "--quick", "--threads", "1", "--out", str(tmp_path / "work"))
    match = re.search(r"rollout tokens identical: (\d+)/(\d+) anchors", output)
    assert match and match.group(1) == match.group(2), output[-2000:]
    sizes = table_rows(output, "format codec")
    assert {tuple(row[0].split()) for row in sizes} == {("zarr", "bf16"), ("zarr", "fp8"), ("wds", "bf16"), ("wds", "fp8")}


def test_train_step_measures_every_row(tmp_path):
    run_benchmark("speed.train_step", "--quick", "--threads", "1", "--out", str(tmp_path / "work"))
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    assert [s["method"] for s in results["steps"]] == ["dflash", "alr_ira"]
    assert all(s["offline_s"] > 0 and s["online_s"] > s["offline_s"] * 0.5 for s in results["steps"])
    assert results["loaders"]


def test_methods_summarises_replicates(tmp_path):
    """Two replicates on one world (--world-seed 0): the second drafter seed reuses the first's world
    and cache (the resume path), so the world and its Ray cache build are paid once."""
    out = tmp_path / "methods"
    run_benchmark(
        "speed.methods", "--quick", "--seeds", "0,1", "--world-seed", "0", "--temperatures", "0", "--methods", "dflash,alr",
        "--out", str(out),
    )  # fmt: skip
    table = json.loads((out / "methods.json").read_text())
    assert [(r["world_seed"], r["seed"]) for r in table["replicates"]] == [(0, 0), (0, 1)]
    assert table["replicates"][0]["world"] == table["replicates"][1]["world"]
    assert [p.name for p in out.iterdir() if p.name.startswith("world-")] == ["world-0"]
    for replicate in table["replicates"]:
        assert all(r["T0"]["lossless_mismatches"] == 0 for r in replicate["methods"].values())
    markdown = (out / "methods.md").read_text()
    assert "| dflash |" in markdown and "| alr |" in markdown

    # The families' training steps side by side, on that cache (benchmarks/speed/family_step.py).
    output = run_benchmark(
        "speed.family_step", "--quick", "--cache", str(out / "world-0" / "cache"), "--steps", "3", "--warmup", "1",
        "--out", str(tmp_path / "family-step"),
    )  # fmt: skip
    assert [row[0] for row in table_rows(output, "family")] == ["dflash", "dspark", "dflash2"]
    report = json.loads((tmp_path / "family-step" / "family_step.json").read_text())
    assert {arch: len(s) for arch, s in report["seconds"].items()} == {"dflash": 3, "dspark": 3, "dflash2": 3}
    assert all(seconds > 0 for seconds in report["median_s_per_step"].values())


def test_rollout_backends_agree():
    pytest.importorskip("vllm")
    output = run_benchmark("speed.rollout_backends", "--quick", "--repeats", "1")
    match = re.search(r"rollout tokens identical for (\d+)/(\d+) anchors", output)
    assert match and match.group(1) == match.group(2), output[-2000:]


def test_read_checksums_refuse_a_flipped_byte():
    rows = table_rows(run_benchmark("speed.read_checksums", "--quick"), "format")
    assert [row[0] for row in rows] == ["zarr", "wds"]
    # Checked reads refuse the flip in both formats. Unchecked, Zarr's Blosc chunk still decodes (to
    # a different value); a compressed WebDataset member may decode or be refused by Blosc itself.
    assert rows[0][-2:] == ["silently different", "refused"], rows[0]
    assert rows[1][-2] in ("silently different", "refused") and rows[1][-1] == "refused", rows[1]


def test_real_shapes_loader_reads_what_each_method_needs(tmp_path):
    output = run_benchmark("speed.real_shapes", "--quick", "--out", str(tmp_path / "work"))  # (a)-(f): the default limit
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    reads = {r["label"]: r for r in results["reads"]}
    assert [row[0] for row in table_rows(output, "method")][:5] == ["dflash", "kd", "erase", "alr", "alr_ira"]
    assert {"dflash", "kd", "erase", "alr", "alr_ira"} <= set(reads)
    assert 1 <= reads["alr"]["ratio"] < float("inf")
    assert reads["alr_ira"]["parents_per_seq"] > 0
    assert reads["alr_ira"]["read_mb_per_seq"] > reads["alr"]["read_mb_per_seq"]
    assert results["drafter_step"]["step_s"] > 0 and [s["shard_size"] for s in results["stage1"]] == [1, 3]
    floors = {r["method"]: r for r in results["loader_floor"]}
    assert "(b2) loader vs its decompression floor" in output
    assert all(floors[m]["floor_seq_per_s"] > 0 and floors[m]["loader_seq_per_s"] > 0 for m in ("alr", "alr_ira"))

    writer = results["writer"]  # (e): each format with 1 and 2 threads, the same bytes
    assert [(w["format"], w["threads"]) for w in writer] == [("zarr", 1), ("zarr", 2), ("wds", 1), ("wds", 2)]
    assert writer[0]["checksum"] == writer[1]["checksum"] != writer[2]["checksum"] == writer[3]["checksum"]
    assert all(w["seconds"] > 0 and w["feature_mb"] > 0 for w in writer)
    assert 1 <= results["chunk_reads"]["ratio"] < float("inf")  # (f)


def test_cache_settings_orders_the_settings_by_bytes(tmp_path):
    output = run_benchmark("speed.cache_settings", "--quick", "--out", str(tmp_path / "work"))
    results = json.loads((tmp_path / "work" / "results.json").read_text())
    per_token = {r["setting"].split(" (")[0]: r["bytes_per_token"] for r in results["bytes"]}
    assert len(table_rows(output, "setting")) == len(results["bytes"]) == 11
    full, compact = per_token["full, bf16"], per_token["--compact"]
    assert full > per_token["--ira-parents 64"] > per_token["--ira-parents 32"] > per_token["--no-rollout-features, bf16"]
    assert full > compact > per_token["--no-rollout-features, bf16"] > per_token["--no-rollout-features, fp8"]
    for row in results["bytes"]:  # the groups add up to the shard
        assert abs(sum(row["per_token"].values()) - row["bytes_per_token"]) < 1e-6
    assert {(r["setting"].split(" (")[0], r["method"]) for r in results["loader"]} == {
        ("full, bf16", "alr"), ("full, bf16", "alr_ira"), ("--compact", "alr"), ("--compact", "alr_ira")
    }
    assert all(r["seq_per_s_per_core"] > 0 for r in results["loader"]) and len(results["codecs"]) == 16


# benchmarks/harness/gpu_check.sh's tests: tests/test_gpu_check.py.


def test_object_store_reads_every_record_from_the_store_as_from_disk():
    """The script compares every record read from moto with the local one (it fails otherwise)."""
    rows = table_rows(run_benchmark("speed.object_store", "--quick"), "format")
    assert [row[:2] for row in rows] == [["zarr", "all arrays"], ["zarr", "alr arrays"], ["wds", "all arrays"], ["wds", "alr arrays"]]
    assert all(int(row[-1]) > 0 for row in rows), rows  # the reads went to the store


def test_store_stream_runs_the_stream_loader_from_every_source_within_the_budget():
    rows = table_rows(run_benchmark("speed.store_stream", "--quick"), "source")
    assert [row[0] for row in rows] == ["local disk", "moto, tar read straight", "moto, local cache + 1 ahead"] * 3
    assert all(float(row[2]) > 0 for row in rows)  # every source delivered its micro-batches
    assert all(int(row[6]) > 0 for row in rows if row[0].startswith("moto"))  # from the store
    for row in rows[2::3]:
        peak, budget = (float(x) for x in row[7].split(" / "))
        assert peak <= budget, row


def test_regenerate_backends_write_the_same_rows():
    output = run_benchmark("speed.regenerate", "--quick", "--no-vllm")
    assert [row[0] for row in table_rows(output, "arm")] == ["hf batched", "hf per row"]
    assert "rows differing from hf batched: hf per row 0/4" in output


def test_cache_tau_rows_share_a_cache_and_compare_paired(tmp_path):
    """Two rows with the same build flags (one cache build, in process, the flag applied) and
    different training settings; the report holds per-seed paired differences, and a label rerun
    with other settings is refused instead of reusing its runs."""
    out = tmp_path / "tau"
    common = ["--quick", "--seeds", "0", "--temperatures", "0", "--methods", "alr", "--in-process-cache", "--out", str(out)]
    run_benchmark("speed.cache_tau", *common, "--row", "base: --shard-size 24", "--row", "draw4: --shard-size 24 | anchors_per_step=4")
    caches = [p for p in (out / "world-0" / "caches").iterdir() if p.is_dir()]
    assert len(caches) == 1
    assert len(json.loads((caches[0] / "manifest.json").read_text())["shards"]) == 2  # 48 rows, --shard-size 24
    rows = out / "world-0" / "rows"
    assert json.loads((rows / "draw4" / "runs" / "alr" / "train_config.json").read_text())["anchors_per_step"] == 4
    report = json.loads((out / "cache_tau.json").read_text())
    base, draw4 = (report["per_seed"]["0"][r]["methods"]["alr"]["T0"]["tau"] for r in ("base", "draw4"))
    assert report["table"]["base"]["alr"]["T0"]["diff_pct"] == [0.0]
    assert report["table"]["draw4"]["alr"]["T0"]["diff_pct"] == [pytest.approx(100 * (draw4 - base) / base)]
    assert "| draw4 | `--shard-size 24 anchors_per_step=4` | alr |" in (out / "cache_tau.md").read_text()
    result = run_to_end(
        [sys.executable, "-m", "benchmarks.speed.cache_tau", *common, "--row", "base: --shard-size 24", "--row", "draw4: | anchors_per_step=2"], cwd=ROOT
    )  # fmt: skip
    assert result.returncode != 0 and "row 'draw4' was run with" in result.stderr, result.stderr[-2000:]


def test_peer_step_runs_alrira_and_the_installed_peers(tmp_path):
    """benchmarks/speed/peer_step.py at its --quick size: alrira's step always runs (a peer without its
    virtualenv is left out in one line); with ALRIRA_PEER_VENVS pointing at --make-peer-venvs' folder,
    SpecForge's first-step loss on the same weights, inputs and anchors equals alrira's."""
    venvs = os.environ.get("ALRIRA_PEER_VENVS")
    args = ["--quick", "--out", str(tmp_path), "--precisions", "fp32"] + (["--peer-venvs", venvs] if venvs else [])
    output = run_benchmark("speed.peer_step", *args)
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    alrira = row["trainers"]["alrira"]
    assert alrira["step_s"] > 0 and 0 < alrira["first_loss"] < 20 and alrira["step_peak_rss_gib"] >= alrira["live_rss_gib"] > 0
    if not venvs:
        assert "not installed (left out): specforge, speculators" in output
        assert set(row["trainers"]) == {"alrira"}
    elif "specforge" in row["trainers"]:
        assert row["trainers"]["specforge"]["first_loss"] == pytest.approx(alrira["first_loss"], rel=1e-5)
