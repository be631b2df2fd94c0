"""The no-download demo: a toy world (trained tiny target, off-policy corpus, prompts), and the
whole pipeline over it on a laptop CPU (`python -m pipeline.demo`)."""
