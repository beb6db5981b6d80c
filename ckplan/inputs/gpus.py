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
from ckplan.inputs import safe_yaml
from ckplan.inputs.files import read_text_file
from ckplan.inputs.presets import preset_folder
from ckplan.quoting import abbreviate, quote

GPU_FOLDER = "gpus"


def _gpu_folder() -> Traversable:
    return preset_folder().joinpath(GPU_FOLDER)


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
        origin = abbreviate(name_or_file)
        text = read_text_file(path, origin, GPUError, "a GPU file")
        return _parse_yaml(text, origin), origin
    name = preset_gpu_name(name_or_file)
    if name is not None:
        return dict(_preset_mapping(name)), f"gpu {name}"
    raise GPUError(
        f"unknown GPU {quote(name_or_file)}: expected one of {', '.join(gpu_names())} "
        f"or a .yaml file (see `ckplan gpus`){_did_you_mean(name_or_file)}"
    )


def preset_gpu_name(text: str) -> str | None:
    """The shipped preset `text` names, whatever its case (H100-SXM is h100-sxm)."""
    by_lower = {name.lower(): name for name in gpu_names()}
    return by_lower.get(text.lower()) if len(text) < 100 else None


def _did_you_mean(text: str) -> str:
    """A near preset name, ignoring case, dashes and spaces (h100sxm -> h100-sxm)."""
    import difflib

    def squeeze(name: str) -> str:
        return name.lower().replace("-", "").replace("_", "").replace(" ", "")

    if len(text) >= 100:
        return ""
    squeezed = {squeeze(name): name for name in gpu_names()}
    if squeeze(text) in squeezed:
        return f"; did you mean {squeezed[squeeze(text)]!r}?"
    # a family name (h100, a100): its presets, before any other near spelling
    family = [
        name for key, name in squeezed.items() if squeeze(text) and key.startswith(squeeze(text))
    ]
    if 0 < len(family) <= 3:
        return "; did you mean " + " or ".join(repr(name) for name in family) + "?"
    close = difflib.get_close_matches(text.lower(), gpu_names(), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _parse_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        data = safe_yaml.load(text)
    except yaml.YAMLError as error:
        raise GPUError(f"{origin}: {safe_yaml.describe_error(error)}") from None
    if not isinstance(data, dict):
        raise GPUError(
            f"{origin}: expected a YAML mapping of keys to values, got {type(data).__name__}"
        )
    return data
