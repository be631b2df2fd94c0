"""Greedy speculative decoding of our drafter by vLLM, one engine in a subprocess (a vLLM crash or
its process state cannot reach the caller): speed/paper.py serves a DFlash export with it,
harness/gpu_dspark.py a DSpark export, harness/gpu_dflash2.py a DFlash2 export; `check_served` is
those two sections' comparison with alrira-eval on the same prompts.

    python -m benchmarks.common.vllm_serve SPEC_JSON   (run by `serve`; writes serve_out.json beside SPEC_JSON)
"""

from __future__ import annotations

import argparse
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


TAU_RTOL = 0.10  # vLLM's tau against alrira-eval's, pooled over every round
NEW_TOKENS = 32
NUM_PROMPTS = 3


def check_served(work: Path, *, title: str, method: str, target: Path, drafter: Path, prompts_file: Path, cpu_smoke: bool,
                 cpu_refusal: str) -> dict:  # fmt: skip
    """gpu_check.sh's serving sections, at T = 0 on one prompt at a time: (1) alrira-eval run (float32)
    is lossless and gives tau and per-slot acceptance; (2) vLLM's greedy outputs with the drafter
    equal the target alone (alrira-eval's AR tokens); (3) vLLM's tau (1 + accepted / drafts, its
    spec-decode counters pooled over every round) is within TAU_RTOL of alrira-eval's pooled tau.
    --cpu-smoke: (1), then the engine's refusal on a CPU build in one line (`cpu_refusal` says why
    it is expected). Returns the section's figures; a failed check is a SystemExit naming it."""
    import time

    import torch

    from pipeline.eval.evaluate import EvalConfig, load_prompts, load_target_and_stops, run_eval

    out = work / f"{title.lower()}-eval"
    summary = run_eval(EvalConfig(
        target=str(target), drafter=str(drafter), prompts=str(prompts_file), out=str(out), max_new_tokens=NEW_TOKENS,
        max_prompts=NUM_PROMPTS, dtype="float32", device="cpu" if cpu_smoke else "cuda", progress=False, reuse_ar_baseline=False,
        overwrite=True,
    ))  # fmt: skip
    num_drafts = summary["num_drafts"]
    result = {"target": str(target), "drafter": str(drafter), "alrira_tau": summary["tau_pooled"],
              "alrira_lossless_mismatches": summary["lossless_mismatches"], "num_drafts": num_drafts,
              "slot_acceptance": [s["acceptance"] for s in summary["slot_acceptance"]]}  # fmt: skip
    print(f"alrira-eval: tau {summary['tau_geomean']:.3f}, {summary['lossless_mismatches']} lossless mismatches, "
          f"per-slot acceptance {result['slot_acceptance']}", flush=True)  # fmt: skip
    if summary["lossless_mismatches"]:
        raise SystemExit(f"alrira-eval's {title} decoding was not lossless")

    # alrira-eval's own AR tokens and rounds, in the order the prompts file gives them.
    ar = json.loads((out / "ar_baseline.json").read_text())
    _, tokenizer, _ = load_target_and_stops(str(target), device=torch.device("cpu"), dtype=torch.float32)
    prompts = load_prompts(str(prompts_file), tokenizer, max_prompts=NUM_PROMPTS)
    began = time.perf_counter()
    proc = serve(work, method=method, target=str(target), drafter=str(drafter), num_drafts=num_drafts,
                 prompts=[p.input_ids for p in prompts], max_tokens=NEW_TOKENS, timeout_s=480)  # fmt: skip
    name = title.lower()
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        # pydantic's "Value error, ..." line says why the engine was refused; else the last error line.
        reason = next((line.strip() for line in lines if "Value error," in line), None)
        reason = (reason or next((line for line in reversed(lines) if "Error" in line), lines[-1])).split(" [type=")[0][:300]
        if cpu_smoke:
            print(f"vLLM {name}: refused on this CPU as expected ({cpu_refusal}): {reason}", flush=True)
            return result | {"vllm": "refused on CPU", "vllm_reason": reason}
        raise SystemExit(f"vLLM {name} serving failed: {reason}")
    served = json.loads((work / "serve_out.json").read_text())
    # ignore_eos: vLLM decodes max_tokens; alrira-eval stops at a stop token: compare the common prefix.
    expected = [ar["results"][str(p.prompt_id)]["tokens"] for p in prompts]
    equal = all(s[: len(e)] == e[: len(s)] for s, e in zip(served["tokens"], expected, strict=True))
    vllm_tau = 1 + served["accepted"] / served["drafts"] if served["drafts"] else None
    result |= {"vllm_tau": vllm_tau, "vllm_outputs_equal_target": equal, "vllm_s": time.perf_counter() - began}
    print(f"vLLM {name}: tau {vllm_tau}, outputs equal the target alone: {equal}", flush=True)
    if not equal:
        raise SystemExit(f"vLLM's {name} outputs differ from the target alone")
    if vllm_tau is None or abs(vllm_tau - summary["tau_pooled"]) > TAU_RTOL * summary["tau_pooled"]:
        raise SystemExit(f"vLLM's tau {vllm_tau} is not within {TAU_RTOL:.0%} of alrira-eval's {summary['tau_geomean']:.3f}")
    return result


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


def serving_section(*, name: str, title: str, method: str, pair, cpu_refusal: str, description: str) -> None:
    """The command line of a gpu_check.sh serving section (harness/gpu_dspark.py, gpu_dflash2.py):
    `--work DIR [--paper-out DIR] [--cpu-smoke]`; `pair(work, paper_out)` gives (target, drafter,
    prompts) under WORK/NAME, check_served checks them, and WORK/NAME.json holds the figures."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--work", required=True, help=f"directory for the pair, the evaluation and {name}.json")
    parser.add_argument("--paper-out", help=f"the paper section's output, whose {title} arm is served when present")
    parser.add_argument("--cpu-smoke", action="store_true", help="on CPU: alrira-eval's side, and vLLM's refusal in one line")
    args = parser.parse_args()
    work = Path(args.work)
    section = work / name  # its files apart from the sections' JSON (gpu_check.sh collects WORK/*.json)
    section.mkdir(parents=True, exist_ok=True)
    target, drafter, prompts_file = pair(section, Path(args.paper_out) if args.paper_out else None)
    result = check_served(section, title=title, method=method, target=target, drafter=drafter, prompts_file=prompts_file,
                          cpu_smoke=args.cpu_smoke, cpu_refusal=cpu_refusal)  # fmt: skip
    (work / f"{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
