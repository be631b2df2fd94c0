"""The cache manifest (`manifest.json`) and the target head file (`target_head.safetensors`).

The manifest says what a cache is: the settings that define its content (compared when a build
resumes), the target's identity and config, and one record per shard with counts and a checksum.
Both files are written atomically: temp file in the same directory, fsync, os.replace, fsync dir;
on an object store (storage.location) each is one object written whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from storage.atomic import atomic_write, atomic_write_bytes
from storage.format import (
    ALL_GROUPS,
    FEATURE_CODECS,
    FORMAT_NAME,
    READABLE_FORMAT_VERSIONS,
    is_readable_format_version,
    MANIFEST_FILE,
    SHARD_COMPLETE,
    SHARD_STATUSES,
    STORAGE_FORMATS,
    TARGET_HEAD_FILE,
    check_codec,
    check_contents,
    check_ira_parents,
    check_num_slots,
    format_version_for,
    shard_name,
)
from storage.location import Location, read_safetensors_header, resolve

TARGET_HEAD_KEYS = ("embed_tokens.weight", "lm_head.weight")
# CacheSettings keys written only when set (a cache without them reads as before they existed).
OPTIONAL_SETTINGS = ("system_prompt", "vision", "ira_parents", "rollout_feature_codec", "profile")
PROFILES = ("compact", "small")  # named setting combinations (`alrira-cache build --profile`)
VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
TARGET_HEAD_HASH_KEY = "alrira_target_hash"  # safetensors metadata key of the head file


def package_version() -> str:
    """Version of the installed `alrira` package (recorded in manifests)."""
    from importlib import metadata

    try:
        return f"alrira {metadata.version('alrira')}"
    except metadata.PackageNotFoundError:
        return "alrira (not installed)"


# ---------------------------------------------------------------------------------------------
# Validation helpers (user data: ValueError naming the field)


# Counts beyond any real cache: a crafted manifest's 10**20 would overflow the int64 arrays the
# reader builds from them, and a planned-shard count drives loops over every index.
MAX_COUNT = 2**62
MAX_SHARDS_PLANNED = 10**7


def _check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int = MAX_COUNT) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_str(name: str, value: Any, *, nonempty: bool = False) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    if nonempty and not value:
        raise ValueError(f"{name} must not be empty")


def _check_int_list(name: str, value: Any, *, minimum: int | None = None) -> None:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of ints, got {value!r}")
    for i, item in enumerate(value):
        _check_int(f"{name}[{i}]", item, minimum=minimum)


def _check_dict(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict, got {type(value).__name__}")


COMPUTE_DTYPES = ("float32", "bfloat16")


def check_compute(name: str, value: Any) -> None:
    """None (a cache built before it was recorded) or {"dtype": "float32" | "bfloat16", "device":
    "cpu" | "cuda" | ...}: what the target computed the cache in, `auto` resolved on the machine
    that computed it."""
    if value is None:
        return
    if not isinstance(value, dict) or set(value) != {"dtype", "device"}:
        raise ValueError(f"{name} must be {{'dtype': ..., 'device': ...}}, got {value!r}")
    if value["dtype"] not in COMPUTE_DTYPES:
        raise ValueError(f"{name}.dtype must be one of {COMPUTE_DTYPES}, got {value['dtype']!r}")
    _check_str(f"{name}.device", value["device"], nonempty=True)


def describe_compute(compute: dict | None) -> str:
    """"bfloat16 on cuda", or what an older cache without the record says."""
    return "not recorded (built before the compute dtype was)" if compute is None else f"{compute['dtype']} on {compute['device']}"


def _check_keys(cls: type, data: Any) -> None:
    """Reject unknown keys and missing required keys of a dict for dataclass `cls`."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise ValueError(f"unknown key {key!r} in {cls.__name__}")
    for name, f in fields.items():
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if name not in data and not has_default:
            raise ValueError(f"missing key {name!r} in {cls.__name__}")


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(kw_only=True)
class CacheSettings:
    """Settings that define a cache's content; a resumed build must use the same ones."""

    target_hash: str  # content hash of the target's config and tokenizer
    layer_ids: list[int]  # target layers whose outputs are the context features
    num_slots: int  # K, predicted slots per block (15)
    top_k: int  # k, stored top-k of every target distribution
    anchors_per_sequence: int  # size of each sequence's anchor pool
    seed: int
    max_length: int  # sequences are truncated to this many tokens
    min_supervised_tokens: int  # sequences with fewer loss-mask tokens are dropped
    feature_codec: str  # "bf16" or "fp8"
    storage_format: str  # "zarr" or "wds"
    shard_size: int  # sequences per shard
    corpus_hash: str  # content hash of the corpus file
    skip_bad_rows: bool  # drop (and count) malformed corpus rows instead of failing
    # Optional array groups stored (storage.format.ARRAY_GROUPS), sorted. Manifests written
    # before groups existed lack the key: those caches hold every group.
    contents: list[str] = field(default_factory=lambda: list(ALL_GROUPS))
    # Which engine computed the target side ("hf" or "vllm"). They agree within fp32 rounding, not
    # bit for bit, so one cache is never resumed with the other (older manifests: "hf").
    backend: str = "hf"
    # The system prompt given to rows without one (--system-prompt, or the vision-language
    # default); None: none, and the key is left out, so a text cache's manifest is as before.
    system_prompt: str | None = None
    # Vision-language targets (docs/vision.md): modality, processor class and settings, pixel
    # limits, image / vision token ids, the deepstack and drafter-position notes. None (no key):
    # a text cache, as every manifest written before vision-language targets.
    vision: dict[str, Any] | None = None
    # Format version 2 (docs/cache-format.md). Rollout features kept for only this many pool anchors
    # per sequence, the ones IRA may draw as parents (storage.format.ira_parent_rows); None: all.
    ira_parents: int | None = None
    # Codec of the rollout features; None: feature_codec's (every version-1 cache).
    rollout_feature_codec: str | None = None
    # The named combination the build was asked for ("compact"); None: chosen flag by flag.
    profile: str | None = None

    def __post_init__(self) -> None:
        _check_str("target_hash", self.target_hash, nonempty=True)
        _check_int_list("layer_ids", self.layer_ids, minimum=0)
        if not self.layer_ids:
            raise ValueError("layer_ids must not be empty")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be unique, got {self.layer_ids}")
        # K - 2 rollout features are stored per anchor, so a block needs at least 3 slots.
        check_num_slots(self.num_slots)
        _check_int("top_k", self.top_k, minimum=1)
        _check_int("anchors_per_sequence", self.anchors_per_sequence, minimum=1)
        _check_int("seed", self.seed, minimum=0)
        _check_int("max_length", self.max_length, minimum=2)
        _check_int("min_supervised_tokens", self.min_supervised_tokens, minimum=0)
        if self.feature_codec not in FEATURE_CODECS:
            raise ValueError(f"feature_codec must be one of {FEATURE_CODECS}, got {self.feature_codec!r}")
        if self.storage_format not in STORAGE_FORMATS:
            raise ValueError(f"storage_format must be one of {STORAGE_FORMATS}, got {self.storage_format!r}")
        _check_int("shard_size", self.shard_size, minimum=1)
        _check_str("corpus_hash", self.corpus_hash, nonempty=True)
        if not isinstance(self.skip_bad_rows, bool):
            raise ValueError(f"skip_bad_rows must be a bool, got {self.skip_bad_rows!r}")
        if not isinstance(self.contents, list):
            raise ValueError(f"contents must be a list of group names, got {self.contents!r}")
        self.contents = list(check_contents(self.contents))
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"backend must be hf or vllm, got {self.backend!r}")
        check_ira_parents(self.ira_parents)
        if self.rollout_feature_codec is not None:
            check_codec(self.rollout_feature_codec, name="rollout_feature_codec")
        if self.profile is not None and self.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES} or unset, got {self.profile!r}")
        if self.system_prompt is not None:
            _check_str("system_prompt", self.system_prompt)
        if self.vision is not None:
            _check_dict("vision", self.vision)
            for name in VISION_TOKEN_KEYS:
                _check_int(f"vision.{name}", self.vision.get(name), minimum=0)

    @property
    def format_version(self) -> int:
        """The format version these settings need (storage.format.format_version_for)."""
        return format_version_for(
            ira_parents=self.ira_parents, feature_codec=self.feature_codec, rollout_feature_codec=self.rollout_feature_codec
        )  # fmt: skip

    @property
    def codecs(self) -> dict[str, str]:
        """{"features": codec, "rollout_features": codec}."""
        return {"features": self.feature_codec, "rollout_features": self.rollout_feature_codec or self.feature_codec}

    @property
    def modality(self) -> str:
        """"text", or the vision settings' modality ("image-text")."""
        return "text" if self.vision is None else str(self.vision.get("modality", "image-text"))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in OPTIONAL_SETTINGS:  # absent rather than null: text manifests stay byte-identical
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheSettings:
        _check_keys(cls, data)
        return cls(**data)


