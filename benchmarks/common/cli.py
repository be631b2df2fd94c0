"""The command line the benchmark scripts share: the parser with the options most of them take,
the work directory behind --out, comma-separated list options, and how a report records the
command that made it."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def bench_parser(doc: str, *, quick_help: str | None = None, out_help: str | None = None, threads: int | None = None,
                 threads_help: str = "torch threads") -> argparse.ArgumentParser:  # fmt: skip
    """A script's parser, described by its docstring's first paragraph, with the options named:
    --quick (tiny sizes, a smoke run) when `quick_help`, --out (default None) when `out_help`,
    --threads (default `threads`) when `threads` is given."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if quick_help:
        parser.add_argument("--quick", action="store_true", help=quick_help)
    if out_help:
        parser.add_argument("--out", default=None, help=out_help)
    if threads is not None:
        parser.add_argument("--threads", type=int, default=threads, help=threads_help)
    return parser


def empty_workdir(out: str | Path) -> Path:
    """--out as a directory that exists and is empty (a benchmark never mixes its files with old ones)."""
    work = Path(out)
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        raise SystemExit(f"error: --out {work} is not empty; give a new or empty directory")
    return work


def work_directory(out: str | Path | None, *, temp_prefix: str) -> Path:
    """--out as an empty directory (empty_workdir), or without it a new temp directory, kept."""
    return empty_workdir(out) if out else Path(tempfile.mkdtemp(prefix=temp_prefix))


@contextlib.contextmanager
def scratch_directory(out: str | Path | None, *, temp_prefix: str) -> Iterator[Path]:
    """--out as an empty directory, kept; without it a new temp directory, removed at the end."""
    if out:
        yield empty_workdir(out)
        return
    with tempfile.TemporaryDirectory(prefix=temp_prefix) as tmp:
        yield Path(tmp)


def int_list(text: str) -> list[int]:
    """A comma-separated option: '0,1,2' -> [0, 1, 2]."""
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    """A comma-separated option: '0,1' -> [0.0, 1.0]."""
    return [float(x) for x in text.split(",") if x.strip()]


def command_line(module: str, argv: list[str] | None = None) -> str:
    """The command that reruns this script with these arguments (the process's own by default),
    as a report records it."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *map(shlex.quote, args)])


def machine() -> str:
    """The machine a report's figures come from: architecture, CPUs, platform, torch."""
    import torch

    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, torch {torch.__version__}"


def run_record(module: str, argv: list[str] | None = None) -> dict:
    """What a report says about its run: the command, when, on what machine."""
    return {"command": command_line(module, argv), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine()}
