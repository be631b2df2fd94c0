"""Stage-1 and stage-2 logic: corpus ingestion, target runner, objectives, trainer, evaluation, CLI."""

__version__ = "0.1.0"
