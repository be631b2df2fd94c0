"""What a run leaves in --out besides its checkpoints (pipeline/train/checkpoints.py), rank 0's:
--out claimed (`claim_run`, with pipeline/outputs.py's pieces), train_config.json and
provenance.json first (`RunLogs.start`), metrics.jsonl and tensorboard events as it steps
(`RunLogs`), then the exported drafter (`save_drafter_to`) and summary.json with the history's
figures (`RunLogs.finish`, `summarize_history`; `format_summary` prints them). A local run writes in
place; a run on an object store stages files locally and uploads each whole.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import torch

from drafter.checkpoint import CONFIG_FILE, WEIGHTS_FILE, exported_file_names, save_drafter
from pipeline.outputs import (
    LOCK_FILE,
    differences,
    read_location_record,
    refuse_foreign,
    refuse_foreign_inside,
    remove_names,
    write_location_record,
)
from pipeline.provenance import append_provenance
from storage.atomic import atomic_write_text
from storage.errors import DISK_FULL_ERRNOS
from storage.location import Location, resolve

PROVENANCE_FILE = "provenance.json"


# --out: whose run it is (pipeline/outputs.py)

TRAIN_COMMAND = "alrira-train"
RUN_NAMES = re.compile(
    r"^\.?(train_config\.json|provenance\.json|summary\.json|metrics\.jsonl|checkpoints|drafter|tensorboard)(\..*\.tmp|\.tmp.*)?$"
    r"|^events\.out\.tfevents\..+$"
)  # what a run writes at its top level (and the temp names of storage.atomic's writes of them)


_DRAFTER_FILES = "|".join(re.escape(name) for name in (CONFIG_FILE, WEIGHTS_FILE, *sorted(exported_file_names())))
RUN_PATHS = re.compile(
    rf"^drafter/\.?({_DRAFTER_FILES})(\..*\.tmp)?$"
    r"|^checkpoints/\.?latest(\..*\.tmp)?$"
    r"|^checkpoints/\.?step-\d{8}(\.tmp-[0-9a-f]{8}|\.old-[0-9a-f]{8})?/(state\.pt)?$"
    r"|^tensorboard/events\.out\.tfevents\.[^/]+$"
)  # what a run writes below its top level (drafter/checkpoint.py, save_checkpoint, tensorboard), temp names included


def claim_run(run: Location, *, inputs: dict, resume: bool, overwrite: bool, log=print) -> None:
    """Check --out before a run writes to it (rank 0), with pipeline/outputs.py's checks and record:
    names a run does not write are refused; an earlier run is refused unless --resume (then it must
    come from the same cache) or --overwrite (then the run's own names are removed, nothing else).
    The run records `inputs` (.alrira-output.json)."""
    names = run.names()
    refuse_foreign(run, names, command=TRAIN_COMMAND, own=RUN_NAMES.match)
    earlier = "train_config.json" in names or "checkpoints" in names
    record = read_location_record(run)
    if earlier and not (resume or overwrite):
        saved = json.loads(run.read_bytes("train_config.json")) if "train_config.json" in names else {}
        raise ValueError(
            f"--out {run}: holds an earlier training run (method {saved.get('method')!r}, --cache {saved.get('cache')}); "
            "pass --resume to continue it, --overwrite to replace it, or use another --out"
        )
    if earlier and resume and record is not None:
        changed = differences(record["inputs"], inputs)
        if changed:
            raise ValueError(f"--out {run}: --resume of a run trained from another cache ({'; '.join(changed)}); use a new --out")
    if earlier and overwrite:
        if not run.is_local:
            raise ValueError(f"--out {run}: --overwrite removes a run only on a local disk; use a new prefix")
        replaced = [n for n in names if n != LOCK_FILE]
        refuse_foreign_inside(run.local_path, replaced, command=TRAIN_COMMAND, own_path=RUN_PATHS.match)
        log(f"--out {run}: --overwrite: removing the earlier run ({', '.join(replaced)})")
        remove_names(run.local_path, replaced)
    run.make_dirs()
    write_location_record(run, {"command": TRAIN_COMMAND, "inputs": inputs, "complete": False})


class RunLogs:
    """Rank 0's metrics.jsonl and tensorboard events. A local run appends them in place; a run on
    an object store writes them to a node-local staging directory and `publish` uploads them, one
    whole object per file, before each checkpoint and at the end. A resume from a checkpoint keeps
    the metrics of the steps up to it (a crash may have logged later steps) and appends."""

    def __init__(self, run: Location, staging: Path):
        self.run, self.staging = run, staging
        self.metrics = open(staging / "metrics.jsonl", "a")
        self.writer = _tensorboard(staging)

    @classmethod
    def start(cls, plan) -> RunLogs:
        """The run's records before its first step (pipeline/train/plan.py's `TrainPlan`): --out
        claimed (`claim_run`), train_config.json (what marks --out as a run), provenance.json, then
        the logs."""
        run, checkpoint = plan.run, plan.config.checkpoint
        claim_run(run, inputs=plan.inputs, resume=checkpoint.resume, overwrite=checkpoint.overwrite, log=plan.ranks.log)
        atomic_write_text(run.join("train_config.json"), json.dumps(plan.settings, indent=2))
        # provenance.json: one entry per invocation of this run (a resume adds one) with the exact command, package
        # versions, source revision and the resolved settings, `auto` resolved (pipeline/provenance.py).
        if not plan.start_step and run.is_file(PROVENANCE_FILE):  # a new run starts the file afresh
            run.remove(PROVENANCE_FILE)
        append_provenance(run, PROVENANCE_FILE, {**plan.settings, "attention_kernel": plan.attention, "start_step": plan.start_step})
        return cls.open(run, start_step=plan.start_step)

    @classmethod
    def open(cls, run: Location, *, start_step: int) -> RunLogs:
        if run.is_local:
            staging = run.local_path
            staging.mkdir(parents=True, exist_ok=True)
        else:
            staging = Path(tempfile.mkdtemp(prefix="alrira-run-"))
        # The metrics of this run: none at step 0 (a new run, or a resume with no checkpoint yet).
        kept = []
        if start_step and run.is_file("metrics.jsonl"):
            kept = [line for line in run.read_bytes("metrics.jsonl").decode().splitlines() if _step_of(line) <= start_step]
        atomic_write_text(staging / "metrics.jsonl", "".join(line + "\n" for line in kept))
        return cls(run, staging)

    def add(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.writer.add_scalar(f"train/{key}", record[key], record["step"])
            evaluation = record.get("eval") or {}
            for key in ("tau_pooled", "tau_mean_per_request"):
                if evaluation.get(key) is not None:
                    self.writer.add_scalar(f"eval/{key}", evaluation[key], record["step"])
            for position, rate in enumerate(evaluation.get("acceptance_per_position") or [], start=1):
                if rate is not None:
                    self.writer.add_scalar(f"eval/acceptance_at_{position}", rate, record["step"])

    def publish(self) -> None:
        if self.run.is_local:
            return
        if self.writer is not None:
            self.writer.flush()
        for path in sorted(self.staging.rglob("*")):
            if path.is_file():
                self.run.put_file(path, path.relative_to(self.staging).as_posix())

    def close(self) -> None:
        self.metrics.close()
        if self.writer is not None:
            self.writer.close()
        self.publish()

    def finish(self, summary: dict, history: list[dict], *, drafter, num_slots: int, dtype: torch.dtype, head: dict | None = None,
               calibration: dict | None = None) -> dict:  # fmt: skip
        """The end of a run: the logs closed, RUN/drafter/ exported (with the target's `head` for a
        family whose options ask for it, and the confidence `calibration` fitted on the split, if
        any: pipeline/train/eval_split.py), then summary.json (last: the run is done)."""
        self.close()
        save_drafter_to(self.run, drafter, dtype=dtype, head=head, calibration=calibration)
        summary = summary | summarize_history(history, num_slots=num_slots)
        if calibration is not None:
            summary["calibration"] = calibration
        atomic_write_text(self.run.join("summary.json"), json.dumps(summary, indent=2))
        return summary

    def discard(self) -> None:
        """Close the files; a store run's staging directory goes (what matters is on the store)."""
        if not self.metrics.closed:
            self.metrics.close()
        if self.writer is not None:
            self.writer.close()  # idempotent; its thread writes into the staging directory
        if not self.run.is_local:  # the staging directory is this run's own: its writer thread is closed above
            shutil.rmtree(self.staging, ignore_errors=True)


