"""Names from outside never leave their directory, URLs never carry secrets, and a store, a Ray
address, a local cache dir or a DataLoader worker that fails ends in one bounded line
(docs/failure-modes.md, "Paths, credentials, hangs"): real S3 (moto on 127.0.0.1), real tars, a
real local Ray, real sockets that never answer."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from storage.location import COPY_LISTING_FILE, LOCAL_COPIES_DIR, remove_local_copies, resolve
from storage.paths import checked_join
from storage.formats.wds import WdsShard
from test_storage import build_cache
from tests.waits import HANG_CAP_S

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


# ---------------------------------------------------------------------------------------------
# 1. Names that would land outside their directory


@pytest.mark.parametrize(
    "name", ["../escape.txt", "a/../../escape.txt", "/etc/passwd", "C:/x", "a\\..\\x", "a//b", "./a", ""]
)
def test_a_name_outside_its_directory_is_refused_in_one_line(tmp_path, name):
    with pytest.raises(ValueError) as refused:
        checked_join(tmp_path, name, source="s3://b/corpus (listing)")
    assert str(refused.value).startswith(f"s3://b/corpus (listing): refused name {name!r}") and "\n" not in str(refused.value)


def test_a_symlink_out_of_the_directory_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "link").symlink_to(outside)
    assert checked_join(root, "sub/file.npy", source="x") == root / "sub/file.npy"
    with pytest.raises(ValueError, match="a symlink out of the directory"):
        checked_join(root, "link/file.npy", source="x")


def test_a_store_key_escaping_the_local_copy_writes_nothing_outside(s3_prefix):
    corpus = resolve(f"{s3_prefix}/corpus")
    corpus.write_bytes("input_ids.npy", b"ids")
    escape = "../../../../../../../../../../tmp/alrira-escaped.txt"
    corpus.write_bytes(escape, b"owned")  # S3 keys may hold any bytes, `..` segments included
    listed = [name for name, _ in corpus.files()]
    assert escape in listed, listed
    copies = Path(tempfile.gettempdir()) / LOCAL_COPIES_DIR
    before = set(copies.iterdir()) if copies.is_dir() else set()
    with pytest.raises(ValueError) as refused:
        corpus.local_copy()
    assert f"refused name {escape!r}" in str(refused.value) and str(refused.value).startswith(f"{s3_prefix}/corpus")
    assert not Path("/tmp/alrira-escaped.txt").exists()
    assert set(copies.iterdir()) == before  # the partial copy is gone too


def _tar_with_member(path: Path, name: str) -> None:
    with tarfile.open(path, "w") as tar:
        data = b"\x93NUMPY"
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def test_a_crafted_tar_member_path_is_refused(tmp_path):
    shard = tmp_path / "shard-00000.tar"
    _tar_with_member(shard, "../../000000001.features.npy")
    with pytest.raises(ValueError, match=r"refused tar member '../../000000001.features.npy'"):
        WdsShard(shard)


# ---------------------------------------------------------------------------------------------
# 3. Credentials in URLs


def _cli(command, args, env=None):
    return CliRunner().invoke(command, args, env=env)


def _assert_one_line_refusal(result, *, flag: str | None = None):
    output = result.output
    assert result.exit_code != 0 and "Traceback" not in output, output
    assert SECRET not in output and "AKIAKEY" not in output, output
    assert "s3://***@bucket/cache" in output and "credentials in a URL are refused" in output, output
    if flag:
        assert flag in output, output


def test_urls_with_credentials_are_refused_everywhere_redacted(toy_target, toy_corpus, tmp_path):
    from pipeline.cli import train_cli
    from ray_jobs.cli import cache_cli

    url = f"s3://AKIAKEY:{SECRET}@bucket/cache"
    build = ["build", "--target", str(toy_target), "--corpus", str(toy_corpus), "--out", str(tmp_path / "c")]
    _assert_one_line_refusal(_cli(cache_cli, [*build[:-1], url]), flag="--out")
    _assert_one_line_refusal(_cli(cache_cli, [*build[:4], url, *build[5:]]), flag="--corpus")
    _assert_one_line_refusal(_cli(train_cli, ["--cache", url, "--out", str(tmp_path / "run")]), flag="--cache")
    _assert_one_line_refusal(_cli(train_cli, ["--cache", str(tmp_path), "--out", url]), flag="--out")
    for command in ("info", "verify"):
        _assert_one_line_refusal(_cli(cache_cli, [command, url]))
    with pytest.raises(ValueError, match=r"s3://\*\*\*@bucket/cache: credentials in a URL are refused"):
        resolve(url)
    assert not (tmp_path / "run").exists() and not (tmp_path / "c").exists()  # nothing written, nothing recorded


def test_error_lines_never_carry_userinfo():
    from storage.errors import first_line

    line = first_line(OSError(f"cannot reach s3://AKIAKEY:{SECRET}@bucket/x\nmore"))
    assert line == "cannot reach s3://***@bucket/x"
    assert first_line(ValueError("s3://bucket/key@v2 is a key")) == "s3://bucket/key@v2 is a key"


# Secrets holding what ends a URL's userinfo early, or a word: `@` (once or twice), `/`, `:`, a
# space, a newline, a percent-encoding. Each piece of 3+ letters or digits must never be shown.
ODD_SECRETS = ["P4SS@W0RD", "X7Q@Y8Z@W9V", "SL4/ASH@AT9", "C0L:ON@Q7R", "SP4 ACE@Q8R", "N3W\nL1NE@Q6R", "PCT%40ENC@Q5R", "@LEAD9@"]


def _secret_pieces(secret: str) -> list[str]:
    import re

    return [piece for piece in re.split(r"[^A-Za-z0-9]", secret) if len(piece) >= 3]


@pytest.mark.parametrize("secret", ODD_SECRETS)
def test_a_secret_of_any_characters_is_redacted_whole(tmp_path, secret):
    """The whole userinfo is hidden whatever the secret holds: a secret with an `@` leaked the
    part after it (`s3://***@W0RD@bucket/...`); one with a space was not even refused."""
    from pipeline.cli import train_cli
    from storage.errors import first_line, redact_url

    url = f"s3://AKIAKEY:{secret}@bucket/cache"
    result = _cli(train_cli, ["--cache", url, "--out", str(tmp_path / "run")])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "s3://***@bucket/cache" in result.output and "credentials in a URL are refused" in result.output, result.output
    for piece in ["AKIAKEY", *_secret_pieces(secret)]:
        assert piece not in result.output, (piece, result.output)
    assert redact_url(url) == "s3://***@bucket/cache"
    if not any(c.isspace() for c in secret):  # in free text a URL ends at white space; such a value is refused whole above
        line = first_line(OSError(f"cannot reach '{url}': timed out"))
        assert line == "cannot reach 's3://***@bucket/cache': timed out"


# ---------------------------------------------------------------------------------------------
# 11. Hangs: a frozen store endpoint, a Ray address where nothing answers


class FrozenServer:
    """Accepts TCP connections on 127.0.0.1 and never answers (a hung endpoint)."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.port = self.socket.getsockname()[1]
        self.held, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        self.socket.settimeout(0.1)
        while not self.stop.is_set():
            try:
                self.held.append(self.socket.accept()[0])
            except TimeoutError:
                continue

    def close(self):
        self.stop.set()
        self.thread.join()
        for connection in self.held:
            connection.close()
        self.socket.close()


