"""Reading the user's text files (models, config.json, GPUs, profiles): one reader with one set
of refusals, so that every kind of file fails the same way on the same hostile input."""

from __future__ import annotations

from pathlib import Path

from ckplan.errors import InputError
from ckplan.model.spec import SpecError

MAX_FILE_BYTES = 1 << 20  # a model description or config.json is a few KB


def read_text_file(
    path: Path, origin: str, error_type: type[InputError] = SpecError, what: str = "a model file"
) -> str:
    """The UTF-8 text of a model (GPU, profile) file, or an `error_type` saying why it cannot be
    read: missing, a directory or device, unreadable, over MAX_FILE_BYTES, or not UTF-8 text."""
    try:
        if not path.exists():
            raise error_type(f"{origin}: no such file")
        if path.is_dir():
            raise error_type(f"{origin}: is a directory, not {what}")
        if not path.is_file():
            raise error_type(f"{origin}: not a regular file")
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except InputError:
        raise
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise error_type(f"{origin}: cannot read file ({reason})") from None
    except ValueError:  # a NUL character, a name the file system's encoding cannot hold
        raise error_type(f"{origin}: cannot read file (not a valid file name)") from None
    if len(data) > MAX_FILE_BYTES:
        raise error_type(f"{origin}: file larger than {MAX_FILE_BYTES // 2**20} MiB: not {what}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise error_type(
            f"{origin}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start})"
        ) from None


class LongInteger(str):
    """A JSON integer too long to convert, kept as its digits (an integer, not a JSON string)."""