def settings_diff(old: CacheSettings, new: CacheSettings) -> list[str]:
    """Human-readable differences, one line per field ("top_k: 8 -> 4"); empty if equal."""
    lines = []
    for f in dataclasses.fields(CacheSettings):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if before != after:
            lines.append(f"{f.name}: {before!r} -> {after!r}")
    return lines


# ---------------------------------------------------------------------------------------------
# Shards and the manifest


@dataclass(kw_only=True)
class ShardRecord:
    """One shard as listed in the manifest."""

    name: str  # file/dir name under shards/, e.g. "shard-00003.zarr"
    index: int
    sequences: int
    tokens: int
    anchors: int
    bytes: int  # size on disk
    checksum: str  # "sha256:<hex>" or "sha256-files:<hex>", see storage.checksums.shard_checksum
    status: str  # "complete" once published; only complete shards are readable
    # Ray node that wrote the shard ("IP/first 8 hex of the node id", ray_jobs.build.this_node);
    # None (no key): built in-process. Not content: resume and verify ignore it.
    node: str | None = None
    # On an object store: shard_object_tags when the checksum was computed (storage.checksums), so a
    # resume can tell with one listing that the objects are still the checksummed ones. None (no
    # key): a local shard. Not content: verify recomputes the checksum.
    object_tags: str | None = None
    # Wall seconds of the target per part of the cache ({"corpus": s, "rollouts": s}, HF backend),
    # for `alrira-eval cost`; None (no key): not measured. Not content: resume and verify ignore it.
    build_seconds: dict[str, float] | None = None
    # Rows of rollout features (caches with settings.ira_parents: P = min(ira_parents, A) per
    # sequence); None (no key): one per anchor.
    parents: int | None = None
    # What the target computed this shard in ({"dtype": "bfloat16", "device": "cuda"}, `auto`
    # resolved on the worker's machine); None (no key): built before it was recorded.
    compute: dict[str, str] | None = None

    def __post_init__(self) -> None:
        _check_str("name", self.name, nonempty=True)
        if "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name must be a plain shard file name, got {self.name!r}")
        _check_int("index", self.index, minimum=0)
        _check_int("sequences", self.sequences, minimum=0)
        _check_int("tokens", self.tokens, minimum=0)
        _check_int("anchors", self.anchors, minimum=0)
        _check_int("bytes", self.bytes, minimum=0)
        _check_str("checksum", self.checksum)
        if not self.checksum.startswith(("sha256:", "sha256-files:")):  # storage.checksums.CHECKSUM_SCHEMES
            raise ValueError(f"checksum must look like 'sha256:<hex>' or 'sha256-files:<hex>', got {self.checksum!r}")
        if self.status not in SHARD_STATUSES:
            raise ValueError(f"status must be one of {SHARD_STATUSES}, got {self.status!r}")
        if self.node is not None:
            _check_str("node", self.node, nonempty=True)
        if self.object_tags is not None and not (isinstance(self.object_tags, str) and self.object_tags.startswith("sha256:")):
            raise ValueError(f"object_tags must look like 'sha256:<hex>', got {self.object_tags!r}")
        if self.build_seconds is not None and not (
            isinstance(self.build_seconds, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in self.build_seconds.values())
        ):
            raise ValueError(f"build_seconds must map parts to seconds >= 0, got {self.build_seconds!r}")
        if self.parents is not None:
            _check_int("parents", self.parents, minimum=0)
        check_compute("compute", self.compute)

    @property
    def is_complete(self) -> bool:
        return self.status == SHARD_COMPLETE

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for optional in ("node", "object_tags", "build_seconds", "parents", "compute"):  # absent rather than null: such manifests read as before
            if data[optional] is None:
                del data[optional]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardRecord:
        _check_keys(cls, data)
        return cls(**data)


