"""Chaos harness: runs a stage again and again, injects random combined faults at
random moments, reruns the same command as a user would until the stage ends, and checks that it
ends exactly as a clean run does (docs/benchmarks.md, "Chaos"; docs/failure-modes.md).

    python benchmarks/chaos.py --stage build|regenerate|train|all (or a list: build,regenerate) --rounds N --seed S

Each round draws from `random.Random(f"{seed}:{stage}:{round}")` which variant it runs (stage 1 to
a local disk or to s3://, regeneration at T = 0 or T = 1), which faults it injects and when: after
a drawn number of published units (shards, parts, checkpoints) plus a drawn delay. `--only-round`
replays one round. Faults:

    kill_actor    SIGKILL a stage-1 or regeneration actor of the harness's own cluster
    kill_driver   SIGKILL the command (its whole process group: the driver or the trainer)
    kill_raylet   SIGKILL the second raylet of the harness's 2-raylet cluster (restarted after)
    stop_store    SIGSTOP the harness's S3 server for longer than ALRIRA_STORE_TIMEOUT_S
    disk_full     fill the small tmpfs the harness mounted for --out (freed before the rerun)
    flip_bit      flip one bit of a published chunk or part file (on disk or on the store)
    kill_loader   SIGKILL a DataLoader worker of the trainer
    truncate_ckpt cut the newest checkpoint's state.pt in half

Every round then checks: stage 1: `alrira-cache verify` passes and the shards' checksums equal the
clean build's; regeneration: every part byte-identical to the clean run's; training: the final
weights bit-identical, metrics.jsonl with every step once. Always: no traceback in what any run
printed, no process of a run left, nothing written outside --out and the declared temp dirs.

The harness signals only processes it started (by pid, or by the session ids of the `ray start`
sessions it made), serves and connects only on 127.0.0.1, bounds every loop in rounds and time,
and removes its work directory, cluster, server and mount at the end. Exit 0 only when every round
passed; the last line is the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = ("build", "regenerate", "train")
FAULTS = {  # variant -> faults it may draw
    "build-local": ["kill_actor", "kill_driver", "kill_raylet", "disk_full", "flip_bit"],
    "build-s3": ["kill_actor", "kill_driver", "kill_raylet", "stop_store", "flip_bit"],
    "regenerate-t0": ["kill_actor", "kill_driver", "disk_full", "flip_bit"],
    "regenerate-t1": ["kill_actor", "kill_driver", "kill_raylet", "flip_bit"],
    "train": ["kill_driver", "kill_loader", "disk_full", "truncate_ckpt"],
}
VARIANTS = {"build": ["build-local", "build-s3"], "regenerate": ["regenerate-t0", "regenerate-t1"], "train": ["train"]}
STORE_TIMEOUT_S = 4  # ALRIRA_STORE_TIMEOUT_S of every command; stop_store holds the server longer
RUN_CAP_S = 900.0  # one command; far past every documented timeout (300 s pool wait, the store's)
MAX_ATTEMPTS = 6  # the first run and five reruns
# The drawn delay after the drawn unit: about one unit's time on an idle machine (a shard or part
# takes 1-3 s, a training step ~0.15 s), so a process fault lands while the run still runs. A
# training delay of 1.5 s mostly lands after the run has ended, so training draws a shorter one.
MAX_DELAY_S = {"build": 1.5, "regenerate": 1.5, "train": 0.25}
ACTOR_TITLES = ("ray::CacheWorker", "ray::RegenerateWorker", "ray::RegenerationWorker")


class RoundFailed(Exception):
    """A round that did not end as a clean run does (its message says how)."""


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
               "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}"]  # fmt: skip
    proc = subprocess.Popen(command, env=world.env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    world.sessions[name] = proc.pid
    output, _ = proc.communicate(timeout=RUN_CAP_S)
    if proc.returncode != 0:
        raise RuntimeError(f"ray start ({name}) failed: {output[-2000:]}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _live_stats():
    """(pid, the /proc/PID/stat fields after the command name) of every live, not zombie, process."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            yield int(stat.parent.name), fields


