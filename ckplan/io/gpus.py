"""Where GPU descriptions come from: the shipped presets (presets/gpus/*.yaml, installed as
`ckplan.preset_data/gpus`) or the user's YAML file. Validation is `hardware.gpus.gpu_from_mapping`.

`--set gpu.KEY=VALUE` overrides are applied here, before validation, as model `--set`s are.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from ckplan.hardware.gpus import GPU, GPUError, gpu_from_mapping
from ckplan.io.presets import _preset_folder

GPU_FOLDER = "gpus"


def _gpu_folder() -> Traversable:
    return _preset_folder().joinpath(GPU_FOLDER)


@lru_cache(maxsize=1)
def gpu_names() -> tuple[str, ...]:
    """The shipped GPU presets, sorted."""
    return tuple(
        sorted(
            entry.name.removesuffix(".yaml")
            for entry in _gpu_folder().iterdir()
            if entry.name.endswith(".yaml")
        )
    )


def load_gpu(name_or_file: str, overrides: Mapping[str, Any] | None = None) -> GPU:
    """A GPU preset name or a path to a .yaml/.yml file, with `--set gpu.KEY` overrides."""
    mapping, origin = _load_mapping(name_or_file)
    return gpu_from_mapping({**mapping, **(overrides or {})}, origin)


@lru_cache(maxsize=32)
def _preset_mapping(name: str) -> tuple[tuple[str, Any], ...]:
    text = _gpu_folder().joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return tuple(_parse_yaml(text, f"gpu {name}").items())


def _load_mapping(name_or_file: str) -> tuple[dict[str, Any], str]:
    path = Path(name_or_file)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise GPUError(f"{name_or_file}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise GPUError(f"{name_or_file}: cannot read file ({error})") from None
        return _parse_yaml(text, name_or_file), name_or_file
    if name_or_file in gpu_names():
        return dict(_preset_mapping(name_or_file)), f"gpu {name_or_file}"
    raise GPUError(
        f"unknown GPU {name_or_file!r}: expected one of {', '.join(gpu_names())} "
        "or a .yaml file (see `ckplan gpus`)"
    )


def _parse_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise GPUError(f"{origin}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise GPUError(
            f"{origin}: expected a YAML mapping of keys to values, got {type(data).__name__}"
        )
    return data
