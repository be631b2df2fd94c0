"""Which build owns a cache directory.

Each build claims the directory before it touches it (`.build-owner`, a fresh id), and its shard
writers publish only while that claim holds. A writer that outlives its killed driver (Ray reaps
orphaned actors asynchronously) or a second build started on the same directory therefore cannot
overwrite the shards of the build that claimed it last (docs/design.md, "A cache build").
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from storage.format import BUILD_OWNER_FILE


class CacheOwnershipLost(ValueError):
    """A shard writer's build no longer owns the cache directory (another build claimed it):
    a user error (two builds on one --out), reported in one line like every bad input."""


def claim_cache(cache_dir: str | os.PathLike) -> str:
    """Make a new build the owner of `cache_dir` (created if needed); return its owner id.

    From now on write_shard(owner=<an older id>) refuses to publish there: a worker that outlives
    its killed driver, or a second build started on the same directory, cannot overwrite shards of
    the build that claimed it last.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    owner = uuid.uuid4().hex
    tmp = cache_dir / f"{BUILD_OWNER_FILE}.{owner}.tmp"
    tmp.write_text(owner + "\n")
    os.replace(tmp, cache_dir / BUILD_OWNER_FILE)
    return owner


def check_owner(cache_dir: str | os.PathLike, owner: str) -> None:
    """Raise CacheOwnershipLost unless `owner` is the build that last claimed `cache_dir`."""
    path = Path(cache_dir) / BUILD_OWNER_FILE
    try:
        current = path.read_text().strip()
    except FileNotFoundError:
        current = None
    if current != owner:
        raise CacheOwnershipLost(
            f"{cache_dir}: another cache build has claimed this directory (owner {current}, this writer {owner}); "
            "this writer stops without publishing"
        )
