"""Stage 1 end to end on real parts: a local Ray cluster, a tiny Qwen3, real Zarr and tar shards."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache as build_cache_here
from pipeline.cache_build.driver import run_shards_here
from ray_jobs.cli import cache_cli
from pipeline.cache_build.corpus import load_tokenized_corpus
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, run_target_batch
from pipeline.target import load_target
from storage.format import SHARD_DIR
from storage.manifest import load_manifest
from storage.reader import open_cache
from storage.verify import verify_cache
from tests.conftest import write_jsonl
from tests.tmpfs import mounted_tmpfs
from tests.waits import HANG_CAP_S, wait_for

pytestmark = pytest.mark.slow

SMALL = dict(layers=[0, 2], anchors=6, top_k=4, max_length=128, shard_size=3, batch_tokens=512)


def _config(target, corpus, out, **overrides) -> CacheBuildConfig:
    return CacheBuildConfig.from_flags(target=str(target), corpus=str(corpus), out=str(out), **{**SMALL, **overrides})


def _build(ray_address, config: CacheBuildConfig):
    from ray_jobs.build import build_cache

    return build_cache(config, progress=False, log=lambda m: None)


def _cli_args(target, corpus, out, ray_address, *extra):
    return [
        "build", "--target", str(target), "--corpus", str(corpus), "--out", str(out), "--ray-address", ray_address,
        "--layers", "0,2", "--anchors", "6", "--top-k", "4", "--max-length", "128", "--shard-size", "3",
        "--batch-tokens", "512", "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def zarr_cache(ray_address, toy_target, toy_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "zarr-bf16"
    return _build(ray_address, _config(toy_target, toy_corpus, out, workers=2)), out


def test_build_with_two_workers_matches_direct_target_run(zarr_cache, toy_target):
    manifest, out = zarr_cache
    corpus = load_tokenized_corpus(out / "corpus")
    assert manifest.is_complete and manifest.num_sequences == len(corpus) > 3
    assert manifest.num_shards_planned == len(manifest.shards) == -(-len(corpus) // 3)
    assert manifest.settings.layer_ids == [0, 2]

    reader = open_cache(out)
    assert len(reader) == len(corpus)
    model = load_target(toy_target)
    config = TargetRunConfig(layer_ids=[0, 2], anchors_per_sequence=6, top_k=4, seed=0)
    for index in (0, len(reader) - 1):
        record = reader.read(index)
        ids, mask = corpus.sequence(index)
        direct = run_target_batch(
            model, [TargetSequence(source_row=int(corpus.source_rows[index]), input_ids=np.asarray(ids), loss_mask=np.asarray(mask))], config
        )[0]
        assert int(record["source_row"]) == int(corpus.source_rows[index])
        assert np.array_equal(record["input_ids"], direct.input_ids.numpy())
        assert np.array_equal(record["anchor_pos"], direct.anchor_pos.numpy())
        assert np.array_equal(record["rollout_tokens"], direct.rollout_tokens.numpy())
        np.testing.assert_allclose(record["rollout_topk_probs"], direct.rollout_topk_probs.numpy(), atol=2e-6)
        # bf16 features: exactly the bf16 rounding of the fp32 features.
        expected = direct.features.to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(record["features"], expected, atol=1e-2, rtol=1e-2)
        assert record["rollout_features"].shape == (len(direct.anchor_pos), 13, direct.features.shape[1])


def test_info_and_verify(zarr_cache):
    _, out = zarr_cache
    runner = CliRunner()
    result = runner.invoke(cache_cli, ["info", str(out), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["sequences"] > 0 and info["bytes_per_token"] > 0
    assert set(info["trainable_methods"]) >= {"dflash", "kd", "erase", "alr", "alr_ira"}
    result = runner.invoke(cache_cli, ["verify", str(out)])
    assert result.exit_code == 0, result.output


def test_verify_catches_one_flipped_byte(zarr_cache, tmp_path):
    import shutil

    _, out = zarr_cache
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = sorted((copy / SHARD_DIR).iterdir())[1]
    chunk = max((p for p in shard.rglob("*") if p.is_file() and "features" in str(p)), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    result = CliRunner().invoke(cache_cli, ["verify", str(copy)])
    assert result.exit_code != 0
    assert shard.name in result.output


def test_wds_fp8_cache_holds_the_same_content(ray_address, zarr_cache, toy_target, toy_corpus, tmp_path):
    _, zarr_out = zarr_cache
    out = tmp_path / "wds-fp8"
    manifest = _build(ray_address, _config(toy_target, toy_corpus, out, storage_format="wds", feature_codec="fp8"))
    assert all(s.name.endswith(".tar") for s in manifest.shards)
    zarr_reader, wds_reader = open_cache(zarr_out), open_cache(out)
    assert len(zarr_reader) == len(wds_reader)
    for index in range(len(wds_reader)):
        a, b = zarr_reader.read(index), wds_reader.read(index)
        for name in ("input_ids", "loss_mask", "anchor_pos", "rollout_tokens", "rollout_topk_ids", "corpus_topk_ids"):
            assert np.array_equal(a[name], b[name]), name
        np.testing.assert_allclose(a["rollout_topk_probs"], b["rollout_topk_probs"], atol=1e-6)
        # fp8-e4m3 keeps 3 mantissa bits: relative error per element <= 2^-4 of the row scale.
        scale = np.abs(a["features"]).max(axis=-1, keepdims=True)
        assert np.all(np.abs(a["features"] - b["features"]) <= scale * 2**-4 + 1e-2)
    zarr_bytes = sum(s.bytes for s in load_manifest(zarr_out).shards)
    assert manifest.num_tokens == load_manifest(zarr_out).num_tokens
    assert sum(s.bytes for s in manifest.shards) > 0 and zarr_bytes > 0


def test_changed_setting_is_refused_unless_overwrite(ray_address, toy_target, toy_corpus, tmp_path):
    out = tmp_path / "cache"
    _build(ray_address, _config(toy_target, toy_corpus, out))
    with pytest.raises(ValueError, match="top_k: 4 -> 3"):
        _build(ray_address, _config(toy_target, toy_corpus, out, top_k=3))
    manifest = _build(ray_address, _config(toy_target, toy_corpus, out, top_k=3, overwrite=True))
    assert manifest.settings.top_k == 3
    assert open_cache(out).read(0)["corpus_topk_ids"].shape[1] == 3
    # The same settings again: nothing to rebuild, the manifest is unchanged.
    again = _build(ray_address, _config(toy_target, toy_corpus, out, top_k=3))
    assert [s.checksum for s in again.shards] == [s.checksum for s in manifest.shards]


def test_bad_rows_error_names_file_and_line_or_are_skipped(ray_address, toy_target, toy_corpus, tmp_path):
    rows = toy_corpus.read_text().splitlines()
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:3] + ["{not json", '{"messages": [{"role": "robot", "content": "x"}]}'] + rows[3:])
    runner = CliRunner()
    result = runner.invoke(cache_cli, _cli_args(toy_target, bad, tmp_path / "c1", ray_address))
    assert result.exit_code != 0
    assert "bad.jsonl:4" in result.output and "\n" not in result.output.strip().split("Error: ")[-1]
    assert not (tmp_path / "c1" / "manifest.json").exists()

    result = runner.invoke(cache_cli, _cli_args(toy_target, bad, tmp_path / "c2", ray_address, "--skip-bad-rows"))
    assert result.exit_code == 0, result.output
    manifest = load_manifest(tmp_path / "c2")
    assert manifest.corpus_stats["dropped"]["bad_json"] == 1
    assert manifest.corpus_stats["dropped"]["unknown_role"] == 1
    assert manifest.corpus_stats["rows"] == len(rows) + 2


class _Phases:
    """The phases of a kill test with their durations, for its failure messages: which phase
    failed, how long each took (a loaded machine stretches them), and the logs of what ran."""

    def __init__(self):
        self.done: list[tuple[str, float]] = []
        self.logs: dict[str, Callable[[], str]] = {}
        self.started = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str):
        began = time.monotonic()
        try:
            yield
        finally:
            self.done.append((name, time.monotonic() - began))

    def report(self, failed: str) -> str:
        lines = [f"{failed}", "phases: " + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.done)
                 + f" (total {time.monotonic() - self.started:.1f}s)"]  # fmt: skip
        lines += [f"--- {name} (last 3000 characters) ---\n{text()[-3000:]}" for name, text in self.logs.items()]
        return "\n".join(lines)


def test_resume_after_kill_gives_identical_cache(ray_address, toy_target, toy_corpus, shard1_reference, tmp_path):
    """Kill the whole build mid-way (driver and its worker actors), resume, compare to a clean run.
    A failure names its phase, every phase's duration and both builds' output (_Phases)."""
    reference = shard1_reference
    out = tmp_path / "killed"
    args = _cli_args(toy_target, toy_corpus, out, ray_address, "--shard-size", "1")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    phases = _Phases()
    killed_log = tmp_path / "killed-build.log"
    phases.logs["the killed build"] = killed_log.read_text
    with phases.phase("start to 2 shards listed"):
        with open(killed_log, "w") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from ray_jobs.cli import cache_cli; cache_cli()", *args],
                env=env, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:  # wait on the event (two shards published), not on a clock: the start may take minutes
            two_listed = wait_for(lambda: _listed(out) >= 2, what="the build publishing 2 shards", ended=lambda: proc.poll() is not None)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert two_listed, phases.report(f"the build ended (exit {proc.returncode}) with {_listed(out)} shard(s) listed, before it could be killed at 2")
    killed = load_manifest(out)
    assert len(killed.shards) < killed.num_shards_planned, phases.report("the build finished every shard before it could be killed")

    with phases.phase("resume"):
        result = CliRunner().invoke(cache_cli, _cli_args(toy_target, toy_corpus, out, ray_address, "--shard-size", "1"))
    phases.logs["the resumed build"] = lambda: result.output + (f"\n{result.exception!r}" if result.exception else "")
    assert result.exit_code == 0, phases.report(f"the resumed build failed (exit {result.exit_code})")
    resumed, clean = load_manifest(out), load_manifest(reference)
    assert resumed.is_complete, phases.report(f"the resumed manifest lists {len(resumed.shards)} of {resumed.num_shards_planned} shards")
    differ = [(a.name, a.checksum, b.checksum) for a, b in zip(resumed.shards, clean.shards) if (a.name, a.checksum) != (b.name, b.checksum)]
    assert len(resumed.shards) == len(clean.shards) and not differ, phases.report(f"resumed shards differ from the clean build's: {differ[:3]}")
    left = [p.name for p in (out / SHARD_DIR).iterdir() if p.name.startswith(".tmp")]
    assert not left, phases.report(f"temp entries left in {out / SHARD_DIR}: {left}")
    with phases.phase("verify"):
        result = CliRunner().invoke(cache_cli, ["verify", str(out)])
    assert result.exit_code == 0, phases.report(f"verify failed: {result.output}")


def _build_and_interrupt(config: CacheBuildConfig, interrupt) -> tuple[int | None, list[Exception]]:
    """Run build_cache in a thread; once its manifest lists a shard, call interrupt() until it
    returns True. Returns how many shards were listed when it did (None: never) and what the
    build raised."""
    import threading

    from ray_jobs.build import build_cache

    errors = []

    def run():
        try:
            build_cache(config, progress=False, log=lambda m: None)
        except Exception as error:  # surfaced by the caller's assertions
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    def interrupted() -> int | None:
        listed = _listed(Path(config.out))
        return listed if listed >= 1 and interrupt() else None

    try:
        interrupted_at = wait_for(interrupted, what="a shard published, then interrupt()", ended=lambda: not thread.is_alive())
    finally:
        wait_for(lambda: not thread.is_alive(), what="the interrupted build ending")
    return interrupted_at, errors


def _own_ray_processes(title: str) -> list[int]:
    """Pids of the Ray worker processes titled `title`* of the session's own cluster (the raylet is
    this process's child): never another user's processes on a shared machine."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith(title):
                found.append(child.pid)
        except psutil.Error:  # exited meanwhile
            continue
    return found


