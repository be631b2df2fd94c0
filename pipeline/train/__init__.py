"""Stage 2: train a block drafter of any family from a cache (config, labels and objectives, batching, the loop,
checkpoints). Imports `drafter` and `storage`, never the build or the target (docs/design.md)."""

from pipeline.train.config import TrainConfig
from pipeline.train.loop import train
from pipeline.train.run_dir import format_summary

__all__ = ["TrainConfig", "format_summary", "train"]
