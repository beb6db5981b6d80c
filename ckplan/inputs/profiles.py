"""Where kernel profiles come from: the shipped ones (`fused`, `torch-eager`, `torch-sdpa`, in
the top-level profiles/ folder, installed as `ckplan.profile_data`) or the user's YAML files.

A reference is a profile name, or a path when it ends in .yaml/.yml or holds a slash. Files are
parsed once per (path, modification time) and validated by `model.profiles.profile_from_mapping`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from ckplan.inputs import safe_yaml
from ckplan.inputs.files import read_text_file
from ckplan.model.profiles import Profile, ProfileError, profile_from_mapping
from ckplan.quoting import abbreviate, quote


def _profile_folder() -> Traversable:
    """The shipped profiles: the `ckplan.profile_data` package of an install, else the source
    tree's profiles/ folder (running from a checkout without installing)."""
    try:
        return resources.files("ckplan.profile_data")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "profiles"


def profile_names() -> list[str]:
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in _profile_folder().iterdir()
        if entry.name.endswith(".yaml")
    )


def is_profile_file(reference: str) -> bool:
    return reference.endswith((".yaml", ".yml")) or "/" in reference or os.sep in reference


def load_profile(reference: str) -> Profile:
    """The profile a model's `profile:` key (or --profile) names, carrying `reference` as the
    name the user gave; ProfileError when it is unknown, missing, unreadable or invalid."""
    profile = _load_profile(reference)
    return dataclasses.replace(profile, reference=reference)


def _load_profile(reference: str) -> Profile:
    if is_profile_file(reference):
        path = Path(reference)
        try:
            stat = path.stat()
        except (OSError, ValueError):
            stat = None
        if stat is None or not path.is_file():  # the reader says why
            return profile_from_mapping(_read(path, reference), abbreviate(reference))
        return _load_file(str(path), stat.st_mtime_ns, stat.st_size)
    if reference not in profile_names():
        close = (
            difflib.get_close_matches(reference, profile_names(), n=1)
            if len(reference) < 100
            else []
        )
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ProfileError(
            f"unknown profile {quote(reference)}{hint}: expected one of "
            f"{', '.join(profile_names())} or a .yaml file"
        )
    return _load_shipped(reference)


def profile_mapping(reference: str) -> dict:
    """The raw YAML mapping of a profile (shipped or a file), before validation."""
    if is_profile_file(reference):
        return _read(Path(reference), reference)
    load_profile(reference)  # the unknown-name error
    entry = _profile_folder().joinpath(f"{reference}.yaml")
    return _parse(entry.read_text(encoding="utf-8"), f"profile {reference}")


@lru_cache(maxsize=16)
def _load_shipped(name: str) -> Profile:
    entry = _profile_folder().joinpath(f"{name}.yaml")
    origin = f"profile {name}"
    return profile_from_mapping(_parse(entry.read_text(encoding="utf-8"), origin), origin)


@lru_cache(maxsize=64)
def _load_file(path: str, mtime_ns: int, size: int) -> Profile:
    return profile_from_mapping(_read(Path(path), path), abbreviate(path))


def _read(path: Path, origin: str) -> dict:
    """A profile file through the model files' reader (size cap, no devices, UTF-8) and the
    safe YAML loader."""
    text = read_text_file(path, f"profile {abbreviate(origin)}", ProfileError, "a profile file")
    return _parse(text, abbreviate(origin))


def _parse(text: str, origin: str) -> dict:
    try:
        data = safe_yaml.load(text)
    except yaml.YAMLError as error:
        raise ProfileError(f"{origin}: {safe_yaml.describe_error(error)}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: expected a YAML mapping with an 'ops' key")
    return data
