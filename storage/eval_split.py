"""A cache's held-out evaluation split (docs/cache-format.md, "Evaluation split"): for each prompt of
`alrira-cache build --eval-prompts`, the target's greedy response and the tapped features of prompt +
response, so a trainer computes the exact greedy tau of its drafter (`alrira-train --eval-every`)
without the target.

Two files beside the shards: `eval_split.safetensors` (tensors below, features float32: the tau it
gives equals `alrira-eval replay`'s, which drafts from float32 features) and `eval_split.json`, its
record: the key it was computed for (target, prompts, settings), its sha256 and sizes. The record is
written last, so a split whose record is there is complete; a split is read only if its bytes match
the record's sha256 and is checked like a shard before use (`read_eval_split`): the record's fields
and types, its counts against the tensors, token ids against the target's vocabulary and feature
widths against the taps, so a crafted or edited split is one line naming it, never a wrong tau or
a traceback after step 1.

A split's identity (`split_identity`: its bytes' sha256, its prompts file's sha256 and generation
settings, its counts) goes into every evaluation point a training run logs, so a tau curve never
joins two splits: a resume on a cache whose split changed is refused (`check_same_split`).

    tokens          int64    [T]       prompt + greedy response of every prompt, concatenated
    offsets         int64    [n + 1]   prompt i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lengths  int64    [n]       its prompt tokens (the response follows)
    prompt_ids      int64    [n]       its row in the prompts file
    features        float32  [T, F]    the tapped target features of every token
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from storage.atomic import atomic_write_bytes, atomic_write_text
from storage.location import Location, read_safetensors_header

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
    identity: dict = field(default_factory=dict)  # split_identity of its record: what an evaluation point measured

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_lengths)

    def sequence(self, i: int) -> tuple[list[int], int, np.ndarray]:
        """(prompt + response tokens, prompt length, features [S, F]) of prompt i."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[start:end].tolist(), int(self.prompt_lengths[i]), self.features[start:end]

    def __iter__(self):
        """Each prompt's `sequence`, in order."""
        return (self.sequence(i) for i in range(self.num_prompts))


def write_eval_split(cache: Location, *, sequences: list[list[int]], prompt_lengths: list[int], prompt_ids: list[int],
                     features: list[np.ndarray], key: dict, held_out: dict | None = None) -> dict:  # fmt: skip
    """Write the split and then its record into `cache` (each atomically); returns the record.
    `held_out`: {"duplicate_prompts": n, "corpus_overlaps": n} (pipeline/eval/split.py)."""
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
        **({"held_out": held_out} if held_out is not None else {}),
    }  # fmt: skip
    atomic_write_bytes(cache.join(EVAL_SPLIT_FILE), data)
    atomic_write_text(cache.join(EVAL_SPLIT_RECORD), json.dumps(record, indent=2) + "\n")  # last: the split is complete
    return record


def split_file_bytes(*, num_tokens: int, num_prompts: int, feature_width: int) -> int:
    """The bytes of a split's tensors (`--estimate`): int64 tokens, offsets, prompt lengths and ids,
    float32 features, plus at most SAFETENSORS_HEADER_BYTES of header."""
    return num_tokens * (8 + 4 * feature_width) + (num_prompts + 1) * 8 + 2 * num_prompts * 8 + SAFETENSORS_HEADER_BYTES


SAFETENSORS_HEADER_BYTES = 1024  # five tensors' names, dtypes, shapes and offsets
TENSORS = {"tokens": ("I64", 1), "offsets": ("I64", 1), "prompt_lengths": ("I64", 1), "prompt_ids": ("I64", 1), "features": ("F32", 2)}
# numpy's dtype names as safetensors' header writes them, so `info` (header) and `verify` (data) say the same.
_DTYPE_CODES = {"int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float64": "F64",
                "float32": "F32", "float16": "F16"}  # fmt: skip
