"""Error text for the one-line messages users see (docs/design.md, "Bad input")."""

from __future__ import annotations

import errno
import re

# The errnos of a full disk, a quota or a file-size limit: where a write says so, the one-line error
# says what was kept and to free space and rerun (docs/failure-modes.md).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)

# `proto://user:secret@host/...`: the userinfo of a URL, which never reaches a message or a file.
# A secret may hold any character, `/` and `@` included (AWS secrets hold `/`), so what precedes the
# first `@` is userinfo when it has a `:` or no `/` (`s3://bucket/key@v2` is a key with an `@`, left
# alone), and the userinfo runs to the LAST `@`: a secret's own `@` never ends it early. Hiding the
# host too where a key also holds an `@` is the price of never showing a part of a secret.
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
_URL_VALUE = re.compile(rf"({_SCHEME})([^@]*)@", re.DOTALL)  # a whole value: the secret may hold spaces
_URL_IN_TEXT = re.compile(rf"\b({_SCHEME})(\S*)")  # in a message: a URL ends at white space


def _is_userinfo(before_at: str) -> bool:
    return ":" in before_at or "/" not in before_at


def has_userinfo(url: str) -> bool:
    """Whether a URL carries credentials (`s3://KEY:SECRET@bucket/...`), whatever the secret holds."""
    found = _URL_VALUE.match(str(url))
    return found is not None and _is_userinfo(found.group(2))


def redact_url(url: str) -> str:
    """A URL value with its whole userinfo replaced by `***` (`s3://***@bucket/x`): everything
    between the scheme and its last `@`."""
    if not has_userinfo(url):
        return url
    return f"{_URL_VALUE.match(url).group(1)}***@{url.rsplit('@', 1)[1]}"


def redact_userinfo(text: str) -> str:
    """`text` with the userinfo of every URL in it replaced by `***` (`s3://***@bucket/x`), each URL
    up to its last `@` before white space. A secret with white space in it cannot be told from the
    words after it here: such a URL given as a value is refused, redacted whole (`redact_url`),
    before any message could carry it."""

    def redact(found: re.Match) -> str:
        scheme, rest = found.group(1), found.group(2)
        if "@" not in rest or not _is_userinfo(rest.split("@", 1)[0]):
            return found.group(0)
        return f"{scheme}***@{rest.rsplit('@', 1)[1]}"

    return _URL_IN_TEXT.sub(redact, text)


def first_line(error: BaseException) -> str:
    """The first line of an error's message (URL userinfo redacted), or its type name when it has
    none: what a one-line report keeps of a library's multi-line error."""
    text = redact_userinfo(str(error).strip())
    return text.splitlines()[0] if text else type(error).__name__


class CorruptShardError(ValueError):
    """A shard's bytes no longer match what was written (one line naming the shard and array).

    Zarr shards (storage/formats/zarr/) and WebDataset tars (storage/formats/wds.py) raise this one class, so
    a reader catches one error whichever format a cache has."""
