"""Greedy replay: the exact rounds of greedy (T = 0) chain speculative decoding for many drafters at
the price of one target decode per prompt (docs/design.md, "Evaluation").

At T = 0 every committed token is the target's greedy token, so what a round accepts depends only
on the greedy response and the drafter: the round anchored at response token j drafts from the
target's features of the positions before it and accepts the leading drafts equal to the next
greedy tokens. Replay decodes each prompt once with the target (`autoregressive_decode`, the
baseline of `alrira-eval run`), runs one forward over prompt + response for the tapped hidden
states, drafts every anchor of the response in batched drafter forwards
(`analysis.block_drafts`), and walks the rounds as `speculative_decode` commits them: a round cut
by a stop token or max_new_tokens counts only what it committed.

Outputs per drafter, in `run_eval`'s format so `compare`, `offsets` and `cost` read them as they
are: results.csv (draft_ms empty: nothing speculative was timed), rounds.csv, summary.json (speedup
null, `"mode": "greedy_replay"`). What can differ from real decoding is float rounding: the
features come from one forward over the whole sequence instead of the verification forwards, and
the drafts from batched blocks instead of the cached draft step, so a near-tie argmax can flip.
benchmarks/speed/paper.py runs both on the same prompts and reports how far they agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from drafter.drafting import block_drafts, match_lengths, position_acceptance, replay_rounds
from pipeline.provenance import provenance_record
from pipeline.eval.evaluate import EVAL_FILES, EvalPrompt, context_budgets, load_prompts, load_target_and_stops, replay_inputs
from pipeline.eval.scores import ROUND_COLUMNS, _write_rows_and_histogram, round_rows, summarize, write_csv_rows
from pipeline.eval.speculative import DecodeResult, autoregressive_decode
from pipeline.outputs import LOCK_FILE, check_out_path, log_line, output_lock, owns, prepare_output, read_record


@torch.inference_mode()
def greedy_response(target, prompt: EvalPrompt, *, max_new_tokens: int, stops: list[int]) -> tuple[DecodeResult, tuple]:
    """The target's greedy decode of `prompt` (timed, as the AR baseline) and the hidden states of
    one forward over prompt + response."""
    ar = autoregressive_decode(
        target, prompt.input_ids, max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stops, generator=None
    )
    device = next(target.parameters()).device
    sequence = torch.as_tensor([list(prompt.input_ids) + ar.tokens], device=device)
    return ar, target(input_ids=sequence, output_hidden_states=True, logits_to_keep=1).hidden_states


def replay_prompt(drafter, *, embed_tokens, lm_head, prompt: EvalPrompt, ar: DecodeResult, hidden_states) -> list[int]:
    """Accepted drafts per round of `drafter` on one prompt's greedy response."""
    from pipeline.target import tapped_features

    response = ar.tokens
    if len(response) < 2:
        return []
    start = len(prompt.input_ids)
    features = tapped_features(hidden_states, list(drafter.config.target_layer_ids))[0]  # [S, F]
    anchors = list(range(start, start + len(response) - 1))  # the anchor of a round is a committed response token
    drafts = block_drafts(
        drafter, embed_tokens=embed_tokens, lm_head=lm_head, mask_token_id=drafter.config.mask_token_id,
        features=features, sequence=list(prompt.input_ids) + response, anchors=anchors, chunk=32,
    )  # fmt: skip
    return replay_rounds(match_lengths(drafts, response=response), num_tokens=len(response))


def replay_result_row(prompt: EvalPrompt, *, ar: DecodeResult, accepted: list[int]) -> dict:
    rounds, total = len(accepted), sum(accepted)
    return {
        "prompt_id": prompt.prompt_id, "benchmark": prompt.benchmark, "prompt_tokens": len(prompt.input_ids),
        "committed": len(ar.tokens), "ar_tokens": len(ar.tokens), "rounds": rounds, "accepted_tokens": total,
        "tau": (total + rounds) / rounds if rounds else None, "ar_ms": 1000.0 * ar.decode_s, "draft_ms": None,
        "ar_ms_per_token": 1000.0 * ar.decode_s / (len(ar.tokens) - 1) if len(ar.tokens) > 1 else None,
        "spec_ms_per_token": None,
    }  # fmt: skip


REPLAY_COMMAND = "alrira-eval replay"


def check_replay_root(out_root: Path, names: list[str]) -> None:
    """OUT holds only replay outputs (one folder per drafter) and folders of the drafters named now
    (each then checked as an output of its own): anything else is the user's, and refused."""
    if not out_root.is_dir():
        return
    foreign = []
    for entry in sorted(out_root.iterdir()):
        if entry.name == LOCK_FILE or (entry.is_dir() and entry.name in names):
            continue
        if not (entry.is_dir() and (read_record(entry) or {}).get("command") == REPLAY_COMMAND):
            foreign.append(entry.name)
    if foreign:
        raise ValueError(f"--out {out_root}: holds files {REPLAY_COMMAND} did not write ({', '.join(foreign[:3])}); "
                         "move them or use another --out")  # fmt: skip


