"""Ray orchestration of the stage-1 cache build (imported only by the CLI)."""
