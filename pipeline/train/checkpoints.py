"""Training checkpoints: model, optimizer, step and RNG (the schedule and the data position are
functions of the step, docs/design.md "A training step"), plus the run's flat settings, which a
resume compares with its own, and the data position after the step (epoch, steps into it and, for
`--loader stream`, the micro-batches each of rank 0's workers delivered), which a resume checks
against the one it computes.

Layout: RUN/checkpoints/step-00000040/state.pt, and RUN/checkpoints/latest naming the newest one.
Both are written atomically (storage/atomic.py), so a crash leaves the previous checkpoint whole.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from storage.atomic import atomic_write_dir, atomic_write_text
from storage.errors import first_line

STATE_FILE = "state.pt"
LATEST_FILE = "latest"

# Settings a resumed run may change: they alter neither the objective nor the data of a step.
# (--attention picks a kernel, not the math: flex and sdpa agree to 1e-5.)
RESUMABLE_CHANGES = frozenset(
    {"epochs", "max_steps", "save_every", "resume", "progress", "num_workers", "prefetch", "out", "attention"}
)
# Settings added after checkpoints were first written: the value an older checkpoint's run had.
ADDED_SETTINGS = {"loader": "map"}


def resumable_changes(loader: str) -> frozenset[str]:
    """A stream's order depends on its workers (each streams its own shards), the map loader's not,
    and the map loader has no shuffle buffer (docs/design.md, "A training step")."""
    if loader == "stream":
        return RESUMABLE_CHANGES - {"num_workers"}
    return RESUMABLE_CHANGES | {"shuffle_buffer"}


def checkpoint_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def save_checkpoint(run: Path, *, step: int, model, optimizer, settings: dict, data_position: dict | None = None) -> Path:
    final = checkpoint_dir(run, step)
    state = {
        "step": step,
        "model": model.state_dict(),
        "drafter_config": model.config.to_hf_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "config": settings,
        "data_position": data_position,
    }
    atomic_write_dir(final, lambda tmp: torch.save(state, tmp / STATE_FILE))
    atomic_write_text(run / "checkpoints" / LATEST_FILE, final.name)
    return final


def _read_state(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as error:
        raise ValueError(f"{path}: unreadable checkpoint ({first_line(error)})") from None


def load_latest_checkpoint(run: Path, *, log=print) -> dict | None:
    """The newest readable checkpoint of `run`, or None when it has none. A truncated or corrupt
    newest checkpoint is skipped for the previous complete one, saying so in one line."""
    root = run / "checkpoints"
    latest = root / LATEST_FILE
    if not latest.exists():
        return None
    named = root / latest.read_text().strip() / STATE_FILE
    candidates = [named] + sorted((p / STATE_FILE for p in root.glob("step-*") if p / STATE_FILE != named), reverse=True)
    candidates = [p for p in candidates if p.is_file()]
    if not candidates:
        raise ValueError(f"{latest}: points to {named}, which does not exist, and no other checkpoint is there")
    problems = []
    for path in candidates:
        try:
            state = _read_state(path)
        except ValueError as error:
            problems.append(str(error))
            continue
        if problems:
            log(f"{problems[0]}; resuming from {path.parent.name} instead")
        return state
    raise ValueError(f"{root}: no readable checkpoint to resume from ({problems[0]})")


def check_resume_settings(saved: dict, current: dict, *, run: Path) -> None:
    """Refuse a resume whose settings change the objective or the data (one line naming them)."""
    saved = {**ADDED_SETTINGS, **saved}
    resumable = resumable_changes(saved["loader"]) & resumable_changes(current.get("loader", "map"))
    changed = [
        name for name in sorted(set(saved) | set(current))
        if name not in resumable and saved.get(name) != current.get(name)
    ]  # fmt: skip
    if changed:
        details = "; ".join(f"--{n.replace('_', '-')} was {saved.get(n)!r}, now {current.get(n)!r}" for n in changed)
        raise ValueError(f"{run}: --resume with different settings ({details}); use a new --out or the same settings")


def check_data_position(state: dict, expected: dict, *, run: Path) -> None:
    """Refuse a resume whose data would not continue where the checkpoint's stopped (the cache's
    shards changed under the run, say). Checkpoints written before positions were stored pass."""
    stored = state.get("data_position")
    if stored is not None and stored != expected:
        raise ValueError(
            f"{run}: the checkpoint at step {state['step']} stopped at data position {stored}, resuming would "
            f"continue from {expected} (did the cache change?); use a new --out"
        )
