"""Measurements, reference checks and harnesses; not tests (benchmarks/README.md lists every script).

Every script is a module run from the repository root with the project's venv:

    .venv/bin/python -m benchmarks.speed.cache_build --quick
    .venv/bin/python -m benchmarks.checks.deepspec_check --deepspec DIR
    .venv/bin/python -m benchmarks.harness.chaos --stage train --rounds 1

speed/ holds the speed, memory, size and tau benchmarks, checks/ the comparisons against reference
code, harness/ the runs that exercise the pipeline under faults or on a lent GPU, and common/ what
they share. This file runs before any script's own imports: the environment every benchmark
process starts from (a local Ray cluster without token auth, tokenizers without fork warnings),
so no script repeats it. Standard library only: harness/gpu_carry.py's `unpack` runs on a machine
without the project's dependencies.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