def _session_pids(sessions) -> list[int]:
    """Live pids whose session is one of `sessions` (the harness's own `ray start` sessions)."""
    wanted = set(sessions)
    return [pid for pid, fields in _live_stats() if int(fields[3]) in wanted]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _kill_session(world: World, name: str) -> None:
    session = world.sessions.pop(name, None)
    for _ in range(100):  # raylets fork workers meanwhile: until none is left (bounded)
        pids = _session_pids([session]) if session else []
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def start_cluster(world: World) -> None:
    """A head and a second raylet on 127.0.0.1, each in a session of its own (so the harness finds
    and stops exactly their processes, never another user's Ray)."""
    port = _free_port()
    _ray_start(world, "head", ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false",
                               f"--ray-client-server-port={_free_port()}"])  # fmt: skip
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
        _kill_session(world, name)
    if world.store is not None:
        with contextlib.suppress(ProcessLookupError):
            world.store.send_signal(signal.SIGCONT)
        world.store.kill()
        world.store.wait()
    if world.disk is not None:
        subprocess.run(["umount", "-l", str(world.disk)], capture_output=True)
    shutil.rmtree(world.root, ignore_errors=True)


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


def _read(world: World, out: str, name: str) -> bytes | None:
    """`out`/`name` from a disk or the store; None when it is not there (or half-visible)."""
    try:
        if out.startswith("s3://"):
            return store_fs(world).cat_file(f"{out}/{name}")
        return Path(out, name).read_bytes()
    except (OSError, ValueError):
        return None


def progress(world: World, variant: str, out: str) -> int:
    """Units the run has published so far: shards listed, parts listed, checkpoints written."""
    if variant == "train":
        return len(list(Path(out, "checkpoints").glob("step-*"))) if Path(out, "checkpoints").is_dir() else 0
    data = _read(world, out, "manifest.json")
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


# --------------------------------------------------------------------------------------------
# Faults. Each targets only what the harness started: the run's own process group, the processes
# of its own `ray start` sessions, its own S3 server, its own tmpfs, files under --out.


def _children(pid: int) -> list[int]:
    return [child for child, fields in _live_stats() if int(fields[1]) == pid]


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_actor(world: World, run: subprocess.Popen, rng: random.Random) -> str:
    actors = sorted(p for p in _session_pids(world.sessions.values()) if _cmdline(p).startswith(ACTOR_TITLES))
    if not actors:
        return "missed (no actor alive)"
    pid = rng.choice(actors)
    return f"pid {pid}" if _signal(pid, signal.SIGKILL) else "missed (exited)"


def kill_driver(world: World, run: subprocess.Popen, rng: random.Random) -> str:
    if run.poll() is not None:
        return "missed (exited)"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.pid, signal.SIGKILL)  # its own session: the driver or trainer and its children
        return f"pgid {run.pid}"
    return "missed (exited)"


def kill_raylet(world: World, run: subprocess.Popen, rng: random.Random) -> str:
    raylets = [p for p in _session_pids([world.sessions.get("node", -1)]) if "/raylet/raylet " in _cmdline(p) + " "]
    if not raylets:
        return "missed (no second raylet)"
    _signal(raylets[0], signal.SIGKILL)
    return f"pid {raylets[0]}"


def stop_store(world: World, run: subprocess.Popen, rng: random.Random) -> str:
    hold = STORE_TIMEOUT_S + 2 + rng.uniform(0, 2)
    world.store.send_signal(signal.SIGSTOP)
    world.store_paused_until = time.monotonic() + hold

    def resume():
        time.sleep(hold)
        world.store.send_signal(signal.SIGCONT)

    threading.Thread(target=resume, daemon=True).start()
    return f"{hold:.1f}s"


def disk_full(world: World, run: subprocess.Popen, rng: random.Random) -> str:
    filler = world.disk / "filler"
    with contextlib.suppress(OSError), open(filler, "ab") as f:
        for _ in range(4096):  # at most 4 GiB; the tmpfs is far smaller
            f.write(b"\0" * (1 << 20))
            f.flush()
    return f"{filler.stat().st_size >> 20} MiB filler"