@pytest.fixture
def isolated_s3(monkeypatch):
    """s3fs clients made afresh for this test's environment (fsspec caches them by options)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield monkeypatch
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_frozen_store_endpoint_ends_within_the_timeout_in_one_line(isolated_s3):
    from ray_jobs.cli import cache_cli

    frozen = FrozenServer()
    try:
        isolated_s3.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{frozen.port}")
        isolated_s3.setenv("AWS_ACCESS_KEY_ID", "testing")
        isolated_s3.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        isolated_s3.setenv("ALRIRA_STORE_TIMEOUT_S", "3")
        result = _cli(cache_cli, ["info", "s3://frozen-bucket/cache"])
    finally:
        frozen.close()
    assert frozen.held, "the client never connected"
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert "s3://frozen-bucket/cache" in result.output and "no answer within ALRIRA_STORE_TIMEOUT_S=3s" in result.output, result.output
    assert "no cache manifest" not in result.output
    # The message proves the timeout ended it: no wall-clock bound on the code under test (a loaded
    # machine stretches every step; tests/waits.py).


def test_info_and_verify_say_the_real_store_error(isolated_s3, s3_prefix):
    import s3fs

    from ray_jobs.cli import cache_cli

    isolated_s3.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: the endpoint is down
    result = _cli(cache_cli, ["info", s3_prefix])
    assert result.exit_code == 1 and "Could not connect" in result.output and "no cache manifest" not in result.output, result.output

    isolated_s3.undo()
    s3fs.S3FileSystem.clear_instance_cache()  # a client is cached by its options, not the environment
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        isolated_s3.delenv(name)
    isolated_s3.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    isolated_s3.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    for command in ("info", "verify"):
        result = _cli(cache_cli, [command, s3_prefix])
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
        assert "Unable to locate credentials" in result.output and "no cache manifest" not in result.output, result.output
        assert s3_prefix in result.output


def test_a_ray_address_where_nothing_answers_ends_in_one_line(toy_target, toy_corpus, tmp_path):
    from ray_jobs.pool import probe_ray_address

    # A port whose listen backlog is full: connect() waits for an answer that never comes.
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    address = f"127.0.0.1:{full.getsockname()[1]}"
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(full.getsockname())
            fillers.append(filler)
        with pytest.raises(ValueError) as refused:  # its message proves the 1 s timeout ended it
            probe_ray_address(address, flag="--ray-address", timeout=1.0)
    finally:
        for filler in fillers:
            filler.close()
        full.close()
    assert str(refused.value).startswith(f"--ray-address {address}: no Ray cluster answers there (within 1s;")

    # The whole command, with $RAY_ADDRESS pointing at a port where nothing listens.
    env = {**os.environ, "RAY_ADDRESS": address, "ALRIRA_RAY_CONNECT_TIMEOUT_S": "2", "PYTHONPATH": os.getcwd()}
    command = [sys.executable, "-m", "ray_jobs", "build", "--target", str(toy_target), "--corpus", str(toy_corpus)]
    proc = subprocess.run([*command, "--out", str(tmp_path / "c")], env=env, capture_output=True, text=True, timeout=HANG_CAP_S)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"Error: $RAY_ADDRESS {address}: no Ray cluster answers there")
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------------
# 12. One line, not a traceback


def test_a_bad_local_cache_dir_or_an_infinite_budget_is_refused_in_one_line(tmp_path):
    from pipeline.cli import train_cli
    from storage.local_cache import LocalCache

    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    base = ["--cache", "s3://bucket/cache", "--out", str(tmp_path / "run"), "--loader", "stream"]
    result = _cli(train_cli, [*base, "--local-cache-dir", str(a_file)])
    assert result.exit_code == 1 and result.output == (
        f"Error: --local-cache-dir {a_file}: exists and is not a directory; a local cache needs a directory\n"
    )
    with pytest.raises(ValueError, match="exists and is not a directory"):
        LocalCache(a_file, budget=1 << 20)
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if not os.access(read_only, os.W_OK):  # root writes anywhere
        with pytest.raises(ValueError, match=f"{read_only}: cannot write there"):
            LocalCache(read_only / "cache", budget=1 << 20)
    assert a_file.read_text() == "mine" and not (tmp_path / "run").exists()

    result = _cli(train_cli, [*base, "--local-cache-gib", "inf"])
    assert result.exit_code == 2 and "'inf' is not a finite number" in result.output and "Traceback" not in result.output


class _DiesInWorker(torch.utils.data.Dataset):
    def __init__(self, how: str):
        self.how = how

    def __len__(self):
        return 4

    def __getitem__(self, index):
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        raise ValueError(f"shard-00001.tar: array features: member {index} fails its CRC32")


def test_a_dead_or_failing_dataloader_worker_is_one_line_naming_it():
    from pipeline.cli import one_line_error

    for how, expected in (
        ("kill", "died (killed, or out of memory); the checkpoints in --out are kept: rerun the same command with --resume"),
        ("raise", "DataLoader worker 0: shard-00001.tar: array features: member 0 fails its CRC32"),
    ):
        loader = torch.utils.data.DataLoader(_DiesInWorker(how), num_workers=1, batch_size=None)
        with pytest.raises(Exception) as failed:
            next(iter(loader))
        line = one_line_error(failed.value)
        assert expected in line and "\n" not in line, line
        if how == "kill":
            assert line.startswith("DataLoader worker (pid ")


def _forked_children() -> set[int]:
    """This process's children running its own command line (DataLoader workers are forks; Ray's
    and moto's processes run other programs)."""
    me, command = os.getpid(), Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                if (entry / "cmdline").read_bytes() == command:
                    found.add(int(entry.name))
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
    return found


