"""Outputs trusted only as far as their inputs (pipeline/outputs.py, docs/failure-modes.md "Outputs"):
a rerun keeps an output of the same inputs and refuses one of other inputs in one line naming the
difference; a user's files are never replaced; a second process on one --out refuses; summaries
pool only as true replicates; damaged weights and misplaced --out are one line each. Real toy
target, real drafters, real decoding."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import eval_cli
from pipeline.outputs import LOCK_FILE, RECORD_FILE, output_lock
from tests.conftest import write_jsonl
from tests.test_analysis import _drafter

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [{"benchmark": "alpha", "prompt": "tell me a story about the river ."}, {"benchmark": "beta", "prompt": "how do people learn ?"}]


@pytest.fixture(scope="module")
def files(toy_target, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    return {
        "prompts": write_jsonl(root / "prompts.jsonl", PROMPTS),
        "other_prompts": write_jsonl(root / "other.jsonl", PROMPTS[:1]),
        "a": _drafter(toy_target, root / "runs" / "a" / "drafter", seed=0),
        "b": _drafter(toy_target, root / "runs" / "b" / "drafter", seed=1),
    }


def _run(toy_target, files, out, *extra, drafter="a", prompts="prompts", new_tokens="8"):
    args = ["run", "--target", str(toy_target), "--drafter", str(files[drafter]), "--prompts", str(files[prompts]), "--out", str(out),
            "--max-new-tokens", new_tokens, "--device", "cpu", "--no-progress", *extra]  # fmt: skip
    return CliRunner().invoke(eval_cli, args)


def _one_line_error(result) -> str:
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    return result.output


def test_eval_run_keeps_the_same_inputs_and_names_what_differs(toy_target, files, tmp_path):
    out = tmp_path / "run"
    first = _run(toy_target, files, out)
    assert first.exit_code == 0, first.output
    csv_before = (out / "results.csv").read_bytes()
    again = _run(toy_target, files, out)
    assert again.exit_code == 0 and "kept (same inputs)" in again.output
    assert (out / "results.csv").read_bytes() == csv_before  # not recomputed: the timings would differ
    for extra, kwargs, named in [((), {"new_tokens": "6"}, "max_new_tokens: 8 -> 6"), ((), {"prompts": "other_prompts"}, "prompts_sha256"),
                                 ((), {"drafter": "b"}, "drafter_hash"), (("--temperature", "0.5"), {}, "temperature: 0.0 -> 0.5")]:  # fmt: skip
        message = _one_line_error(_run(toy_target, files, out, *extra, **kwargs))
        assert named in message and "--overwrite" in message
    assert (out / "results.csv").read_bytes() == csv_before
    scored = CliRunner().invoke(eval_cli, ["score", str(out / "results.csv")])
    assert scored.exit_code == 0 and "max_new_tokens 8" in scored.output and "drafter_hash sha256:" in scored.output
    replaced = _run(toy_target, files, out, "--overwrite", new_tokens="6")
    assert replaced.exit_code == 0, replaced.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["max_new_tokens"] == 6 and summary["inputs"]["max_new_tokens"] == 6
    assert json.loads((out / RECORD_FILE).read_text())["complete"] is True


def test_a_users_files_are_never_replaced(toy_target, files, tmp_path):
    users = tmp_path / "users"
    users.mkdir()
    (users / "results.csv").write_text("my numbers\n")
    message = _one_line_error(_run(toy_target, files, users))
    assert "no record of the inputs" in message and (users / "results.csv").read_text() == "my numbers\n"
    (users / "notes.txt").write_text("mine")
    for extra in ((), ("--overwrite",)):  # a name the command never writes: refused even under --overwrite
        assert "did not write (notes.txt)" in _one_line_error(_run(toy_target, files, users, *extra))
    assert sorted(os.listdir(users)) == ["notes.txt", "results.csv"]
    # --out naming a file inside another output: one line, not a bare [Errno 17].
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text("{}")
    message = _one_line_error(_run(toy_target, files, tmp_path / "done" / "summary.json" / "x"))
    assert "summary.json is a file, not a directory" in message
    from tests.test_analysis import _cache_with_part_times, _eval_dir

    evaluation = _eval_dir(tmp_path / "eval", method="erase", rounds=[(1, 2)], train_s=1.0, cache=_cache_with_part_times(tmp_path / "cache", [(1.0, 2.0)]))
    for command, name in ((["compare"], "compare.csv"), (["offsets"], "offset_profile.csv"), (["cost", "--reference", "erase"], "training_cost.csv")):
        (tmp_path / command[0]).mkdir()
        (tmp_path / command[0] / name).write_text("mine")
        result = CliRunner().invoke(eval_cli, [*command, str(evaluation), "--out", str(tmp_path / command[0])])
        assert "no record of the inputs" in _one_line_error(result)
        assert (tmp_path / command[0] / name).read_text() == "mine"
        fresh = CliRunner().invoke(eval_cli, [*command, str(evaluation), "--out", str(tmp_path / f"{command[0]}-new")])
        assert fresh.exit_code == 0, fresh.output


HOLDER = """
import sys, time
from pipeline.outputs import output_lock
with output_lock(sys.argv[1], command="holder"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_process_on_one_out_refuses_and_a_dead_holders_lock_is_taken_over(toy_target, files, tmp_path):
    from pipeline.demo.run import run_demo

    out = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        message = _one_line_error(_run(toy_target, files, out))
        assert f"in use by holder (pid {holder.pid} on {socket.gethostname()}" in message
        with pytest.raises(ValueError, match=rf"in use by holder \(pid {holder.pid}"):
            run_demo(out=out, seed=0, quick=True, temperatures=[0.0])
        replay = ["replay", "--target", str(toy_target), "--prompts", str(files["prompts"]), "--drafter", str(files["a"]), "--out", str(out)]
        assert "in use by holder" in _one_line_error(CliRunner().invoke(eval_cli, replay))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK_FILE).is_file()  # killed: its lock stays, naming a pid that is gone
    with output_lock(out, command="next") as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not (out / LOCK_FILE).exists()


