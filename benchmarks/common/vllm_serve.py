"""Greedy speculative decoding of our drafter by vLLM, one engine in a subprocess (a vLLM crash or
its process state cannot reach the caller): speed/paper.py serves a DFlash export with it,
harness/gpu_dspark.py a DSpark export.

    python -m benchmarks.common.vllm_serve SPEC_JSON   (run by `serve`; writes serve_out.json beside SPEC_JSON)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import ROOT

# One engine process, a small KV cache on a CPU build (the GPU build ignores the latter).
SERVE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def serve(workdir: Path, *, method: str, target: str, drafter: str, num_drafts: int, prompts: list[list[int]], max_tokens: int,
          timeout_s: float) -> subprocess.CompletedProcess:  # fmt: skip
    """vLLM's `method` ("dflash", "dspark") speculative decoding with `drafter`, `num_drafts` tokens
    a round, each prompt alone at T = 0 for `max_tokens` tokens (ignoring stop tokens). The
    finished process: on success workdir/serve_out.json holds {"tokens": [per prompt], "drafts",
    "accepted"} (vLLM's spec-decode counters, pooled over every round)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "serve_spec.json"
    spec.write_text(json.dumps({"method": method, "target": target, "drafter": drafter, "num_drafts": num_drafts,
                                "prompts": prompts, "max_tokens": max_tokens}))  # fmt: skip
    env = {**os.environ, **SERVE_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", __spec__.name, str(spec)], env=env, capture_output=True, text=True, timeout=timeout_s)


def _spec_counts(llm) -> tuple[int, int]:
    drafts = accepted = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(metric.value)
    return drafts, accepted


def main(spec_path: Path) -> None:
    """The subprocess: one engine, every prompt greedily, tokens and spec-decode counts to serve_out.json."""
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = json.loads(spec_path.read_text())
    speculative = {"method": spec["method"], "model": spec["drafter"], "num_speculative_tokens": spec["num_drafts"]}
    llm = LLM(spec["target"], speculative_config=speculative, dtype="float32", enforce_eager=True, max_model_len=2048,
              max_num_seqs=1, disable_log_stats=False, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    tokens = [list(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0].outputs[0].token_ids)
              for p in spec["prompts"]]  # fmt: skip
    drafts, accepted = _spec_counts(llm)
    (spec_path.parent / "serve_out.json").write_text(json.dumps({"tokens": tokens, "drafts": drafts, "accepted": accepted}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
