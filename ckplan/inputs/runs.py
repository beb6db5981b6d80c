"""Where the public-runs suite comes from: validation/runs/*.yaml, one file per publication,
shipped with ckplan as the `ckplan.run_data` package (read from the source tree when running from
a checkout without installing). Each file goes through the safe YAML loader; validation of the
runs is `ckplan.published.runs`."""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from ckplan.inputs import safe_yaml
from ckplan.model.spec import SpecError


def run_folder() -> Traversable:
    try:
        return resources.files("ckplan.run_data")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "validation" / "runs"


def run_files() -> list[tuple[str, Any]]:
    """(file name, parsed YAML) of every publication in the suite, by file name."""
    files = []
    for entry in sorted(run_folder().iterdir(), key=lambda entry: entry.name):
        if not entry.name.endswith(".yaml"):
            continue
        try:
            data = safe_yaml.load(entry.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            raise SpecError(f"{entry.name}: {safe_yaml.describe_error(error)}") from None
        files.append((entry.name, data))
    return files
