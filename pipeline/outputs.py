"""Output directories: who wrote them, from which inputs, and who is writing them now
(docs/failure-modes.md, "Outputs").

Every command that writes an --out (`alrira-train`, `alrira-eval run | replay | hard | offsets |
cost | compare`, `python -m pipeline.demo`) claims it here before it writes anything:

- `.alrira-lock` holds the writing process's pid, host and command, written aside and linked into
  place (never seen empty): a second process on the same --out refuses in one line naming the
  holder. A lock whose pid is gone on this host is stale and taken over, as is one naming no holder
  after 30 s; one from another host is left to the user (its path is named).
- `.alrira-output.json` records the command and its inputs (hashes of the target, the drafter and
  the prompts file, and every setting that changes a number), whether the output is complete, and
  the sha256 of every file it vouches for (`files`). A rerun with equal inputs keeps a complete
  output ("kept (same inputs)") only when each file still has its recorded checksum: an edited one
  is refused in one line naming it (recomputed under --overwrite), a record without checksums (an
  older version's) is recomputed. Other inputs are refused in one line naming what differs, or
  recomputed under --overwrite. Only regular files are opened (`read_regular_file`).
- A directory holding names the command does not write is refused, --overwrite or not, and
  --overwrite removes only the command's own names, and refuses (naming them) when one of those is
  a directory holding files the command did not write: nothing of the user's is touched.

This module is the one home of protecting an --out; the commands call these and nothing else:

- `check_out_path`: --out is a directory or can become one (one line otherwise).
- `output_lock`: OUT/.alrira-lock held while a command writes (build, regenerate, train, eval, demo).
- `claim_output` / `prepare_output` -> `Output` (`finish()` marks it complete): the lock, the record
  and the kept / refused / --overwrite decision of the evaluation tools and the demo.
- `read_record` / `write_record` (a local --out or a store prefix), `is_bookkeeping` (the lock and
  record's own names, left out of every check of what an --out holds), `refuse_foreign`,
  `refuse_foreign_inside`, `remove_names`, `differences`: the pieces a command with its own rules
  (`claim_run` of alrira-train: --resume; regeneration, whose manifest is its record) builds its
  claim from.
- `check_cache_out` and `claim_cache`: the cache build's --out, a cache directory owned by the
  build that claimed it last. They live in storage/ownership.py because the shard writers check
  the claim (`check_owner`) without pipeline; the build calls them from here.

Every file written here goes through storage/atomic.py (the record with `atomic_write_text`, the
lock with `create_exclusive_text`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from storage.atomic import atomic_write_text, create_exclusive_text, move_into_place
from storage.errors import DISK_FULL_ERRNOS, first_line
from storage.format import OUTPUT_LOCK_FILE
from storage.location import Location, resolve
from storage.ownership import check_out_dir as check_cache_out
from storage.ownership import claim_cache

__all__ = [
    "LOCK_FILE", "RECORD_FILE", "Output", "cannot_write", "check_cache_out", "check_out_path", "claim_cache", "claim_output",
    "differences", "file_checksums", "foreign_inside", "is_bookkeeping", "log_line", "not_a_regular_file", "os_error_line", "output_lock", "owns",
    "prepare_output", "read_record", "read_regular_file", "refuse_foreign", "refuse_foreign_inside", "remove_names", "sha256_of",
    "unproven", "write_record",
]  # fmt: skip

RECORD_FILE = ".alrira-output.json"
LOCK_FILE = OUTPUT_LOCK_FILE


def log_line(line: str) -> None:
    """Where the commands' one-line notes go by default: stderr, beside the progress bars."""
    print(line, file=sys.stderr, flush=True)


def differences(old: dict, new: dict, prefix: str = "", *, skip: Callable[[str, object], bool] | None = None) -> list[str]:
    """'name: old -> new' for every entry that differs (nested dicts flattened to a.b); `skip(name,
    new value)` True leaves out an entry the old record lacks (a setting added since)."""
    found = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, prefix=f"{prefix}{key}.", skip=skip)
        elif key not in old and skip is not None and skip(f"{prefix}{key}", b):
            continue
        elif a != b:
            found.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return found


