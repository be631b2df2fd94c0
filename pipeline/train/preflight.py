"""Checks `alrira-train` makes before it writes anything: that --out is a run directory (new,
empty, or a run's) and not the cache, and that the cache is whole unless --allow-partial
(docs/design.md, "A training step"; docs/failure-modes.md)."""

from __future__ import annotations

from pipeline.outputs import is_bookkeeping
from storage.location import Location
from storage.manifest import Manifest

RUN_MARKERS = ("train_config.json", "checkpoints")  # what every run directory holds from its first step on


def _same_or_inside(inner: Location, outer: Location) -> bool:
    """Whether `inner` is `outer` or lies under it (local paths resolved, store URLs compared as prefixes)."""
    if inner.is_local != outer.is_local:
        return False
    if inner.is_local:
        a, b = inner.local_path.resolve(), outer.local_path.resolve()
        return a == b or b in a.parents
    a, b = str(inner).rstrip("/"), str(outer).rstrip("/")
    return a == b or a.startswith(b + "/")


def check_run_dir(run: Location, *, cache: Location) -> None:
    """Refuse an --out that is (or is inside) the cache, a file, or a non-empty directory that is
    not a training run: a run writes metrics.jsonl, train_config.json and drafter/ there, and
    would overwrite a user's files of those names."""
    if _same_or_inside(run, cache):
        raise ValueError(f"--out {run}: is the cache (--cache {cache}) or inside it; give the run its own directory")
    if run.is_local and run.exists() and not run.is_dir():
        raise ValueError(f"--out {run}: is a file, not a directory")
    names = [n for n in run.names() if not is_bookkeeping(n)]  # the lock and record: pipeline/outputs.py's
    if names and not any(marker in names for marker in RUN_MARKERS):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(
            f"--out {run}: not empty and not a training run (no {' or '.join(RUN_MARKERS)}; holds {shown}); "
            "use an empty or new directory"
        )


def check_cache_complete(manifest: Manifest, *, cache: Location, allow_partial: bool, log=print) -> None:
    """A cache whose build stopped early (some planned shards not complete) trains only with
    --allow-partial, which then says how much of it is used."""
    done, planned = len(manifest.complete_shards), manifest.num_shards_planned
    if done >= planned:
        return
    used = f"{done} of {planned} planned shards ({manifest.num_sequences} sequences)"
    if not allow_partial:
        raise ValueError(
            f"--cache {cache}: the build did not finish: {used} are complete; rerun the build to finish it, "
            "or pass --allow-partial to train on what is there"
        )
    log(f"--allow-partial: training on {used} of {cache}")
