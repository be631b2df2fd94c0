"""`alrira-eval` end to end on a toy target and a random drafter: files, pooled tau, geometric
means, losslessness, the score table; plus prompt parsing and config validation."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from drafter.checkpoint import save_drafter
from drafter.config import DFlashConfig
from drafter.model import DFlashDrafter
from pipeline.eval.evaluate import (
    RESULT_COLUMNS,
    EvalConfig,
    load_prompts,
    render_prompt,
    run_eval,
    score_table,
    summarize,
)
from pipeline.chat import prompt_messages
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    {"benchmark": "alpha", "prompt": "tell me a story about the river ."},
    {
        "benchmark": "alpha",
        "conversations": [
            {"from": "human", "value": "what is the name of the city ?"},
            {"from": "gpt", "value": "the city has no name ."},
        ],
    },
    {"group": "beta", "messages": [{"role": "system", "content": "be good ."}, {"role": "user", "content": "how do people learn ?"}]},
    {"group": "beta", "prompt": "write about the house , the door and the light ."},
]


@pytest.fixture(scope="module")
def tokenizer(toy_target):
    return AutoTokenizer.from_pretrained(toy_target)


@pytest.fixture(scope="module")
def drafter_dir(toy_target, tokenizer, tmp_path_factory):
    target_config = json.loads((toy_target / "config.json").read_text())
    config = DFlashConfig.from_target_config(target_config, num_draft_layers=1, mask_token_id=len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DFlashDrafter(config)
    out = tmp_path_factory.mktemp("drafter") / "random-drafter"
    save_drafter(model, out, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "mixed.jsonl", ROWS)


@pytest.fixture(scope="module")
def greedy_run(toy_target, drafter_dir, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "greedy"
    config = EvalConfig(
        target=str(toy_target),
        drafter=str(drafter_dir),
        prompts=str(prompts_file),
        out=str(out),
        max_new_tokens=24,
        device="cpu",
        progress=False,
    )
    return out, run_eval(config)


def test_results_csv(greedy_run, tokenizer):
    out, _ = greedy_run
    with open(out / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == RESULT_COLUMNS
    assert [r["benchmark"] for r in rows] == ["alpha", "alpha", "beta", "beta"]
    assert [int(r["prompt_id"]) for r in rows] == [0, 1, 2, 3]
    first_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": ROWS[0]["prompt"]}], add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert int(rows[0]["prompt_tokens"]) == len(tokenizer(first_prompt, add_special_tokens=False)["input_ids"])
    for r in rows:
        committed, rounds, accepted = int(r["committed"]), int(r["rounds"]), int(r["accepted_tokens"])
        assert 1 <= committed <= 24
        # The prefill yields the first token; every round commits its accepted drafts + 1.
        assert accepted + rounds == committed - 1
        if rounds:
            assert float(r["tau"]) == pytest.approx((accepted + rounds) / rounds, abs=1e-3)
            assert float(r["spec_ms_per_token"]) == pytest.approx(float(r["draft_ms"]) / (committed - 1), abs=1e-3)
        assert float(r["ar_ms"]) > 0 and float(r["draft_ms"]) > 0


def test_summary(greedy_run):
    out, summary = greedy_run
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["lossless_mismatches"] == 0
    assert summary["num_prompts"] == 4 and summary["num_groups"] == 2
    groups = summary["groups"]
    assert set(groups) == {"alpha", "beta"}
    for g in groups.values():
        assert g["prompts"] == 2
        assert g["tau"] >= 1
        assert g["tau"] == pytest.approx((g["accepted_tokens"] + g["rounds"]) / g["rounds"])
        assert g["speedup"] == pytest.approx(g["ar_ms_per_token"] / g["spec_ms_per_token"])
    assert summary["tau_geomean"] == pytest.approx(math.sqrt(groups["alpha"]["tau"] * groups["beta"]["tau"]))
    assert summary["speedup_geomean"] == pytest.approx(math.sqrt(groups["alpha"]["speedup"] * groups["beta"]["speedup"]))
    assert summary["rounds"] == sum(g["rounds"] for g in groups.values())
    # What produced the numbers: the command, versions, source revision and the resolved settings.
    provenance = summary["provenance"]
    assert provenance["config"]["dtype_resolved"] == "float32" and provenance["config"]["drafter"].endswith("random-drafter")
    assert provenance["versions"]["torch"] and provenance["config"]["max_new_tokens"] == summary["max_new_tokens"]


def test_accept_histogram(greedy_run):
    out, summary = greedy_run
    hist = json.loads((out / "accept_hist.json").read_text())
    assert len(hist["all"]) == summary["block_size"]  # accepted lengths 0..K
    assert sum(hist["all"]) == summary["rounds"]
    assert [sum(c) for c in zip(*hist["groups"].values())] == hist["all"]
    assert sum(hist["groups"]["alpha"]) == summary["groups"]["alpha"]["rounds"]
    assert summary["accept_hist_png"] is True
    assert (out / "accept_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_score_table(greedy_run):
    out, summary = greedy_run
    table = score_table(out / "results.csv")
    lines = table.splitlines()
    assert lines[0].split() == ["benchmark", "prompts", "tau", "speedup", "per-request"]
    by_name = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert set(by_name) == {"alpha", "beta", "geomean", "all"}
    # tau two ways over every prompt: pooled over the rounds, and the mean of the requests' own tau.
    assert float(by_name["all"][2]) == pytest.approx(summary["tau_pooled"], abs=1e-3)
    assert float(by_name["all"][4]) == pytest.approx(summary["tau_mean_per_request"], abs=1e-3)
    rows = list(csv.DictReader(open(out / "results.csv")))
    taus = [float(r["tau"]) for r in rows if r["tau"]]
    assert summary["tau_mean_per_request"] == pytest.approx(sum(taus) / len(taus))
    rounds = sum(int(r["rounds"]) for r in rows)
    assert summary["tau_pooled"] == pytest.approx((sum(int(r["accepted_tokens"]) for r in rows) + rounds) / rounds)
    # Per position i, the share of rounds accepting >= i drafts; their sum is tau_pooled - 1.
    assert lines[-1].startswith("acceptance per position: ")
    assert sum(summary["acceptance_per_position"]) == pytest.approx(summary["tau_pooled"] - 1, abs=1e-3)
    assert by_name["alpha"][1] == "2" and by_name["geomean"][1] == "4"
    assert float(by_name["beta"][2]) == pytest.approx(summary["groups"]["beta"]["tau"], abs=1e-3)
    assert float(by_name["geomean"][2]) == pytest.approx(summary["tau_geomean"], abs=1e-3)
    assert float(by_name["geomean"][3].rstrip("x")) == pytest.approx(summary["speedup_geomean"], abs=1e-3)
    with pytest.raises(ValueError, match="no column 'suite'"):
        score_table(out / "results.csv", group="suite")


def test_sampled_run_skips_the_lossless_check(toy_target, drafter_dir, prompts_file, tmp_path):
    config = EvalConfig(
        target=str(toy_target),
        drafter=str(drafter_dir),
        prompts=str(prompts_file),
        out=str(tmp_path / "sampled"),
        temperature=1.0,
        max_new_tokens=8,
        max_prompts=2,
        device="cpu",
        progress=False,
    )
    summary = run_eval(config)
    assert summary["lossless_mismatches"] is None
    assert summary["num_prompts"] == 2 and list(summary["groups"]) == ["alpha", "beta"]  # --max-prompts: evenly across groups
    with open(tmp_path / "sampled" / "results.csv", newline="") as f:
        assert all(int(r["committed"]) <= 8 for r in csv.DictReader(f))


# ----------------------------------------------------------------------------------------------


def test_prompt_messages():
    assert prompt_messages(ROWS[1], where="x") == [{"role": "user", "content": "what is the name of the city ?"}]
    assert prompt_messages(ROWS[2], where="x")[0] == {"role": "system", "content": "be good ."}
    # Earlier turns stay as the conversation history; only the trailing answer goes.
    history = {"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
    ]}
    assert [m["content"] for m in prompt_messages(history, where="x")] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="x: the conversation has no user turn"):
        prompt_messages({"messages": [{"role": "system", "content": "s"}]}, where="x")
    with pytest.raises(ValueError, match="x: message 0"):
        prompt_messages({"conversations": [{"from": "robot", "value": "hi"}]}, where="x")
    with pytest.raises(ValueError, match="x: row has no 'prompt'"):
        prompt_messages({"text": "hi"}, where="x")


def test_load_prompts_default_group_and_limit(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "mt-bench.jsonl", [{"prompt": "hello"}, {"prompt": "the end", "benchmark": "other"}, {"prompt": "x"}])
    prompts = load_prompts(path, tokenizer, max_prompts=2)
    assert [p.benchmark for p in prompts] == ["mt-bench", "other"]
    assert prompts[0].input_ids == render_prompt(tokenizer, [{"role": "user", "content": "hello"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": '])
    with pytest.raises(ValueError, match="bad.jsonl:1: bad JSON"):
        load_prompts(bad, tokenizer)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"temperature": -0.5}, "--temperature"),
        ({"max_new_tokens": 0}, "--max-new-tokens"),
        ({"max_prompts": 0}, "--max-prompts"),
        ({"dtype": "int8"}, "--dtype"),
        ({"device": "tpu-ish"}, "--device"),
        ({"target": ""}, "--target"),
    ],
)
def test_config_validation(changes, message):
    kwargs = {"target": "t", "drafter": "d", "prompts": "p.jsonl", "out": "o", **changes}
    with pytest.raises(ValueError, match=message):
        EvalConfig(**kwargs)


def test_speedup_is_total_decode_time_over_total_decode_time():
    """A prompt that stops after two tokens must not decide the group's speedup: AR 100 ms and
    speculative 25 ms over 100 decode tokens, plus one prompt of a single decode token where the
    drafter's first context projection dominates (1 ms AR vs 5 ms). The ratio of totals is
    101/30 = 3.37x; a mean of per-prompt ms/token would say (1 + 1) / (0.25 + 5) = 0.38x."""
    row = dict(benchmark="g", rounds=1, accepted_tokens=0)
    rows = [
        {**row, "committed": 101, "ar_tokens": 101, "ar_ms": 100.0, "draft_ms": 25.0},
        {**row, "committed": 2, "ar_tokens": 2, "ar_ms": 1.0, "draft_ms": 5.0},
        {**row, "committed": 1, "ar_tokens": 1, "ar_ms": 0.5, "draft_ms": 9.0},  # no decode tokens: left out
    ]
    group = summarize(rows)["groups"]["g"]
    assert group["speedup"] == pytest.approx(101 / 30)
    assert group["ar_ms_per_token"] == pytest.approx(101 / 101) and group["spec_ms_per_token"] == pytest.approx(30 / 101)


def test_dtype_auto_and_a_bf16_run_reports_mismatches_as_a_count(toy_target, drafter_dir, prompts_file, greedy_run, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import eval_cli

    assert greedy_run[1]["dtype"] == "float32" and greedy_run[1]["lossless_exact"] is True  # auto on CPU
    out = tmp_path / "bf16"
    args = [
        "run", "--target", str(toy_target), "--drafter", str(drafter_dir), "--prompts", str(prompts_file),
        "--out", str(out), "--max-new-tokens", "16", "--device", "cpu", "--dtype", "bfloat16", "--no-progress",
    ]  # fmt: skip
    result = CliRunner().invoke(eval_cli, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dtype"] == "bfloat16" and summary["lossless_exact"] is False
    assert isinstance(summary["lossless_mismatches"], int) and "round differently" in summary["lossless_note"]
    assert f"{summary['lossless_mismatches']} prompt(s) differ from greedy AR" in result.output


def _summary_file(path: Path, *, method: str, taus: dict[str, float], speedups: dict[str, float]) -> Path:
    """A summary.json as `alrira-eval run` writes it, for a drafter trained in RUN (train_config.json)."""
    run = path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "train_config.json").write_text(json.dumps({"method": method}))
    groups = {g: {"tau": taus[g], "speedup": speedups[g]} for g in taus}
    (path / "summary.json").write_text(json.dumps({"drafter": str(run / "drafter"), "groups": groups}))
    return path / "summary.json"


def test_compare_pools_replicates_and_measures_gain_over_the_baseline(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import eval_cli

    files = [
        _summary_file(tmp_path / "a0", method="dflash", taus={"coco": 2.0, "doc": 4.0}, speedups={"coco": 1.0, "doc": 2.0}),
        _summary_file(tmp_path / "a1", method="dflash", taus={"coco": 2.0, "doc": 4.0}, speedups={"coco": 1.0, "doc": 2.0}),
        _summary_file(tmp_path / "b0", method="alr_ira", taus={"coco": 3.0, "doc": 6.0}, speedups={"coco": 2.0, "doc": 3.0}),
        _summary_file(tmp_path / "b1", method="alr_ira", taus={"coco": 5.0, "doc": 6.0}, speedups={"coco": 2.0, "doc": 3.0}),
    ]
    out = tmp_path / "cmp"
    result = CliRunner().invoke(eval_cli, ["compare", *map(str, files), "--out", str(out), "--baseline", "dflash"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:2] == ["method", "n"] and [line.split()[0] for line in lines[1:]] == ["dflash", "alr_ira"]
    with open(out / "compare.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert rows["alr_ira"]["n"] == "2"
    assert float(rows["alr_ira"]["tau coco mean"]) == pytest.approx(4.0)
    assert float(rows["alr_ira"]["tau coco sd"]) == pytest.approx(math.sqrt(2.0), rel=1e-4)  # (3, 5)
    assert float(rows["alr_ira"]["tau gain coco"]) == pytest.approx(100.0)  # 4 vs 2
    assert float(rows["alr_ira"]["tau gain doc"]) == pytest.approx(50.0)
    geo_ira = (math.sqrt(3 * 6) + math.sqrt(5 * 6)) / 2
    assert float(rows["alr_ira"]["tau geomean mean"]) == pytest.approx(geo_ira, rel=1e-4)
    assert float(rows["alr_ira"]["tau gain geomean"]) == pytest.approx(100 * (geo_ira / math.sqrt(8) - 1), rel=1e-4)
    assert float(rows["dflash"]["speedup geomean mean"]) == pytest.approx(math.sqrt(2.0), rel=1e-4)
    assert (out / "compare_gain.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(eval_cli, ["compare", str(files[0]), "--out", str(out), "--baseline", "eagle"])
    assert bad.exit_code == 1 and "--baseline 'eagle'" in bad.output


def test_tree_verification_through_alrira_eval(toy_target, drafter_dir, prompts_file, tmp_path):
    config = EvalConfig(
        target=str(toy_target), drafter=str(drafter_dir), prompts=str(prompts_file), out=str(tmp_path / "tree"),
        max_new_tokens=24, device="cpu", progress=False, tree_budget=16, tree_branch=4,
    )  # fmt: skip
    summary = run_eval(config)
    assert summary["verify"] == "tree (budget 16, branch 4)" and summary["lossless_mismatches"] == 0
    assert all(g["tau"] >= 1 for g in summary["groups"].values())
    with pytest.raises(ValueError, match="--tree-budget"):
        EvalConfig(target="t", drafter="d", prompts="p.jsonl", out="o", temperature=1.0, tree_budget=16)