def _listed(out: Path) -> int:
    """How many shards the manifest in `out` lists (0 before it exists; it is replaced atomically)."""
    manifest_path = out / "manifest.json"
    return len(json.loads(manifest_path.read_text())["shards"]) if manifest_path.exists() else 0


def test_worker_killed_mid_build_is_replaced_and_the_shard_redone(ray_address, toy_target, toy_corpus, shard1_reference, tmp_path):
    """SIGKILL one target actor while it works: the driver starts a new one and redoes its shard."""
    reference = shard1_reference

    def kill_a_worker() -> bool:
        pids = _own_ray_processes("ray::CacheWorker")
        if pids:
            os.kill(pids[0], signal.SIGKILL)
        return bool(pids)

    out = tmp_path / "killed-worker"
    killed_at, errors = _build_and_interrupt(_config(toy_target, toy_corpus, out, shard_size=1, workers=2), kill_a_worker)
    assert not errors, errors
    assert killed_at is not None and killed_at < load_manifest(reference).num_shards_planned
    resumed, clean = load_manifest(out), load_manifest(reference)
    assert resumed.is_complete
    assert [(s.name, s.checksum) for s in resumed.shards] == [(s.name, s.checksum) for s in clean.shards]


def test_a_build_that_loses_the_directory_stops_and_the_claimant_finishes(
    ray_address, toy_target, toy_corpus, shard1_reference, tmp_path
):
    """Another build claiming the directory mid-way (a re-run started while Ray still reaps the
    actors of a killed driver, or a second build on the same --out) stops this one at its next
    shard with a one-line error naming the directory; the claimant's resume equals a clean build."""
    from storage.location import resolve
    from storage.ownership import CacheOwnershipLost, claim_cache

    reference = shard1_reference
    out = tmp_path / "contested"
    claimed_at, errors = _build_and_interrupt(
        _config(toy_target, toy_corpus, out, shard_size=1, workers=1), lambda: bool(claim_cache(resolve(out)))
    )
    assert claimed_at is not None and claimed_at < load_manifest(reference).num_shards_planned
    assert len(errors) == 1 and isinstance(errors[0], CacheOwnershipLost), errors
    assert str(out) in str(errors[0]) and "\n" not in str(errors[0])
    # At most the shard in flight when the claim landed was recorded; no temp files are left.
    assert len(load_manifest(out).shards) <= claimed_at + 1
    assert not [p for p in (out / SHARD_DIR).iterdir() if p.name.startswith(".tmp")]

    resumed, clean = _build(ray_address, _config(toy_target, toy_corpus, out, shard_size=1)), load_manifest(reference)
    assert resumed.is_complete
    assert [(s.name, s.checksum) for s in resumed.shards] == [(s.name, s.checksum) for s in clean.shards]


