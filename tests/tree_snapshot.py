"""What a case left in its directory: the corpus test and the fuzzer check that a failing run
writes nothing."""

from __future__ import annotations

import os
from pathlib import Path


def snapshot(root: Path) -> dict[str, int]:
    """Every entry under `root` (symlinks not followed) with its size."""
    entries = {}
    for folder, names, files in os.walk(root):
        for name in names + files:
            path = Path(folder, name)
            entries[str(path.relative_to(root))] = path.lstat().st_size
    return entries
