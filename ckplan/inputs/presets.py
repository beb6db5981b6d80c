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

from ckplan.inputs import safe_yaml
from ckplan.inputs.files import LongInteger, read_text_file
from ckplan.model.ops import layer_ops
from ckplan.model.parts import FP32_DEFAULTS
from ckplan.model.spec import (
    DEFAULT_PROFILE,
    ModelSpec,
    SpecError,
    coerce_value,
    spec_from_mapping,
)
from ckplan.quoting import abbreviate, quote


def preset_folder() -> Traversable:
    """The shipped presets: the `ckplan.preset_data` package of an install (wheel or editable),
    else the source tree's presets/ folder (running from a checkout without installing)."""
    try:
        return resources.files("ckplan.preset_data")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "presets"


def preset_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in preset_folder().iterdir()
        if entry.name.endswith(".yaml")
    )


# Old preset names, still accepted.
PRESET_ALIASES = {"seed": "example-8192"}


def preset_mapping(name: str) -> dict[str, Any]:
    """The raw mapping of a shipped preset (before validation)."""
    name = PRESET_ALIASES.get(name, name)
    entry = preset_folder().joinpath(f"{name}.yaml")
    if not entry.is_file():
        raise SpecError(_unknown_model(name))
    return _parse_yaml(entry.read_text(encoding="utf-8"), f"preset {name}")


def load_mapping(model: str) -> tuple[dict[str, Any], str]:
    """Resolve MODEL (preset name, .yaml/.yml path, or config.json path) to (mapping, origin)."""
    path = Path(model)
    if path.suffix in (".yaml", ".yml", ".json"):
        origin = abbreviate(model)
        text = read_text_file(path, origin)
        if path.suffix == ".json":
            from ckplan.inputs.hf_config import hf_config_mapping  # only for config.json

            return hf_config_mapping(_parse_json(text, origin), origin, with_context=True), origin
        return _parse_yaml(text, origin), origin
    if model in preset_names() or model in PRESET_ALIASES:
        return preset_mapping(model), f"preset {PRESET_ALIASES.get(model, model)}"
    raise SpecError(_unknown_model(model))