# ---------------------------------------------------------------------------------------------
# What a build may delete, and bad paths: one line each, nothing of the user's touched


def _build_here(config: CacheBuildConfig, log=lambda m: None):
    """The driver with shards computed in this process: the same files as the Ray pool, faster."""
    return build_cache_here(config, run_shards=run_shards_here, progress=False, log=log)


def _one_line_error(result, *needles: str) -> str:
    assert result.exit_code != 0, result.output
    # The error is the last line, one line; the lines before it are the build's progress log
    # (each published shard and its node, ray_jobs.build.shard_line).
    lines = result.output.strip().splitlines()
    message = lines[-1]
    assert message.startswith("Error: ") and "Traceback" not in result.output, result.output
    assert not [line for line in lines[:-1] if not line.startswith("shard-")], result.output
    for needle in needles:
        assert needle in message, message
    return message


def test_out_that_is_not_a_cache_is_refused_and_keeps_its_files(ray_address, toy_target, toy_corpus, tmp_path):
    """The reported case: the input corpus lives in OUT/corpus/chat.jsonl. Without --overwrite and
    with it, the build refuses in one line, writes nothing, and the same command fails the same way."""
    out = tmp_path / "out"
    (out / "corpus").mkdir(parents=True)
    corpus = out / "corpus" / "chat.jsonl"
    shutil.copy(toy_corpus, corpus)
    runner = CliRunner()
    for extra in ((), (), ("--overwrite",)):
        result = runner.invoke(cache_cli, _cli_args(toy_target, corpus, out, ray_address, *extra))
        _one_line_error(result, str(out), "not a cache")
        assert corpus.read_bytes() == toy_corpus.read_bytes()
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["corpus", "corpus/chat.jsonl"]


