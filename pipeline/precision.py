"""What `auto` means for a compute dtype, in one place for every stage: bf16 on CUDA, and on a CPU
whose cores multiply bf16 matrices natively (AMX-BF16 or AVX512-BF16) for the stages where bf16 was
measured faster there (docs/benchmarks.md, "bf16 on the CPU"); fp32 on every other CPU.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of a CPU with bf16 matmul units
# Stages where `auto` is bf16 on a native-bf16 CPU: stage 1's target pass (build and regeneration) and
# the training step, measured faster in bf16 side by side (benchmarks/speed/bf16.py). Evaluation stays fp32,
# where the lossless check is exact (in bf16 it counts near-tie flips instead: docs/design.md).
CPU_BF16_STAGES = frozenset({"build", "train"})
# "0": `auto` is fp32 on every CPU (the tests set it, so their numbers do not depend on the CI
# machine's instruction set); "1": as on a native-bf16 CPU; unset: the CPU decides.
CPU_BF16_ENV = "ALRIRA_CPU_BF16"


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this machine's CPU has bf16 matrix units (Linux: its /proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def auto_bf16(device_type: str, *, stage: str) -> bool:
    """Whether `auto` computes `stage` ("build", "train" or "eval") in bf16 on `device_type`."""
    if device_type == "cuda":
        return True
    if device_type != "cpu" or stage not in CPU_BF16_STAGES:
        return False
    forced = os.environ.get(CPU_BF16_ENV, "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"{CPU_BF16_ENV}={forced}: expected 0, 1 or unset")
    return forced == "1" if forced else native_bf16_matmul()
