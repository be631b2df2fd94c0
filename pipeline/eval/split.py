"""The evaluation split a cache build stores for training-time tau (storage/eval_split.py): for each
held-out prompt, the target's greedy response and the tapped features of prompt + response,
computed exactly as `alrira-eval replay` computes them (`replay.greedy_response`: the same float32
target, chat rendering, stop tokens and decode), so a drafter's tau on the split is replay's tau.
Text targets only: a vision-language prompt's image is refused in one line.

The build plans the split before any shard (`plan_eval_split`): a bad, empty or image row of
--eval-prompts, or a prompt that fills the target's context, is refused then, and each prompt's
generation budget is cut to the context. The split is meant to be held out, so the plan counts
what is not: prompts that repeat an earlier one (the same rendered tokens) and prompts the corpus
also holds (the same messages, system messages aside, as a corpus row up to one of its user
turns); the build says so, the record keeps the counts and `alrira-cache info` prints them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.chat import CorpusError, iter_corpus_rows, normalize_row, prompt_row
from pipeline.corpus_source import file_sha256
from pipeline.eval.evaluate import EvalPrompt, context_budgets, load_prompts, load_target_and_stops
from pipeline.eval.replay import greedy_response
from pipeline.target import tapped_features
from storage.eval_split import SplitFit, eval_split_problems, read_eval_split_record, write_eval_split
from storage.location import Location

SPLIT_DTYPE = torch.float32  # replay's: the split's tau is replay's tau


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    """--eval-prompts resolved before the build writes anything."""

    prompts_path: str
    prompts: list[EvalPrompt]  # rendered with the target's chat template
    budgets: dict[int, int]  # prompt id -> tokens it may generate (--eval-max-new-tokens, cut to the context)
    max_new_tokens: int
    max_prompts: int | None
    held_out: dict  # {"duplicate_prompts": n, "corpus_overlaps": n}

    @property
    def max_tokens(self) -> int:
        """The most tokens the split can hold: every prompt and its whole budget (`--estimate`)."""
        return sum(len(p.input_ids) + self.budgets[p.prompt_id] for p in self.prompts)


def plan_eval_split(prompts: str, *, target: str, tokenizer, max_new_tokens: int, max_prompts: int | None, corpus: str | Path,
                    log=print) -> SplitPlan:  # fmt: skip
    """Read and check --eval-prompts: every row a text prompt (one line naming the row if not), at
    least one, each leaving room in the target's context; count its repeats and corpus overlaps."""
    try:
        rows = load_prompts(prompts, tokenizer, max_prompts=max_prompts)  # a bad row, or none: one line naming the file
    except ValueError as error:
        raise ValueError(f"--eval-prompts {error}") from None
    budgets = context_budgets(target, tokenizer, rows, max_new_tokens=max_new_tokens, flag="--eval-max-new-tokens", path=prompts, log=log)
    held_out = held_out_counts(prompts, rows, corpus=corpus)
    if any(held_out.values()):
        log(
            f"--eval-prompts {prompts}: not all held out: {held_out['duplicate_prompts']} of {len(rows)} prompt(s) repeat an earlier "
            f"one, {held_out['corpus_overlaps']} are also in the corpus (as a corpus row's messages up to a user turn); their "
            "tau measures memory, not drafting"
        )
    return SplitPlan(prompts_path=prompts, prompts=rows, budgets=budgets, max_new_tokens=max_new_tokens, max_prompts=max_prompts,
                     held_out=held_out)  # fmt: skip


def _conversation_key(messages: list[dict]) -> str:
    turns = [(m["role"], m["content"]) for m in messages if m["role"] != "system"]
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode()).hexdigest()


def held_out_counts(prompts: str, rows: list[EvalPrompt], *, corpus: str | Path) -> dict:
    """{"duplicate_prompts": prompts whose rendered tokens equal an earlier prompt's,
    "corpus_overlaps": prompts whose messages (system messages aside) a corpus row holds up to one
    of its user turns}. The corpus is streamed once; only the prompts' keys are kept."""
    selected = {p.prompt_id for p in rows}
    keys = {}
    for row_index, row in iter_corpus_rows(prompts):
        if row_index in selected:  # load_prompts read these rows already: they are well formed
            keys[row_index] = _conversation_key(prompt_row(row, where=f"{prompts}:{row_index}").messages)
    wanted, found = set(keys.values()), set()
    for row_index, row in iter_corpus_rows(corpus):
        try:
            if isinstance(row, CorpusError):
                continue
            messages = normalize_row(row, where=str(row_index), require_assistant=False).messages
        except CorpusError:  # the build counts (or stops at) bad rows itself
            continue
        for end, message in enumerate(messages, start=1):
            if message["role"] == "user" and (key := _conversation_key(messages[:end])) in wanted:
                found.add(key)
    return {
        "duplicate_prompts": len(rows) - len({tuple(p.input_ids) for p in rows}),
        "corpus_overlaps": sum(key in found for key in keys.values()),
    }


def eval_split_key(*, target_hash: str, prompts: str, max_new_tokens: int, max_prompts: int | None, layer_ids: list[int]) -> dict:
    """What a split depends on: an existing split with the same key is kept by a rebuild."""
    return {
        "target_hash": target_hash, "prompts_sha256": file_sha256(prompts), "max_new_tokens": max_new_tokens,
        "max_prompts": max_prompts, "layer_ids": list(layer_ids), "dtype": str(SPLIT_DTYPE).removeprefix("torch."),
    }  # fmt: skip


def build_eval_split(cache: Location, plan: SplitPlan, *, target: str, fit: SplitFit, device: str = "cpu", log=print) -> dict:
    """Compute and write the split of `plan` into `cache` unless a whole one of the same key is there
    (one that fails its checks, `eval_split_problems`, is computed again); its record."""
    key = eval_split_key(target_hash=fit.target_hash, prompts=plan.prompts_path, max_new_tokens=plan.max_new_tokens,
                         max_prompts=plan.max_prompts, layer_ids=fit.layer_ids)  # fmt: skip
    problems = eval_split_problems(cache, fit)  # [] without a split
    existing = None if problems else read_eval_split_record(cache)
    if existing is not None and existing["key"] == key:
        log(f"eval split: kept ({existing['num_prompts']} prompts, same inputs)")
        return existing
    if problems:
        log(f"eval split: {problems[0]}; computing it again")
    model, _, stops = load_target_and_stops(target, device=torch.device(device), dtype=SPLIT_DTYPE)
    sequences, prompt_lengths, features = [], [], []
    for prompt in plan.prompts:
        ar, hidden_states = greedy_response(model, prompt, max_new_tokens=plan.budgets[prompt.prompt_id], stops=stops)
        sequences.append(list(prompt.input_ids) + ar.tokens)
        prompt_lengths.append(len(prompt.input_ids))
        features.append(tapped_features(hidden_states, list(fit.layer_ids))[0].float().cpu().numpy())  # [S, F]
    record = write_eval_split(
        cache, sequences=sequences, prompt_lengths=prompt_lengths, prompt_ids=[p.prompt_id for p in plan.prompts], features=features,
        key=key, held_out=plan.held_out,
    )  # fmt: skip
    log(f"eval split: {record['num_prompts']} prompts, {record['num_tokens']} tokens ({Path(plan.prompts_path).name})")
    return record