def test_a_second_build_of_the_same_out_refuses_while_the_first_runs(ray_address, toy_target, toy_corpus, tmp_path):
    """Two builds on one --out: the second refuses in one line naming the holder (pid and host) and
    writes nothing, on the Ray job and in process; the lock of a build whose process is gone (a
    killed build) is taken over, and a finished build leaves no lock behind."""
    import socket

    from pipeline.outputs import LOCK_FILE, output_lock

    out = tmp_path / "cache"
    with output_lock(out, command="alrira-cache build"):  # the first build, still running (this process)
        holder = rf"in use by alrira-cache build \(pid {os.getpid()} on "
        with pytest.raises(ValueError, match=rf"--out {out}: {holder}"):
            _build_here(_config(toy_target, toy_corpus, out))
        result = CliRunner().invoke(cache_cli, _cli_args(toy_target, toy_corpus, out, ray_address))
        assert "in use by alrira-cache build" in _one_line_error(result, str(out))
        assert [p.name for p in out.iterdir()] == [LOCK_FILE]
    assert not out.exists()  # the lock's directory, made for it and left empty

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(), "command": "alrira-cache build"}))
    manifest = _build_here(_config(toy_target, toy_corpus, out))
    assert manifest.is_complete and verify_cache(out) == [] and not (out / LOCK_FILE).exists()


