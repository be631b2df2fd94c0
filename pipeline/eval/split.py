"""The evaluation split a cache build stores for training-time tau (storage/eval_split.py): for each
held-out prompt, the target's greedy response and the tapped features of prompt + response,
computed exactly as `alrira-eval replay` computes them (`replay.greedy_response`: the same float32
target, chat rendering, stop tokens and decode), so a drafter's tau on the split is replay's tau.
Text targets only: a vision-language prompt's image is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.corpus_source import file_sha256
from pipeline.eval.evaluate import load_prompts, load_target_and_stops
from pipeline.eval.replay import greedy_response
from pipeline.target import tapped_features, target_hash
from storage.eval_split import read_eval_split_record, write_eval_split
from storage.location import Location

SPLIT_DTYPE = torch.float32  # replay's: the split's tau is replay's tau


def eval_split_key(*, target: str, prompts: str, max_new_tokens: int, max_prompts: int | None, layer_ids: list[int]) -> dict:
    """What a split depends on: an existing split with the same key is kept by a rebuild."""
    return {
        "target_hash": target_hash(target), "prompts_sha256": file_sha256(prompts), "max_new_tokens": max_new_tokens,
        "max_prompts": max_prompts, "layer_ids": list(layer_ids), "dtype": str(SPLIT_DTYPE).removeprefix("torch."),
    }  # fmt: skip


def build_eval_split(cache: Location, *, target: str, prompts: str, max_new_tokens: int, max_prompts: int | None,
                     layer_ids: list[int], device: str = "cpu", log=print) -> dict:  # fmt: skip
    """Compute and write the split into `cache` unless one of the same key is there; its record."""
    key = eval_split_key(target=target, prompts=prompts, max_new_tokens=max_new_tokens, max_prompts=max_prompts, layer_ids=layer_ids)
    existing = read_eval_split_record(cache)
    if existing is not None and existing["key"] == key:
        log(f"eval split: kept ({existing['num_prompts']} prompts, same inputs)")
        return existing
    model, tokenizer, stops = load_target_and_stops(target, device=torch.device(device), dtype=SPLIT_DTYPE)
    rows = load_prompts(prompts, tokenizer, max_prompts=max_prompts)
    sequences, prompt_lengths, features = [], [], []
    for prompt in rows:
        if prompt.image is not None:
            raise ValueError(f"{prompts}: row {prompt.prompt_id} has an image; --eval-prompts takes text prompts")
        ar, hidden_states = greedy_response(model, prompt, max_new_tokens=max_new_tokens, stops=stops)
        sequences.append(list(prompt.input_ids) + ar.tokens)
        prompt_lengths.append(len(prompt.input_ids))
        features.append(tapped_features(hidden_states, list(layer_ids))[0].float().cpu().numpy())  # [S, F]
    record = write_eval_split(
        cache, sequences=sequences, prompt_lengths=prompt_lengths, prompt_ids=[p.prompt_id for p in rows], features=features, key=key
    )
    log(f"eval split: {record['num_prompts']} prompts, {record['num_tokens']} tokens ({Path(prompts).name})")
    return record
