"""The chaos harness's world (harness/chaos.py): a work directory with the toy target and corpus, a
2-raylet Ray cluster and an S3 server on 127.0.0.1, a small tmpfs; the stages' commands, their
progress, and the clean run of each that a round must end as.

The harness signals only processes it started: its `ray start` sessions are found by their session
ids, never by name."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.common.store import free_port

STAGES = ("build", "regenerate", "train")
VARIANTS = {"build": ["build-local", "build-s3"], "regenerate": ["regenerate-t0", "regenerate-t1"], "train": ["train"]}
STORE_TIMEOUT_S = 4  # ALRIRA_STORE_TIMEOUT_S of every command; stop_store holds the server longer
RUN_CAP_S = 900.0  # one command; far past every documented timeout (300 s pool wait, the store's)
ACTOR_TITLES = ("ray::CacheWorker", "ray::RegenerateWorker", "ray::RegenerationWorker")


# --------------------------------------------------------------------------------------------
# The world: a work dir, a toy target and corpus, a 2-raylet Ray cluster, an S3 server, a tmpfs.


@dataclass
class World:
    root: Path
    env: dict[str, str]
    target: Path
    corpus: Path
    address: str = ""
    sessions: dict[str, int] = field(default_factory=dict)  # "head" / "node" -> session id of its `ray start`
    store: subprocess.Popen | None = None
    endpoint: str = ""
    disk: Path | None = None  # the small tmpfs (None: mounting refused here)
    references: dict[str, Path | str] = field(default_factory=dict)
    store_paused_until: float = 0.0
    live: set[int] = field(default_factory=set)  # process groups of runs still going (killed on close)
    log: callable = print


def _ray_start(world: World, name: str, args: list[str]) -> None:
    temp = world.root / f"ray-{name}"
    command = [str(Path(sys.executable).parent / "ray"), "start", *args, f"--temp-dir={temp}", "--num-cpus=2",
               "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}"]  # fmt: skip
    proc = subprocess.Popen(command, env=world.env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    world.sessions[name] = proc.pid
    output, _ = proc.communicate(timeout=RUN_CAP_S)
    if proc.returncode != 0:
        raise RuntimeError(f"ray start ({name}) failed: {output[-2000:]}")


def live_stats():
    """(pid, the /proc/PID/stat fields after the command name) of every live, not zombie, process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            yield int(stat.parent.name), fields


def session_pids(sessions) -> list[int]:
    """Live pids whose session is one of `sessions` (the harness's own `ray start` sessions)."""
    wanted = set(sessions)
    return [pid for pid, fields in live_stats() if int(fields[3]) in wanted]


def children(pid: int) -> list[int]:
    return [child for child, fields in live_stats() if int(fields[1]) == pid]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kill_session(world: World, name: str) -> None:
    session = world.sessions.pop(name, None)
    for _ in range(100):  # raylets fork workers meanwhile: until none is left (bounded)
        pids = session_pids([session]) if session else []
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def start_cluster(world: World) -> None:
    """A head and a second raylet on 127.0.0.1, each in a session of its own (so the harness finds
    and stops exactly their processes, never another user's Ray)."""
    port = free_port()
    _ray_start(world, "head", ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false",
                               f"--ray-client-server-port={free_port()}"])  # fmt: skip
    world.address = f"127.0.0.1:{port}"
    start_second_raylet(world)


def start_second_raylet(world: World) -> None:
    _ray_start(world, "node", [f"--address={world.address}", "--node-ip-address=127.0.0.1"])
    script = "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
    for _ in range(120):  # until the GCS lists both nodes alive (bounded)
        proc = subprocess.run([sys.executable, "-c", script, world.address], env=world.env, capture_output=True, text=True, timeout=RUN_CAP_S)
        if proc.returncode == 0 and proc.stdout.strip().endswith("2"):
            return
        time.sleep(1)
    raise RuntimeError("the second raylet never registered")


def start_store(world: World) -> None:
    from tests.s3_fixtures import start_moto_server, store_environment

    world.store, world.endpoint = start_moto_server()
    world.env.update(store_environment(world.endpoint))
    store_fs(world).mkdir("chaos")


def store_fs(world: World):
    """The harness's own client of its server (explicit options: this process's environment, a
    test session's store among it, is left alone)."""
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True, key="testing", secret="testing",
                             client_kwargs={"endpoint_url": world.endpoint})  # fmt: skip


def mount_disk(world: World, size: str = "24m") -> None:
    """A small tmpfs for --out of the disk_full rounds (the harness runs as root). Where mounting
    is refused, disk_full is left out of the draw and the summary says so."""
    path = world.root / "disk"
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if mounted.returncode == 0:
        world.disk = path
    else:
        world.log(f"chaos: no tmpfs ({mounted.stderr.strip()}): disk_full is not drawn")