def kill_loader(world: World, run: subprocess.Popen, rng: random.Random) -> str:
    workers = [c for c in _children(run.pid) if _cmdline(c) == _cmdline(run.pid)]  # DataLoader workers are forks
    if not workers:
        return "missed (no worker alive)"
    pid = rng.choice(sorted(workers))
    return f"pid {pid}" if _signal(pid, signal.SIGKILL) else "missed (exited)"


def flip_bit(world: World, variant: str, out: str, rng: random.Random) -> str:
    """Flip one bit of a published chunk (a listed shard's chunk file) or part file."""
    data = json.loads(_read(world, out, "manifest.json") or b"{}")
    if variant.startswith("build"):
        listed = [s["name"] for s in data.get("shards", [])]
        if not listed:
            return "missed (nothing published)"
        shard = rng.choice(sorted(listed))
        files = _files(world, out, f"shards/{shard}")
        files = [f for f in files if "/c/" in f] or files  # a chunk file when there is one
    else:
        files = sorted(p["name"] for p in data.get("parts", []))
    if not files:
        return "missed (nothing published)"
    name = rng.choice(files)
    blob = bytearray(_read(world, out, name))
    bit = rng.randrange(len(blob) * 8)
    blob[bit // 8] ^= 1 << (bit % 8)
    _write(world, out, name, bytes(blob))
    return f"{name} bit {bit}"


def _files(world: World, out: str, under: str) -> list[str]:
    if out.startswith("s3://"):
        fs = store_fs(world)
        base = out[len("s3://"):]
        return sorted(p[len(base) + 1:] for p in fs.find(f"{base}/{under}"))
    return sorted(str(p.relative_to(out)) for p in Path(out, under).rglob("*") if p.is_file())


def _write(world: World, out: str, name: str, data: bytes) -> None:
    if out.startswith("s3://"):
        store_fs(world).pipe_file(f"{out}/{name}", data)
    else:
        Path(out, name).write_bytes(data)


def truncate_ckpt(world: World, variant: str, out: str, rng: random.Random) -> str:
    states = sorted(Path(out, "checkpoints").glob("step-*/state.pt"))
    if not states:
        return "missed (no checkpoint)"
    size = states[-1].stat().st_size
    os.truncate(states[-1], size // 2)
    return f"{states[-1].parent.name} {size} -> {size // 2} bytes"


DURING = {"kill_actor": kill_actor, "kill_driver": kill_driver, "kill_raylet": kill_raylet, "stop_store": stop_store,
          "disk_full": disk_full, "kill_loader": kill_loader}  # fmt: skip
BETWEEN = {"flip_bit": flip_bit, "truncate_ckpt": truncate_ckpt}  # after the first run ended, before the rerun


# --------------------------------------------------------------------------------------------
# A round: draw, run with faults, rerun until the stage ends, check.


@dataclass
class Round:
    stage: str
    index: int
    variant: str = ""
    faults: dict[str, str] = field(default_factory=dict)  # fault -> what it hit
    attempts: int = 0
    seconds: float = 0.0
    recovery_s: float = 0.0  # from the end of the faulted run to the rerun that finished the stage
    error: str = ""
    first_error: str = ""  # the faulted run's `Error: ` line, if it printed one


def draw(world: World, stage: str, index: int, seed: int, only: list[str] | None = None) -> tuple[random.Random, str, list[str], int, float]:
    """The round's variant, faults (one to three, or those of `only` the variant can take), and
    moment (after `units` published, plus a delay)."""
    rng = random.Random(f"{seed}:{stage}:{index}")
    variant = rng.choice([v for v in VARIANTS[stage] if not only or set(only) & set(FAULTS[v])] or VARIANTS[stage])
    pool = [f for f in FAULTS[variant] if f != "disk_full" or world.disk is not None]
    faults = rng.sample(pool, min(rng.choice([1, 1, 2, 2, 3]), len(pool)))
    if only:
        faults = [f for f in only if f in pool]
    units = rng.randrange(max(1, total_units(world, variant)))
    return rng, variant, faults, units, rng.uniform(0.0, MAX_DELAY_S[stage])


def out_for(world: World, variant: str, name: str) -> str:
    if variant == "build-s3":
        return f"s3://chaos/{name}"
    return str((world.disk or world.root / "outs") / name)


def remove_out(world: World, out: str) -> None:
    if out.startswith("s3://"):
        fs = store_fs(world)
        if fs.exists(out):
            fs.rm(out, recursive=True)
    else:
        shutil.rmtree(out, ignore_errors=True)


def _wait_exit(proc: subprocess.Popen, what: str) -> None:
    try:
        proc.wait(timeout=RUN_CAP_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RoundFailed(f"{what} hung: still running after {RUN_CAP_S:.0f} s") from None


def faulted_run(world: World, variant: str, argv: list[str], out: str, plan: tuple, log_path: Path, result: Round) -> tuple[int, str, int]:
    """The first run: started, the faults injected at the drawn moment, waited on. Returns its exit
    status, what it printed and its process group id."""
    rng, _, faults, units, delay = plan
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(argv, env=world.env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        world.live.add(proc.pid)
        started = time.monotonic()
        while proc.poll() is None and progress(world, variant, out) < units and time.monotonic() - started < RUN_CAP_S:
            time.sleep(0.05)
        if proc.poll() is None:
            time.sleep(delay)
        for fault in faults:
            if fault in DURING and proc.poll() is not None:  # the run ended before the moment: no fault
                result.faults[fault] = "missed (run ended)"
            elif fault in DURING:
                hit = DURING[fault](world, proc, rng)
                # No target yet (actors still starting, DataLoader workers between epochs): the
                # moment is the first one after the drawn one where there is.
                while hit.startswith("missed (no") and proc.poll() is None and time.monotonic() - started < RUN_CAP_S:
                    time.sleep(0.05)
                    hit = DURING[fault](world, proc, rng)
                result.faults[fault] = hit
        _wait_exit(proc, "the faulted run")
        world.live.discard(proc.pid)
        log.seek(0)
        return proc.returncode, log.read(), proc.pid


def repair(world: World, faults: list[str]) -> None:
    """What the operator does before the rerun: free the disk, restart the lost node, and (the
    store) nothing: it answers again by itself once the pause ends."""
    if "disk_full" in faults and world.disk is not None:
        (world.disk / "filler").unlink(missing_ok=True)
    raylet_alive = any("/raylet/raylet " in _cmdline(p) + " " for p in _session_pids([world.sessions.get("node", -1)]))
    if "kill_raylet" in faults or not raylet_alive:
        _kill_session(world, "node")
        start_second_raylet(world)
    if "stop_store" in faults:
        time.sleep(max(0.0, world.store_paused_until - time.monotonic()))
        world.store.send_signal(signal.SIGCONT)


def check_printed(printed: str, returncode: int, attempt: int, killed: bool) -> None:
    if "Traceback" in printed:
        tail = printed[printed.index("Traceback"):][:1500]
        raise RoundFailed(f"run {attempt} showed a traceback: {tail}")
    # Ray forwards its workers' and raylets' log lines to the driver's terminal, sometimes after
    # the error: the error is the one `Error: ` line, wherever it lands.
    errors = [line for line in printed.splitlines() if line.startswith("Error: ")]
    if returncode not in (0, -9) and not killed and len(errors) != 1:
        raise RoundFailed(f"run {attempt} exited {returncode} without one error line: {printed.splitlines()[-5:]}")


def play_round(world: World, stage: str, index: int, seed: int, only: list[str] | None = None) -> Round:
    result = Round(stage=stage, index=index, attempts=1)
    plan = draw(world, stage, index, seed, only)
    rng, result.variant, faults, units, delay = plan
    out = out_for(world, result.variant, f"{stage}-{index}")
    argv = command(world, result.variant, out)
    before, pgids = snapshot(world, out), []
    started = time.monotonic()
    try:
        rc, printed, pgid = faulted_run(world, result.variant, argv, out, plan, world.root / "logs" / f"{stage}-{index}-1.log", result)
        pgids.append(pgid)
        ended = time.monotonic()
        check_printed(printed, rc, 1, killed="kill_driver" in faults)
        result.first_error = next((line for line in printed.splitlines() if line.startswith("Error: ")), "")
        repair(world, faults)
        for fault in faults:
            if fault in BETWEEN:
                result.faults[fault] = BETWEEN[fault](world, result.variant, out, rng)
        result.faults.update({f: "" for f in faults if f not in result.faults})
        check_flip_found(world, result, out)
        damaged = any(result.faults[f] and not result.faults[f].startswith("missed") for f in BETWEEN if f in result.faults)
        while (rc != 0 or damaged) and result.attempts < MAX_ATTEMPTS:  # the user's reruns
            damaged = False
            result.attempts += 1
            rc, printed, pgid = rerun(world, argv)
            pgids.append(pgid)
            check_printed(printed, rc, result.attempts, killed=False)
            if rc == 0:
                break
        if rc != 0:
            raise RoundFailed(f"the stage did not end after {result.attempts} runs: {printed.strip().splitlines()[-1:]}")
        result.recovery_s = time.monotonic() - ended
        check_outputs(world, result.variant, out)
        check_leftovers(world, pgids)
        check_outside(world, before, snapshot(world, out))
    except RoundFailed as failure:
        result.error = str(failure)
        repair(world, faults)  # the next round starts from a whole cluster, store and disk
    finally:
        result.seconds = time.monotonic() - started
        remove_out(world, out)
    return result


def rerun(world: World, argv: list[str]) -> tuple[int, str, int]:
    proc = subprocess.Popen(argv, env=world.env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    world.live.add(proc.pid)
    try:
        printed, _ = proc.communicate(timeout=RUN_CAP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RoundFailed(f"a rerun hung: still running after {RUN_CAP_S:.0f} s") from None
    world.live.discard(proc.pid)
    return proc.returncode, printed, proc.pid


# --------------------------------------------------------------------------------------------
# Checks.


def check_flip_found(world: World, result: Round, out: str) -> None:
    """A bit flipped in a published shard is found by `alrira-cache verify`, naming the shard,
    before the rerun rebuilds it (the trainer's per-chunk CRC check is tests/test_object_store.py's)."""
    hit = result.faults.get("flip_bit", "")
    if not result.variant.startswith("build") or not hit.startswith("shards/"):
        return
    shard = hit.split("/")[1]
    verify = subprocess.run([sys.executable, "-m", "ray_jobs", "verify", out], env=world.env, capture_output=True, text=True, timeout=RUN_CAP_S)
    if verify.returncode == 0 or shard not in verify.stdout + verify.stderr:
        raise RoundFailed(f"verify did not report the flipped bit in {shard}: exit {verify.returncode}, {verify.stdout[-500:]} {verify.stderr[-500:]}")


def check_outputs(world: World, variant: str, out: str) -> None:
    if variant.startswith("build"):
        verify = subprocess.run([sys.executable, "-m", "ray_jobs", "verify", out], env=world.env, capture_output=True, text=True, timeout=RUN_CAP_S)
        if verify.returncode != 0:
            raise RoundFailed(f"alrira-cache verify failed: {verify.stdout[-800:]} {verify.stderr[-800:]}")
        got, want = json.loads(_read(world, out, "manifest.json")), json.loads(_read(world, str(world.references["build"]), "manifest.json"))
        pairs = [[(s["name"], s["checksum"]) for s in m["shards"]] for m in (got, want)]
        if pairs[0] != pairs[1]:
            raise RoundFailed(f"the shards differ from the clean build's: {sorted(set(pairs[0]) ^ set(pairs[1]))[:4]}")
    elif variant.startswith("regenerate"):
        reference = str(world.references[variant])
        names = sorted(p["name"] for p in json.loads(_read(world, reference, "manifest.json"))["parts"])
        got = sorted(p["name"] for p in json.loads(_read(world, out, "manifest.json"))["parts"])
        differ = [n for n in names if _read(world, out, n) != _read(world, reference, n)]
        if got != names or differ:
            raise RoundFailed(f"the parts differ from the clean run's: listed {got}, differing {differ}")
    else:
        check_training(Path(world.references["train"]), Path(out))


def check_training(reference: Path, out: Path) -> None:
    want = sorted(p.relative_to(reference) for p in (reference / "drafter").rglob("*.safetensors"))
    differ = [str(p) for p in want if not (out / p).is_file() or (out / p).read_bytes() != (reference / p).read_bytes()]
    if not want or differ:
        raise RoundFailed(f"the final weights differ from the clean run's: {differ or 'no weights in the reference'}")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    clean = [json.loads(line)["step"] for line in (reference / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if steps != clean:
        raise RoundFailed(f"metrics.jsonl steps {steps} (the clean run's {clean})")


def check_leftovers(world: World, pgids: list[int]) -> None:
    """No process of any run left (its own session), no stage actor left on the cluster (Ray reaps
    a killed driver's actors asynchronously: waited for, within a bound)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = _session_pids(pgids)
        actors = [p for p in _session_pids(world.sessions.values()) if _cmdline(p).startswith(ACTOR_TITLES)]
        if not left and not actors:
            return
        time.sleep(0.5)
    raise RoundFailed(f"processes left running: {[(p, _cmdline(p)[:60]) for p in left + actors]}")


def snapshot(world: World, out: str) -> dict[str, tuple[int, int]]:
    """Every file under the work dir outside --out and the declared temp dirs (TMPDIR, the
    XDG cache, Ray's temp dirs, the logs), and every object of the bucket outside --out."""
    declared = {"tmp", "xdg", "ray-head", "ray-node", "logs", "disk", "outs"}
    files = {}
    for path in world.root.rglob("*"):
        relative = path.relative_to(world.root)
        if relative.parts[0] in declared or not path.is_file():
            continue
        stat = path.stat()
        files[str(relative)] = (stat.st_size, stat.st_mtime_ns)
    if world.store is not None:
        fs = store_fs(world)
        for name, info in fs.find("chaos", detail=True).items():
            if not f"s3://{name}".startswith(out + "/"):
                files[f"s3://{name}"] = (info["size"], 0)
    if world.disk is not None:
        files.update({f"disk/{p.name}": (0, 0) for p in world.disk.iterdir() if str(p) != out})
    return files


def check_outside(world: World, before: dict, after: dict) -> None:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        raise RoundFailed(f"written outside --out and the declared temp dirs: {changed[:6]}")


# --------------------------------------------------------------------------------------------
# Main.


def summary(seed: int, rounds: list[Round], stages: list[str]) -> str:
    parts = []
    for stage in stages:
        mine = [r for r in rounds if r.stage == stage]
        counts: dict[str, int] = {}
        for r in mine:
            for fault in r.faults:
                counts[fault] = counts.get(fault, 0) + 1
        faults = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        parts.append(f"{stage} {sum(not r.error for r in mine)}/{len(mine)} rounds passed (faults: {faults})")
    return f"chaos: seed {seed}: " + "; ".join(parts)


def table(rows: list[dict]) -> str:
    """docs/benchmarks.md's table of rounds (the --jsonl lines of one or more runs): per stage, the
    distinct rounds (a round replayed later counts once, its last result), faults hit / missed,
    round and recovery seconds, runs per round."""
    import statistics

    latest = {(r["seed"], r["stage"], r["index"]): r for r in rows}
    lines = ["| stage | rounds passed | faults injected (hit / missed) | round s: median (min-max) | recovery s: median (max) | runs per round: 1 / 2 / 3+ |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for stage in STAGES:
        mine = [r for key, r in sorted(latest.items()) if key[1] == stage]
        if not mine:
            continue
        variants = {}
        faults: dict[str, list[int]] = {}
        for r in mine:
            variants[r["variant"]] = variants.get(r["variant"], 0) + 1
            for fault, hit in r["faults"].items():
                faults.setdefault(fault, [0, 0])[bool(hit.startswith("missed"))] += 1
        seconds, recovery = [r["seconds"] for r in mine], [r["recovery_s"] for r in mine]
        runs = [sum(r["attempts"] == n for r in mine) for n in (1, 2)] + [sum(r["attempts"] >= 3 for r in mine)]
        lines.append(
            f"| {stage} ({', '.join(f'{v} {n}' for v, n in sorted(variants.items()))}) | {sum(not r['error'] for r in mine)}/{len(mine)} "
            f"| {', '.join(f'{f} {h}/{m}' for f, (h, m) in sorted(faults.items()))} "
            f"| {statistics.median(seconds):.0f} ({min(seconds):.0f}-{max(seconds):.0f}) | {statistics.median(recovery):.0f} ({max(recovery):.0f}) "
            f"| {' / '.join(map(str, runs))} |"
        )
    return "\n".join(lines)


def _stages(text: str) -> list[str]:
    """--stage: `all` or a comma-separated subset of STAGES, in STAGES' order."""
    names = list(STAGES) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text}: expected all or one or more of {', '.join(STAGES)}")
    return [s for s in STAGES if s in names]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=_stages, default="all", help=f"all, or one or more of {', '.join(STAGES)}, comma-separated")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per stage")
    parser.add_argument("--seed", type=int, default=None, help="seed of every draw (default: a fresh one, printed)")
    parser.add_argument("--only-round", type=int, default=None, help="replay only this round (with --seed)")
    parser.add_argument("--first-round", type=int, default=0,
                        help="start at this round index (rounds are independent draws: a later run with the same seed continues where one stopped)")
    parser.add_argument("--time-budget-s", type=float, default=None, help="start no round after this many seconds")
    parser.add_argument("--work-root", default=None, help="where the work directory goes (default: $TMPDIR)")
    parser.add_argument("--jsonl", default=None, help="append one JSON line per round here")
    parser.add_argument("--faults", default=None, help="comma-separated: inject only these (regression runs)")
    parser.add_argument("--table", nargs="+", default=None, metavar="JSONL",
                        help="print docs/benchmarks.md's table of the rounds in these --jsonl files and exit (runs nothing)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(table([json.loads(line) for name in args.table for line in Path(name).read_text().splitlines() if line.strip()]))
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    stages = args.stage
    print(f"chaos: seed {seed} (replay: --seed {seed}), stages {','.join(stages)}, {args.rounds} round(s) each", flush=True)
    root = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.work_root))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on a plain kill too
    world, rounds, started = None, [], time.monotonic()
    try:
        (root / "logs").mkdir()
        world = make_world(root, log=lambda m: print(m, flush=True))
        start_store(world)
        start_cluster(world)
        mount_disk(world)
        make_references(world, stages)
        indices = [args.only_round] if args.only_round is not None else range(args.first_round, args.first_round + args.rounds)
        for index in indices:
            for stage in stages:
                if args.time_budget_s is not None and time.monotonic() - started > args.time_budget_s:
                    break
                result = play_round(world, stage, index, seed, args.faults.split(",") if args.faults else None)
                rounds.append(result)
                print(report_line(result, seed), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps({"seed": seed, **result.__dict__}) + "\n")
    finally:
        if world is not None:
            close_world(world)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(summary(seed, rounds, stages), flush=True)
    return 0 if rounds and not any(r.error for r in rounds) else 1


def report_line(r: Round, seed: int) -> str:
    faults = ", ".join(f"{k}{f' ({v})' if v else ''}" for k, v in r.faults.items())
    head = f"{r.stage} round {r.index} [{r.variant}]: {faults}; {r.attempts} run(s), {r.seconds:.1f}s, recovery {r.recovery_s:.1f}s"
    if r.error:
        return f"{head}: FAILED: {r.error} (replay: --stage {r.stage} --seed {seed} --only-round {r.index})"
    return f"{head}: ok"


if __name__ == "__main__":
    sys.exit(main())
