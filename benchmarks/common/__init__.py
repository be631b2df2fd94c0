"""What the benchmark scripts share, one module per mechanism:

- cli: the parser (--quick, --out, --threads), the work directory, comma-separated lists, the
  command and machine a report records;
- report: the printed table, a results.json with the run's wall time and load average;
- toy: the toy target, chat corpus and cache the stage benchmarks build on;
- records: synthetic cache records (random bf16 features, real array shapes) and their manifest;
- real_shape_cache: those records at Qwen3-4B shapes as a cache, and the drafter of that shape;
- loader: the map loader's rate on one core and its decompression floor;
- process: timing, a fresh process, resident memory and its peak;
- store: a moto S3 server on 127.0.0.1 and the requests it logged.

Standard library only here (harness/gpu_carry.py runs where the project's dependencies are not).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