def make_world(root: Path, log, *, target: Path | None = None, corpus: Path | None = None) -> World:
    """The work dir with its environment, and the toy target and corpus (made here unless given:
    the CI variant reuses its test session's)."""
    from pipeline.demo.toy import make_toy_target, toy_chat_rows

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    tmp = root / "tmp"
    tmp.mkdir(parents=True)
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT),
               TMPDIR=str(tmp), XDG_CACHE_HOME=str(root / "xdg"), ALRIRA_STORE_TIMEOUT_S=str(STORE_TIMEOUT_S),
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
    target = target or make_toy_target(root / "target", seed=0, peaked=True)
    if corpus is None:
        corpus = root / "chat.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in toy_chat_rows(8, seed=1, response_words=(30, 60))))
    world = World(root=root, env=env, target=target, corpus=corpus, log=log)
    return world


def close_world(world: World) -> None:
    for pgid in list(world.live):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    for name in list(world.sessions):
        kill_session(world, name)
    if world.store is not None:
        with contextlib.suppress(ProcessLookupError):
            world.store.send_signal(signal.SIGCONT)
        world.store.kill()
        world.store.wait()
    if world.disk is not None:
        subprocess.run(["umount", "-l", str(world.disk)], capture_output=True)
    shutil.rmtree(world.root, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Files under --out, on a disk or on the store.


def read_out(world: World, out: str, name: str) -> bytes | None:
    """`out`/`name` from a disk or the store; None when it is not there (or half-visible)."""
    try:
        if out.startswith("s3://"):
            return store_fs(world).cat_file(f"{out}/{name}")
        return Path(out, name).read_bytes()
    except (OSError, ValueError):
        return None


def out_files(world: World, out: str, under: str) -> list[str]:
    if out.startswith("s3://"):
        fs = store_fs(world)
        base = out[len("s3://"):]
        return sorted(p[len(base) + 1:] for p in fs.find(f"{base}/{under}"))
    return sorted(str(p.relative_to(out)) for p in Path(out, under).rglob("*") if p.is_file())


def write_out(world: World, out: str, name: str, data: bytes) -> None:
    if out.startswith("s3://"):
        store_fs(world).pipe_file(f"{out}/{name}", data)
    else:
        Path(out, name).write_bytes(data)


def remove_out(world: World, out: str) -> None:
    if out.startswith("s3://"):
        fs = store_fs(world)
        if fs.exists(out):
            fs.rm(out, recursive=True)
    else:
        shutil.rmtree(out, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# The stages' commands, their progress, and the clean references.


def command(world: World, variant: str, out: str) -> list[str]:
    """The command a user runs for `variant`, the same for the first run and every rerun."""
    py = [sys.executable, "-m"]
    if variant.startswith("build"):
        return [*py, "ray_jobs", "build", "--target", str(world.target), "--corpus", str(world.corpus), "--out", out,
                "--ray-address", world.address, "--layers", "0,2", "--anchors", "6", "--top-k", "4", "--max-length", "128",
                "--shard-size", "1", "--batch-tokens", "512", "--workers", "2", "--no-progress"]  # fmt: skip
    if variant.startswith("regenerate"):
        sampling = ["--temperature", "1.0", "--seed", "3"] if variant.endswith("t1") else []
        return [*py, "ray_jobs", "regenerate", "--target", str(world.target), "--corpus", str(world.corpus), "--out", out,
                "--ray-address", world.address, "--max-new-tokens", "24", "--rows-per-part", "1", "--workers", "2",
                "--no-progress", *sampling]  # fmt: skip
    return [*py, "pipeline.train", "--cache", str(world.references["build"]), "--out", out, "--method", "alr",
            "--epochs", "4", "--batch-size", "2", "--num-workers", "1", "--save-every", "1", "--save-dtype", "float32",
            "--log-every", "1", "--loader", "map", "--no-progress", "--resume"]  # fmt: skip


def progress(world: World, variant: str, out: str) -> int:
    """Units the run has published so far: shards listed, parts listed, checkpoints written."""
    if variant == "train":
        return len(list(Path(out, "checkpoints").glob("step-*"))) if Path(out, "checkpoints").is_dir() else 0
    data = read_out(world, out, "manifest.json")
    try:
        manifest = json.loads(data) if data else {}
    except ValueError:
        return 0
    return len(manifest.get("shards" if variant.startswith("build") else "parts", []))


def total_units(world: World, variant: str) -> int:
    return progress(world, variant, str(world.references[variant.split("-")[0] if variant.startswith("build") else variant]))


def run_clean(world: World, variant: str, out: str) -> None:
    proc = subprocess.run(command(world, variant, out), env=world.env, capture_output=True, text=True, timeout=RUN_CAP_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the clean {variant} run failed: {proc.stderr[-3000:]}")


def make_references(world: World, stages: list[str], *, build: Path | None = None) -> dict[str, float]:
    """One clean run per variant the stages need (training needs the stage-1 cache), but for a
    clean build given as `build` (the same settings); seconds each."""
    needed = ["build"] + [v for s in stages if s != "build" for v in VARIANTS[s]]
    if build is not None:
        world.references["build"] = build
        needed.remove("build")
    seconds = {}
    for variant in needed:
        out = world.root / "references" / variant
        started = time.monotonic()
        run_clean(world, "build-local" if variant == "build" else variant, str(out))
        seconds[variant] = time.monotonic() - started
        world.references[variant] = out
        world.log(f"chaos: clean {variant} run {seconds[variant]:.1f}s")
    return seconds

