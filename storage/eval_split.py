"""A cache's held-out evaluation split (docs/cache-format.md, "Evaluation split"): for each prompt of
`alrira-cache build --eval-prompts`, the target's greedy response and the tapped features of prompt +
response, so a trainer computes the exact greedy tau of its drafter (`alrira-train --eval-every`)
without the target.

Two files beside the shards: `eval_split.safetensors` (tensors below, features float32: the tau it
gives equals `alrira-eval replay`'s, which drafts from float32 features) and `eval_split.json`, its
record: the key it was computed for (target, prompts, settings), its sha256 and sizes. The record is
written last, so a split whose record is there is complete; a split is read only if its bytes match
the record's sha256.

    tokens          int64    [T]       prompt + greedy response of every prompt, concatenated
    offsets         int64    [n + 1]   prompt i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lengths  int64    [n]       its prompt tokens (the response follows)
    prompt_ids      int64    [n]       its row in the prompts file
    features        float32  [T, F]    the tapped target features of every token
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from storage.atomic import atomic_write_bytes, atomic_write_text
from storage.location import Location

EVAL_SPLIT_FILE = "eval_split.safetensors"
EVAL_SPLIT_RECORD = "eval_split.json"
EVAL_SPLIT_VERSION = 1


@dataclass(kw_only=True)
class EvalSplit:
    tokens: np.ndarray  # [T] int64
    offsets: np.ndarray  # [n + 1] int64
    prompt_lengths: np.ndarray  # [n] int64
    prompt_ids: np.ndarray  # [n] int64
    features: np.ndarray  # [T, F] float32
    key: dict  # what it was computed for (target hash, prompts sha256, max new tokens, taps, ...)

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_lengths)

    def sequence(self, i: int) -> tuple[list[int], int, np.ndarray]:
        """(prompt + response tokens, prompt length, features [S, F]) of prompt i."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[start:end].tolist(), int(self.prompt_lengths[i]), self.features[start:end]


def write_eval_split(cache: Location, *, sequences: list[list[int]], prompt_lengths: list[int], prompt_ids: list[int],
                     features: list[np.ndarray], key: dict) -> dict:  # fmt: skip
    """Write the split and then its record into `cache` (each atomically); returns the record."""
    if not (len(sequences) == len(prompt_lengths) == len(prompt_ids) == len(features)):
        raise ValueError("an evaluation split needs one sequence, prompt length, prompt id and feature array per prompt")
    for tokens, rows in zip(sequences, features, strict=True):
        if rows.shape[0] != len(tokens):
            raise ValueError(f"an evaluation sequence of {len(tokens)} tokens has {rows.shape[0]} feature rows")
    tensors = {
        "tokens": np.asarray([t for tokens in sequences for t in tokens], dtype=np.int64),
        "offsets": np.cumsum([0] + [len(tokens) for tokens in sequences]).astype(np.int64),
        "prompt_lengths": np.asarray(prompt_lengths, dtype=np.int64),
        "prompt_ids": np.asarray(prompt_ids, dtype=np.int64),
        "features": np.concatenate([np.asarray(rows, dtype=np.float32) for rows in features]) if features else np.zeros((0, 0), np.float32),
    }
    data = save_tensors(tensors)
    record = {
        "version": EVAL_SPLIT_VERSION, "file": EVAL_SPLIT_FILE, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
        "num_prompts": len(sequences), "num_tokens": int(tensors["tokens"].shape[0]), "key": key,
    }  # fmt: skip
    atomic_write_bytes(cache.join(EVAL_SPLIT_FILE), data)
    atomic_write_text(cache.join(EVAL_SPLIT_RECORD), json.dumps(record, indent=2) + "\n")  # last: the split is complete
    return record


def read_eval_split_record(cache: Location) -> dict | None:
    """The split's record, or None when the cache has no (complete) split."""
    if not cache.is_file(EVAL_SPLIT_RECORD):
        return None
    try:
        record = json.loads(cache.read_bytes(EVAL_SPLIT_RECORD))
    except ValueError as error:
        raise ValueError(f"{cache.join(EVAL_SPLIT_RECORD)}: unreadable ({error})") from None
    if not isinstance(record, dict) or record.get("version") != EVAL_SPLIT_VERSION or not isinstance(record.get("key"), dict):
        raise ValueError(f"{cache.join(EVAL_SPLIT_RECORD)}: not an evaluation split record of version {EVAL_SPLIT_VERSION}")
    return record


def read_eval_split(cache: Location) -> EvalSplit:
    """The split, its bytes checked against the record's sha256 (one line naming the file if not)."""
    record = read_eval_split_record(cache)
    if record is None:
        raise ValueError(f"{cache}: has no evaluation split (build the cache with --eval-prompts FILE)")
    data = cache.read_bytes(EVAL_SPLIT_FILE) if cache.is_file(EVAL_SPLIT_FILE) else b""
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        raise ValueError(
            f"{cache.join(EVAL_SPLIT_FILE)}: does not match its record's sha256 (changed or truncated); rebuild it with "
            "`alrira-cache build` and the same --eval-prompts (the shards are kept)"
        )
    tensors = load_tensors(data)
    return EvalSplit(
        tokens=tensors["tokens"], offsets=tensors["offsets"], prompt_lengths=tensors["prompt_lengths"],
        prompt_ids=tensors["prompt_ids"], features=tensors["features"], key=record["key"],
    )  # fmt: skip