def check_out_path(out: str | os.PathLike, *, flag: str = "--out") -> Path:
    """One-line ValueError when `out`, or a folder above it, exists and is not a directory (an --out
    that names a file inside another output, which mkdir reports as a bare [Errno 17])."""
    out = Path(out)
    for place in (out, *out.parents):
        if place.exists() or place.is_symlink():
            if place.is_dir():
                return out
            if place == out:
                raise ValueError(f"{flag} {out}: is a file, not a directory; give the output its own directory")
            raise ValueError(f"{flag} {out}: {place} is a file, not a directory; give the output its own directory")
    return out


def cannot_write(out: str | os.PathLike, error: OSError, *, flag: str = "--out", what: str | None = None) -> ValueError:
    """The one line of a failed write in --out, with the advice its errno calls for: free space for a
    full disk or quota, a writable --out for a read-only filesystem or a missing permission."""
    where = what or (error.filename if error.filename is not None else out)
    reason = error.strerror or first_line(error)
    if error.errno in DISK_FULL_ERRNOS:
        advice = "free space and rerun the same command"
    elif error.errno == errno.EROFS:
        advice = f"it is on a read-only filesystem: give a writable {flag}"
    elif error.errno in (errno.EACCES, errno.EPERM):
        advice = f"this user may not write there: give a writable {flag}"
    else:
        advice = f"give another {flag}"
    return ValueError(f"{flag} {out}: cannot write {where}: {reason}; {advice}")


def os_error_line(error: OSError, out: str | Location, *, kind: str = "cache", kept: str = "shards published") -> str:
    """One line for a failing filesystem: the path, the reason, and for a full disk what to do
    (`kind` and `kept` name what the command writes: a regeneration's parts, say)."""
    line = f"{error.filename or out}: {error.strerror or error}"
    if error.errno in DISK_FULL_ERRNOS:
        line += f" ({kind} {out})" if error.filename else ""
        line += f"; the {kept} so far are kept: free space and rerun the same command to resume"
    return line


def _inside(filename, out: str | os.PathLike) -> bool:
    if not isinstance(filename, (str, os.PathLike)):
        return False
    return Path(os.path.abspath(filename)).is_relative_to(os.path.abspath(out))


def not_a_regular_file(path: Path) -> str | None:
    """"a directory", "a symlink", "a FIFO or device" when `path` exists and is not a regular file
    (which this tool writes for its lock and record, and which alone it opens), else None."""
    if path.is_symlink():
        return "a symlink"
    if not path.exists():
        return None
    if path.is_dir():
        return "a directory"
    return None if path.is_file() else "a FIFO, socket or device"


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


# ----------------------------------------------------------------------------------------------
# The lock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_lock(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(path.read_text())
        if isinstance(holder, dict):
            return holder
    return {}


HOLDERLESS_GRACE_S = 30.0


def _holderless(path: Path, holder: dict) -> bool:
    """A lock that names no holder (an older version's, left empty by a full disk or a kill between
    its create and its write) and is older than a creation's moment: nobody holds it."""
    if holder.get("pid") is not None:
        return False
    with contextlib.suppress(OSError):
        return time.time() - path.stat().st_mtime > HOLDERLESS_GRACE_S
    return False