_INT_FIELDS = ("bytes", "num_prompts", "num_tokens")
_KEY_FIELDS = {"target_hash": str, "prompts_sha256": str, "max_new_tokens": int, "max_prompts": (int, type(None)),
               "layer_ids": list, "dtype": str}  # fmt: skip


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:55] + "..." + text[-2:]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def record_problem(record) -> str | None:
    """What is wrong with a split record's fields and types, or None."""
    if not isinstance(record, dict):
        return f"a JSON object, got {type(record).__name__}"
    if record.get("version") != EVAL_SPLIT_VERSION or not _is_int(record.get("version")):
        return f"not an evaluation split record of version {EVAL_SPLIT_VERSION} (version {_shown(record.get('version'))})"
    if record.get("file") != EVAL_SPLIT_FILE:
        return f"file must be {EVAL_SPLIT_FILE!r}, got {_shown(record.get('file'))}"
    sha = record.get("sha256")
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        return f"sha256 must be 64 hex digits, got {_shown(sha)}"
    for name in _INT_FIELDS:
        if not _is_int(record.get(name)) or not 0 <= record[name] < 1 << 62:
            return f"{name} must be an integer >= 0, got {_shown(record.get(name))}"
    if record["num_prompts"] < 1:
        return "num_prompts must be >= 1, got 0"
    key = record.get("key")
    if not isinstance(key, dict):
        return f"key must be a JSON object, got {_shown(key)}"
    for name, kind in _KEY_FIELDS.items():
        value = key.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 1):
            return f"key.{name} must be {'a list' if kind is list else 'a string' if kind is str else 'an integer'}, got {_shown(value)}"
    if not key["layer_ids"] or not all(_is_int(i) and i >= 0 for i in key["layer_ids"]):
        return f"key.layer_ids must be a list of layer ids, got {_shown(key['layer_ids'])}"
    held_out = record.get("held_out")
    if held_out is not None and not (
        isinstance(held_out, dict) and all(_is_int(held_out.get(n)) and held_out[n] >= 0 for n in HELD_OUT_COUNTS)
    ):
        return f"held_out must hold the counts {', '.join(HELD_OUT_COUNTS)}, got {_shown(held_out)}"
    return None


HELD_OUT_COUNTS = ("duplicate_prompts", "corpus_overlaps")


def read_eval_split_record(cache: Location) -> dict | None:
    """The split's record, checked field by field, or None when the cache has no (complete) split."""
    if not cache.is_file(EVAL_SPLIT_RECORD):
        return None
    try:
        record = json.loads(cache.read_bytes(EVAL_SPLIT_RECORD))
    except ValueError as error:
        raise ValueError(f"{cache.join(EVAL_SPLIT_RECORD)}: unreadable ({error})") from None
    problem = record_problem(record)
    if problem is not None:
        raise ValueError(f"{cache.join(EVAL_SPLIT_RECORD)}: damaged record: {problem}; rebuild it with `alrira-cache build` and the same --eval-prompts")
    return record


@dataclass(frozen=True, kw_only=True)
class SplitFit:
    """What a cache's split must fit: its target and taps, the target's vocabulary, the width of
    the features the taps give (`of(manifest)`)."""

    target_hash: str
    layer_ids: list[int]
    vocab_size: int
    feature_width: int

    @classmethod
    def of(cls, manifest) -> SplitFit:
        settings = manifest.settings
        return cls(target_hash=settings.target_hash, layer_ids=list(settings.layer_ids), vocab_size=manifest.vocab_size,
                   feature_width=manifest.feature_dim)  # fmt: skip


def _fit_problem(record: dict, fit: SplitFit) -> str | None:
    key = record["key"]
    if key["target_hash"] != fit.target_hash or key["layer_ids"] != fit.layer_ids:
        return (
            f"computed for another target or taps (layer ids {_shown(key['layer_ids'])}, the cache's {fit.layer_ids}); rebuild it "
            "with `alrira-cache build` and --eval-prompts (the shards are kept)"
        )
    return None


