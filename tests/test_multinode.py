"""A cache build spread over two Ray nodes (docs/cluster.md): a head and a second raylet started
with `ray start` on this machine, each with its own temp dir and a marker resource, the build's
driver joining them as `ray job submit` would (RAY_ADDRESS), workers on both nodes writing to one
--out. The cache must equal a build on one machine shard for shard (one computed in this process:
the same files as a one-node Ray build, tests/test_cache_build.py), and the log must say which
node wrote which shard.

Both raylets share this machine's disk; the build runs once with --out a local path and once
with an s3:// prefix of a real S3 server on 127.0.0.1 (tests/s3_fixtures.py), which is what a
real cluster without a shared disk uses. The raylets are started with the store's AWS_* variables
in their environment, as a real cluster's nodes have credentials of their own.

Teardown never runs `ray stop`, which stops every Ray session on the machine (other tests, other
users): it kills the processes of the two `ray start` sessions this module started, found by
their session id.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from storage.manifest import load_manifest
from storage.verify import verify_cache
from tests.test_cache_build import SMALL, _build_here, _config
from tests.waits import HANG_CAP_S, run_to_end

RAY = str(Path(sys.executable).parent / "ray")
HEAD_MARKER, NODE_MARKER = "alrira_test_head", "alrira_test_node"  # custom resources telling the nodes apart
NODE_CPUS = 2  # logical CPUs per node: room for 2 workers on either, so only pinning puts one on each
START_TIMEOUT_S = HANG_CAP_S  # `ray start` on 2 busy cores takes ~10 s; the cap is against hangs only
BUILD_TIMEOUT_S = HANG_CAP_S
SHARD_LINE = re.compile(r"^(shard-\d+\.\w+): \d+ sequences, \d+ tokens, node (\S+)/([0-9a-f]{8})$", re.M)
# The node list as the cluster's GCS sees it: [[node id, [resource names]], ...] of alive nodes.
NODES_SCRIPT = (
    "import json, sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level='ERROR', include_dashboard=False)\n"
    "print(json.dumps([[n['NodeID'], sorted(n['Resources'])] for n in ray.nodes() if n['Alive']]))\n"
)


@dataclass(kw_only=True)
class LocalCluster:
    address: str  # host:port of the head's GCS
    sessions: list[int]  # session id of each `ray start`: every process of that node is in it
    node_markers: dict[str, str]  # node id -> HEAD_MARKER or NODE_MARKER


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ray_env() -> dict[str, str]:
    """This environment without a RAY_ADDRESS of another cluster (each command names its own)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}


def _session_processes(sessions: list[int]) -> list[int]:
    """Live (not zombie) pids whose session is one of `sessions`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) in sessions and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _kill_sessions(sessions: list[int], *, timeout: float = 30) -> None:
    """SIGKILL every process of `sessions` until none is left (raylets fork workers meanwhile)."""
    deadline = time.monotonic() + timeout
    while (pids := _session_processes(sessions)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert not _session_processes(sessions), "processes of the test's Ray cluster survived SIGKILL"


def _ray_start(args: list[str], *, temp_dir: Path, sessions: list[int]) -> None:
    """`ray start` in a session of its own (recorded in `sessions` before it can leave processes)."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    command = [
        RAY, "start", *args, f"--temp-dir={temp_dir}", f"--num-cpus={NODE_CPUS}", "--disable-usage-stats",
        f"--dashboard-agent-listen-port={_free_port()}",  # its default (52365) would collide between the nodes
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=_ray_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sessions.append(proc.pid)
    try:
        output, _ = proc.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")


def _alive_nodes(address: str, *, count: int, timeout: float = HANG_CAP_S) -> dict[str, list[str]]:
    """Node id -> resource names, once `count` nodes are alive (a raylet registers after its start)."""
    deadline = time.monotonic() + timeout
    while True:
        proc = run_to_end([sys.executable, "-c", NODES_SCRIPT, address], cap_s=HANG_CAP_S, env=_ray_env())
        nodes = dict(json.loads(proc.stdout.strip().splitlines()[-1])) if proc.returncode == 0 else {}
        if len(nodes) >= count or time.monotonic() > deadline:
            assert len(nodes) == count, f"{len(nodes)} alive node(s), expected {count}: {proc.stderr[-2000:]}"
            return nodes
        time.sleep(1)


def _start_two_nodes(root: Path, sessions: list[int]) -> str:
    """Head + one more raylet, each with its own temp dir and marker resource; the head's address.
    Ports the head would otherwise take from fixed defaults are picked free, so that another Ray
    on this machine does not collide (a port taken in between fails the start: retried)."""
    for attempt in range(3):
        port = _free_port()
        try:
            _ray_start(
                ["--head", f"--port={port}", "--include-dashboard=false", f"--dashboard-port={_free_port()}",
                 f"--ray-client-server-port={_free_port()}", "--resources", json.dumps({HEAD_MARKER: 1})],
                temp_dir=root / f"h{attempt}", sessions=sessions,
            )  # fmt: skip
            break
        except RuntimeError:
            _kill_sessions(sessions)
            sessions.clear()
            if attempt == 2:
                raise
    address = f"127.0.0.1:{port}"
    _ray_start([f"--address={address}", "--resources", json.dumps({NODE_MARKER: 1})], temp_dir=root / "n1", sessions=sessions)
    return address


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, s3_bucket):  # the store's environment first: the workers inherit it
    """A Ray cluster of two raylets on this machine (short temp dirs: Ray's socket paths must stay
    under the 107 bytes of a Unix socket name)."""
    sessions: list[int] = []
    try:
        address = _start_two_nodes(tmp_path_factory.mktemp("rn"), sessions)
        nodes = _alive_nodes(address, count=2)
        markers = {node_id: next(m for m in (HEAD_MARKER, NODE_MARKER) if m in names) for node_id, names in nodes.items()}
        yield LocalCluster(address=address, sessions=sessions, node_markers=markers)
    finally:
        _kill_sessions(sessions)