@contextlib.contextmanager
def output_lock(out: str | os.PathLike, *, command: str, flag: str = "--out") -> Iterator[Path]:
    """Hold OUT/.alrira-lock while the block runs; ValueError naming the holder when another live
    process holds it. A directory this call created is removed again if it is left empty."""
    out = check_out_path(out, flag=flag)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a read-only filesystem, a folder this user may not write
        raise cannot_write(out, error, flag=flag) from None
    path = out / LOCK_FILE
    if (kind := not_a_regular_file(path)) is not None:
        raise ValueError(f"{flag} {out}: {path} is {kind}, not a lock this tool wrote; remove it and rerun")
    me = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    stale = False  # the last try found a lock whose process is gone: it is taken over first
    for _ in range(3):
        try:
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    move_into_place(path, out / f"{LOCK_FILE}.stale-{uuid.uuid4().hex[:8]}", sync=False)
                for stale_lock in out.glob(f"{LOCK_FILE}.stale-*"):
                    stale_lock.unlink(missing_ok=True)
            create_exclusive_text(path, json.dumps(me) + "\n")  # never seen empty (an empty lock refused every rerun)
        except FileExistsError:
            if (kind := not_a_regular_file(path)) is not None:  # made between the check above and the link
                raise ValueError(f"{flag} {out}: {path} is {kind}, not a lock this tool wrote; remove it and rerun") from None
            holder = _read_lock(path)
            pid, host = holder.get("pid"), holder.get("host")
            stale = (host == me["host"] and isinstance(pid, int) and not _alive(pid)) or _holderless(path, holder)
            if stale:
                continue
            raise ValueError(
                f"{flag} {out}: in use by {holder.get('command', 'another command')} (pid {pid} on {host}, since "
                f"{holder.get('started')}); wait for it to finish, or if that process is gone, remove {path}"
            ) from None
        except OSError as error:  # a full disk, a read-only one: nothing was left behind (create_exclusive_text)
            raise cannot_write(out, error, flag=flag, what=f"its lock {LOCK_FILE}") from None
        break
    else:
        raise ValueError(f"{flag} {out}: could not take {path} (another process keeps taking it)")
    try:
        yield path
    finally:
        if _read_lock(path).get("pid") == me["pid"]:
            path.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if empty: the command wrote nothing


# ----------------------------------------------------------------------------------------------
# The record of the inputs


def read_regular_file(path: str | os.PathLike) -> bytes:
    """The bytes of `path`, a regular file (a link to one is followed); OSError otherwise. Opened
    without blocking and checked before it is read, so a FIFO planted at the name (which an open
    for reading waits on forever) is refused, as are devices and directories."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_checksums(out: Path, own: Callable[[str], bool]) -> dict[str, str]:
    """{name: sha256} of the regular files at `out`'s top level that `own` claims (what a record vouches for)."""
    names = sorted(n for n in os.listdir(out) if own(n) and not is_bookkeeping(n))
    return {n: sha256_of(read_regular_file(out / n)) for n in names if (out / n).is_file() and not (out / n).is_symlink()}


def unproven(out: Path, record: dict, names: list[str]) -> str | None:
    """Why the files of `out` (its own `names`) are not the ones its record vouches for, or None."""
    recorded = record.get("files")
    if not isinstance(recorded, dict):
        return "its record holds no checksums of its files"
    for name in names:
        if name not in recorded:
            return f"{out / name} is not among the files its record vouches for"
    for name, checksum in sorted(recorded.items()):
        path = out / name
        if path.is_symlink() or not path.is_file():
            return f"{path}, which its record vouches for, is missing or not a regular file"
        try:
            found = sha256_of(read_regular_file(path))
        except OSError as error:
            return f"{path}: unreadable ({error.strerror})"
        if found != checksum:
            return f"{path} differs from the checksum its record holds (changed after it was written)"
    return None


def read_record(out: str | os.PathLike | Location) -> dict | None:
    """OUT/.alrira-output.json, or None when there is none; one-line ValueError when it is not a
    record this tool wrote. `out` may be a store prefix (a run's --out)."""
    return read_location_record(resolve(out))