@dataclass(kw_only=True)
class Manifest:
    """Everything `manifest.json` holds."""

    format: str = FORMAT_NAME
    format_version: int | None = None  # None: the oldest version describing `settings` (settings.format_version)
    settings: CacheSettings
    target_path: str
    target_config: dict[str, Any]  # the target's HF config.json (drafter configs derive from it)
    num_target_layers: int
    hidden_size: int
    vocab_size: int
    stop_token_ids: list[int]
    mask_token_id: int
    corpus_path: str
    corpus_stats: dict[str, Any]  # e.g. {"rows": n, "sequences": n, "dropped": {reason: n}}
    shards: list[ShardRecord]
    num_shards_planned: int
    created_with: str = field(default_factory=package_version)
    # What the target computed the cache in ({"dtype": "bfloat16", "device": "cuda"}): `auto`
    # resolves per machine, so a build resumed elsewhere could mix dtypes; every shard's record
    # must match it. None (no key): a cache built before it was recorded.
    compute: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.format != FORMAT_NAME:
            raise ValueError(f"format must be {FORMAT_NAME!r}, got {self.format!r}")
        if not isinstance(self.settings, CacheSettings):
            raise ValueError(f"settings must be a CacheSettings, got {type(self.settings).__name__}")
        if self.format_version is None:
            self.format_version = self.settings.format_version
        if not is_readable_format_version(self.format_version):
            raise ValueError(f"format_version {self.format_version!r} is not supported (this code reads {READABLE_FORMAT_VERSIONS})")
        if self.format_version < self.settings.format_version:
            raise ValueError(
                f"format_version {self.format_version} cannot hold these settings (ira_parents, rollout_feature_codec, e8m codecs "
                f"need version {self.settings.format_version})"
            )
        _check_str("target_path", self.target_path)
        _check_dict("target_config", self.target_config)
        _check_int("num_target_layers", self.num_target_layers, minimum=1)
        _check_int("hidden_size", self.hidden_size, minimum=1)
        _check_int("vocab_size", self.vocab_size, minimum=1)
        _check_int_list("stop_token_ids", self.stop_token_ids, minimum=0)
        _check_int("mask_token_id", self.mask_token_id, minimum=0)
        _check_str("corpus_path", self.corpus_path)
        _check_dict("corpus_stats", self.corpus_stats)
        _check_int("num_shards_planned", self.num_shards_planned, minimum=0, maximum=MAX_SHARDS_PLANNED)
        _check_str("created_with", self.created_with)
        check_compute("compute", self.compute)
        bad_layers = [i for i in self.settings.layer_ids if i >= self.num_target_layers]
        if bad_layers:
            raise ValueError(f"settings.layer_ids {bad_layers} out of range for num_target_layers={self.num_target_layers}")
        if not isinstance(self.shards, list) or not all(isinstance(s, ShardRecord) for s in self.shards):
            raise ValueError("shards must be a list of ShardRecord")
        seen: set[int] = set()
        for shard in self.shards:
            if shard.index in seen:
                raise ValueError(f"shards: index {shard.index} listed twice")
            seen.add(shard.index)
            expected = shard_name(shard.index, self.settings.storage_format)
            if shard.name != expected:
                raise ValueError(f"shards: shard {shard.index} is named {shard.name!r}, expected {expected!r}")
            if shard.index >= self.num_shards_planned:
                raise ValueError(f"shards: index {shard.index} >= num_shards_planned={self.num_shards_planned}")
            if self.compute is not None and shard.compute is not None and shard.compute != self.compute:
                raise ValueError(
                    f"shards: {shard.name} was computed in {describe_compute(shard.compute)}, the cache in "
                    f"{describe_compute(self.compute)}; rebuild it (alrira-cache build --overwrite)"
                )

    @property
    def feature_dim(self) -> int:
        """F = number of tapped layers * hidden_size."""
        return len(self.settings.layer_ids) * self.hidden_size

    @property
    def complete_shards(self) -> list[ShardRecord]:
        return [s for s in self.shards if s.is_complete]

    @property
    def num_sequences(self) -> int:
        return sum(s.sequences for s in self.complete_shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.complete_shards)

    @property
    def num_anchors(self) -> int:
        return sum(s.anchors for s in self.complete_shards)

    @property
    def is_complete(self) -> bool:
        """All planned shards are written and complete."""
        return len(self.complete_shards) == self.num_shards_planned

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["settings"] = self.settings.to_dict()
        data["shards"] = [s.to_dict() for s in self.shards]
        if data["compute"] is None:  # absent rather than null: such manifests read as before
            del data["compute"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        _check_keys(cls, data)
        if not isinstance(data["shards"], list):
            raise ValueError("shards must be a list")
        fields = {
            **data,
            "settings": CacheSettings.from_dict(data["settings"]),
            "shards": [ShardRecord.from_dict(s) for s in data["shards"]],
        }
        return cls(**fields)


def save_manifest(cache_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Atomically write `cache_dir/manifest.json` (a directory or a store URL)."""
    location = resolve(cache_dir)
    location.make_dirs()
    text = json.dumps(manifest.to_dict(), indent=2) + "\n"
    atomic_write_bytes(location.join(MANIFEST_FILE), text.encode("utf-8"))


def load_manifest(cache_dir: str | os.PathLike) -> Manifest:
    """Read and validate `cache_dir/manifest.json`; one-line ValueError naming the file otherwise."""
    return _read_manifest(resolve(cache_dir), shown=cache_dir)


def _read_manifest(location: Location, *, shown: str | os.PathLike) -> Manifest:
    """load_manifest of the resolved `location` (`shown`: the cache directory as the caller named it)."""
    path = location.join(MANIFEST_FILE)
    if not location.is_file(MANIFEST_FILE):
        raise ValueError(f"{path}: no cache manifest (is {shown} a cache directory?)")
    try:
        data = json.loads(location.read_bytes(MANIFEST_FILE).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt manifest ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: corrupt manifest (top level is not a JSON object)")
    if data.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: not an {FORMAT_NAME} manifest (format is {data.get('format')!r})")
    if not is_readable_format_version(data.get("format_version")):
        raise ValueError(
            f"{path}: unsupported format_version {data.get('format_version')!r} (this code reads versions "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}; a newer alrira wrote it, or it is not a cache)"
        )
    try:
        return Manifest.from_dict(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: invalid manifest: {e}") from None


def previous_manifest(
    out: Location, settings: CacheSettings, *, mask_token_id: int, compute: dict[str, str], overwrite: bool, target_dtype: str
) -> tuple[Manifest | None, Manifest | None]:
    """(the manifest to resume from, the manifest of the cache --overwrite replaces) for a cache build
    of `settings` into `out`: at most one of them, both None without a manifest; refuses a changed
    setting unless `overwrite` (--overwrite). The mask token is compared as the id it
    resolves to (the manifest's `mask_token_id`): `--mask-token 128002` and the token it names
    are one setting, and so are the default and the first unused row given by id. The compute
    dtype is compared as resolved (`auto` is bf16 on one machine, fp32 on another); a cache
    without the record (built before it) resumes in whatever this machine resolves (`target_dtype`:
    the --target-dtype that resolved to `compute`, named in the refusal)."""
    if not out.exists(MANIFEST_FILE):
        return None, None
    previous = _read_manifest(out, shown=out)
    changed = settings_diff(previous.settings, settings)
    if previous.mask_token_id != mask_token_id:
        changed.append(f"mask_token_id (--mask-token): {previous.mask_token_id} -> {mask_token_id}")
    if previous.compute is not None and previous.compute["dtype"] != compute["dtype"] and not overwrite:
        raise ValueError(
            f"{out}: the cache was computed in {describe_compute(previous.compute)}, this build would compute in "
            f"{describe_compute(compute)} (--target-dtype {target_dtype}); pass --target-dtype {previous.compute['dtype']} "
            "to continue it, --overwrite to replace it, or use a new --out"
        )
    if previous.compute is not None and previous.compute["dtype"] != compute["dtype"]:
        changed.append(f"compute dtype: {previous.compute['dtype']} -> {compute['dtype']}")
    if not changed:
        return previous, None
    if not overwrite:
        raise ValueError(
            f"{out}: existing cache was built with different settings ({'; '.join(changed)}); "
            "use a new --out or pass --overwrite to replace it"
        )
    return None, previous


# ---------------------------------------------------------------------------------------------
# Target head


def save_target_head(
    cache_dir: str | os.PathLike, *, embed_tokens: torch.Tensor, lm_head: torch.Tensor, target_hash: str | None = None
) -> None:
    """Atomically write the target's input embedding and LM head ([V, H] each), tagged with the
    target hash of the build that wrote them (so a head can never pass for another target's)."""
    from safetensors.torch import save_file

    if embed_tokens.ndim != 2 or lm_head.ndim != 2:
        raise ValueError(
            f"embed_tokens and lm_head must be [V, H], got {tuple(embed_tokens.shape)} and {tuple(lm_head.shape)}"
        )
    if embed_tokens.shape[1] != lm_head.shape[1]:
        raise ValueError(f"embed_tokens and lm_head hidden sizes differ: {embed_tokens.shape[1]} vs {lm_head.shape[1]}")
    # Clone: tied weights share storage, which safetensors refuses to write twice.
    tensors = {
        "embed_tokens.weight": embed_tokens.detach().to("cpu").contiguous().clone(),
        "lm_head.weight": lm_head.detach().to("cpu").contiguous().clone(),
    }
    metadata = {"format": "pt"} if target_hash is None else {"format": "pt", TARGET_HEAD_HASH_KEY: target_hash}
    location = resolve(cache_dir)
    location.make_dirs()
    atomic_write(location.join(TARGET_HEAD_FILE), lambda tmp: save_file(tensors, tmp, metadata=metadata))


def target_head_hash(cache_dir: str | os.PathLike | Location) -> str | None:
    """The target hash a head file was written for; None if the file is missing, unreadable or
    untagged. On a store only the file's header is read."""
    return location_head_hash(resolve(cache_dir))


def location_head_hash(location: Location) -> str | None:
    """target_head_hash of a resolved cache."""
    from safetensors import SafetensorError, safe_open

    if not location.is_local:
        try:
            return (read_safetensors_header(location, TARGET_HEAD_FILE).get("__metadata__") or {}).get(TARGET_HEAD_HASH_KEY)
        except (OSError, ValueError):
            return None
    path = location.join(TARGET_HEAD_FILE)
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(TARGET_HEAD_HASH_KEY)
    except (SafetensorError, OSError):
        return None


def load_target_head(cache_dir: str | os.PathLike | Location, *, target_hash: str | None = None) -> dict[str, torch.Tensor]:
    """{"embed_tokens.weight": [V, H], "lm_head.weight": [V, H]} from `cache_dir`; with `target_hash`
    (the manifest's), a head written for another target is refused."""
    return read_target_head(resolve(cache_dir), target_hash=target_hash)


def read_target_head(location: Location, *, target_hash: str | None = None) -> dict[str, torch.Tensor]:
    """load_target_head of a resolved cache."""
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    path = location.join(TARGET_HEAD_FILE)
    if not location.is_file(TARGET_HEAD_FILE):
        raise ValueError(f"{path}: missing target head file")
    try:
        tensors = load_file(path) if location.is_local else load(location.read_bytes(TARGET_HEAD_FILE))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: corrupt target head ({e})") from None
    missing = [k for k in TARGET_HEAD_KEYS if k not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    if target_hash is not None and (written_for := location_head_hash(location)) != target_hash:
        raise ValueError(
            f"{path}: written for target {written_for or 'unknown (untagged)'}, but the manifest's target is "
            f"{target_hash}; rebuild the cache (alrira-cache build resumes and rewrites the head)"
        )
    return {k: tensors[k] for k in TARGET_HEAD_KEYS}