def test_a_killed_dataloader_worker_stops_training_in_one_line(k7_cache, tmp_path):
    from pipeline.cli import train_cli

    before, killed, done = _forked_children(), [], threading.Event()

    def kill_the_first_worker():
        while not done.is_set():
            started = _forked_children() - before
            if started:
                killed.append(min(started))
                os.kill(killed[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_first_worker, daemon=True)
    killer.start()
    args = ["--cache", str(k7_cache), "--out", str(tmp_path / "run"), "--method", "alr", "--rollout-depth", "6"]
    result = _cli(train_cli, [*args, "--epochs", "200", "--batch-size", "2", "--num-workers", "1", "--no-progress"])
    done.set()
    killer.join()
    assert killed, result.output
    assert result.exit_code == 1 and result.output == (
        f"Error: DataLoader worker (pid {killed[0]}) died (killed, or out of memory); the checkpoints in --out are kept: "
        "rerun the same command with --resume to continue from the last one\n"
    ), result.output


def test_info_on_a_crafted_tar_header_or_a_huge_count_is_one_line(tmp_path):
    from ray_jobs.cli import cache_cli

    cache = tmp_path / "cache"
    build_cache(cache, storage_format="wds", codec="bf16")
    shard = cache / "shards" / "shard-00000.tar"
    header = bytearray(shard.read_bytes())
    header[124:136] = b"77777777777\0"  # a size far past the end of the file, with a valid checksum
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header[:512]):06o}\0 ".encode()
    shard.write_bytes(bytes(header))
    result = _cli(cache_cli, ["info", str(cache)])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith(f"Error: {shard}: corrupt tar shard") and "alrira-cache verify" in result.output

    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["shards"][1]["sequences"] = 10**20
    (cache / "manifest.json").write_text(json.dumps(manifest))
    result = _cli(cache_cli, ["info", str(cache)])
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert f"must be <= {2**62}, got {10**20}" in result.output