def test_replay_keeps_a_drafter_of_the_same_inputs_only(toy_target, files, tmp_path):
    out = tmp_path / "replay"
    args = ["replay", "--target", str(toy_target), "--drafter", str(files["a"]), "--out", str(out), "--max-prompts", "1"]
    first = CliRunner().invoke(eval_cli, [*args, "--prompts", str(files["prompts"]), "--max-new-tokens", "8"])
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(eval_cli, [*args, "--prompts", str(files["prompts"]), "--max-new-tokens", "8"])
    assert again.exit_code == 0 and "kept (same inputs)" in again.output
    message = _one_line_error(CliRunner().invoke(eval_cli, [*args, "--prompts", str(files["other_prompts"]), "--max-new-tokens", "6"]))
    assert "max_new_tokens: 8 -> 6" in message and "prompts_sha256" in message
    (out / "README").write_text("mine")
    assert "did not write (README)" in _one_line_error(CliRunner().invoke(eval_cli, [*args, "--prompts", str(files["prompts"])]))
    (out / "README").unlink()
    replaced = CliRunner().invoke(eval_cli, [*args, "--prompts", str(files["prompts"]), "--max-new-tokens", "6", "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((out / "a" / "summary.json").read_text())["max_new_tokens"] == 6


def test_only_true_replicates_pool(toy_target, files, tmp_path):
    """A decode run and a replay (and another max-new-tokens) are not replicates of one method; the
    same drafter twice is not two replicates; --allow-mixed-replicates pools them and says so."""
    decoded = tmp_path / "decoded"
    assert _run(toy_target, files, decoded, drafter="b").exit_code == 0
    shorter = tmp_path / "shorter"
    assert _run(toy_target, files, shorter, drafter="a", new_tokens="6").exit_code == 0
    replayed = tmp_path / "replayed"
    args = ["replay", "--target", str(toy_target), "--drafter", str(files["a"]), "--prompts", str(files["prompts"]), "--out",
            str(replayed), "--max-new-tokens", "8"]  # fmt: skip
    assert CliRunner().invoke(eval_cli, args).exit_code == 0
    pair = [str(decoded), str(replayed / "a"), "--label", "alr", "--label", "alr"]
    for command in ("compare", "offsets"):
        message = _one_line_error(CliRunner().invoke(eval_cli, [command, *pair, "--out", str(tmp_path / command)]))
        assert "cannot be pooled" in message and "mode: 'decode' -> 'greedy_replay'" in message
    message = _one_line_error(CliRunner().invoke(eval_cli, ["compare", str(decoded), str(shorter), "--label", "x", "--label", "x",
                                                            "--out", str(tmp_path / "c2")]))  # fmt: skip
    assert "max_new_tokens: 8 -> 6" in message
    twice = CliRunner().invoke(eval_cli, ["compare", str(decoded), str(decoded), "--out", str(tmp_path / "c3")])
    assert "evaluated the same drafter" in _one_line_error(twice)
    mixed = CliRunner().invoke(eval_cli, ["compare", *pair, "--out", str(tmp_path / "mixed"), "--allow-mixed-replicates"])
    assert mixed.exit_code == 0, mixed.output
    with open(tmp_path / "mixed" / "compare.csv") as f:
        row = next(csv.DictReader(f))
    assert row["n"] == "2" and "mode" in row["mixed_replicates"]
    assert json.loads((tmp_path / "mixed" / RECORD_FILE).read_text())["inputs"]["allow_mixed_replicates"] is True


def test_damaged_weights_are_named_in_one_line(toy_target, files, tmp_path):
    import shutil

    from drafter.checkpoint import load_drafter
    from pipeline.target import load_target

    drafter = shutil.copytree(files["a"], tmp_path / "drafter")
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"^{weights}: damaged weights file"):
        load_drafter(drafter)
    target = shutil.copytree(toy_target, tmp_path / "target")
    for path in target.glob("*.safetensors"):
        path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"^{target}/.*\.safetensors: damaged weights file"):
        load_target(target)
    files = {**files, "a": drafter}
    assert "model.safetensors: damaged weights file" in _one_line_error(_run(toy_target, files, tmp_path / "o1"))
    assert _run(toy_target, {**files, "a": files["b"]}, tmp_path / "o1").exit_code == 0  # the refused run left no output to guard


