"""Error text for the one-line messages users see (docs/design.md, "Bad input")."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type name when it has none: what a one-line
    report keeps of a library's multi-line error."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class CorruptShardError(ValueError):
    """A shard's bytes no longer match what was written (one line naming the shard and array).

    Zarr shards (storage/shards.py) and WebDataset tars (storage/wds.py) raise this one class, so
    a reader catches one error whichever format a cache has."""
