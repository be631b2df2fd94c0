"""A real S3 protocol server for the tests: moto's standalone server as a subprocess on
127.0.0.1, credentials and endpoint in the environment the way users give them (AWS_* variables,
inherited by CLI subprocesses and DataLoader workers), one bucket. Nothing leaves the machine.

tests/conftest.py imports the fixtures, so every test module can ask for them.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import pytest

from tests.waits import HANG_CAP_S

BUCKET = "alrira-tests"
SERVER_START_S = HANG_CAP_S  # a cap against a server that never answers, not a speed bound (tests/waits.py)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_serving(endpoint: str, server: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"moto server exited with status {server.returncode}: {log.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise RuntimeError(f"moto server at {endpoint} did not answer within {SERVER_START_S:.0f}s")


def start_moto_server() -> tuple[subprocess.Popen, str]:
    """(the server process, its endpoint URL): moto's S3 server on a free 127.0.0.1 port."""
    port = _free_port()
    # Its request log goes to a file: a pipe nobody reads would fill up and stall the server.
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(endpoint, server, log)
    except BaseException:
        server.kill()
        server.wait()
        raise
    return server, endpoint


def store_environment(endpoint: str) -> dict[str, str]:
    """What a user sets to reach an S3-compatible store (dummy credentials for moto)."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",  # never ask a metadata service for credentials
    }


@pytest.fixture(scope="session")
def s3_bucket(tmp_path_factory) -> str:
    """`s3://alrira-tests` on a moto server started for this session (the environment points
    every S3 client of this process and its children there, and is restored afterwards). Temp
    files, the node-local copies of store prefixes among them (storage.location), go to a pytest
    temp directory meanwhile."""
    server, endpoint = start_moto_server()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in store_environment(endpoint).items():
            patch.setenv(name, value)
        patch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tmp")))
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir(BUCKET)
        try:
            yield f"s3://{BUCKET}"
        finally:
            fsspec.filesystem("s3").clear_instance_cache()
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


@pytest.fixture
def s3_prefix(s3_bucket) -> str:
    """A fresh prefix of the session's bucket for one test."""
    return f"{s3_bucket}/{uuid.uuid4().hex[:12]}"