def test_train_out_on_a_missing_bucket_is_one_line(k7_cache, s3_bucket):
    from pipeline.cli import train_cli

    args = ["--cache", str(k7_cache), "--out", "s3://no-such-bucket-alrira/run", "--num-workers", "0", "--no-progress"]
    result = _cli(train_cli, [*args, "--method", "dflash", "--epochs", "1", "--batch-size", "2", "--rollout-depth", "6"])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "Traceback" not in result.output, result.output
    assert "s3://no-such-bucket-alrira/run" in result.output and "bucket does not exist" in result.output, result.output


def test_a_node_without_the_store_credentials_says_so_first(ray_address, toy_target, s3_prefix):
    import ray

    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import ShardSpec
    from pipeline.target import target_hash
    from ray_jobs.build import CacheWorker
    from ray_jobs.pool import plain_error

    config = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus="unused.jsonl", out=s3_prefix, layers=[0, 2], anchors=6, top_k=4, max_length=128,
    ).with_taps([0, 2])  # fmt: skip
    no_credentials = {
        "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
        "AWS_CONFIG_FILE": "/nonexistent/config", "AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"],
        "AWS_EC2_METADATA_DISABLED": "true",
    }  # fmt: skip
    worker = CacheWorker.options(num_cpus=1, runtime_env={"env_vars": no_credentials}).remote(config, target_hash(toy_target))
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            ray.get(worker.build.remote(ShardSpec(index=0, start=0, stop=1, owner=None)), timeout=HANG_CAP_S)
    finally:
        ray.kill(worker, no_restart=True)
    line = str(plain_error(failed.value))
    assert line.startswith("node ") and "Unable to locate credentials" in line and "\n" not in line, line
    assert "every node needs the store's credentials and endpoint in its environment" in line


