"""Files ckplan writes (`--plot FILE`, `calibrate --out FILE`): checked before any work, written
atomically.

`check_output` refuses, as bad input naming the option, what cannot be written: a NUL character
or a lone surrogate in the name (no file system holds them), a name over NAME_MAX bytes or a path
over PATH_MAX, a folder that does not exist, a directory or a device where the file would go, a
folder ckplan cannot create files in (/proc, read-only). `write_atomic` writes to a temporary
file beside the target and renames it over the target, so that a failure half-way (a full disk)
leaves no partial file: the old file, if any, stays as it was. A symlink to a file is
followed: the file it names is replaced, the link stays.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from ckplan.errors import InputError
from ckplan.quoting import QUOTE_LIMIT, abbreviate, quote

NAME_MAX = 255  # bytes of one file name (ext4, xfs, btrfs, APFS, NTFS's characters)
PATH_MAX = 4096  # bytes of a whole path (Linux)
_TEMP_PREFIX = ".ckplan-"


class OutputPathError(InputError):
    """An output file that cannot be written."""


def check_output(path: str, option: str) -> Path:
    """The output `path` of `option` as a Path, or OutputPathError saying why it cannot be
    written. Creates and removes one temporary file to learn whether the folder is writable."""
    shown = _shown(option, path)
    if not path:
        raise OutputPathError(f"{shown}: expected a file name")
    if "\0" in path:
        raise OutputPathError(f"{shown}: not a valid file name (it holds a NUL character)")
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError:
        raise OutputPathError(
            f"{shown}: not a valid file name (characters no file system can hold)"
        ) from None
    if len(encoded) > PATH_MAX:
        raise OutputPathError(f"{shown}: path longer than {PATH_MAX:,} bytes")
    if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise OutputPathError(f"{shown}: a file or folder name longer than {NAME_MAX} bytes")
    target = Path(path)
    try:
        if not target.parent.is_dir():
            raise OutputPathError(f"{shown}: no such folder {quote(str(target.parent))}")
        if target.is_dir():
            raise OutputPathError(f"{shown}: is a directory, expected a file name")
        if target.exists() and not stat.S_ISREG(target.stat().st_mode):
            raise OutputPathError(f"{shown}: not a regular file")
        fd, probe = tempfile.mkstemp(dir=_final(target).parent, prefix=_TEMP_PREFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise _cannot_write(option, path, error) from None
    return target


def write_atomic(path: str | Path, option: str, write: Callable[[Path], None]) -> None:
    """`write(temporary path)`, then rename it over `path`; on any failure the temporary file
    is removed, and an OSError becomes OutputPathError."""
    try:
        target = _final(Path(path))
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=_TEMP_PREFIX, suffix=target.suffix)
    except OSError as error:
        raise _cannot_write(option, path, error) from None
    os.close(fd)
    temporary = Path(name)
    try:
        write(temporary)
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, target)
    except OSError as error:
        raise _cannot_write(option, path, error) from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def _final(target: Path) -> Path:
    """Where the file really goes: a symlink's target is replaced, not the link."""
    return target.resolve() if target.is_symlink() else target


def _shown(option: str, path: str) -> str:
    """`--plot 'name'`, a long path cut in the middle so that its file name still shows."""
    return f"{option} {quote(abbreviate(path, QUOTE_LIMIT))}"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _cannot_write(option: str, path: str | Path, error: OSError) -> OutputPathError:
    reason = error.strerror or type(error).__name__
    return OutputPathError(f"{_shown(option, str(path))}: cannot write ({reason})")