def read_location_record(location: Location) -> dict | None:
    """read_record of a resolved --out."""
    path = location.join(RECORD_FILE)
    if location.is_local:
        if (kind := not_a_regular_file(Path(path))) is not None:
            raise ValueError(f"{path}: is {kind}, not a record this tool wrote; move it or use another --out")
        if not Path(path).is_file():
            return None
    elif not location.is_file(RECORD_FILE):
        return None
    try:
        record = json.loads(read_regular_file(path) if location.is_local else location.read_bytes(RECORD_FILE))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: unreadable record of the output's inputs ({error}); move the output or use another --out") from None
    if not isinstance(record, dict) or not isinstance(record.get("inputs"), dict) or not isinstance(record.get("command"), str):
        raise ValueError(f"{path}: damaged record of the output's inputs; move the output or use another --out")
    return record


def write_record(out: str | os.PathLike | Location, record: dict) -> None:
    """Replace OUT/.alrira-output.json atomically (storage.atomic; on a store, one PUT)."""
    write_location_record(resolve(out), record)


def write_location_record(location: Location, record: dict) -> None:
    """write_record of a resolved --out."""
    atomic_write_text(location.join(RECORD_FILE), json.dumps(record, indent=1, sort_keys=True) + "\n")


def is_bookkeeping(name: str) -> bool:
    """Whether a top-level name in an --out is this module's own: the lock, the record, or a temp
    or stale name of either. Every check of what an --out holds leaves these out."""
    return name in (RECORD_FILE, LOCK_FILE) or name.startswith((f"{RECORD_FILE}.", f".{RECORD_FILE}.", f"{LOCK_FILE}."))


def refuse_foreign(out, names: list[str], *, command: str, own: Callable[[str], bool], flag: str = "--out") -> None:
    """One-line ValueError naming the top-level `names` of `out` that `command` does not write."""
    foreign = [n for n in names if not own(n) and not is_bookkeeping(n)]
    if foreign:
        raise ValueError(f"{flag} {out}: holds files {command} did not write ({_shown(foreign)}); move them or use another {flag}")


@dataclass(kw_only=True)
class Output:
    """A claimed --out: `kept` when a complete earlier output has the same inputs (nothing to do)."""

    path: Path
    command: str
    inputs: dict
    kept: bool
    own: Callable[[str], bool]

    def finish(self, **extra) -> None:
        """Mark the output complete (last, after every file it holds is written), with the checksum
        of each of its files: a later "kept" or a reuse of one is checked against them."""
        files = file_checksums(self.path, self.own)
        write_record(self.path, {"command": self.command, "inputs": self.inputs, "complete": True, "files": files, **extra})


def foreign_inside(out: Path, names: list[str], own_path: Callable[[str], bool] | None = None) -> list[str]:
    """The paths (relative to `out`, a directory's ending in "/") below the directories among `names`
    that `own_path` does not claim as written by the command: a user's notes in RUN/drafter/, a
    folder of theirs where the command writes a file. Without `own_path` nothing below a top-level
    name is the command's. Links are not followed, and an unclaimed directory is named whole."""
    found = []
    for name in names:
        top = out / name
        if top.is_symlink() or not top.is_dir():
            continue
        if own_path is None:
            found.append(f"{name}/")
            continue
        for root, dirs, files in os.walk(top):
            here = Path(root).relative_to(out)
            for directory in list(dirs):
                relative = (here / directory).as_posix()
                if os.path.islink(os.path.join(root, directory)):  # a link: never the command's
                    found.append(relative)
                    dirs.remove(directory)
                elif not own_path(f"{relative}/"):
                    found.append(f"{relative}/")
                    dirs.remove(directory)
            found += [(here / f).as_posix() for f in files if not own_path((here / f).as_posix())]
    return sorted(found)


def refuse_foreign_inside(out: Path, names: list[str], *, command: str, own_path: Callable[[str], bool] | None = None,
                          flag: str = "--out") -> None:  # fmt: skip
    """One-line ValueError naming what removing `names` would take that `command` did not write."""
    foreign = foreign_inside(out, names, own_path)
    if foreign:
        raise ValueError(
            f"{flag} {out}: replacing it would remove files {command} did not write ({_shown(foreign)}); "
            f"move them or use another {flag}"
        )


