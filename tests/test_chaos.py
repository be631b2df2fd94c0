"""The chaos harness in CI (benchmarks/harness/chaos.py): rounds of random combined faults per
stage (a seeded draw: the failing round's replay command is in the message), each ending exactly
as a clean run; and the regression tests of the failures the harness found (docs/failure-modes.md,
"Chaos").

One world for the module: the toy target and corpus, the harness's own 2-raylet Ray cluster and S3
server on 127.0.0.1, a small tmpfs, and one clean reference per stage. No wall-clock bound decides
anything: a round fails on what it ended with, or on a hang past the harness's cap.

ALRIRA_CHAOS_ROUNDS sets the rounds per stage (default 1: what fits this suite's budget on two
shared cores; 10 per stage took 577 s on the idle machine, docs/benchmarks.md "Chaos"),
ALRIRA_CHAOS_SEED the seed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.common import ROOT
from benchmarks.harness import chaos
from tests.tmpfs import mounted_tmpfs

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("ALRIRA_CHAOS_ROUNDS", "1"))
SEED = int(os.environ.get("ALRIRA_CHAOS_SEED", "30"))


@pytest.fixture(scope="module")
def world(toy_target, toy_corpus, shard1_reference):
    """The session's toy target and corpus, and its clean build at the harness's settings
    (tests/conftest.py's shard1_reference: tests/test_cache_build.py's SMALL at --shard-size 1)."""
    # A short root: Ray's socket paths under it (ray-head/session_.../sockets/plasma_store) must fit
    # AF_UNIX's 107 bytes, which pytest's own temp paths exceed.
    root = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    world = chaos.make_world(root / "world", log=print, target=toy_target, corpus=toy_corpus)
    try:
        (world.root / "logs").mkdir()
        chaos.start_store(world)
        chaos.start_cluster(world)
        chaos.mount_disk(world)
        chaos.make_references(world, list(chaos.STAGES), build=shard1_reference)
        yield world
    finally:
        chaos.close_world(world)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("stage", chaos.STAGES)
def test_rounds_of_random_faults_end_as_clean_runs(world, stage):
    lines = []
    for index in range(ROUNDS):
        result = chaos.play_round(world, stage, index, SEED)
        lines.append(chaos.report_line(result, SEED))
        print(lines[-1])
    assert not [line for line in lines if ": FAILED: " in line], "\n".join(lines)


def test_a_raylet_killed_mid_build_is_survived(world):
    """Regression: the build's progress board could live on the lost node; the driver's next
    take() raised ActorUnavailableError and the user saw a traceback."""
    result = chaos.play_round(world, "build", 1000, SEED, only=["kill_raylet"])
    assert not result.error, chaos.report_line(result, SEED)


def test_a_full_disk_during_regeneration_is_one_line_and_the_rerun_resumes(world):
    """Regression: regeneration said only `Error: [Errno 28] No space left on device`."""
    result = chaos.play_round(world, "regenerate", 1001, SEED, only=["disk_full"])
    assert not result.error, chaos.report_line(result, SEED)
    if result.first_error:  # the run may have ended before the disk filled
        assert result.first_error.startswith("Error: ") and "regenerate-1001" in result.first_error, result.first_error
        assert "No space left on device" in result.first_error, result.first_error


BOARD_SCRIPT = """
import json, sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR")
here = ray.get_runtime_context().get_node_id()
# Every CPU of the driver's node taken: a board placed by load alone would go to the other node.
@ray.remote(num_cpus=2)
class Hog:
    def ready(self):
        return True
