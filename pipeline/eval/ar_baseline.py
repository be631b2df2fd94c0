"""The autoregressive baseline of `alrira-eval run`, decoded once per (target, prompts, settings) and
reused by every drafter evaluated on them (docs/design.md, "Evaluation"): the target's AR decode
does not depend on the drafter, so evaluating five drafters decodes it once, not five times.

Every run keeps its baseline inside its own --out (`OUT/ar_baseline.json`, with its key: a sha256 of
the target's hash, the rendered prompts and every setting the decode or its timing depends on:
temperature, max new tokens, seed, dtype, device, torch threads), so nothing is written outside
--out (docs/design.md, "Outputs"). A run looks for a baseline of the same key in
`--ar-baseline-from DIR` (DIR/ar_baseline.json and DIR/*/ar_baseline.json) and in its siblings
(OUT/../*/ar_baseline.json: the usual `evals/<method>` layout) and, when it finds one, decodes
only the speculative side; those tokens are the reference of the lossless check and those times the
AR side of the speedup. `--no-reuse-ar-baseline` decodes it again, alternating with the drafter per
prompt as before.

A baseline is reused only when it is proven to be what its run wrote: the folder's record
(pipeline/outputs.py) is a complete `alrira-eval run` whose checksum of ar_baseline.json matches
the bytes read, which are the bytes parsed. An edited file (a speedup 80x off was printed from one),
a run still writing, or anything but a regular file (a FIFO would block the open forever) is passed
over, and the run decodes the baseline itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from pipeline.eval.speculative import DecodeResult
from pipeline.outputs import log_line, read_record, read_regular_file, sha256_of
from pipeline.target import target_hash
from storage.atomic import atomic_write_text

AR_BASELINE_FILE = "ar_baseline.json"
AR_BASELINE_VERSION = 2  # 2: kept inside each run's --out with its key (1: OUT/../.alrira-ar-baseline/)


def ar_baseline_key(config, prompts: list, *, dtype: torch.dtype, device: torch.device) -> str:
    """The key of the AR baseline of `config`'s target, `prompts` and decode settings."""
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
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def ar_baseline_candidates(out: str | Path, reuse_from: str | Path | None = None) -> list[Path]:
    """Where a run with --out `out` looks for a baseline, in order: --ar-baseline-from (the folder and
    its subfolders), then its siblings (read only: a run writes only its own). Its own --out holds
    none by then: the claim (pipeline/outputs.py) keeps a complete output whole or removes its files."""
    out = Path(out).resolve()
    places = []
    if reuse_from is not None:
        reuse_from = Path(reuse_from).resolve()
        places += [reuse_from / AR_BASELINE_FILE, *sorted(reuse_from.glob(f"*/{AR_BASELINE_FILE}"))]
    places += sorted(p for p in out.parent.glob(f"*/{AR_BASELINE_FILE}") if p.parent != out)
    return list(dict.fromkeys(places))  # each once, first place first


def find_ar_baseline(places: list[Path], key: str, prompts: list, *, log=log_line) -> tuple[Path, dict[int, DecodeResult]] | None:
    """(the file, {prompt_id: its AR decode}) of the first place holding the proven baseline of `key`
    for every prompt; None when none does (then the run decodes the baseline itself)."""
    for path in places:
        results = read_ar_baseline(path, key, prompts, log=log)
        if results is not None:
            return path, results
    return None


def read_ar_baseline(path: Path, key: str, prompts: list, *, log=log_line) -> dict[int, DecodeResult] | None:
    """{prompt_id: its AR decode} from `path`, or None when it is missing, not a regular file,
    unproven by its folder's record, unreadable, of another key or does not hold every prompt."""
    try:
        data = read_regular_file(path)
    except OSError as error:
        if not isinstance(error, FileNotFoundError):
            log(f"{path}: not reused as the AR baseline ({error.strerror})")
        return None
    try:
        record = read_record(path.parent)
    except ValueError:
        record = None
    proven = (
        record is not None and record.get("command") == "alrira-eval run" and record.get("complete") is True
        and isinstance(record.get("files"), dict) and record["files"].get(AR_BASELINE_FILE) == sha256_of(data)
    )  # fmt: skip
    try:
        parsed = json.loads(data)
        if parsed.get("version") != AR_BASELINE_VERSION or parsed.get("key") != key:
            return None
        results = {int(prompt_id): DecodeResult(**result) for prompt_id, result in parsed["results"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not proven:  # the right key, but not what a finished run wrote (edited, or its run not finished)
        log(f"{path}: not reused as the AR baseline: its folder's record does not vouch for these bytes "
            "(changed after its run wrote it, or the run did not finish); decoding the baseline here")  # fmt: skip
        return None
    return results if all(p.prompt_id in results for p in prompts) else None


def write_ar_baseline(out: str | Path, key: str, results: dict[int, DecodeResult]) -> Path:
    """Keep the run's baseline in its own --out; returns the file."""
    path = Path(out).resolve() / AR_BASELINE_FILE
    data = {"version": AR_BASELINE_VERSION, "key": key, "results": {str(k): dataclasses.asdict(v) for k, v in results.items()}}
    atomic_write_text(path, json.dumps(data) + "\n")
    return path
