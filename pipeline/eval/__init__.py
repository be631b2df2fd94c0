"""Evaluation by real speculative decoding: the decoders and `alrira-eval`."""
