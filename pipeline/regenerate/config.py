"""`alrira-cache regenerate`'s settings: what the target writes (sampling, lengths) and where the work
runs (the build's WorkerConfig: the same --workers / --gpus-per-worker / --workers-per-node pool)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.cache_build.config import WorkerConfig
from pipeline.config import from_flags, group, opt, to_flags
from pipeline.vision import VisionInputConfig

LENGTH_CONTROLS = ("none", "truncate", "window")
# Settings that only place the work: a rerun may change them and keep the parts already written.
PLACEMENT_SETTINGS = ("workers", "workers_per_node", "cpus_per_worker", "ray_address")


@dataclass(kw_only=True)
class SamplingConfig:
    """How the target writes each assistant turn."""

    temperature: float = opt("Sampling temperature; 0 = greedy (the paper's references).", default=0.0)
    top_p: float = opt("Nucleus sampling mass (with --temperature > 0).", default=1.0)
    seed: int = opt("Seed of the per-row sampling seeds (each row's is derived from it and the row).", default=0)
    max_new_tokens: int = opt("Most tokens generated for one assistant turn.", default=512)
    batched_sampling: bool = opt(
        "--backend hf with --temperature > 0: decode sampled rows in batches, each row drawing from its own seeded "
        "generator (many times faster on CPU; a row's text may then also depend, through the float rounding of "
        "batched logits, on which rows shared its batch). Default: one row at a time.",
        default=False,
    )
    length_control: str = opt(
        "none: keep each regenerated turn; truncate: cut it to the token count of the corpus turn it replaces; "
        "window: keep it whole but give loss to that many leading tokens only (the message's 'loss_tokens').",
        default="none",
    )

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_p < 1 and self.temperature == 0:
            raise ValueError("--top-p needs --temperature > 0 (greedy decoding ignores it)")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.length_control not in LENGTH_CONTROLS:
            raise ValueError(f"--length-control must be one of {', '.join(LENGTH_CONTROLS)}, got {self.length_control!r}")


@dataclass(kw_only=True)
class RegenerateConfig:
    """`alrira-cache regenerate`: rewrite every assistant turn of a corpus with the target."""

    target: str = opt("Local HF directory of the target model (config, tokenizer, weights).")
    corpus: str = opt("Corpus to regenerate: JSONL or a JSON array (ShareGPT, OpenAI or LLaVA rows), parquet, arrow, or a save_to_disk directory.")
    out: str = opt(
        "Output folder (parts + manifest.json) to create or resume, or an object-store URL (s3://bucket/prefix)."
    )
    sampling: SamplingConfig = group(SamplingConfig)
    rows_per_part: int = opt("Corpus rows per output part (the unit of resume).", default=256)
    skip_bad_rows: bool = opt("Skip (and count) malformed corpus rows instead of stopping.", default=False)
    vision_input: VisionInputConfig = group(VisionInputConfig)
    compute: WorkerConfig = group(WorkerConfig)
    overwrite: bool = opt("Replace an existing output written with different settings.", default=False)

    from_flags = classmethod(from_flags)

    def __post_init__(self):
        for name in ("target", "corpus", "out"):
            value = getattr(self, name)
            if not isinstance(value, (str, os.PathLike)) or not str(value):
                raise ValueError(f"--{name} must be a non-empty path, got {value!r}")
            setattr(self, name, os.fspath(value))
        if self.rows_per_part < 1:
            raise ValueError(f"--rows-per-part must be >= 1, got {self.rows_per_part}")

    def content_settings(self) -> dict:
        """Every setting that can change the written rows: all but where the work is placed and the
        paths of the target and corpus (the manifest compares their hashes instead)."""
        skipped = (*PLACEMENT_SETTINGS, "overwrite", "out", "target", "corpus")
        return {name: value for name, value in to_flags(self).items() if name not in skipped}
