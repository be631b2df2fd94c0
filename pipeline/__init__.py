"""alrira's stages: `build/` (stage 1, the cache), `train/` (stage 2, the drafter), `eval/`
(speculative decoding), `demo/`; `target.py` and `chat.py` are shared by build and eval."""

__version__ = "0.1.0"
