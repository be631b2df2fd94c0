"""What the benchmark scripts print and keep: the table, mean and spread over repeats, a log line
stamped with the run's elapsed seconds, and results.json with the run's wall time and load."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """Labels left-aligned in the first column, numbers right-aligned in the others; flushed (a run
    killed by its time limit keeps the tables it printed)."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def stamped_log() -> Callable[[str], None]:
    """A log function printing each message after the seconds elapsed since it was made."""
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:6.0f}s] {message}", flush=True)

    return log


class RunClock:
    """A run's wall time and the machine's 1-minute load average, from the run's start (the
    machine is shared: a figure names the load it was measured under)."""

    def __init__(self) -> None:
        self.began, self.load_before = time.perf_counter(), os.getloadavg()[0]

    def wall_s(self) -> float:
        return time.perf_counter() - self.began

    def load_average(self) -> list[float]:
        """[at the start, now]."""
        return [self.load_before, os.getloadavg()[0]]

    def load_line(self) -> str:
        return f"load average {self.load_before:.1f} -> {os.getloadavg()[0]:.1f}"


def write_results(work: Path, results: dict) -> Path:
    """work/results.json, the run's figures as the tables printed them."""
    path = work / "results.json"
    path.write_text(json.dumps(results, indent=1))
    return path


def finish_run(work: Path, results: dict, clock: RunClock) -> Path:
    """results.json with the run's load average and wall time added, and the line that ends the
    run's output: its wall, the load, where the results are."""
    results = {**results, "load_average": clock.load_average(), "wall_s": clock.wall_s()}
    path = write_results(work, results)
    print(f"\nwall {results['wall_s']:.0f} s; {clock.load_line()}; {path}")
    return path