def _shape_problems(shapes: dict[str, tuple[str, list]], record: dict, fit: SplitFit) -> list[str]:
    """The tensors' names, dtypes and shapes against the record's counts and the taps' width."""
    if set(shapes) != set(TENSORS):
        return [f"holds tensors {sorted(shapes)}, a split holds {sorted(TENSORS)}"]
    n, num_tokens = record["num_prompts"], record["num_tokens"]
    expected = {"tokens": [num_tokens], "offsets": [n + 1], "prompt_lengths": [n], "prompt_ids": [n],
                "features": [num_tokens, fit.feature_width]}  # fmt: skip
    wrong = [
        f"{name} is {dtype} {list(shape)}, not {TENSORS[name][0]} {expected[name]}"
        for name, (dtype, shape) in sorted(shapes.items())
        if dtype != TENSORS[name][0] or list(shape) != expected[name]
    ]
    if not wrong:
        return []
    return [f"its tensors do not match its record ({n} prompts, {num_tokens} tokens) and the taps ({fit.feature_width} features): {'; '.join(wrong)}"]


def _value_problems(tensors: dict[str, np.ndarray], record: dict, fit: SplitFit) -> list[str]:
    """Offsets, prompt lengths, token ids and features against each other and the vocabulary."""
    offsets, lengths, tokens = tensors["offsets"], tensors["prompt_lengths"], tensors["tokens"]
    problems = []
    sizes = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != record["num_tokens"] or (sizes < 1).any():
        problems.append(f"offsets do not cut {record['num_tokens']} tokens into {record['num_prompts']} sequences")
    elif ((lengths < 1) | (lengths > sizes)).any():
        problems.append("a prompt length is < 1 or longer than its sequence")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= fit.vocab_size):
        problems.append(f"token ids {int(tokens.min())}..{int(tokens.max())} outside the target's vocabulary (0..{fit.vocab_size - 1})")
    if (tensors["prompt_ids"] < 0).any():
        problems.append("a prompt id (its row in the prompts file) is negative")
    if not np.isfinite(tensors["features"]).all():
        problems.append("features hold NaN or infinite values")
    return problems


def eval_split_problems(cache: Location, fit: SplitFit, *, full: bool = True) -> list[str]:
    """Every problem of the cache's split, one line each ([] without a split): its record, what it
    was computed for, its tensors' shapes against the record and the taps; with `full`
    (`verify`, training) also its bytes against the record's sha256 and its values (offsets, token
    ids against the vocabulary, finite features). Without, only the header is read (`info`)."""
    try:
        record = read_eval_split_record(cache)
        if record is None:
            return []
        if (problem := _fit_problem(record, fit)) is not None:
            return [f"{cache.join(EVAL_SPLIT_RECORD)}: {problem}"]
        where = cache.join(EVAL_SPLIT_FILE)
        if not cache.is_file(EVAL_SPLIT_FILE):
            return [f"{where}: missing; its record {EVAL_SPLIT_RECORD} is there"]
        if not full:
            header = read_safetensors_header(cache, EVAL_SPLIT_FILE)
            shapes = {name: (v.get("dtype"), v.get("shape")) for name, v in header.items() if name != "__metadata__" and isinstance(v, dict)}
            return [f"{where}: {p}" for p in _shape_problems(shapes, record, fit)]
        _, problems = _checked_tensors(cache, record, fit)
        return problems
    except ValueError as error:
        return [str(error).splitlines()[0]]