def test_overwrite_removes_only_the_caches_own_files(toy_target, toy_corpus, tmp_path):
    out = tmp_path / "cache"
    lines = []
    first = _build_here(_config(toy_target, toy_corpus, out), log=lines.append)
    # The summary line counts truncated sequences like the manifest does.
    assert first.corpus_stats["truncated"] > 0
    assert f"truncated {first.corpus_stats['truncated']}," in lines[-1]
    user_files = {out / "notes.txt": b"mine", out / SHARD_DIR / "README": b"also mine"}
    for path, data in user_files.items():
        path.write_bytes(data)

    second = _build_here(_config(toy_target, toy_corpus, out, top_k=3, overwrite=True))
    assert second.settings.top_k == 3 and second.is_complete
    assert all(path.read_bytes() == data for path, data in user_files.items())
    assert verify_cache(out) == []

    # A file of the user's inside corpus/ would be replaced with the tokenized corpus: refused
    # before anything is touched, the cache stays as it was.
    mine = out / "corpus" / "mine.txt"
    mine.write_text("do not delete")
    with pytest.raises(ValueError, match=r"corpus: holds files a cache build did not write \(mine.txt\)"):
        _build_here(_config(toy_target, toy_corpus, out, top_k=4, overwrite=True))
    assert mine.read_text() == "do not delete"
    assert load_manifest(out).settings.top_k == 3 and verify_cache(out) == []


