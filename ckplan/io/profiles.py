"""Where kernel profiles come from: the shipped ones (`fused`, `torch-eager`, `torch-sdpa`, in
the top-level profiles/ folder, installed as `ckplan.profile_data`) or the user's YAML files.

A reference is a profile name, or a path when it ends in .yaml/.yml or holds a slash. Files are
parsed once per (path, modification time) and validated by `model.profiles.profile_from_mapping`.
"""

from __future__ import annotations

import difflib
import os
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

from ckplan.model.profiles import Profile, ProfileError, profile_from_mapping


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
    """The profile a model's `profile:` key (or --profile) names; ProfileError when it is
    unknown, missing, unreadable or invalid."""
    if is_profile_file(reference):
        path = Path(reference)
        try:
            stat = path.stat()
        except OSError:
            raise ProfileError(f"profile {reference}: no such file") from None
        return _load_file(str(path), stat.st_mtime_ns, stat.st_size)
    if reference not in profile_names():
        close = difflib.get_close_matches(reference, profile_names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ProfileError(
            f"unknown profile {reference!r}{hint}: expected one of "
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
    return profile_from_mapping(_read(Path(path), path), path)


def _read(path: Path, origin: str) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"profile {origin}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileError(f"profile {origin}: cannot read file ({error})") from None
    return _parse(text, origin)


def _parse(text: str, origin: str) -> dict:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "invalid YAML"
        raise ProfileError(f"{origin}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: expected a YAML mapping with an 'ops' key")
    return data