def test_the_credentials_hint_also_follows_a_store_corpus():
    from pipeline.cache_build.config import CacheBuildConfig
    from ray_jobs.pool import worker_problem

    config = CacheBuildConfig.from_flags(target="t", corpus="s3://bucket/chat.jsonl", out="local-cache", layers=[0, 2], anchors=6, top_k=4)
    hint = "every node needs the store's credentials"
    assert hint in worker_problem(OSError("denied"), node="n", paths=(config.out, config.corpus.path))
    assert hint not in worker_problem(OSError("denied"), node="n", paths=(config.out, "chat.jsonl"))


# ---------------------------------------------------------------------------------------------
# 14. Node-local copies of a store prefix: checked when reused, removed by whoever made them


def test_a_local_copy_is_checked_before_reuse_and_removed_by_its_maker(s3_prefix):
    corpus = resolve(f"{s3_prefix}/corpus")
    corpus.write_bytes("input_ids.npy", b"0123456789")
    corpus.write_bytes("sub/offsets.npy", b"abc")
    copy = corpus.local_copy()
    assert (copy / "input_ids.npy").read_bytes() == b"0123456789" and (copy / COPY_LISTING_FILE).is_file()
    (copy / "input_ids.npy").write_bytes(b"0123")  # truncated on the node (a full disk, a user)
    again = corpus.local_copy()
    assert again == copy and (again / "input_ids.npy").read_bytes() == b"0123456789"
    (copy / "stray.npy").write_bytes(b"x")  # a file the listing does not hold
    assert not (corpus.local_copy() / "stray.npy").exists()

    someone_elses = copy.parent / "0123456789abcdef0123456789abcdef"
    someone_elses.mkdir()
    assert copy in remove_local_copies()
    assert not copy.exists() and someone_elses.is_dir()  # never what this process did not make
    someone_elses.rmdir()


def test_a_build_on_the_store_removes_its_node_local_copies(ray_address, toy_target, toy_corpus, s3_prefix):
    from pipeline.cache_build.config import CacheBuildConfig
    from ray_jobs.build import build_cache

    out = f"{s3_prefix}/cache"
    config = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(toy_corpus), out=out, layers=[0, 2], anchors=6, top_k=4, max_length=128,
        shard_size=4, num_slots=5, workers=1,
    )  # fmt: skip
    planted = Path(tempfile.gettempdir()) / LOCAL_COPIES_DIR / "0123456789abcdef0123456789abcdef"
    planted.mkdir(parents=True)  # a copy this build did not make
    assert build_cache(config, progress=False, log=lambda line: None).is_complete
    keys = resolve(f"{out}/corpus").object_tags()
    digest = hashlib.sha256(json.dumps([f"{out}/corpus", keys]).encode()).hexdigest()[:32]
    # The driver's copy (in this process's temp dir) and the worker's (the raylet's, /tmp) are gone.
    worker_temp = ray_worker_temp_dir()
    for temp in (tempfile.gettempdir(), worker_temp):
        assert not (Path(temp) / LOCAL_COPIES_DIR / digest).exists(), temp
    assert planted.is_dir()
    planted.rmdir()


def ray_worker_temp_dir() -> str:
    import ray

    return ray.get(ray.remote(num_cpus=0)(tempfile.gettempdir).remote())