@pytest.fixture(params=["local", "s3"])
def cache_root(request, tmp_path) -> str:
    """Where the two-node build writes: a local directory, or a prefix on the S3 server."""
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("s3_prefix")


def _build_args(target, corpus, out: str, *extra: str) -> list[str]:
    """`alrira-cache build` with the settings of tests/test_cache_build.py (SMALL)."""
    flags = [
        f"--{name.replace('_', '-')}={','.join(map(str, value)) if isinstance(value, list) else value}"
        for name, value in SMALL.items()
    ]
    return ["build", f"--target={target}", f"--corpus={corpus}", f"--out={out}", *flags, "--no-progress", *extra]


def _run_build(args: list[str], *, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The CLI in a subprocess: its own Ray driver, whatever Ray this test process has joined."""
    proc = run_to_end([sys.executable, "-m", "ray_jobs", *args], cap_s=BUILD_TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _shard_nodes(log: str, cluster: LocalCluster) -> dict[str, str]:
    """Shard name -> marker of the node that wrote it, from the build's log lines."""
    by_prefix = {node_id[:8]: marker for node_id, marker in cluster.node_markers.items()}
    found = {name: by_prefix.get(node_id, f"unknown node {node_id}") for name, _, node_id in SHARD_LINE.findall(log)}
    assert len(found) == len(SHARD_LINE.findall(log)), "a shard was logged twice"
    return found


@pytest.mark.slow
def test_build_over_two_nodes_matches_a_single_node_build(two_nodes, toy_target, toy_corpus, cache_root, tmp_path):
    reference = _build_here(_config(toy_target, toy_corpus, tmp_path / "one-node", shard_size=1))
    assert reference.num_shards_planned >= 4

    out = f"{cache_root}/two-nodes"
    started = time.monotonic()
    env = {**_ray_env(), "RAY_ADDRESS": two_nodes.address}  # as `ray job submit` sets it
    proc = _run_build(_build_args(toy_target, toy_corpus, out, "--shard-size=1", "--workers-per-node=1"), env=env)
    elapsed = time.monotonic() - started

    manifest = load_manifest(out)
    assert manifest.is_complete
    assert [(s.name, s.checksum) for s in manifest.shards] == [(s.name, s.checksum) for s in reference.shards]
    assert verify_cache(out) == []
    assert "pool: 2 worker(s) on 2 node(s), at most 1 per node" in proc.stderr
    written_on = _shard_nodes(proc.stderr, two_nodes)
    assert sorted(written_on) == [s.name for s in manifest.shards], proc.stderr
    # One worker pinned to each node: each wrote shards (each got one at the start).
    assert sorted(set(written_on.values())) == [HEAD_MARKER, NODE_MARKER], written_on
    # The manifest records the same node per shard as the log (node ids' first 8 hex digits).
    by_prefix = {node_id[:8]: marker for node_id, marker in two_nodes.node_markers.items()}
    assert {s.name: by_prefix[s.node.split("/")[1]] for s in manifest.shards} == written_on
    assert reference.shards[0].node is None  # built in-process: no node
    counts = {marker: list(written_on.values()).count(marker) for marker in (HEAD_MARKER, NODE_MARKER)}
    summary = next(line for line in proc.stderr.splitlines() if line.startswith("shards by node: "))
    assert sorted(int(n) for n in re.findall(r" (\d+)(?:,|$)", summary)) == sorted(counts.values()), summary
    print(f"two-node build: {elapsed:.1f}s, shards per node {counts}")


def test_a_node_without_the_drivers_target_is_named_in_one_line(toy_target, tmp_path):
    """What a worker checks before it loads the target: the path exists on its node and holds the
    files the driver hashed (a stale copy on one node would silently mix two targets in a cache)."""
    from pipeline.target import target_hash
    from ray_jobs.pool import target_problem

    driver_hash = target_hash(toy_target)
    assert target_problem(str(toy_target), driver_target_hash=driver_hash, node="10.0.0.7/1a2b3c4d") is None
    missing = target_problem(str(tmp_path / "nowhere"), driver_target_hash=driver_hash, node="10.0.0.7/1a2b3c4d")
    assert missing.startswith("node 10.0.0.7/1a2b3c4d: --target ") and "no model directory there" in missing

    copy = tmp_path / "stale-copy"
    shutil.copytree(toy_target, copy)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # another training's last weight
    weights.write_bytes(bytes(data))
    stale = target_problem(str(copy), driver_target_hash=driver_hash, node="10.0.0.7/1a2b3c4d")
    assert stale is not None and "holds other files than the driver's" in stale and "\n" not in stale
