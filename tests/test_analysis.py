"""The paper's analyses (pipeline/eval/analysis.py): the offset profile from `alrira-eval run`'s
rounds.csv, the training-cost view, and "where drafting is hard" on a toy target with real drafters."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from drafter.checkpoint import save_drafter
from drafter.config import DFlashConfig
from drafter.model import DFlashDrafter
from pipeline.cli import eval_cli
from drafter.drafting import block_drafts
from pipeline.eval.analysis import acceptance_lengths, greedy_sequence
from pipeline.eval.evaluate import EvalConfig, load_prompts, load_target_and_stops, round_start_offsets, run_eval
from pipeline.eval.speculative import drafter_draft
from pipeline.target import tapped_features
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    {"benchmark": "alpha", "prompt": "tell me a story about the river ."},
    {"benchmark": "beta", "prompt": "write about the house , the door and the light ."},
]


def _drafter(toy_target: Path, out: Path, *, seed: int) -> Path:
    from transformers import AutoTokenizer

    target_config = json.loads((toy_target / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(toy_target)
    config = DFlashConfig.from_target_config(target_config, num_draft_layers=1, mask_token_id=len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DFlashDrafter(config)
    save_drafter(model, out, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def drafters(toy_target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    return {name: _drafter(toy_target, root / name, seed=seed) for name, seed in (("a", 0), ("b", 1), ("c", 2))}


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "held_out.jsonl", PROMPTS)


def test_round_start_offsets():
    assert round_start_offsets([3, 0, 15, 2]) == [1, 5, 6, 22]
    assert round_start_offsets([]) == []


def test_rounds_csv_accounts_for_every_committed_token(toy_target, drafters, prompts_file, tmp_path):
    out = tmp_path / "eval"
    run_eval(EvalConfig(target=str(toy_target), drafter=str(drafters["a"]), prompts=str(prompts_file), out=str(out),
                        max_new_tokens=40, device="cpu", progress=False))  # fmt: skip
    with open(out / "results.csv") as f:
        results = {int(r["prompt_id"]): r for r in csv.DictReader(f)}
    with open(out / "rounds.csv") as f:
        rounds = list(csv.DictReader(f))
    for prompt_id, result in results.items():
        mine = [r for r in rounds if int(r["prompt_id"]) == prompt_id]
        assert len(mine) == int(result["rounds"]) and [int(r["round"]) for r in mine] == list(range(len(mine)))
        assert all(r["benchmark"] == result["benchmark"] for r in mine)
        # Each round starts where the previous one ended; the last ends at the committed count.
        ends = [int(r["start_offset"]) + int(r["accepted"]) + 1 for r in mine]
        assert [int(r["start_offset"]) for r in mine] == [1] + ends[:-1]
        assert ends[-1] == int(result["committed"])


def _eval_dir(path: Path, *, method: str, rounds: list[tuple[int, int]], cache: Path | None = None, train_s: float = 0.0) -> Path:
    """An evaluation as `alrira-eval run` leaves it (summary.json, rounds.csv) of a drafter trained in path/run."""
    run = path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "train_config.json").write_text(json.dumps({"method": method, "cache": str(cache)}))
    (run / "summary.json").write_text(json.dumps({"elapsed_s": train_s}))
    tau = sum(a + 1 for _, a in rounds) / len(rounds)
    (path / "summary.json").write_text(json.dumps({"drafter": str(run / "drafter"), "groups": {"all": {"tau": tau, "speedup": 1.0}}}))
    with open(path / "rounds.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt_id", "benchmark", "round", "start_offset", "accepted"])
        writer.writerows([0, "all", i, start, accepted] for i, (start, accepted) in enumerate(rounds))
    return path / "summary.json"


def test_offset_profile_buckets_and_gains(tmp_path):
    # alr: MAT 2 in 0-15 (accepted 1), 3 in 16-63, 1 at 128+; ira: 3, 3, 2 in the same buckets.
    alr = _eval_dir(tmp_path / "alr", method="alr", rounds=[(1, 1), (15, 1), (16, 2), (63, 2), (200, 0)])
    ira = [
        _eval_dir(tmp_path / "ira0", method="alr_ira", rounds=[(1, 2), (16, 2), (130, 1)]),
        _eval_dir(tmp_path / "ira1", method="alr_ira", rounds=[(1, 2), (16, 2), (130, 1)]),
    ]
    out = tmp_path / "offsets"
    result = CliRunner().invoke(eval_cli, ["offsets", str(alr), *map(str, ira), "--baseline", "alr", "--out", str(out)])
    assert result.exit_code == 0, result.output
    with open(out / "offset_profile.csv") as f:
        rows = {(r["method"], r["bucket"]): r for r in csv.DictReader(f)}
    assert float(rows[("alr", "0-15")]["mat"]) == pytest.approx(2.0) and rows[("alr", "0-15")]["rounds"] == "2"
    assert float(rows[("alr", "128+")]["mat"]) == pytest.approx(1.0)
    assert rows[("alr", "64-127")]["mat"] == ""  # no round started there
    assert float(rows[("alr_ira", "0-15")]["gain_pct"]) == pytest.approx(50.0)
    assert float(rows[("alr_ira", "16-63")]["gain_pct"]) == pytest.approx(0.0)
    assert float(rows[("alr_ira", "128+")]["gain_pct"]) == pytest.approx(100.0)
    assert rows[("alr_ira", "all")]["replicates"] == "2" and float(rows[("alr_ira", "all")]["mat_sd"]) == 0.0
    assert float(rows[("alr", "all")]["mat"]) == pytest.approx(11 / 5)
    assert (out / "offset_profile.png").read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(eval_cli, ["offsets", str(alr), "--baseline", "kd", "--out", str(out)])
    assert bad.exit_code == 1 and "--baseline 'kd'" in bad.output


def _cache_with_part_times(path: Path, parts: list[tuple[float, float]]) -> Path:
    path.mkdir(parents=True)
    shards = [{"name": f"shard-{i:05d}.zarr", "build_seconds": {"corpus": c, "rollouts": r}} for i, (c, r) in enumerate(parts)]
    (path / "manifest.json").write_text(json.dumps({"shards": shards}))
    return path


def test_training_cost_counts_the_stage1_time_of_the_arrays_a_method_reads(tmp_path):
    cache = _cache_with_part_times(tmp_path / "cache", [(10.0, 30.0), (10.0, 30.0)])  # corpus 20 s, rollouts 60 s
    erase = _eval_dir(tmp_path / "erase", method="erase", rounds=[(1, 2)], cache=cache, train_s=100.0)
    ira = _eval_dir(tmp_path / "ira", method="alr_ira", rounds=[(1, 3)], cache=cache, train_s=50.0)
    out = tmp_path / "cost"
    result = CliRunner().invoke(eval_cli, ["cost", str(erase), str(ira), "--reference", "erase", "--out", str(out)])
    assert result.exit_code == 0, result.output
    with open(out / "training_cost.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert float(rows["alr_ira"]["train_over_c"]) == pytest.approx(0.5)
    assert float(rows["erase"]["train_plus_stage1_s"]) == pytest.approx(120.0)  # erase reads no rollout arrays
    assert float(rows["alr_ira"]["train_plus_stage1_s"]) == pytest.approx(130.0)
    assert float(rows["alr_ira"]["with_stage1_over_c"]) == pytest.approx(130.0 / 120.0, rel=1e-3)
    assert float(rows["alr_ira"]["mat"]) == pytest.approx(4.0)
    assert (out / "training_cost.png").read_bytes()[:4] == b"\x89PNG"


@torch.inference_mode()
def test_block_acceptance_equals_one_decoding_round_per_offset(toy_target, drafters, prompts_file):
    from drafter.checkpoint import load_drafter

    target, tokenizer, stops = load_target_and_stops(str(toy_target), device=torch.device("cpu"), dtype=torch.float32)
    drafter = load_drafter(drafters["a"], dtype=torch.float32, device=torch.device("cpu")).eval()
    prompt = load_prompts(prompts_file, tokenizer)[0]
    sequence, hidden_states = greedy_sequence(target, prompt.input_ids, max_new_tokens=40, stops=stops)
    features = tapped_features(hidden_states, list(drafter.config.target_layer_ids))[0]
    num_draft = drafter.config.block_size - 1
    anchors = list(range(len(prompt.input_ids), len(sequence) - num_draft))
    assert len(anchors) >= 10
    heads = {"embed_tokens": target.get_input_embeddings(), "lm_head": target.get_output_embeddings(),
             "mask_token_id": drafter.config.mask_token_id}  # fmt: skip
    batched = block_drafts(drafter, **heads, features=features, sequence=sequence, anchors=anchors, chunk=4)
    for anchor, drafts in zip(anchors, batched, strict=True):
        one = drafter_draft(drafter, **heads, context_features=features[:anchor], anchor_token=sequence[anchor], anchor_pos=anchor)
        assert torch.equal(drafts, one)
    # The first 3 slots right and the 4th wrong: acceptance length 4.
    fake = list(sequence)
    fake[anchors[0] + 1 : anchors[0] + 4] = batched[0, :3].tolist()
    fake[anchors[0] + 4] = int(batched[0, 3]) + 1
    assert acceptance_lengths(batched[:1], sequence=fake, anchors=anchors[:1]) == [4]


def test_hard_offsets_through_the_cli(toy_target, drafters, prompts_file, tmp_path):
    out = tmp_path / "hard"
    args = ["hard", "--target", str(toy_target), "--prompts", str(prompts_file), "--drafter", str(drafters["a"]),
            "--baseline", str(drafters["b"]), "--independent", str(drafters["c"]), "--control", str(drafters["b"]),
            "--out", str(out), "--max-new-tokens", "40"]  # fmt: skip
    result = CliRunner().invoke(eval_cli, args)
    assert result.exit_code == 0, result.output
    with open(out / "hard_offsets_raw.csv") as f:
        raw = list(csv.DictReader(f))
    with open(out / "hard_offsets.csv") as f:
        rows = {r["independent_accept"]: r for r in csv.DictReader(f)}
    assert int(rows["all"]["offsets"]) == len(raw) > 0
    assert sum(int(rows[g]["offsets"]) for g in ("1", "2", "3", "4", "5", "6+")) == len(raw)
    # The control here is the baseline itself: its gain is exactly 0 in every group with offsets.
    assert all(float(r["control_gain_pct"]) == 0.0 for r in rows.values() if int(r["offsets"]) and r["control_gain_pct"])
    mean_a = sum(int(r["drafter"]) for r in raw) / len(raw)
    assert float(rows["all"]["drafter_mean"]) == pytest.approx(mean_a, abs=1e-4)
    assert (out / "hard_offsets.png").read_bytes()[:4] == b"\x89PNG"


def test_the_build_records_its_target_time_per_part(toy_target, toy_corpus, tmp_path):
    """What `alrira-eval cost` reads: each shard's target seconds for the corpus pass and the rollouts."""
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here
    from pipeline.eval.analysis import stage1_seconds
    from pipeline.train.methods import RECIPES

    corpus = write_jsonl(tmp_path / "chat.jsonl", [json.loads(line) for line in toy_corpus.read_text().splitlines()[:4]])
    config = CacheBuildConfig.from_flags(target=str(toy_target), corpus=str(corpus), out=str(tmp_path / "cache"), anchors=8,
                                         shard_size=2, max_length=256)  # fmt: skip
    manifest = build_cache(config, run_shards=run_shards_here, progress=False, log=lambda m: None)
    parts = [s.build_seconds for s in manifest.shards]
    assert len(parts) == 2 and all(p["corpus"] > 0 and p["rollouts"] > 0 for p in parts)
    on_disk = json.loads((tmp_path / "cache" / "manifest.json").read_text())["shards"]
    assert [s["build_seconds"] for s in on_disk] == parts
    corpus_s, rollout_s = sum(p["corpus"] for p in parts), sum(p["rollouts"] for p in parts)
    assert stage1_seconds(tmp_path / "cache", arrays=RECIPES["kd"].arrays) == pytest.approx(corpus_s)
    assert stage1_seconds(tmp_path / "cache", arrays=RECIPES["alr_ira"].arrays) == pytest.approx(corpus_s + rollout_s)
