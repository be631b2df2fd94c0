"""Evaluation defaults: the AR baseline decoded once per (target, prompts, settings) and
reused across drafters, --threads, --max-prompts taken evenly across the groups, one line when
matplotlib is missing, no legend warning from `compare`."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from pipeline.eval import plots
from pipeline.eval.compare import plot_gains
from pipeline.eval.evaluate import load_prompts, select_evenly
from tests.conftest import write_jsonl
from tests.test_analysis import _drafter  # a random drafter saved for the toy target

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    {"benchmark": "alpha", "prompt": "tell me a story about the river ."},
    {"benchmark": "alpha", "prompt": "what is the name of the city ?"},
    {"benchmark": "alpha", "prompt": "how do people learn ?"},
    {"benchmark": "beta", "prompt": "write about the house , the door and the light ."},
    {"benchmark": "gamma", "prompt": "the end"},
]


def test_max_prompts_takes_the_groups_in_turn(toy_target, tmp_path):
    rows = [(i, row, row["benchmark"]) for i, row in enumerate(ROWS)]
    assert [i for i, _, _ in select_evenly(rows, max_prompts=3)] == [0, 3, 4]  # one of each group
    assert [i for i, _, _ in select_evenly(rows, max_prompts=4)] == [0, 1, 3, 4]  # then alpha's second
    assert select_evenly(rows, max_prompts=None) == rows == select_evenly(rows, max_prompts=9)
    tokenizer = AutoTokenizer.from_pretrained(toy_target)
    prompts = load_prompts(write_jsonl(tmp_path / "p.jsonl", ROWS), tokenizer, max_prompts=3)
    assert [(p.prompt_id, p.benchmark) for p in prompts] == [(0, "alpha"), (3, "beta"), (4, "gamma")]


def test_the_ar_baseline_is_decoded_once_and_reused_by_the_next_drafter(toy_target, tmp_path):
    """Drafter B's run reads drafter A's AR decodes (same target, prompts, settings): its AR times
    are A's and its lossless check still passes; its tau is what a run decoding AR itself gives."""
    from pipeline.cli import eval_cli

    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:3])
    drafters = {name: _drafter(toy_target, tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}

    def run(name: str, out: str, *extra: str) -> dict:
        args = ["run", "--target", str(toy_target), "--drafter", str(drafters[name]), "--prompts", str(prompts),
                "--out", str(tmp_path / "evals" / out), "--max-new-tokens", "12", "--device", "cpu", "--threads", "1",
                "--no-progress", *extra]  # fmt: skip
        result = CliRunner().invoke(eval_cli, args)
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / "evals" / out / "summary.json").read_text())

    first, second = run("a", "a"), run("b", "b")
    assert first["ar_baseline"]["reused"] is False and second["ar_baseline"]["reused"] is True
    assert second["ar_baseline"]["reused_from"] == first["ar_baseline"]["file"] == str(tmp_path / "evals" / "a" / "ar_baseline.json")
    # Nothing outside each run's --out: b keeps its own copy, the evals folder holds only the runs.
    assert second["ar_baseline"]["file"] == str(tmp_path / "evals" / "b" / "ar_baseline.json")
    assert sorted(p.name for p in (tmp_path / "evals").iterdir()) == ["a", "b"]
    assert second["lossless_mismatches"] == 0
    ar_ms = lambda out: [line.split(",")[8] for line in (tmp_path / "evals" / out / "results.csv").read_text().splitlines()[1:]]  # noqa: E731
    assert ar_ms("a") == ar_ms("b")
    alone = run("b", "b-alone", "--no-reuse-ar-baseline")
    assert alone["ar_baseline"]["reused"] is False and alone["tau_geomean"] == second["tau_geomean"]
    other = run("b", "b-longer", "--max-new-tokens", "13")  # another setting: another baseline
    assert other["ar_baseline"]["reused"] is False
    elsewhere = tmp_path / "elsewhere" / "b"  # not a sibling: found through --ar-baseline-from
    result = CliRunner().invoke(eval_cli, ["run", "--target", str(toy_target), "--drafter", str(drafters["b"]), "--prompts",
                                           str(prompts), "--out", str(elsewhere), "--max-new-tokens", "12", "--device", "cpu",
                                           "--threads", "1", "--no-progress", "--ar-baseline-from", str(tmp_path / "evals")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((elsewhere / "summary.json").read_text())["ar_baseline"]["reused_from"] == first["ar_baseline"]["file"]


def test_a_missing_matplotlib_is_one_line_and_compare_warns_of_no_legend(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # its import raises ImportError
    monkeypatch.setattr(plots, "_said_skipped", False)
    assert plots.plot_figure(tmp_path / "a.png", lambda axes: None, size=(1, 1)) is False
    assert plots.plot_figure(tmp_path / "b.png", lambda axes: None, size=(1, 1)) is False
    assert capsys.readouterr().err == plots.PLOTS_SKIPPED + "\n"
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found" would fail here
        assert plot_gains([{"method": "dflash", "tau gain mt": None}], tmp_path / "gain.png", baseline="dflash")


def _eval(toy_target, drafter, prompts, out, *extra):
    from pipeline.cli import eval_cli

    args = ["run", "--target", str(toy_target), "--drafter", str(drafter), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "12", "--device", "cpu", "--threads", "1", "--no-progress", *extra]  # fmt: skip
    return CliRunner().invoke(eval_cli, args)


@pytest.mark.timeout(300)  # a FIFO opened for reading would block forever
def test_only_a_proven_ar_baseline_is_reused(toy_target, tmp_path):
    """A sibling's ar_baseline.json whose bytes are not those its run's record vouches for (edited:
    its AR times scaled 80x, which printed a speedup 80x off) is not reused, and neither is a FIFO
    planted at the name: the run decodes its own baseline, says why, and its speedup is its own."""
    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:2])
    drafters = {name: _drafter(toy_target, tmp_path / name, seed=seed) for name, seed in (("a", 0), ("b", 1))}
    evals = tmp_path / "evals"
    assert _eval(toy_target, drafters["a"], prompts, evals / "a").exit_code == 0
    baseline = evals / "a" / "ar_baseline.json"
    data = json.loads(baseline.read_text())
    data["results"] = {k: {**v, **{f: x * 80 for f, x in v.items() if isinstance(x, float)}} for k, v in data["results"].items()}
    baseline.write_text(json.dumps(data) + "\n")  # the same key: only its checksum tells
    (evals / "fifo").mkdir()
    os.mkfifo(evals / "fifo" / "ar_baseline.json")
    result = _eval(toy_target, drafters["b"], prompts, evals / "b")
    assert result.exit_code == 0, result.output
    summary = json.loads((evals / "b" / "summary.json").read_text())
    assert summary["ar_baseline"]["reused"] is False
    assert f"{baseline}: not reused as the AR baseline: its folder's record does not vouch for these bytes" in result.output
    assert f"{evals / 'fifo' / 'ar_baseline.json'}: not reused as the AR baseline (not a regular file)" in result.output
    # b's own baseline is proven: the next drafter reuses it.
    again = _eval(toy_target, drafters["a"], prompts, evals / "a2")
    assert again.exit_code == 0 and json.loads((evals / "a2" / "summary.json").read_text())["ar_baseline"]["reused_from"] == str(
        evals / "b" / "ar_baseline.json"
    )


def test_a_kept_output_is_checked_against_its_records_checksums(toy_target, tmp_path):
    """"kept (same inputs)" used to trust the record alone: an edited summary.json was printed as the
    current result. Now an edited file is named and refused (recomputed under --overwrite), and an
    older record without checksums is recomputed."""
    from pipeline.outputs import RECORD_FILE

    prompts = write_jsonl(tmp_path / "p.jsonl", ROWS[:2])
    drafter = _drafter(toy_target, tmp_path / "a", seed=0)
    out = tmp_path / "run"
    assert _eval(toy_target, drafter, prompts, out).exit_code == 0
    record = json.loads((out / RECORD_FILE).read_text())
    assert set(record["files"]) == {"results.csv", "summary.json", "accept_hist.json", "rounds.csv", "ar_baseline.json"} | (
        {"accept_hist.png"} if (out / "accept_hist.png").exists() else set()
    )
    assert "kept (same inputs)" in _eval(toy_target, drafter, prompts, out).output
    original = (out / "summary.json").read_text()
    edited = json.loads(original)
    edited["tau_geomean"] = 99.0
    (out / "summary.json").write_text(json.dumps(edited))
    refused = _eval(toy_target, drafter, prompts, out)
    assert refused.exit_code == 1 and refused.output.strip() == (
        f"Error: --out {out}: not kept: {out / 'summary.json'} differs from the checksum its record holds (changed after it "
        "was written); pass --overwrite to recompute it, or use another --out"
    )
    assert json.loads((out / "summary.json").read_text())["tau_geomean"] == 99.0  # refused: left as it is
    assert _eval(toy_target, drafter, prompts, out, "--overwrite").exit_code == 0
    assert json.loads((out / "summary.json").read_text())["tau_geomean"] == json.loads(original)["tau_geomean"]
    record = json.loads((out / RECORD_FILE).read_text())
    (out / RECORD_FILE).write_text(json.dumps({k: v for k, v in record.items() if k != "files"}))  # an older version's record
    older = _eval(toy_target, drafter, prompts, out)
    assert older.exit_code == 0 and "its record holds no checksums of its files (an older alrira's): recomputing" in older.output
    assert "files" in json.loads((out / RECORD_FILE).read_text())
