"""Hostile inputs the corpus (tests/corpus/crashes.yaml) cannot express: output files written
atomically, closed or full stdout, odd COLUMNS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckplan.errors import InputError
from ckplan.inputs.paths import check_output, write_atomic


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


DEV_FULL = "/dev/full"
needs_dev_full = pytest.mark.skipif(not os.path.exists(DEV_FULL), reason="needs /dev/full")


@needs_dev_full
@pytest.mark.parametrize(
    "args",
    [
        ["estimate", "llama3-8b"],
        ["estimate", "llama3-8b", "--json"],
        ["export", "gpt2", "--plan", "full", "--to", "megatron", "--quiet"],
        ["--version"],
        [],  # the usage, printed on stdout
    ],
    ids=["table", "json", "export", "version", "usage"],
)
def test_a_full_stdout_is_one_line_and_exit_2(args, tmp_path):
    with open(DEV_FULL, "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "ckplan", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=60,
            cwd=tmp_path,
        )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert err == "error: cannot write to standard output (No space left on device)\n"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX shell")
def test_a_closed_stdout_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "ckplan", "estimate", "gpt2"],
        stderr=subprocess.PIPE,
        timeout=60,
        cwd=tmp_path,
    )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert err == "error: standard output is closed: nowhere to print the answer\n"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file descriptors")
def test_stdout_closed_under_python_is_one_line_and_exit_2(tmp_path):
    code = (
        "import os, runpy, sys; os.close(1); sys.argv[1:] = ['estimate', 'llama3-8b']; "
        "runpy.run_module('ckplan', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, timeout=60, cwd=tmp_path
    )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert err == "error: cannot write to standard output (Bad file descriptor)\n"


@needs_dev_full
def test_a_full_stderr_keeps_the_exit_code(tmp_path):
    with open(DEV_FULL, "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "ckplan", "estimate", "nosuch"],
            stdout=subprocess.PIPE,
            stderr=full,
            timeout=60,
            cwd=tmp_path,
        )
    assert result.returncode == 2
    assert result.stdout == b""


@pytest.mark.parametrize("columns", ["0", "-5", "\u00b2", "\u0664\u0660", "abc", "99999999999"])
def test_odd_columns_and_lines_do_not_crash(columns, tmp_path):
    env = {**os.environ, "COLUMNS": columns, "LINES": columns}
    ok = subprocess.run(
        [sys.executable, "-m", "ckplan", "estimate", "gpt2"],
        capture_output=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr.decode()
    assert ok.stderr == b""
    bad = subprocess.run(
        [sys.executable, "-m", "ckplan", "estimate", "nosuch"],
        capture_output=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert bad.stderr.decode().count("\n") == 1
    assert bad.stderr.decode().startswith("error: unknown model 'nosuch'")


def test_a_symlink_to_a_file_is_followed(tmp_path):
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "p.yaml"
    real.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    check_output(str(link), "--out")
    write_atomic(link, "--out", lambda temporary: temporary.write_text("new\n"))
    assert link.is_symlink()
    assert real.read_text() == "new\n"
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["p.yaml"]
