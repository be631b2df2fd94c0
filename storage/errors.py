"""Error text for the one-line messages users see (docs/design.md, "Bad input")."""

from __future__ import annotations

import errno
import re

# The errnos of a full disk, a quota or a file-size limit: where a write says so, the one-line error
# says what was kept and to free space and rerun (docs/failure-modes.md).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

# `proto://user:secret@host/...`: the userinfo of a URL, which never reaches a message or a file.
# A secret may hold a `/` (AWS secrets do), so what precedes the first `@` is userinfo when it has
# a `:` or no `/` (`s3://bucket/key@v2` is a key with an `@`, left alone).
_BEFORE_AT = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^@\s]*)@")


def _is_userinfo(before_at: str) -> bool:
    return ":" in before_at or "/" not in before_at


def has_userinfo(url: str) -> bool:
    """Whether a URL carries credentials (`s3://KEY:SECRET@bucket/...`)."""
    found = _BEFORE_AT.match(str(url))
    return found is not None and _is_userinfo(found.group(2))


def redact_userinfo(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by `***` (`s3://***@bucket/x`)."""
    return _BEFORE_AT.sub(lambda m: f"{m.group(1)}***@" if _is_userinfo(m.group(2)) else m.group(0), text)


def first_line(error: BaseException) -> str:
    """The first line of an error's message (URL userinfo redacted), or its type name when it has
    none: what a one-line report keeps of a library's multi-line error."""
    text = redact_userinfo(str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


class CorruptShardError(ValueError):
    """A shard's bytes no longer match what was written (one line naming the shard and array).

    Zarr shards (storage/formats/zarr/) and WebDataset tars (storage/formats/wds.py) raise this one class, so
    a reader catches one error whichever format a cache has."""
