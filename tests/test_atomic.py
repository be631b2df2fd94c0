"""storage/atomic.py: the one temp-then-rename of the project (STYLE 15)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.outputs import RECORD_FILE, is_bookkeeping, read_record, write_record
from storage.atomic import atomic_write, atomic_write_text, create_exclusive_text, move_into_place
from storage.location import resolve


def test_atomic_write_replaces_whole_and_leaves_nothing_when_the_write_fails(tmp_path):
    path = tmp_path / "a.json"
    atomic_write_text(path, "old\n")

    def half_then_fail(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("ne")
        raise OSError(28, "No space left on device", tmp)

    with pytest.raises(OSError, match="No space"):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temp file left
    atomic_write(path, lambda tmp: Path(tmp).write_text("new\n"), sync=False)
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


@pytest.mark.parametrize("sync", [True, False])
def test_move_into_place_renames_a_finished_file_or_directory(tmp_path, sync):
    partial = tmp_path / ".x.part"
    partial.write_bytes(b"whole")
    move_into_place(partial, tmp_path / "x", sync=sync)
    assert (tmp_path / "x").read_bytes() == b"whole" and not partial.exists()
    folder = tmp_path / ".d.tmp"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "f").write_text("f")
    move_into_place(folder, tmp_path / "d", sync=sync)
    assert (tmp_path / "d" / "sub" / "f").read_text() == "f"


def test_create_exclusive_text_refuses_a_taken_name_and_leaves_no_temp(tmp_path):
    lock = tmp_path / ".lock"
    create_exclusive_text(lock, "first\n")
    with pytest.raises(FileExistsError):
        create_exclusive_text(lock, "second\n")
    assert lock.read_text() == "first\n"
    assert os.listdir(tmp_path) == [".lock"]


def test_the_record_is_written_atomically_and_its_names_are_bookkeeping(tmp_path):
    """write_record goes through storage.atomic (local path or Location alike); the temp names of
    that write are the protection's own, never a file a command 'did not write'."""
    write_record(resolve(tmp_path), {"command": "c", "inputs": {"a": 1}, "complete": False})
    assert read_record(tmp_path) == read_record(resolve(tmp_path)) == {"command": "c", "inputs": {"a": 1}, "complete": False}
    assert os.listdir(tmp_path) == [RECORD_FILE]
    for name in (RECORD_FILE, f".{RECORD_FILE}.k2j4h1.tmp", f"{RECORD_FILE}.1a2b3c4d.tmp", ".alrira-lock", ".alrira-lock.new-1a2b3c4d"):
        assert is_bookkeeping(name), name
    assert not is_bookkeeping("results.csv")


def test_an_atomic_file_has_the_mode_a_plain_write_would(tmp_path):
    """Written in place or atomically, a file gets the umask's mode (a record or manifest another
    user of a shared output must read), not a temp file's 0600."""
    atomic_write_text(tmp_path / "atomic", "x")
    (tmp_path / "plain").write_text("x")
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode
