"""Timing and process memory for the benchmarks: a timed call, a call in a fresh process (its own
peak memory, none of the caller's), the resident set and its peak, and a peak sampled on a thread
while something runs."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

GIB = 1 << 30


def timed(fn) -> tuple[float, object]:
    """(seconds, fn())."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def in_fresh_process(fn, *args):
    """fn(*args) in a new spawned process (its own peak RSS, none of this one's memory)."""
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def rss_bytes() -> int:
    """This process's resident set now (psutil reads /proc/self/statm)."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """This process's peak RSS since its exec (VmHWM; ru_maxrss would carry the forking parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/self/status has no VmHWM line")


class PeakSampler:
    """The largest value of `measure()` seen while the block runs, sampled every `every_s` on a
    thread (torch's kernels and I/O release the GIL), once at the start and once at the end."""

    def __init__(self, measure: Callable[[], int], *, every_s: float):
        self.measure, self.every_s = measure, every_s
        self.peak, self._stop = measure(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.measure())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.measure())