def test_cost_resolves_an_older_runs_relative_cache_from_another_directory(tmp_path, monkeypatch):
    from tests.test_analysis import _cache_with_part_times, _eval_dir

    _cache_with_part_times(tmp_path / "caches" / "c", [(10.0, 30.0)])
    erase = _eval_dir(tmp_path / "erase", method="erase", rounds=[(1, 2)], train_s=100.0)
    config = erase.parent / "run" / "train_config.json"
    config.write_text(json.dumps({"method": "erase", "cache": "caches/c"}))  # as an older run recorded it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = CliRunner().invoke(eval_cli, ["cost", str(erase), "--reference", "erase", "--out", str(tmp_path / "cost")])
    assert result.exit_code == 0, result.output
    config.write_text(json.dumps({"method": "erase", "cache": "gone/c"}))
    message = _one_line_error(CliRunner().invoke(eval_cli, ["cost", str(erase), "--reference", "erase", "--out", str(tmp_path / "cost2")]))
    assert f"{config}: its --cache gone/c is relative" in message


def test_hard_keeps_its_output_and_takes_only_a_true_seed_control(toy_target, files, tmp_path):
    runs = {}
    for name, seed, lr in (("base", 0, 0.003), ("control", 1, 0.003), ("other", 1, 0.01)):
        runs[name] = _drafter(toy_target, tmp_path / name / "drafter", seed=seed)
        (tmp_path / name / "train_config.json").write_text(json.dumps({"method": "alr", "seed": seed, "lr": lr, "out": str(tmp_path / name)}))
    out = tmp_path / "hard"

    def hard(control, *extra, new_tokens="24"):
        args = ["hard", "--target", str(toy_target), "--prompts", str(files["prompts"]), "--drafter", str(files["a"]), "--baseline",
                str(runs["base"]), "--independent", str(files["b"]), "--control", str(runs[control]), "--out", str(out),
                "--max-new-tokens", new_tokens, "--max-prompts", "1", *extra]  # fmt: skip
        return CliRunner().invoke(eval_cli, args)

    message = _one_line_error(hard("other"))
    assert "--control" in message and "lr: 0.003 -> 0.01" in message and not out.exists()
    first = hard("control")
    assert first.exit_code == 0, first.output
    again = hard("control")
    assert again.exit_code == 0 and "kept (same inputs)" in again.output
    all_row = [[line for line in result.output.splitlines() if line.startswith("all ")] for result in (first, again)]
    assert all_row[0] and all_row[0] == all_row[1]  # the table read back
    assert "max_new_tokens: 24 -> 20" in _one_line_error(hard("control", new_tokens="20"))
    mixed = hard("other", "--allow-mixed-replicates", "--overwrite")
    assert mixed.exit_code == 0, mixed.output
    assert "lr: 0.003 -> 0.01" in json.loads((out / RECORD_FILE).read_text())["inputs"]["control_mixed"][0]
