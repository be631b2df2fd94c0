"""Speed, memory, size and tau benchmarks: each prints its tables (and most write results.json);
the figures worth keeping go to docs/benchmarks.md, docs/results.md or docs/vllm.md."""