def _checked_tensors(cache: Location, record: dict, fit: SplitFit) -> tuple[dict | None, list[str]]:
    where = cache.join(EVAL_SPLIT_FILE)
    data = cache.read_bytes(EVAL_SPLIT_FILE)
    if hashlib.sha256(data).hexdigest() != record["sha256"] or len(data) != record["bytes"]:
        return None, [
            f"{where}: does not match its record's sha256 (changed or truncated); rebuild it with `alrira-cache build` and the "
            "same --eval-prompts (the shards are kept)"
        ]
    try:
        tensors = load_tensors(data)
    except SafetensorError as error:  # a crafted header whose sha256 was updated with it
        return None, [f"{where}: not a safetensors file ({str(error).splitlines()[0] if str(error) else type(error).__name__})"]
    shapes = {name: (_DTYPE_CODES.get(str(t.dtype), str(t.dtype)), list(t.shape)) for name, t in tensors.items()}
    problems = _shape_problems(shapes, record, fit) or _value_problems(tensors, record, fit)
    return tensors, [f"{where}: {p}" for p in problems]


def read_eval_split(cache: Location, fit: SplitFit) -> EvalSplit:
    """The cache's split, checked in full against its record and the cache (`eval_split_problems`):
    one line naming the file for the first problem."""
    record = read_eval_split_record(cache)
    if record is None:
        raise ValueError(f"{cache}: has no evaluation split (build the cache with --eval-prompts FILE)")
    if (problem := _fit_problem(record, fit)) is not None:
        raise ValueError(f"{cache.join(EVAL_SPLIT_RECORD)}: {problem}")
    if not cache.is_file(EVAL_SPLIT_FILE):
        raise ValueError(f"{cache.join(EVAL_SPLIT_FILE)}: missing; rebuild it with `alrira-cache build` and the same --eval-prompts")
    tensors, problems = _checked_tensors(cache, record, fit)
    if problems:
        raise ValueError(problems[0])
    return EvalSplit(
        tokens=tensors["tokens"], offsets=tensors["offsets"], prompt_lengths=tensors["prompt_lengths"],
        prompt_ids=tensors["prompt_ids"], features=tensors["features"], key=record["key"], identity=split_identity(record),
    )  # fmt: skip


def split_identity(record: dict) -> dict:
    """What an evaluation on the split measured: its bytes (sha256), its prompts file and the
    settings they were generated with, its counts."""
    key = record["key"]
    return {
        "sha256": record["sha256"], "prompts_sha256": key["prompts_sha256"], "max_new_tokens": key["max_new_tokens"],
        "max_prompts": key["max_prompts"], "num_prompts": record["num_prompts"], "num_tokens": record["num_tokens"],
    }  # fmt: skip


def describe_split(identity: dict) -> str:
    """`split sha256:0123456789ab (4 prompts, 96 tokens; prompts sha256:..., max new tokens 24)`."""
    prompts = str(identity.get("prompts_sha256", "")).removeprefix("sha256:")
    return (
        f"split sha256:{str(identity.get('sha256'))[:12]} ({identity.get('num_prompts')} prompts, {identity.get('num_tokens')} "
        f"tokens; prompts sha256:{prompts[:12]}, max new tokens {identity.get('max_new_tokens')})"
    )


def logged_split_identities(metrics: bytes) -> list[dict]:
    """The split identity of every evaluation point in a run's metrics.jsonl (its `eval.split`); a
    line a crash cut short, or a point logged before identities were recorded, adds none."""
    identities = []
    for line in metrics.decode("utf-8", errors="replace").splitlines():
        try:
            point = json.loads(line)
        except ValueError:
            continue
        evaluation = point.get("eval") if isinstance(point, dict) else None
        if isinstance(evaluation, dict) and isinstance(evaluation.get("split"), dict):
            identities.append(evaluation["split"])
    return identities


def check_same_split(earlier: list[dict], current: dict, *, run: str) -> None:
    """Refuse a resume whose evaluation points would join two splits: `earlier`, the identities the
    run's logged points measured, must all be `current`'s (points logged before identities were
    recorded say nothing, and pass)."""
    for identity in earlier:
        if identity != current:
            raise ValueError(
                f"{run}: --resume: its evaluation points measured {describe_split(identity)}, the cache now holds "
                f"{describe_split(current)}; one tau curve cannot join two splits: use a new --out, or rebuild the split with "
                "the run's --eval-prompts"
            )