def run_replay(*, target: str, drafters: dict[str, str], prompts: str, out: str, max_new_tokens: int,
               max_prompts: int | None = None, overwrite: bool = False, log=None, device: str = "cpu") -> dict[str, dict]:  # fmt: skip
    """Greedy replay of every drafter on every prompt; OUT/<name>/{results.csv, rounds.csv,
    summary.json, accept_hist.*} per drafter. A drafter whose complete output has the same
    recorded inputs is kept; one of other inputs is refused unless `overwrite` (pipeline/outputs.py).
    Returns each drafter's summary."""
    from drafter.checkpoint import drafter_hash

    out_root = check_out_path(out)
    common = replay_inputs(target=target, prompts=prompts, max_new_tokens=max_new_tokens, max_prompts=max_prompts, device=device)
    with output_lock(out_root, command=REPLAY_COMMAND):
        check_replay_root(out_root, list(drafters))
        outputs = {
            name: prepare_output(out_root / name, command=REPLAY_COMMAND, inputs=common | {"drafter_hash": drafter_hash(path)},
                                 own=owns(*EVAL_FILES), overwrite=overwrite, log=log or log_line)  # fmt: skip
            for name, path in drafters.items()
        }
        todo = {name: drafters[name] for name, output in outputs.items() if not output.kept}
        if todo:
            _replay(target=target, todo=todo, prompts=prompts, outputs=outputs, max_new_tokens=max_new_tokens,
                    max_prompts=max_prompts, log=log, device=device)  # fmt: skip
    return {name: json.loads((out_root / name / "summary.json").read_text()) for name in drafters}


def _replay(*, target: str, todo: dict[str, str], prompts: str, outputs: dict, max_new_tokens: int, max_prompts: int | None,
            log, device: str) -> None:  # fmt: skip
    """Replay the drafters of `todo` and write each one's claimed output."""
    from drafter.checkpoint import load_drafter
    from pipeline.eval.evaluate import check_drafter_fits

    device = torch.device(device)  # float32 on any device: replay scores the drafters, not a dtype
    models = {}
    target_model, tokenizer, stops = load_target_and_stops(target, device=device, dtype=torch.float32)
    for name, path in todo.items():
        models[name] = load_drafter(path, dtype=torch.float32, device=device).eval()
        try:
            check_drafter_fits(target_model, models[name])
        except ValueError as error:
            raise ValueError(f"--drafter {path}: {error}") from None
    embed_tokens, lm_head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
    rows = {name: [] for name in todo}
    rounds = {name: [] for name in todo}
    accepted_by_group = {name: {} for name in todo}
    rows_in = load_prompts(prompts, tokenizer, max_prompts=max_prompts)
    budgets = context_budgets(target, tokenizer, rows_in, max_new_tokens=max_new_tokens, flag="--max-new-tokens", path=prompts,
                              log=log or log_line)  # fmt: skip
    for prompt in rows_in:
        ar, hidden_states = greedy_response(target_model, prompt, max_new_tokens=budgets[prompt.prompt_id], stops=stops)
        for name, model in models.items():
            accepted = replay_prompt(model, embed_tokens=embed_tokens, lm_head=lm_head, prompt=prompt, ar=ar,
                                     hidden_states=hidden_states)  # fmt: skip
            rows[name].append(replay_result_row(prompt, ar=ar, accepted=accepted))
            rounds[name].extend(round_rows(prompt, accepted))
            accepted_by_group[name].setdefault(prompt.benchmark, []).extend(accepted)
        if log:
            log(f"replay: prompt {prompt.prompt_id} ({prompt.benchmark}), {len(ar.tokens)} tokens, {len(models)} drafters")
    for name, model in models.items():
        output = outputs[name]
        num_drafts = model.config.num_drafts
        plotted = _write_rows_and_histogram(output.path, rows[name], accepted_by_group[name], num_draft=num_drafts)
        write_csv_rows(output.path / "rounds.csv", rounds[name], columns=ROUND_COLUMNS)
        summary = {
            "mode": "greedy_replay", "target": str(Path(target).resolve()), "drafter": str(Path(todo[name]).resolve()),
            "prompts": str(Path(prompts).resolve()), "temperature": 0.0, "max_new_tokens": max_new_tokens, "dtype": "float32",
            "device": str(device), "block_size": model.config.block_size, "verify": "chain", "num_prompts": len(rows[name]),
            "num_groups": len(accepted_by_group[name]), "committed_tokens": sum(r["committed"] for r in rows[name]),
            "rounds": sum(r["rounds"] for r in rows[name]), **summarize(rows[name]), "lossless_mismatches": None,
            "lossless_exact": None, "lossless_note": "greedy replay: the committed tokens are the target's greedy tokens",
            "accept_hist_png": plotted, "inputs": output.inputs, "num_drafts": num_drafts,
            "capped_prompts": sum(b < max_new_tokens for b in budgets.values()),
            "acceptance_per_position": position_acceptance(
                [n for lengths in accepted_by_group[name].values() for n in lengths], num_drafts=num_drafts
            ),
            "provenance": provenance_record({
                "target": target, "drafter": todo[name], "prompts": prompts, "max_new_tokens": max_new_tokens,
                "max_prompts": max_prompts, "device_resolved": str(device), "dtype_resolved": "float32",
            }),
        }  # fmt: skip
        (output.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        output.finish()
