"""`alrira-eval`: acceptance length (tau) and decode speedup of a drafter by real speculative decoding.

For every prompt the autoregressive baseline and speculative decoding run on the same target, in
alternating order (even prompts AR first, odd prompts speculative first) so warm-up and thermal
drift do not favour either; the AR side is decoded once per target, prompts and settings and reused
by the next drafter's run (pipeline/eval/ar_baseline.py). Outputs in `out/`:
  results.csv       one row per prompt (RESULT_COLUMNS)
  summary.json      per group: tau pooled over its prompts, speedup; geometric means across groups
  accept_hist.json  counts of committed draft tokens per round (0..K), overall and per group
  accept_hist.png   the same as a bar chart (skipped when matplotlib is missing)
  rounds.csv        one row per verification round (ROUND_COLUMNS): its start offset (response tokens
                    committed before it) and accepted drafts, for `alrira-eval offsets`
  ar_baseline.json  the AR side's tokens and times with their key, for the next drafter's run
At T = 0 the speculative tokens must equal the AR tokens; mismatches are counted in the summary.
Prompt rows may carry one image for a vision-language target (docs/vision.md); it is read and
processed before each decode, outside the timed part.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from drafter.checkpoint import check_compatible, load_drafter
from pipeline.chat import CorpusError, iter_corpus_rows, prompt_row, row_locator
from pipeline.config import group, opt, to_flags
from pipeline.provenance import provenance_record
from pipeline.eval.ar_baseline import AR_BASELINE_FILE, ar_baseline_candidates, ar_baseline_key, find_ar_baseline, write_ar_baseline
from drafter.drafting import position_acceptance
from drafter.families import family_of
from pipeline.eval.speculative import DecodeResult, autoregressive_decode, cached_draft_logits_fn, speculative_decode
from pipeline.eval.scores import (
    ROUND_COLUMNS,
    _write_json,
    _write_rows_and_histogram,
    result_row,
    round_rows,
    slot_acceptance,
    summarize,
    write_csv_rows,
)
from pipeline.eval.tree import tree_speculative_decode
from pipeline.outputs import check_out_path, claim_output, log_line, owns
from pipeline.target import context_limit, load_target, load_tokenizer, prompt_budgets, stop_token_ids
from pipeline.vision import (
    SequenceImage,
    VisionInputConfig,
    VisionInputs,
    effective_system_prompt,
    expand_image_tokens,
    image_record,
    resolve_image_path,
    template_messages,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARMUP_TOKENS = 32  # new tokens of the untimed warm-up run of each decoder


@dataclass(kw_only=True)
class EvalConfig:
    """`alrira-eval`: speculative decoding of a prompt set with a target and a DFlash drafter."""

    target: str = opt("Local HF directory of the target model.")
    drafter: str = opt("DFlash drafter checkpoint directory (ours or a public release).")
    prompts: str = opt(
        "JSONL prompts: ShareGPT/OpenAI rows (the final assistant turn is dropped) or rows with a "
        "'prompt' string; an optional 'benchmark' or 'group' key names the group (default: the file stem)."
    )
    out: str = opt("Output directory (results.csv, summary.json, accept_hist.json/.png).")
    temperature: float = opt("Sampling temperature (0 = greedy, checked lossless against AR).", default=0.0)
    max_new_tokens: int = opt("Generated tokens per prompt (fewer when a stop token comes first).", default=256)
    max_prompts: int | None = opt("Evaluate only N prompts, taken evenly across the groups (each group's first rows).", default=None)
    seed: int = opt("Seed of the samplers at T > 0 (prompt i uses seed + i).", default=0)
    dtype: str = opt(
        "Compute dtype of target and drafter: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16.",
        default="auto",
    )
    device: str = opt("auto (cuda if available, else cpu), cpu, cuda or cuda:N.", default="auto")
    tree_budget: int | None = opt(
        "Verify a token tree of at most N draft nodes per round instead of the chain (greedy only; the paper's vision runs use 63).",
        default=None,
    )
    tree_branch: int = opt("Children per tree node: the drafter's top-B tokens of the next slot (--tree-budget).", default=8)
    confidence_threshold: float = opt(
        "Drafters that predict each slot's acceptance (a confidence head): cut each round's proposal before the "
        "first slot whose predicted acceptance is below this (a dynamic proposal length; 0 verifies every slot).",
        default=0.0,
    )
    vision_input: VisionInputConfig = group(VisionInputConfig)
    reuse_ar_baseline: bool = opt(
        "Decode the autoregressive baseline once per target, prompts and settings and reuse it for every drafter: each run "
        "keeps it in OUT/ar_baseline.json and reads one of the same key from --ar-baseline-from or its sibling "
        "folders (pipeline/eval/ar_baseline.py).",
        default=True,
    )
    ar_baseline_from: str | None = opt(
        "Another folder to read a kept AR baseline from (DIR/ar_baseline.json or DIR/*/ar_baseline.json), besides --out's siblings.",
        default=None,
    )
    progress: bool = opt("Show a progress bar.", default=True)
    overwrite: bool = opt(
        "Replace an earlier output in --out computed from other inputs (without it: refused; with the same inputs it is kept).",
        default=False,
    )

    def __post_init__(self):
        for name in ("target", "drafter", "prompts", "out"):
            value = getattr(self, name)
            if not isinstance(value, (str, os.PathLike)) or not str(value):
                raise ValueError(f"--{name} must be a non-empty path, got {value!r}")
            setattr(self, name, os.fspath(value))
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"--max-prompts must be >= 1, got {self.max_prompts}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tree_budget is not None and (self.tree_budget < 1 or self.temperature != 0):
            raise ValueError(f"--tree-budget must be >= 1 and needs --temperature 0, got {self.tree_budget} at T={self.temperature}")
        if self.tree_branch < 1:
            raise ValueError(f"--tree-branch must be >= 1, got {self.tree_branch}")
        if not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"--confidence-threshold must be in [0, 1], got {self.confidence_threshold}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from None


# ----------------------------------------------------------------------------------------------
# Prompts


@dataclass(kw_only=True)
class EvalPrompt:
    prompt_id: int  # 0-based row of the prompts file
    benchmark: str
    input_ids: list[int]
    image: SequenceImage | None = None  # a vision-language prompt's image, processed before each decode


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids ending in the generation prompt (thinking disabled where supported)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_prompts(
    path: str | os.PathLike, tokenizer, *, max_prompts: int | None = None, vision: VisionInputs | None = None,
    system_prompt: str | None = None,
) -> list[EvalPrompt]:  # fmt: skip
    """Render every row (or max_prompts taken evenly across the groups: select_evenly) of a prompts
    file with the target chat template; with `vision`, a row's image goes first in its user turn
    and its `<|image_pad|>` is expanded to the image's tokens, as in the corpus
    (pipeline/cache_build/corpus.py)."""
    default_group = Path(path).stem
    locate = row_locator(path)
    system_prompt = effective_system_prompt(system_prompt, vision=vision)
    rows = []
    for row_index, row in iter_corpus_rows(path):
        if isinstance(row, CorpusError):
            raise ValueError(str(row))
        group = (row.get("benchmark") or row.get("group") if isinstance(row, dict) else None) or default_group
        rows.append((row_index, row, str(group)))
    prompts = []
    for row_index, row, group in select_evenly(rows, max_prompts=max_prompts):
        where = locate(row_index)
        chat = prompt_row(row, where=where)
        if chat.image is not None and vision is None:
            raise CorpusError(f"{where}: row has an image ({chat.image}) but the target is text-only", "image_for_text_target")
        input_ids = render_prompt(tokenizer, template_messages(chat, system_prompt=system_prompt))
        image = None
        if vision is not None:
            record = image_record(chat, vision=vision, where=where) if chat.image is not None else None
            ids = np.asarray(input_ids, dtype=np.int64)
            input_ids = expand_image_tokens(ids, np.zeros_like(ids), image=record, vision=vision, where=where)[0].tolist()
            if record is not None:
                image = SequenceImage(
                    path=resolve_image_path(chat.image, image_root=vision.image_root), sha256=record["sha256"],
                    grid_thw=tuple(record["grid_thw"]), where=where, vision=vision,
                )  # fmt: skip
        prompts.append(EvalPrompt(prompt_id=row_index, benchmark=group, input_ids=input_ids, image=image))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def select_evenly(rows: list[tuple], *, max_prompts: int | None) -> list[tuple]:
    """At most `max_prompts` of `rows` ((row index, row, group), in file order), taken evenly across
    the groups: the first of every group, then the second of every group, ... (a group with fewer
    rows leaves its turns to the others); returned in file order."""
    if max_prompts is None or max_prompts >= len(rows):
        return rows
    by_group: dict[str, list[int]] = {}
    for position, (_, _, group) in enumerate(rows):
        by_group.setdefault(group, []).append(position)
    rounds = (positions[turn] for turn in range(max(map(len, by_group.values()))) for positions in by_group.values() if turn < len(positions))
    return [rows[position] for position in sorted(itertools.islice(rounds, max_prompts))]


def context_budgets(target_dir: str, tokenizer, prompts: list[EvalPrompt], *, max_new_tokens: int, path: str,
                    flag: str = "--max-new-tokens", log=log_line) -> dict[int, int]:  # fmt: skip
    """{prompt id: tokens it may generate}: `max_new_tokens`, cut where the prompt and its response
    would outgrow the target's context (pipeline.target.context_limit), with one line saying so; a
    prompt that fills the context is refused naming its row. Every decode of a prompts file (run,
    replay, hard, the cache's evaluation split) goes through it."""
    locate = row_locator(path)
    budgets, line = prompt_budgets(
        context_limit(target_dir, tokenizer), [len(p.input_ids) for p in prompts], max_new_tokens=max_new_tokens, flag=flag,
        where=[locate(p.prompt_id) for p in prompts],
    )  # fmt: skip
    if line is not None:
        log(line)
    return {p.prompt_id: budget for p, budget in zip(prompts, budgets, strict=True)}


# ----------------------------------------------------------------------------------------------
# The run


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


# Why a low-precision run may differ from greedy AR although the algorithm is lossless: the verify
# pass scores 16 positions in one forward, AR one at a time; in bf16 their rounding differs, and a
# near-tie in the argmax can go the other way (docs/design.md, "Evaluation").
LOW_PRECISION_NOTE = (
    "in {dtype} the verify forward (a block of positions at once) and AR (one at a time) round differently, "
    "so near-ties can flip; exact equality is checked in float32"
)


def load_target_and_stops(target_dir: str, *, device: torch.device, dtype: torch.dtype):
    """(target, tokenizer, stop ids) of a target directory."""
    target = load_target(target_dir, device=str(device), dtype=dtype)
    tokenizer = load_tokenizer(target_dir)
    return target, tokenizer, stop_token_ids(tokenizer, {"eos_token_id": target.generation_config.eos_token_id})


def load_models(config: EvalConfig, device: torch.device, dtype: torch.dtype):
    """(target, tokenizer, drafter, stop ids), checked to belong together."""
    target, tokenizer, stops = load_target_and_stops(config.target, device=device, dtype=dtype)
    drafter = load_drafter(config.drafter, dtype=dtype, device=device).eval()
    check_drafter_fits(target, drafter)
    return target, tokenizer, drafter, stops


def check_drafter_fits(target, drafter) -> None:
    """ValueError unless the drafter was built for this target (layers, taps, sizes, vocabulary)."""
    embed_tokens = target.get_input_embeddings()
    draft_config = drafter.config
    num_target_layers = target.config.get_text_config().num_hidden_layers
    if draft_config.num_target_layers != num_target_layers:
        raise ValueError(
            f"drafter was built for {draft_config.num_target_layers} target layers, the target has {num_target_layers}"
        )
    check_compatible(
        draft_config,
        target_layer_ids=draft_config.target_layer_ids,
        hidden_size=embed_tokens.embedding_dim,
        vocab_size=embed_tokens.num_embeddings,
        block_size=draft_config.block_size,
    )


def eval_prompts(config: EvalConfig, tokenizer) -> list[EvalPrompt]:
    """The prompts of `config`, with the target's image processor for a vision-language target
    (relative image paths resolve against --image-root, else the prompts file's folder)."""
    vision = config.vision_input.load(config.target, default_image_root=Path(config.prompts).parent)
    return load_prompts(
        config.prompts, tokenizer, max_prompts=config.max_prompts, vision=vision, system_prompt=config.vision_input.system_prompt
    )


EVAL_FILES = ("results.csv", "summary.json", "accept_hist.json", "accept_hist.png", "rounds.csv", AR_BASELINE_FILE)


def eval_inputs(config: EvalConfig, *, device: torch.device, dtype: torch.dtype) -> dict:
    """What the numbers of a run depend on (pipeline/outputs.py): the target, drafter and prompts by
    content, and every setting that changes a number; `mode` tells real decoding from replay."""
    from dataclasses import asdict

    from drafter.checkpoint import drafter_hash
    from pipeline.corpus_source import file_sha256
    from pipeline.target import target_hash

    return {
        "mode": "decode", "target_hash": target_hash(config.target), "drafter_hash": drafter_hash(config.drafter),
        "prompts_sha256": file_sha256(config.prompts), "max_prompts": config.max_prompts, "temperature": config.temperature,
        "max_new_tokens": config.max_new_tokens, "seed": config.seed, "dtype": str(dtype).removeprefix("torch."),
        "device": device.type, "verify": _verify_name(config), "vision_input": asdict(config.vision_input),
        **({"confidence_threshold": config.confidence_threshold} if config.confidence_threshold else {}),
    }  # fmt: skip


def replay_inputs(*, target: str, prompts: str, max_new_tokens: int, max_prompts: int | None, device: str = "cpu") -> dict:
    """What every drafter's replay numbers depend on besides the drafter (pipeline/outputs.py);
    the keys `alrira-eval run` records, so `compare` can tell replay from decoding."""
    from pipeline.corpus_source import file_sha256
    from pipeline.target import target_hash

    return {
        "mode": "greedy_replay", "target_hash": target_hash(target), "prompts_sha256": file_sha256(prompts),
        "max_prompts": max_prompts, "temperature": 0.0, "max_new_tokens": max_new_tokens, "dtype": "float32",
        "device": torch.device(device).type, "verify": "chain",
    }  # fmt: skip


def _verify_name(config: EvalConfig) -> str:
    return "chain" if config.tree_budget is None else f"tree (budget {config.tree_budget}, branch {config.tree_branch})"


def run_eval(config: EvalConfig, *, log=log_line) -> dict:
    """Evaluate the drafter on every prompt; write results.csv, summary.json, accept_hist.*; return
    the summary. --out is claimed first (pipeline/outputs.py): an earlier output of the same inputs
    is kept (its summary returned), one of other inputs refused unless --overwrite."""
    device = _resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    check_out_path(config.out)
    inputs = eval_inputs(config, device=device, dtype=dtype)
    with claim_output(config.out, command="alrira-eval run", inputs=inputs, own=owns(*EVAL_FILES), overwrite=config.overwrite,
                      log=log) as output:  # fmt: skip
        if output.kept:
            return json.loads((output.path / "summary.json").read_text())
        summary = _run_eval(config, device=device, dtype=dtype, log=log)
        summary["inputs"] = inputs
        summary["provenance"] = provenance_record({**to_flags(config), "dtype_resolved": str(dtype).removeprefix("torch."),
                                                   "device_resolved": str(device)})  # fmt: skip
        _write_json(output.path / "summary.json", summary)
        output.finish()
    return summary


def _run_eval(config: EvalConfig, *, device: torch.device, dtype: torch.dtype, log=log_line) -> dict:
    target, tokenizer, drafter, stops = load_models(config, device, dtype)
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    draft_config = drafter.config
    prompts = eval_prompts(config, tokenizer)
    budgets = context_budgets(config.target, tokenizer, prompts, max_new_tokens=config.max_new_tokens, path=config.prompts, log=log)
    num_draft = draft_config.num_drafts
    check_drafting_options(config, drafter)

    def run_ar(prompt: EvalPrompt, max_new_tokens: int, seed: int) -> DecodeResult:
        return autoregressive_decode(
            target,
            prompt.input_ids,
            max_new_tokens=max_new_tokens,
            temperature=config.temperature,
            stop_token_ids=stops,
            generator=torch.Generator(device=device).manual_seed(seed),
            image=None if prompt.image is None else prompt.image.pixel_inputs(),
        )

    def run_spec(prompt: EvalPrompt, max_new_tokens: int, seed: int) -> DecodeResult:
        image = None if prompt.image is None else prompt.image.pixel_inputs()
        if config.tree_budget is not None:
            return tree_speculative_decode(
                target, draft_logits_fn=cached_draft_logits_fn(
                    drafter, embed_tokens=embed_tokens, lm_head=lm_head, mask_token_id=draft_config.mask_token_id
                ), layer_ids=list(draft_config.target_layer_ids), num_draft=draft_config.block_size - 1,
                prompt_ids=prompt.input_ids, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                budget=config.tree_budget, branch=config.tree_branch, image=image,
            )  # fmt: skip
        return speculative_decode(
            target,
            drafter,
            embed_tokens=embed_tokens,
            lm_head=lm_head,
            prompt_ids=prompt.input_ids,
            max_new_tokens=max_new_tokens,
            temperature=config.temperature,
            stop_token_ids=stops,
            generator=torch.Generator(device=device).manual_seed(seed),
            mask_token_id=draft_config.mask_token_id,
            image=image,
            confidence_threshold=config.confidence_threshold,
        )

    ar_key, reused_from, known_ar = _kept_ar_baseline(config, prompts, budgets, dtype=dtype, device=device)
    # Untimed warm-up of both decoders: first-call costs (allocator, kernels) would skew prompt 0.
    warmup = min(budgets[prompts[0].prompt_id], WARMUP_TOKENS)
    if known_ar is None:
        run_ar(prompts[0], warmup, config.seed)
    run_spec(prompts[0], warmup, config.seed)

    rows, rounds, mismatches, ar_results, spec_results = [], [], 0, {}, []
    accepted_by_group: dict[str, list[int]] = {}
    bar = tqdm(prompts, desc="eval", unit="prompt", disable=not config.progress)
    for i, prompt in enumerate(bar):
        seed, max_new_tokens = config.seed + i, budgets[prompt.prompt_id]
        if known_ar is not None:
            ar, spec = known_ar[prompt.prompt_id], run_spec(prompt, max_new_tokens, seed)
        elif i % 2 == 0:
            ar = run_ar(prompt, max_new_tokens, seed)
            spec = run_spec(prompt, max_new_tokens, seed)
        else:
            spec = run_spec(prompt, max_new_tokens, seed)
            ar = run_ar(prompt, max_new_tokens, seed)
        ar_results[prompt.prompt_id] = ar
        spec_results.append(spec)
        if config.temperature == 0 and spec.tokens != ar.tokens:
            mismatches += 1
        rows.append(result_row(prompt, ar=ar, spec=spec))
        rounds.extend(round_rows(prompt, spec.accepted_lengths))
        accepted_by_group.setdefault(prompt.benchmark, []).extend(spec.accepted_lengths)
        running = summarize(rows)
        bar.set_postfix(tau=running["tau_geomean"], speedup=running["speedup_geomean"])

    out = Path(config.out)
    ar_file = write_ar_baseline(out, ar_key, ar_results)  # every run's own copy: its --out stands alone
    plotted = _write_rows_and_histogram(out, rows, accepted_by_group, num_draft=num_draft)
    write_csv_rows(out / "rounds.csv", rounds, columns=ROUND_COLUMNS)
    summary = _summary(config, rows, num_groups=len(accepted_by_group), mismatches=mismatches, dtype=dtype, device=device,
                       block_size=draft_config.block_size, plotted=plotted, budgets=budgets)  # fmt: skip
    summary["ar_baseline"] = {"file": str(ar_file), "reused": known_ar is not None, "reused_from": None if reused_from is None else str(reused_from)}
    summary |= drafting_summary(config, drafter, spec_results)
    _write_json(out / "summary.json", summary)
    return summary


def check_drafting_options(config: EvalConfig, drafter) -> None:
    """The evaluation options the drafter's family supports (drafter/family.py): a token tree only
    over slots drafted independently, a confidence threshold only with a per-slot acceptance prediction."""
    family = family_of(drafter)
    if config.tree_budget is not None and not family.tree_verification:
        raise ValueError(f"--tree-budget: {config.drafter} is a {family.title} drafter, whose slots are not drafted independently; verify a chain")
    if config.confidence_threshold > 0 and not family.has_confidence(drafter.config):
        raise ValueError(
            f"--confidence-threshold {config.confidence_threshold}: {config.drafter} is a {family.title} drafter without a "
            "confidence prediction, so no threshold can cut its proposals; leave it at 0"
        )


def drafting_summary(config: EvalConfig, drafter, spec_results: list[DecodeResult]) -> dict:
    """What summary.json says of the drafter's rounds: its family, drafts per block, acceptance per
    slot and per position, the mean proposal, and the confidence threshold where one applies."""
    family, num_drafts = family_of(drafter), drafter.config.num_drafts
    summary = {
        "arch": family.name,
        "num_drafts": num_drafts,
        "slot_acceptance": slot_acceptance(spec_results, num_drafts=num_drafts),
        "acceptance_per_position": position_acceptance([n for r in spec_results for n in r.accepted_lengths], num_drafts=num_drafts),
        "mean_proposed": sum(sum(r.proposed_lengths) for r in spec_results) / max(1, sum(len(r.proposed_lengths) for r in spec_results)),
    }
    if family.has_confidence(drafter.config):  # a threshold only a confidence prediction can apply
        summary["confidence_threshold"] = config.confidence_threshold
    return summary


def _kept_ar_baseline(config: EvalConfig, prompts: list[EvalPrompt], budgets: dict[int, int], *, dtype: torch.dtype,
                      device: torch.device) -> tuple[str, Path | None, dict | None]:  # fmt: skip
    """(the AR baseline's key, where a kept one was found, its results by prompt id) (None, None
    when none is reused: --no-reuse-ar-baseline, none found, or one holding more tokens than a
    prompt's budget under the target's context, which this run would not decode)."""
    ar_key = ar_baseline_key(config, prompts, dtype=dtype, device=device)
    found = find_ar_baseline(ar_baseline_candidates(config.out, config.ar_baseline_from), ar_key, prompts) if config.reuse_ar_baseline else None
    if found is None or any(len(found[1][p.prompt_id].tokens) > budgets[p.prompt_id] for p in prompts):
        return ar_key, None, None
    return ar_key, found[0], found[1]


def _summary(config: EvalConfig, rows: list[dict], *, num_groups: int, mismatches: int, dtype: torch.dtype,
             device: torch.device, block_size: int, plotted: bool, budgets: dict[int, int]) -> dict:  # fmt: skip
    """summary.json of a run: its settings, the pooled scores, the lossless check, how many prompts
    the target's context held to fewer than --max-new-tokens (`budgets`)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "target": str(Path(config.target).resolve()),
        "drafter": str(Path(config.drafter).resolve()),
        "prompts": str(Path(config.prompts).resolve()),
        "temperature": config.temperature,
        "max_new_tokens": config.max_new_tokens,
        "capped_prompts": sum(budget < config.max_new_tokens for budget in budgets.values()),
        "seed": config.seed,
        "dtype": dtype_name,
        "device": str(device),
        "block_size": block_size,
        "verify": _verify_name(config),
        "num_prompts": len(rows),
        "num_groups": num_groups,
        "committed_tokens": sum(r["committed"] for r in rows),
        "rounds": sum(r["rounds"] for r in rows),
        **summarize(rows),
        # Losslessness is checked token for token at T = 0 only (sampled runs differ by design).
        "lossless_mismatches": mismatches if config.temperature == 0 else None,
        # Only a float32 run must match AR exactly; a low-precision one reports its count and why.
        "lossless_exact": config.temperature == 0 and dtype_name == "float32",
        "lossless_note": None if dtype_name == "float32" else LOW_PRECISION_NOTE.format(dtype=dtype_name),
        "accept_hist_png": plotted,
    }