def test_a_build_that_fails_before_its_first_shard_removes_what_it_wrote(toy_target, toy_corpus, tmp_path):
    """Every sequence dropped: the build fails after tokenizing; no claim or corpus is left behind
    (a directory it created is gone, an empty one given to it stays empty)."""
    for out in (tmp_path / "new", tmp_path / "given"):
        if out.name == "given":
            out.mkdir()
        with pytest.raises(ValueError, match="no sequences left"):
            _build_here(_config(toy_target, toy_corpus, out, min_supervised_tokens=128))
        assert (not out.exists()) if out.name == "new" else list(out.iterdir()) == []


def test_workers_beyond_the_cluster_are_refused_in_one_line(ray_address, toy_target, toy_corpus, tmp_path):
    """--workers 3 on the 2-CPU cluster: refused up front instead of waiting forever for a third
    actor (a subprocess with a timeout, so a regression fails instead of hanging the suite)."""
    out = tmp_path / "cache"
    args = _cli_args(toy_target, toy_corpus, out, ray_address, "--workers", "3")
    proc = subprocess.run(
        [sys.executable, "-c", "from ray_jobs.cli import cache_cli; cache_cli()", *args],
        capture_output=True, text=True, timeout=HANG_CAP_S,
    )  # fmt: skip
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: --workers 3:") and "can place 2 worker(s)" in last and "--workers 2" in last, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_bad_paths_are_one_line_errors(ray_address, toy_target, toy_corpus, tmp_path):
    runner = CliRunner()
    not_a_dataset = tmp_path / "texts"
    not_a_dataset.mkdir()
    (not_a_dataset / "a.txt").write_text("hello")
    result = runner.invoke(cache_cli, _cli_args(toy_target, not_a_dataset, tmp_path / "c1", ray_address))
    _one_line_error(result, str(not_a_dataset), "not a dataset")
    assert not (tmp_path / "c1").exists()

    a_file = tmp_path / "c2"
    a_file.write_text("not a directory")
    result = runner.invoke(cache_cli, _cli_args(toy_target, toy_corpus, a_file, ray_address))
    _one_line_error(result, f"--out {a_file}: exists and is not a directory")
    assert a_file.read_text() == "not a directory"

    with mounted_tmpfs(tmp_path / "ro", read_only=True) as read_only:
        result = runner.invoke(cache_cli, _cli_args(toy_target, toy_corpus, read_only / "cache", ray_address))
        _one_line_error(result, str(read_only / "cache"), "Read-only file system")


def test_full_disk_is_one_line_and_the_cache_stays_consistent(ray_address, toy_target, toy_corpus, tmp_path):
    """A 1 MiB tmpfs holds the corpus, head and a few shards, then a worker's shard write hits
    ENOSPC: one line naming the cache, every listed shard intact, no temp files; with room again
    the same command finishes the cache."""
    with mounted_tmpfs(tmp_path / "disk") as disk:
        out = disk / "cache"
        args = _cli_args(toy_target, toy_corpus, out, ray_address, "--shard-size", "1")
        result = CliRunner().invoke(cache_cli, args)
        _one_line_error(result, str(out), "No space left on device", "free space and rerun the same command to resume")
        manifest = load_manifest(out)
        assert 0 < len(manifest.shards) < manifest.num_shards_planned
        assert verify_cache(out) == [f"{out}/manifest.json: {len(manifest.shards)} of {manifest.num_shards_planned} planned shards are complete"]
        assert not [p for p in (out / SHARD_DIR).iterdir() if p.name.startswith(".tmp")]

        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        result = CliRunner().invoke(cache_cli, args)
        assert result.exit_code == 0, result.output
        assert load_manifest(out).is_complete and verify_cache(out) == []
