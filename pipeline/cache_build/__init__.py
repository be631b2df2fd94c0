"""Stage 1 without Ray: corpus ingestion, batched target rollouts (HF and vLLM), the shard
builder and the build driver. `ray_jobs/` runs the shard builder on a pool of actors."""
