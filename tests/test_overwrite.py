"""`--overwrite` replaces what the tool wrote, nothing else (pipeline/outputs.py, claim_run in
pipeline/train/run_dir.py; docs/failure-modes.md "Outputs"): a user's file inside a folder the
command writes (RUN/drafter/, RUN/checkpoints/, a folder where an evaluation writes a file) is named
in a one-line refusal and left in place. The run is laid out by the real writers (save_drafter,
save_checkpoint), so every name they write must count as the run's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafter.checkpoint import save_drafter
from drafter.config import DFlashConfig
from drafter.model import DFlashDrafter
from pipeline.outputs import RECORD_FILE, claim_output, owns
from pipeline.train.checkpoints import save_checkpoint
from pipeline.train.run_dir import claim_run
from storage.location import resolve


def _written_run(toy_target: Path, run: Path) -> None:
    """A finished run's files, as alrira-train writes them: two checkpoints, `latest`, the drafter."""
    target_config = json.loads((toy_target / "config.json").read_text())
    model = DFlashDrafter(DFlashConfig.from_target_config(target_config, num_draft_layers=1, mask_token_id=0))
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2):
        save_checkpoint(resolve(run), step=step, model=model, optimizer=optimizer, settings={"method": "alr"})
    save_drafter(model, run / "drafter", dtype=torch.float32)
    (run / "train_config.json").write_text(json.dumps({"method": "alr", "cache": "c"}))
    (run / "metrics.jsonl").write_text("")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host").write_text("")
    (run / RECORD_FILE).write_text(json.dumps({"command": "alrira-train", "inputs": {"cache": "c"}, "complete": True}))


@pytest.mark.parametrize(
    ("users", "named"),
    [
        (("drafter/notes.md",), "drafter/notes.md"),
        (("checkpoints/step-00000002/my-eval.json",), "checkpoints/step-00000002/my-eval.json"),
        (("checkpoints/mine/best.pt", "drafter/README.md"), "checkpoints/mine/, drafter/README.md"),
        (("tensorboard/their-run/events.out.tfevents.9.host",), "tensorboard/their-run/"),
    ],
)
def test_train_overwrite_names_a_users_file_inside_the_run_and_keeps_it(toy_target, tmp_path, users, named):
    """alrira-train --overwrite removed RUN/drafter/ and RUN/checkpoints/ whole, a user's notes with them."""
    run = tmp_path / "run"
    _written_run(toy_target, run)
    for name in users:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("mine")
    weights = (run / "drafter" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError) as refused:
        claim_run(resolve(run), inputs={"cache": "c"}, resume=False, overwrite=True, log=lambda line: None)
    assert str(refused.value) == f"--out {run}: replacing it would remove files alrira-train did not write ({named}); move them or use another --out"
    assert all((run / name).read_text() == "mine" for name in users)
    assert (run / "drafter" / "model.safetensors").read_bytes() == weights  # nothing of the run removed either


def test_train_overwrite_replaces_every_file_a_run_writes(toy_target, tmp_path):
    run = tmp_path / "run"
    _written_run(toy_target, run)
    removed = []
    claim_run(resolve(run), inputs={"cache": "c"}, resume=False, overwrite=True, log=removed.append)
    assert sorted(p.name for p in run.iterdir()) == [RECORD_FILE]
    assert "--overwrite: removing the earlier run" in removed[0]


def test_eval_overwrite_keeps_a_users_folder_of_an_output_name(tmp_path):
    """A name the command writes as a file, held by a user's folder: named, not removed whole."""
    out = tmp_path / "out"
    (out / "results.csv").mkdir(parents=True)
    (out / "results.csv" / "mine.txt").write_text("mine")
    with pytest.raises(ValueError) as refused, claim_output(out, command="alrira-eval run", inputs={}, own=owns("results.csv"), overwrite=True):
        pass
    assert str(refused.value) == (
        f"--out {out}: replacing it would remove files alrira-eval run did not write (results.csv/); move them or use another --out"
    )
    assert (out / "results.csv" / "mine.txt").read_text() == "mine"
    (out / "results.csv" / "mine.txt").unlink()
    (out / "results.csv").rmdir()
    (out / "results.csv").write_text("an older version's")
    with claim_output(out, command="alrira-eval run", inputs={}, own=owns("results.csv"), overwrite=True) as output:
        assert not (output.path / "results.csv").exists()  # the command's own name: replaced
