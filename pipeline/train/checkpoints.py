"""Training checkpoints: model, optimizer, step and RNG (the schedule and the data position are
functions of the step, docs/design.md "A training step"), plus the run's flat settings, which a
resume compares with its own, and the data position after the step (epoch, steps into it and, for
`--loader stream`, the micro-batches each of rank 0's workers delivered), which a resume checks
against the one it computes.

Layout: RUN/checkpoints/step-00000040/state.pt, and RUN/checkpoints/latest naming the newest one.
Both are written atomically (storage/atomic.py), so a crash leaves the previous checkpoint whole.
RUN may be a prefix on an object store (storage.location): state.pt is then one object, uploaded
whole before `latest` (one object too) names it, so there as well a reader never follows `latest`
to a partial checkpoint (docs/design.md, "Caches on object stores").
"""

from __future__ import annotations

import json
import pickle
import tempfile
from pathlib import Path

import torch

from drafter.families import DEFAULT_FAMILY, FAMILIES, families
from storage.atomic import atomic_write_dir, atomic_write_text
from storage.errors import DISK_FULL_ERRNOS, first_line
from storage.location import Location, is_url
from storage.paths import unsafe_name_reason

STATE_FILE = "state.pt"
LATEST_FILE = "latest"

# Settings a resumed run may change: they alter neither the objective nor the data of a step.
# (--attention picks a kernel, not the math: flex and sdpa agree to 1e-5.)
RESUMABLE_CHANGES = frozenset(
    {"epochs", "max_steps", "save_every", "resume", "overwrite", "progress", "num_workers", "prefetch", "out", "attention",
     "local_cache_gib", "local_cache_dir", "prefetch_shards", "allow_partial", "log_every", "eval_every",
     # --precision may change while the dtype it resolves to does not (compute_dtype, checked on its own)
     "precision", "device_kind",
     # the evaluation split: a resume's is checked against the run's logged points (plan.load_eval_split)
     "eval_split"}
)  # fmt: skip
# Settings added after checkpoints were first written: the value an older checkpoint's run had. A
# run recorded before a family existed trained the default family and left every family's options
# at their defaults.
ADDED_SETTINGS = {
    "loader": "map", "arch": DEFAULT_FAMILY, **{flag: value for family in families() for flag, value in family.option_flags().items()},
}  # fmt: skip


def resumable_changes(loader: str) -> frozenset[str]:
    """A stream's order depends on its workers (each streams its own shards), the map loader's not,
    and the map loader has no shuffle buffer (docs/design.md, "A training step")."""
    if loader == "stream":
        return RESUMABLE_CHANGES - {"num_workers"}
    return RESUMABLE_CHANGES | {"shuffle_buffer"}


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(run: Location, *, step: int, model, optimizer, settings: dict, data_position: dict | None = None,
                    drafter_config: dict | None = None) -> str:  # fmt: skip
    """Write the checkpoint after `step`, then point `latest` at it; returns where it went.
    `drafter_config`: the drafter's config.json form, recorded beside its weights."""
    final = run.join(f"checkpoints/{checkpoint_name(step)}")
    state = {
        "step": step,
        "model": model.state_dict(),
        "drafter_config": drafter_config,
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "config": settings,
        "data_position": data_position,
    }
    try:
        atomic_write_dir(final, lambda tmp: _save_state(state, tmp / STATE_FILE))
    except OSError as error:
        if error.errno not in DISK_FULL_ERRNOS:
            raise
        raise ValueError(
            f"{final}: {error.strerror}; the checkpoints before it are kept: free space and rerun the same command with --resume"
        ) from None
    atomic_write_text(run.join(f"checkpoints/{LATEST_FILE}"), checkpoint_name(step))
    return str(final)


def _save_state(state: dict, path: Path) -> None:
    """torch.save through a Python file object: torch's zip writer turns a failed write (a full
    disk, a quota) into a RuntimeError ("unexpected pos", "iostream error") that the CLI would show
    as a traceback; the OSError it hides is raised instead (found by benchmarks/harness/chaos.py)."""
    with open(path, "wb") as f:
        try:
            torch.save(state, f)
        except RuntimeError as error:
            if isinstance(error.__context__, OSError):
                raise OSError(error.__context__.errno, error.__context__.strerror, str(path)) from None
            raise


class UnsafeCheckpoint(ValueError):
    """A state.pt that holds more than tensors and plain values: never loaded, never skipped over."""


