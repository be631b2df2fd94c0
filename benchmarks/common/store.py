"""An object store for the store benchmarks: moto's S3 server in a subprocess on 127.0.0.1, with
this process's AWS_* variables pointing at it, and the GET requests its log counts."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_moto(port: int, log) -> subprocess.Popen:
    """moto's S3 server on 127.0.0.1:`port` logging its requests to `log` (a file: a pipe nobody
    reads would fill up and stall it), with this process's AWS_* variables pointing at it."""
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},  # each request's log line at once: they are counted
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"error: moto server on {endpoint} did not start")


@contextlib.contextmanager
def moto_bucket(tmp: Path):
    """(a fresh prefix URL in a bucket on a moto server started here, the server's request log);
    the server stops on exit."""
    log_path = tmp / "moto.log"
    with open(log_path, "wb") as log:
        server = start_moto(free_port(), log)
    try:
        import fsspec

        fsspec.filesystem("s3").mkdir("bench")
        yield f"s3://bench/{uuid.uuid4().hex[:8]}", log_path
    finally:
        server.terminate()
        server.wait()


def get_requests(log_path: Path) -> int:
    """GET requests the server has logged so far (a line per request, its method after a quote and
    maybe a terminal colour code)."""
    return len(re.findall(r'"(?:\x1b\[[0-9;]*m)*GET ', log_path.read_text(errors="replace")))
