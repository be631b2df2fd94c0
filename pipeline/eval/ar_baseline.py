"""The autoregressive baseline of `alrira-eval run`, decoded once per (target, prompts, settings) and
reused by every drafter evaluated on them (docs/design.md, "Evaluation"): the target's AR decode
does not depend on the drafter, so evaluating five drafters decodes it once, not five times.

The baseline is kept as one JSON file beside the runs (OUT/../.alrira-ar-baseline/<key>.json, key: a
sha256 of the target's hash, the rendered prompts and every setting the decode or its timing
depends on: temperature, max new tokens, seed, dtype, device, torch threads). A run that finds it
decodes only the speculative side; its tokens are the reference of the lossless check and its times
the AR side of the speedup. `--no-reuse-ar-baseline` decodes it again, alternating with the drafter
per prompt as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from pipeline.eval.speculative import DecodeResult
from pipeline.target import target_hash
from storage.atomic import atomic_write_text

AR_BASELINE_DIR = ".alrira-ar-baseline"
AR_BASELINE_VERSION = 1


def ar_baseline_file(config, prompts: list, *, dtype: torch.dtype, device: torch.device) -> Path:
    """Where the AR baseline of `config`'s target, `prompts` and decode settings is kept."""
    key = {
        "version": AR_BASELINE_VERSION,
        "target": target_hash(config.target),
        "prompts": [(p.prompt_id, p.benchmark, p.input_ids, None if p.image is None else [p.image.sha256, list(p.image.grid_thw)]) for p in prompts],
        "temperature": config.temperature,
        "max_new_tokens": config.max_new_tokens,
        "seed": config.seed,
        "dtype": str(dtype),
        "device": str(device),
        "threads": torch.get_num_threads(),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return Path(config.out).resolve().parent / AR_BASELINE_DIR / f"{digest}.json"


def read_ar_baseline(path: Path, prompts: list) -> dict[int, DecodeResult] | None:
    """{prompt_id: its AR decode} from `path`, or None when it is missing, unreadable or does not
    hold every prompt (then the run decodes the baseline itself)."""
    try:
        data = json.loads(path.read_text())
        results = {int(prompt_id): DecodeResult(**result) for prompt_id, result in data["results"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return results if all(p.prompt_id in results for p in prompts) else None


def write_ar_baseline(path: Path, results: dict[int, DecodeResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"version": AR_BASELINE_VERSION, "results": {str(k): dataclasses.asdict(v) for k, v in results.items()}}
    atomic_write_text(path, json.dumps(data) + "\n")