hog = Hog.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
ray.get(hog.ready.remote())
from ray_jobs.build import progress_board
boards = [progress_board() for _ in range(4)]
ray.get([b.take.remote() for b in boards])
nodes = [ray._private.state.actors(b._actor_id.hex())["Address"]["NodeID"] for b in boards]
print(json.dumps({"here": here, "boards": nodes}))
"""


def test_the_progress_board_lives_on_the_drivers_node(world):
    """Regression (the root cause of the one above): the board is pinned to the driver's node, even
    when that node's CPUs are all taken."""
    proc = subprocess.run([sys.executable, "-c", BOARD_SCRIPT, world.address], env=world.env, capture_output=True, text=True, timeout=chaos.RUN_CAP_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert placed["boards"] == [placed["here"]] * 4, placed


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs; skipped where mounting is not permitted."""
    with mounted_tmpfs(tmp_path / "disk") as path:
        yield path


class _Net(torch.nn.Linear):
    """A module with the drafter's one extra attribute save_checkpoint reads (its HF config)."""

    class config:  # noqa: N801 (an attribute, as on DFlashDrafter)
        @staticmethod
        def to_hf_dict() -> dict:
            return {"architectures": ["Test"]}


def test_a_full_disk_at_a_checkpoint_is_one_line_not_a_traceback(full_disk):
    """Regression: torch.save's zip writer turned ENOSPC into `RuntimeError: ... unexpected pos` /
    `basic_ios::clear: iostream error`, which alrira-train showed as a traceback (found by the chaos
    harness). Now the one-line ValueError the CLI prints; nothing half-written is left."""
    from pipeline.train.checkpoints import save_checkpoint
    from storage.location import resolve

    model = _Net(1024, 512)  # 2 MiB of weights, more than the disk
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as failed:
        save_checkpoint(resolve(str(full_disk / "run")), step=3, model=model, optimizer=optimizer, settings={})
    line = str(failed.value)
    assert line.startswith(str(full_disk / "run" / "checkpoints" / "step-00000003")) and "\n" not in line, line
    assert "No space left on device" in line and "rerun the same command with --resume" in line, line
    assert list((full_disk / "run" / "checkpoints").iterdir()) == []  # the temp directory went too


def test_the_table_counts_a_replayed_round_once_and_every_fault():
    """docs/benchmarks.md's table is rendered from the --jsonl lines of one or more runs (a later
    session continues with --first-round): a round replayed later counts once, with its last result."""
    row = dict(seed=5, stage="train", variant="train", attempts=2, seconds=20.0, recovery_s=8.0, error="", first_error="")
    rows = [{**row, "index": 0, "faults": {"kill_driver": "pgid 1"}, "error": "hung"},
            {**row, "index": 0, "faults": {"kill_driver": "pgid 2"}},  # the replay, after the fix
            {**row, "index": 1, "faults": {"kill_loader": "missed (no worker alive)", "disk_full": "1 MiB filler"}, "attempts": 1,
             "seconds": 40.0, "recovery_s": 0.0}]  # fmt: skip
    lines = chaos.table(rows).splitlines()
    assert len(lines) == 3 and lines[2].startswith("| train (train 2) | 2/2 | disk_full 1/0, kill_driver 1/0, kill_loader 0/1 |"), lines
    assert lines[2].endswith("| 30 (20-40) | 4 (8) | 1 / 1 / 0 |"), lines[2]


def test_a_full_disk_at_the_final_drafter_is_one_line_not_a_traceback(full_disk):
    """Regression: safetensors reports ENOSPC as a SafetensorError ("... (os error 28)"),
    which alrira-train showed as a traceback (found by the chaos harness). Now the OSError
    naming the file, and from the trainer's save the one-line ValueError with what to do."""
    from drafter.checkpoint import save_drafter
    from pipeline.train.run_dir import save_drafter_to
    from storage.location import resolve

    with pytest.raises(OSError) as failed:
        save_drafter(_Net(1024, 512), full_disk / "drafter", dtype=torch.float32)  # 2 MiB, more than the disk
    assert failed.value.errno == 28 and failed.value.filename == str(full_disk / "drafter" / "model.safetensors")
    with pytest.raises(ValueError) as failed:
        save_drafter_to(resolve(str(full_disk / "run")), _Net(1024, 512), dtype=torch.float32)
    line = str(failed.value)
    assert line.startswith(str(full_disk / "run" / "drafter" / "model.safetensors")) and "\n" not in line, line
    assert "No space left on device" in line and "rerun the same command with --resume" in line, line
    assert not [p for p in full_disk.rglob("*") if p.name.endswith(".tmp")]  # no half-written weights left


def test_a_lock_is_never_left_empty_by_a_full_disk(full_disk):
    """Regression: the lock was created (O_EXCL) and then its holder written; on a full disk the write
    failed and an empty lock refused every rerun: "in use by another command (pid None on None)"
    (found by the chaos harness). Now the holder is written aside and linked into place."""
    import os

    from pipeline.outputs import LOCK_FILE, output_lock

    out = full_disk / "out"
    out.mkdir()
    filler = full_disk / "filler"
    with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
        while True:  # every block of the 1 MiB disk
            f.write(b"\0" * 4096)
            f.flush()
    with pytest.raises(ValueError) as failed, output_lock(out, command="test"):
        pass
    assert str(failed.value) == f"--out {out}: cannot write its lock {LOCK_FILE}: No space left on device; free space and rerun the same command"
    assert sorted(os.listdir(out)) == []  # neither the lock nor its temporary name is left
    filler.unlink()
    with output_lock(out, command="test") as lock:  # the rerun, once there is space, takes it
        assert '"command": "test"' in lock.read_text()
    assert not lock.exists()


def test_a_lock_naming_no_holder_is_taken_over_once_old(tmp_path):
    """An empty lock (an older version's, or a kill between its create and its write) is refused
    while it may still be being written, and taken over once older than the grace period."""
    import os
    import time

    from pipeline.outputs import HOLDERLESS_GRACE_S, LOCK_FILE, output_lock

    lock = tmp_path / LOCK_FILE
    lock.write_text("")
    with pytest.raises(ValueError, match="in use by"), output_lock(tmp_path, command="test"):
        pass
    old = time.time() - HOLDERLESS_GRACE_S - 5
    os.utime(lock, (old, old))
    with output_lock(tmp_path, command="test") as taken:
        assert '"command": "test"' in taken.read_text()


WORKER_SCRIPT = """
import os, signal, sys, time
import torch
from pipeline.train.config import LoaderConfig
from pipeline.train.data import release_loader

loader = torch.utils.data.DataLoader(list(range(64)), batch_sampler=[[0, 1], [2, 3], [4, 5]], num_workers=1)
batches = iter(loader)
next(batches), next(batches)  # the trainer's last step: its batches taken, the iterator not exhausted
if sys.argv[1] == "stop":
    release_loader(batches, loader=LoaderConfig(num_workers=1))
try:
    os.kill(batches._workers[0].pid, signal.SIGKILL)  # the worker dies after the last step
except ProcessLookupError:
    pass  # stopped already
for _ in range(50):  # the final save and the exit: torch's SIGCHLD handler raises in here, or not
    time.sleep(0.02)
print("ended cleanly")
"""


@pytest.mark.parametrize("stop", [True, False])
def test_a_loader_worker_killed_after_the_last_step_is_not_a_traceback(stop):
    """Regression (found by the chaos harness): the map loader's workers lived until the
    interpreter exited, so one killed after the last step made torch's SIGCHLD handler raise in the
    final save or in an atexit hook: a traceback after the run ended. The trainer now stops them
    after the last step (`release_loader`); without that, the control shows the raise."""
    proc = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, "stop" if stop else "keep"], capture_output=True, text=True,
                          timeout=chaos.RUN_CAP_S, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    if stop:
        assert proc.returncode == 0 and proc.stdout.strip() == "ended cleanly" and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0 and "is killed by signal: Killed" in proc.stderr, (proc.returncode, proc.stderr[-2000:])


