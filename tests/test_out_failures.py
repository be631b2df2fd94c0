"""Every --out failure is one correct line (pipeline/outputs.py, docs/failure-modes.md "Outputs"): a
read-only or unwritable --out names the filesystem, not a full disk, for every command (they all
take their --out through `output_lock`); a lock or record path that is not a regular file is named,
never followed, taken over or left to hang. Real tmpfs mounts (the tests run as root), real CLIs."""

from __future__ import annotations

import errno
import os

import pytest
from click.testing import CliRunner

from pipeline.cli import eval_cli
from pipeline.outputs import LOCK_FILE, RECORD_FILE, cannot_write, claim_output, output_lock, owns
from tests.test_analysis import _eval_dir
from tests.tmpfs import mounted_tmpfs


@pytest.mark.parametrize("command", ["compare", "offsets"])
def test_a_read_only_out_is_one_line_naming_the_filesystem(tmp_path, command):
    """`compare` and `offsets` ended in a traceback (mkdir's OSError), the others advised freeing space."""
    summaries = [str(_eval_dir(tmp_path / m, method=m, rounds=[(1, 1), (20, 2)])) for m in ("alr", "ira")]
    with mounted_tmpfs(tmp_path / "ro", read_only=True) as read_only:
        for out in (read_only, read_only / "new" / "deeper"):
            result = CliRunner().invoke(eval_cli, [command, *summaries, "--out", str(out)])
            assert result.exit_code == 1 and "Traceback" not in result.output, result.output
            lines = result.output.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"Error: --out {out}: cannot write "), result.output
            assert "Read-only file system; it is on a read-only filesystem: give a writable --out" in lines[0]
            assert "free space" not in lines[0]


def test_output_lock_on_a_read_only_out_names_it_for_every_command(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", read_only=True) as read_only:
        for out in (read_only, read_only / "run"):
            with pytest.raises(ValueError) as failed, output_lock(out, command="alrira-train"):
                pass
            assert str(failed.value).startswith(f"--out {out}: cannot write ")
            assert str(failed.value).endswith("Read-only file system; it is on a read-only filesystem: give a writable --out")


def test_the_advice_follows_the_errno(tmp_path):
    def line(code: int) -> str:
        return str(cannot_write(tmp_path, OSError(code, os.strerror(code), str(tmp_path / "x"))))

    assert line(errno.ENOSPC).endswith("No space left on device; free space and rerun the same command")
    assert line(errno.EDQUOT).endswith("free space and rerun the same command")
    assert line(errno.EACCES).endswith("Permission denied; this user may not write there: give a writable --out")
    assert line(errno.EROFS).endswith("it is on a read-only filesystem: give a writable --out")
    assert line(errno.EIO) == f"--out {tmp_path}: cannot write {tmp_path / 'x'}: Input/output error; give another --out"


@pytest.mark.timeout(60)  # a FIFO read as a lock blocks forever
@pytest.mark.parametrize("kind", ["a directory", "a symlink", "a FIFO, socket or device"])
def test_a_lock_path_that_is_not_a_regular_file_is_named(tmp_path, kind):
    """A directory at OUT/.alrira-lock used to read as a holderless lock: refused as held by
    "pid None on None", then taken over after 30 s with a traceback removing it."""
    out = tmp_path / "out"
    out.mkdir()
    lock = out / LOCK_FILE
    if kind == "a directory":
        (lock / "inner").mkdir(parents=True)
    elif kind == "a symlink":
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(lock)
    old = os.path.getmtime(out) - 3600
    os.utime(lock, (old, old), follow_symlinks=False)  # past the 30 s a holderless lock is waited for
    with pytest.raises(ValueError) as failed, output_lock(out, command="alrira-eval run"):
        pass
    assert str(failed.value) == f"--out {out}: {lock} is {kind}, not a lock this tool wrote; remove it and rerun"
    assert lock.is_symlink() or lock.exists()  # nothing of the user's is moved
    assert not (tmp_path / "elsewhere").exists()


def test_a_record_path_that_is_a_directory_is_named(tmp_path):
    out = tmp_path / "out"
    (out / RECORD_FILE).mkdir(parents=True)
    with pytest.raises(ValueError) as failed, claim_output(out, command="alrira-eval compare", inputs={}, own=owns("compare.csv"), overwrite=True):
        pass
    assert str(failed.value) == f"{out / RECORD_FILE}: is a directory, not a record this tool wrote; move it or use another --out"
    assert (out / RECORD_FILE).is_dir()


def test_an_inputs_missing_file_keeps_its_own_error(tmp_path):
    """Only a failed write in --out becomes the --out line: an input's error inside the block is the command's."""
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError), claim_output(out, command="c", inputs={}, own=owns("a"), overwrite=False):
        (tmp_path / "missing-input").read_text()
    with pytest.raises(ValueError, match=r"cannot write .*/out/sub/a: No such file or directory; give another --out"):
        with claim_output(out, command="c", inputs={}, own=owns("a"), overwrite=False) as output:
            (output.path / "sub" / "a").write_text("x")
