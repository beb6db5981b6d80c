"""Hostile inputs the corpus (tests/corpus/crashes.yaml) cannot express: output files written
atomically, closed or full stdout, odd COLUMNS."""

from __future__ import annotations

import os

import pytest

from ckplan.errors import InputError
from ckplan.io.paths import check_output, write_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "p.yaml"
    target.write_text("old\n")

    def half_then_full(temporary):
        temporary.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(InputError, match=r"--out '.*p.yaml': cannot write \(No space left"):
        write_atomic(target, "--out", half_then_full)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_a_failed_write_of_a_new_file_leaves_nothing(tmp_path):
    def broken(temporary):
        temporary.write_text("half")
        raise RuntimeError("a bug in the writer")

    with pytest.raises(RuntimeError):
        write_atomic(tmp_path / "new.svg", "--plot", broken)
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_write_replaces_the_file_with_the_usual_mode(tmp_path):
    target = tmp_path / "p.yaml"
    write_atomic(target, "--out", lambda temporary: temporary.write_text("new\n"))
    assert target.read_text() == "new\n"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_check_output_leaves_nothing_behind(tmp_path):
    assert check_output(str(tmp_path / "x.png"), "--plot") == tmp_path / "x.png"
    assert list(tmp_path.iterdir()) == []