def load_spec(model: str, overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """Load MODEL and apply `--set`-style overrides before validation. A kernel profile other
    than fused is read here (the model does no I/O) and applied, so that its errors are bad
    input like the model's."""
    mapping, origin = load_mapping(model)
    overrides = dict(overrides or {})
    if "_max_seq" in mapping:  # a config.json: say where its sequence length came from
        from ckplan.inputs.hf_config import seq_note

        longest = mapping.pop("_max_seq")
        if "seq" not in overrides and isinstance(longest, int):
            mapping["source"] = f"{mapping['source']}; {seq_note({**mapping, '_max_seq': longest})}"
    if overrides.get("precision") == "fp32":
        mapping = _without_precision_keys(mapping, overrides)
    return spec_from_values({**_profile_beside(mapping, model), **overrides}, origin)


def _without_precision_keys(mapping: dict[str, Any], overrides: Mapping[str, Any]) -> dict:
    """The model file's keys that `--set precision=fp32` decides, removed unless `--set` names
    them too: a preset or config.json gives the checkpoint's dtype (dtype_bytes: 2 for bf16
    weights), while an fp32 run computes and keeps its activations in fp32
    (`ckplan.model.parts.FP32_DEFAULTS`)."""
    return {
        key: value for key, value in mapping.items() if key not in FP32_DEFAULTS or key in overrides
    }


def spec_from_values(values: Mapping[str, Any], origin: str = "model") -> ModelSpec:
    """`model.spec.spec_from_mapping` with the `profile` key read here when it names a shipped
    profile or a file (the model does no I/O), checked against the model and applied."""
    reference = values.get("profile") if isinstance(values, Mapping) else None
    if reference is None and isinstance(values, Mapping):
        spec = spec_from_mapping(values, origin)
        implied = _framework_profile(spec)
        if implied == DEFAULT_PROFILE:
            return spec
        from ckplan.inputs.profiles import load_profile
        from ckplan.model.profiles import ProfileError

        try:  # a profile the architecture does not fit stays the op table's (fused)
            implied_spec = spec.replace(profile=load_profile(implied))
            layer_ops(implied_spec)
        except ProfileError:
            return spec
        return implied_spec
    if reference == DEFAULT_PROFILE or not isinstance(reference, str) or not reference.strip():
        return spec_from_mapping(values, origin)
    spec = spec_from_mapping({**values, "profile": DEFAULT_PROFILE}, origin)
    try:
        coerce_value(origin, "profile", reference)  # the text checks of every string key
    except SpecError as error:
        raise SpecError(str(error)) from None
    if spec.kind != "transformer":
        raise SpecError(
            f"{origin}: key 'profile' applies to kind: transformer; the NumPy MLP has no profiles"
        )
    from ckplan.inputs.profiles import load_profile  # only with a profile
    from ckplan.model.profiles import ProfileError

    try:
        spec = spec.replace(profile=load_profile(reference))
        layer_ops(spec)
    except ProfileError as error:
        raise SpecError(f"{origin}: {error}") from None
    return spec


def _framework_profile(spec: ModelSpec) -> str:
    """The kernel profile a framework's eager PyTorch code implies when the model names none:
    Hugging Face's and torchtitan's eager modules save what the torch-sdpa profile (flash
    attention through SDPA) or torch-eager (standard attention) measures; fused and compiled
    kernels what the op table counts (fused)."""
    if spec.kind != "transformer" or spec.kernels != "eager":
        return DEFAULT_PROFILE
    return "torch-sdpa" if spec.attention == "flash" else "torch-eager"


def _profile_beside(mapping: dict[str, Any], model: str) -> dict[str, Any]:
    """A model file's relative `profile:` path is read beside the model file when it is there."""
    reference = mapping.get("profile")
    if not isinstance(reference, str):
        return mapping
    from ckplan.inputs.profiles import is_profile_file

    if not is_profile_file(reference):
        return mapping
    beside = Path(model).parent / reference
    if Path(reference).is_absolute() or not Path(model).is_file() or not beside.is_file():
        return mapping
    return {**mapping, "profile": str(beside)}


def _unknown_model(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, preset_names(), n=1) if len(name) < 100 else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown model {quote(name)}{hint}: expected a preset name (see `ckplan presets`), "
        "a .yaml file or a config.json"
    )


def _parse_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        data = safe_yaml.load(text)
    except yaml.YAMLError as error:
        raise SpecError(f"{origin}: {safe_yaml.describe_error(error)}") from None
    if data is None:
        raise SpecError(f"{origin}: empty, expected a YAML mapping of keys to values")
    if not isinstance(data, dict):
        raise SpecError(
            f"{origin}: expected a YAML mapping of keys to values, got {type(data).__name__}"
        )
    return data


def _parse_json(text: str, origin: str) -> dict[str, Any]:
    try:
        data = json.loads(text, parse_int=_json_int, object_pairs_hook=_json_object)
    except json.JSONDecodeError as error:
        raise SpecError(f"{origin}: malformed JSON at line {error.lineno}: {error.msg}") from None
    except RecursionError:
        raise SpecError(f"{origin}: JSON nested too deeply: not a config.json") from None
    except _DuplicateKey as error:
        raise SpecError(f"{origin}: duplicate JSON key {quote(error.args[0])}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: expected a JSON object, got {type(data).__name__}")
    return data


class _DuplicateKey(ValueError):
    pass


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return data


def _json_int(text: str) -> int | str:
    """JSON integers as ints; one too long for any size stays text, which the spec rejects by
    key (Python refuses to convert over 4,300 digits, and no size has 100)."""
    return LongInteger(text) if len(text) > safe_yaml.MAX_NUMBER_CHARS else int(text)