def _load_state(path: Path | str, *, where: str) -> dict:
    """torch.load with weights_only=True: tensors, dicts, lists and plain values only, so a planted
    pickle (a run directory is often a shared prefix) cannot run code (docs/design.md, "A training step")."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "GLOBAL" not in str(error):  # a corrupt file: weights_only names a refused global (a callable, a class)
            raise
        raise UnsafeCheckpoint(
            f"{where}: refused: it holds objects other than tensors and plain values, which only a tampered or "
            "foreign file does (loaded with weights_only=True, nothing in it ran); remove it or use a new --out"
        ) from None


def _read_state(run: Location, relative: str) -> dict:
    where = run.join(relative)
    try:
        if run.is_local:
            return _load_state(where, where=where)
        with tempfile.TemporaryDirectory(prefix="alrira-checkpoint-") as tmp:  # streamed to disk, not held twice
            run.download(relative, Path(tmp) / STATE_FILE)
            return _load_state(Path(tmp) / STATE_FILE, where=where)
    except UnsafeCheckpoint:
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as error:
        raise ValueError(f"{where}: unreadable checkpoint ({first_line(error)})") from None


def load_latest_checkpoint(run: Location, *, log=print) -> dict | None:
    """The newest readable checkpoint of `run`, or None when it has none. A truncated or corrupt
    newest checkpoint is skipped for the previous complete one, saying so in one line."""
    latest = f"checkpoints/{LATEST_FILE}"
    if not run.is_file(latest):
        return None
    named = run.read_bytes(latest).decode(errors="replace").strip()
    if unsafe_name_reason(named) is not None or "/" in named:  # it becomes a path: one plain name only
        raise ValueError(f"{run.join(latest)}: refused: names {named[:80]!r}, not a checkpoint directory; remove it or use a new --out")
    others = sorted((n for n in run.names("checkpoints") if n.startswith("step-") and n != named), reverse=True)
    candidates = [f"checkpoints/{n}/{STATE_FILE}" for n in [named, *others]]
    candidates = [c for c in candidates if run.is_file(c)]
    if not candidates:
        missing = run.join(f"checkpoints/{named}/{STATE_FILE}")
        raise ValueError(f"{run.join(latest)}: points to {missing}, which does not exist, and no other checkpoint is there")
    problems = []
    for relative in candidates:
        try:
            state = _read_state(run, relative)
        except UnsafeCheckpoint:
            raise  # a tampered checkpoint stops the resume: falling back would hide it
        except ValueError as error:
            problems.append(str(error))
            continue
        if problems:
            log(f"{problems[0]}; resuming from {relative.split('/')[1]} instead")
        return state
    raise NoReadableCheckpoint(f"{run.join('checkpoints')}: no readable checkpoint to resume from ({problems[0]})")


class NoReadableCheckpoint(ValueError):
    """Every checkpoint of a run is damaged (none tampered with): the resume starts again at step 0."""


def restart_settings_check(run: Location, current: dict, error: NoReadableCheckpoint, *, log=print) -> None:
    """A resume whose every checkpoint is damaged starts again from step 0, the oldest state there
    is: the seed makes it the same run, bit for bit (so a run whose only checkpoint is truncated is
    not refused on every rerun). The settings are still checked, against
    the run's train_config.json, as a checkpoint's would be; without a readable one the resume is
    refused: starting with whatever flags were given could quietly become another run."""
    saved = None
    if run.is_file("train_config.json"):
        try:
            saved = json.loads(run.read_bytes("train_config.json"))
        except ValueError:
            saved = None
    if not isinstance(saved, dict):
        raise ValueError(
            f"{error}, and {run.join('train_config.json')} is missing or unreadable, so this run's settings cannot be checked: "
            "rerun with --overwrite to start it again with these flags, or use a new --out"
        )
    check_resume_settings(saved, current, run=run)
    log(f"{error}; starting again from step 0 (the same seed: the same run)")


def _resolved_cache(settings: dict) -> dict:
    """Runs record --cache resolved; an older run's relative one is compared resolved from here."""
    cache = settings.get("cache")
    if isinstance(cache, str) and cache and not is_url(cache):
        return {**settings, "cache": str(Path(cache).resolve())}
    return settings


def unused_settings(settings: dict) -> set[str]:
    """The settings a run with these flags never reads (a different value is no reason to refuse its
    resume): the options of the families it does not train, the methods' envelopes where its family
    has its own (else the envelope its method does not use), the rollout depth of a corpus-labelled method."""
    from pipeline.train.methods import RECIPES

    recipe, family = RECIPES.get(settings.get("method")), FAMILIES.get(settings.get("arch", DEFAULT_FAMILY))
    if recipe is None or family is None:
        return set()
    unused = {flag for other in families() if other is not family for flag in other.option_flags()}
    if family.own_envelope:
        unused |= {"gamma", "dflash_gamma"}
    else:
        unused.add("gamma" if recipe.dflash_envelope else "dflash_gamma")
    if recipe.label_source != "rollout":
        unused.add("rollout_depth")
    return unused


def check_resume_settings(saved: dict, current: dict, *, run: Location) -> None:
    """Refuse a resume whose settings change the objective or the data (one line naming them); a
    resume that would compute in another dtype than the run did (`auto` resolves per machine) is
    refused naming both. Settings the run's method and architecture never read are not compared."""
    saved, current = {**ADDED_SETTINGS, **_resolved_cache(saved)}, _resolved_cache(current)
    recorded, here = saved.pop("compute_dtype", None), current.pop("compute_dtype", None)
    if recorded is not None and here is not None and recorded != here:
        raise ValueError(
            f"{run}: this run computed in {recorded} (on {saved.get('device_kind', '?')}); here --precision "
            f"{current.get('precision')} resolves to {here} on {current.get('device_kind', '?')}: resume with --precision "
            f"{'bf16' if recorded == 'bfloat16' else 'fp32'} to continue in {recorded}, or use a new --out"
        )
    resumable = resumable_changes(saved["loader"]) & resumable_changes(current.get("loader", "map"))
    resumable = resumable | (unused_settings(saved) & unused_settings(current))
    changed = [
        name for name in sorted(set(saved) | set(current))
        if name not in resumable and saved.get(name) != current.get(name)
    ]  # fmt: skip
    if changed:
        details = "; ".join(f"--{n.replace('_', '-')} was {saved.get(n)!r}, now {current.get(n)!r}" for n in changed)
        raise ValueError(f"{run}: --resume with different settings ({details}); use a new --out or the same settings")


def check_data_position(state: dict, expected: dict, *, run: Location) -> None:
    """Refuse a resume whose data would not continue where the checkpoint's stopped (the cache's
    shards changed under the run, say). Checkpoints written before positions were stored pass."""
    stored = state.get("data_position")
    if stored is not None and stored != expected:
        raise ValueError(
            f"{run}: the checkpoint at step {state['step']} stopped at data position {stored}, resuming would "
            f"continue from {expected} (did the cache change?); use a new --out"
        )