def _step_of(line: str) -> float:
    """A metrics line's step; a torn line (a crash mid-write) sorts after every step, so it is dropped."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def save_drafter_to(run: Location, drafter, *, dtype: torch.dtype, head: dict | None = None, calibration: dict | None = None) -> None:
    """RUN/drafter/: written in place locally; on a store, written locally and uploaded file by file.
    A full disk is one line: the checkpoints are kept, a rerun with --resume writes it again."""
    try:
        _save_drafter_to(run, drafter, dtype=dtype, head=head, calibration=calibration)
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        raise ValueError(
            f"{error.filename or run.join('drafter')}: {error.strerror}; the checkpoints are kept: free space and rerun the same "
            "command with --resume"
        ) from None


def _save_drafter_to(run: Location, drafter, *, dtype: torch.dtype, head: dict | None, calibration: dict | None) -> None:
    if run.is_local:
        save_drafter(drafter, run.local_path / "drafter", dtype=dtype, head=head, calibration=calibration)
        return
    with tempfile.TemporaryDirectory(prefix="alrira-drafter-") as tmp:
        save_drafter(drafter, tmp, dtype=dtype, head=head, calibration=calibration)
        # config.json last, as save_drafter writes it: a drafter/ whose config is new has new weights.
        for path in sorted(Path(tmp).iterdir(), key=lambda p: (p.name == CONFIG_FILE, p.name)):
            run.put_file(path, f"drafter/{path.name}")


def _tensorboard(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(directory / "tensorboard"))


def summarize_history(history: list[dict], *, num_slots: int) -> dict:
    if not history:
        return {}
    tail = history[-max(1, len(history) // 10) :]
    return {
        "final_loss": history[-1]["loss"],
        "mean_loss_last_10pct": sum(h["loss"] for h in tail) / len(tail),
        "slot_acc_last_10pct": [round(sum(h["slot_acc"][k] for h in tail) / len(tail), 4) for k in range(num_slots)],
        "mean_tokens_per_s": sum(h["tokens_per_s"] for h in history) / len(history),
        **({"final_eval": history[-1]["eval"]} if "eval" in history[-1] else {}),
    }


def format_summary(summary: dict) -> str:
    lines = [f"run        {summary['run']}", f"method     {summary['method']}", f"steps      {summary['steps']}  ({summary['elapsed_s']:.1f}s)"]
    if "final_loss" in summary:
        lines += [
            f"loss       final {summary['final_loss']:.4f}, mean of last 10% {summary['mean_loss_last_10pct']:.4f}",
            f"tokens/s   {summary['mean_tokens_per_s']:.0f}",
            "slot acc   " + " ".join(f"{a:.2f}" for a in summary["slot_acc_last_10pct"]),
            *(
                [f"eval tau   {summary['final_eval']['tau_pooled']:.3f} pooled, {summary['final_eval']['tau_mean_per_request']:.3f} "
                 f"per request ({summary['final_eval']['prompts']} prompts of the cache's evaluation split)"]
                if summary.get("final_eval") and summary["final_eval"]["tau_pooled"] is not None else []
            ),
            f"drafter    {resolve(summary['run']).join('drafter')}",
        ]
    return "\n".join(lines)