def remove_names(out: Path, names: list[str]) -> None:
    for name in names:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def prepare_output(
    out: str | os.PathLike, *, command: str, inputs: dict, own: Callable[[str], bool], overwrite: bool, log=log_line,
    flag: str = "--out", keep: bool = True,
) -> Output:  # fmt: skip
    """Check --out (held under `output_lock`) for this command and these inputs; see the module
    docstring. `own(name)` says whether a top-level name is one this command writes. `keep` False
    (a command that recomputes in seconds, like `compare`): a complete output of the same inputs is
    recomputed (to the same files) instead of kept."""
    out = check_out_path(out, flag=flag)
    names = sorted(os.listdir(out)) if out.is_dir() else []
    names = [n for n in names if not is_bookkeeping(n)]
    refuse_foreign(out, names, command=command, own=own, flag=flag)
    record = read_record(out)
    if record is not None and record["command"] != command:
        raise ValueError(f"{flag} {out}: an output of `{record['command']}`, not of `{command}`; use another {flag}")
    if record is None and names:
        if not overwrite:
            raise ValueError(
                f"{flag} {out}: holds {_shown(names)} with no record of the inputs they were computed from; "
                "pass --overwrite to replace them, or use another " + flag
            )
        refuse_foreign_inside(out, names, command=command, flag=flag)
        log(f"{flag} {out}: --overwrite: replacing {_shown(names)}")
        remove_names(out, names)
    elif record is not None and (names or record.get("complete")):  # (a claim that wrote nothing is no output)
        changed = differences(record["inputs"], inputs)
        if not changed and record.get("complete"):
            if not overwrite and keep:
                problem = unproven(out, record, names)
                if problem is None:
                    log(f"{out}: kept (same inputs)")
                    return Output(path=out, command=command, inputs=inputs, kept=True, own=own)
                if isinstance(record.get("files"), dict):
                    raise ValueError(f"{flag} {out}: not kept: {problem}; pass --overwrite to recompute it, or use another {flag}")
                log(f"{out}: same inputs, but {problem} (an older alrira's): recomputing")
            if overwrite:
                log(f"{flag} {out}: --overwrite: recomputing (same inputs)")
        elif changed and not overwrite:
            raise ValueError(
                f"{flag} {out}: an earlier `{command}` computed it from other inputs ({'; '.join(changed)}); "
                f"pass --overwrite to replace it, or use another {flag}"
            )
        elif changed:
            log(f"{flag} {out}: --overwrite: replacing an output of other inputs ({'; '.join(changed)})")
        refuse_foreign_inside(out, names, command=command, flag=flag)
        remove_names(out, names)  # ours: an unfinished run of the same inputs, or replaced under --overwrite
    out.mkdir(parents=True, exist_ok=True)
    write_record(out, {"command": command, "inputs": inputs, "complete": False})
    return Output(path=out, command=command, inputs=inputs, kept=False, own=own)


@contextlib.contextmanager
def claim_output(
    out: str | os.PathLike, *, command: str, inputs: dict, own: Callable[[str], bool], overwrite: bool, log=log_line,
    flag: str = "--out", keep: bool = True,
) -> Iterator[Output]:  # fmt: skip
    """`prepare_output` under `output_lock`: the block writes the output and calls `finish()`."""
    with output_lock(out, command=command, flag=flag):
        try:
            yield prepare_output(out, command=command, inputs=inputs, own=own, overwrite=overwrite, log=log, flag=flag, keep=keep)
        except OSError as error:  # a write in --out failed (a disk filling, a folder made read-only meanwhile)
            if not _inside(error.filename, out):
                raise  # an input's error: the command's own message
            raise cannot_write(out, error, flag=flag) from None


def owns(*names: str) -> Callable[[str], bool]:
    """`own` for a command whose top-level names are fixed."""
    fixed = frozenset(names)
    return lambda name: name in fixed
