"""alrira's stages: `cache_build/` (stage 1, `alrira-cache build`: the cache), `regenerate/`
(`alrira-cache regenerate`: a corpus rewritten by the target), `train/` (stage 2, the drafter),
`eval/` (speculative decoding), `demo/`; `target.py`, `chat.py`, `corpus_source.py` and
`precision.py` are shared by the stages."""

__version__ = "0.1.0"
