"""Where model descriptions come from: shipped presets, the user's YAML, or a HF config.json.

This is the I/O edge of the library: everything here reads files and hands a mapping to
`spec.spec_from_mapping`, which does all validation. Presets ship inside the package
(`ckplan.preset_data`), so a wheel install finds them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from ckplan.io.hf_config import hf_config_mapping
from ckplan.io.profiles import is_profile_file
from ckplan.model.ops import layer_ops
from ckplan.model.profiles import DEFAULT_PROFILE, ProfileError
from ckplan.model.spec import ModelSpec, SpecError, spec_from_mapping


def _preset_folder() -> Traversable:
    """The shipped presets: the `ckplan.preset_data` package of an install (wheel or editable),
    else the source tree's presets/ folder (running from a checkout without installing)."""
    try:
        return resources.files("ckplan.preset_data")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "presets"


def preset_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in _preset_folder().iterdir()
        if entry.name.endswith(".yaml")
    )


def preset_mapping(name: str) -> dict[str, Any]:
    """The raw mapping of a shipped preset (before validation)."""
    entry = _preset_folder().joinpath(f"{name}.yaml")
    if not entry.is_file():
        raise SpecError(_unknown_model(name))
    return _parse_yaml(entry.read_text(encoding="utf-8"), f"preset {name}")


def load_mapping(model: str) -> tuple[dict[str, Any], str]:
    """Resolve MODEL (preset name, .yaml/.yml path, or config.json path) to (mapping, origin)."""
    path = Path(model)
    if path.suffix in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise SpecError(f"{model}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise SpecError(f"{model}: cannot read file ({error})") from None
        if path.suffix == ".json":
            return hf_config_mapping(_parse_json(text, model), model), model
        return _parse_yaml(text, model), model
    if model in preset_names():
        return preset_mapping(model), f"preset {model}"
    raise SpecError(_unknown_model(model))


def load_spec(model: str, overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """Load MODEL and apply `--set`-style overrides before validation. A kernel profile other
    than fused is loaded and applied here, so that its errors are bad input like the model's."""
    mapping, origin = load_mapping(model)
    spec = spec_from_mapping({**_profile_beside(mapping, model), **(overrides or {})}, origin)
    if spec.profile != DEFAULT_PROFILE:
        try:
            layer_ops(spec)
        except ProfileError as error:
            raise SpecError(f"{origin}: {error}") from None
    return spec


def _profile_beside(mapping: dict[str, Any], model: str) -> dict[str, Any]:
    """A model file's relative `profile:` path is read beside the model file when it is there."""
    reference = mapping.get("profile")
    if not isinstance(reference, str) or not is_profile_file(reference):
        return mapping
    beside = Path(model).parent / reference
    if Path(reference).is_absolute() or not Path(model).is_file() or not beside.is_file():
        return mapping
    return {**mapping, "profile": str(beside)}


def _unknown_model(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, preset_names(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown model {name!r}{hint}: expected a preset name (see `ckplan presets`), "
        "a .yaml file or a config.json"
    )


def _parse_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise SpecError(f"{origin}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(
            f"{origin}: expected a YAML mapping of keys to values, got {type(data).__name__}"
        )
    return data


def _parse_json(text: str, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise SpecError(f"{origin}: malformed JSON at line {error.lineno}: {error.msg}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: expected a JSON object, got {type(data).__name__}")
    return data
