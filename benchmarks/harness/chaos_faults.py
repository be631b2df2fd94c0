"""The chaos harness's faults (harness/chaos.py). Each targets only what the harness started: the
run's own process group, the processes of its own `ray start` sessions, its own S3 server, its own
tmpfs, files under --out. A fault returns what it hit, or "missed (why)"."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.harness.chaos_world import (
    ACTOR_TITLES, STORE_TIMEOUT_S, World, children, cmdline, out_files, read_out, session_pids, write_out,
)  # fmt: skip

FAULTS = {  # variant -> faults it may draw
    "build-local": ["kill_actor", "kill_driver", "kill_raylet", "disk_full", "flip_bit"],
    "build-s3": ["kill_actor", "kill_driver", "kill_raylet", "stop_store", "flip_bit"],
    "regenerate-t0": ["kill_actor", "kill_driver", "disk_full", "flip_bit"],
    "regenerate-t1": ["kill_actor", "kill_driver", "kill_raylet", "flip_bit"],
    "train": ["kill_driver", "kill_loader", "disk_full", "truncate_ckpt"],
}


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_actor(world: World, run: subprocess.Popen, rng: random.Random) -> str:
    actors = sorted(p for p in session_pids(world.sessions.values()) if cmdline(p).startswith(ACTOR_TITLES))
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
    raylets = [p for p in session_pids([world.sessions.get("node", -1)]) if "/raylet/raylet " in cmdline(p) + " "]
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
    workers = [c for c in children(run.pid) if cmdline(c) == cmdline(run.pid)]  # DataLoader workers are forks
    if not workers:
        return "missed (no worker alive)"
    pid = rng.choice(sorted(workers))
    return f"pid {pid}" if _signal(pid, signal.SIGKILL) else "missed (exited)"


def flip_bit(world: World, variant: str, out: str, rng: random.Random) -> str:
    """Flip one bit of a published chunk (a listed shard's chunk file) or part file."""
    data = json.loads(read_out(world, out, "manifest.json") or b"{}")
    if variant.startswith("build"):
        listed = [s["name"] for s in data.get("shards", [])]
        if not listed:
            return "missed (nothing published)"
        shard = rng.choice(sorted(listed))
        files = out_files(world, out, f"shards/{shard}")
        files = [f for f in files if "/c/" in f] or files  # a chunk file when there is one
    else:
        files = sorted(p["name"] for p in data.get("parts", []))
    if not files:
        return "missed (nothing published)"
    name = rng.choice(files)
    blob = bytearray(read_out(world, out, name))
    bit = rng.randrange(len(blob) * 8)
    blob[bit // 8] ^= 1 << (bit % 8)
    write_out(world, out, name, bytes(blob))
    return f"{name} bit {bit}"


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