def test_a_loader_worker_death_inside_a_checkpoint_save_is_one_line():
    """Regression (found by the chaos harness): torch's SIGCHLD handler raised the worker's
    death inside torch.save, whose cleanup raised another error "during handling" of it; the CLI
    matched only the last error and showed a traceback. It now finds the death in the chain."""
    from pipeline.cli import training_error_line

    def chained() -> BaseException:
        try:
            try:
                raise RuntimeError("DataLoader worker (pid 20878) is killed by signal: Killed. ")
            except RuntimeError:
                raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")  # noqa: B904
        except RuntimeError as error:
            return error

    line = training_error_line(chained())
    assert line.startswith("DataLoader worker (pid 20878) died (killed, or out of memory)") and "--resume" in line, line
    assert training_error_line(RuntimeError("an unexpected bug")) is None  # a bug keeps its traceback
    assert training_error_line(OSError(28, "No space left on device")) == "[Errno 28] No space left on device"


def test_a_run_that_fails_before_its_first_step_stops_its_loader_workers(shard1_reference, tmp_path, monkeypatch):
    """Regression (found by the chaos harness): the map loader's workers start in setup, but
    the trainer wrote train_config.json and opened its logs outside the block whose exit stops them;
    a full disk there ended the run with its one line while the workers lived on, and one killed
    then made torch's SIGCHLD handler raise in an atexit hook: a traceback after the error line."""
    import errno

    import psutil

    from pipeline.train import loop
    from pipeline.train.config import TrainConfig
    from tests.waits import wait_for

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(loop, "atomic_write_text", full_disk)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    config = TrainConfig.from_flags(cache=str(shard1_reference), out=str(tmp_path / "run"), method="alr", epochs=1, batch_size=2,
                                    num_workers=1, progress=False)  # fmt: skip
    with pytest.raises(OSError, match="No space left on device") as failed:
        loop.train(config)
    # While the error is held (as the CLI holds it while it prints and exits), its traceback keeps
    # the trainer's frame and loader alive: the workers must be stopped by the trainer, not by GC.
    left = lambda: [p for p in me.children(recursive=True) if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # noqa: E731
    assert wait_for(lambda: not left(), what="the loader's workers to stop", cap_s=30) is True, left()
    assert failed.value.errno == errno.ENOSPC  # (the error held until here)


def test_the_docs_chaos_tables_are_the_runs_they_name():
    """docs/benchmarks.md's chaos tables come from the --jsonl files kept under docs/chaos/: each
    table is chaos.table of the files named in the paragraph right above it."""
    import re

    section = (ROOT / "docs" / "benchmarks.md").read_text().split("\n## Chaos", 1)[1].split("\n### Earlier runs", 1)[0]
    found = re.findall(r"([^\n]*(?:\n[^\n]+)*)\n\n(\| stage \| rounds passed \|.*?)(?:\n\n|\Z)", section, re.S)
    assert len(found) >= 3, "no chaos table names its runs"
    for paragraph, doc_table in found:
        names = re.findall(r"`(docs/chaos/[\w.-]+\.jsonl)`", paragraph)
        assert names, f"a chaos table names no docs/chaos/*.jsonl above it: {paragraph[-200:]}"
        rows = [json.loads(line) for name in names for line in (ROOT / name).read_text().splitlines() if line.strip()]
        assert doc_table.strip() == chaos.table(rows), f"{names}: the doc's table is not these runs'"
