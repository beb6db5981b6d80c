"""A kernel profile as a value: the numbers a profile gives per op, once read and validated.

The model never reads files: the edge (`ckplan.inputs.profiles`) reads a profile's YAML, and
`ckplan.model.profiles.profile_from_mapping` validates it into a `Profile` that the model
description carries (`ModelSpec.profile`). `FUSED` is the op table itself (no op replaced).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

Form = tuple[Fraction, Fraction]  # bytes per element: (constant, multiple of B)
Terms = tuple[tuple[str, Form], ...]
Field = tuple[Terms, ...]  # alternatives: the field is the largest of them (one, mostly)
Condition = tuple[tuple[bool, str, Any], ...]  # (negated, key, value or None for a bare key)

FUSED_NAME = "fused"


@dataclass(frozen=True)
class Case:
    """Field values of one op that apply when `condition` holds (always, when empty)."""

    condition: Condition
    fields: tuple[tuple[str, Field], ...]


@dataclass(frozen=True)
class Profile:
    """A profile's numbers per op. `reference` is what the user wrote to name it (a shipped name
    or a file path), shown in the output as the model's `profile` key."""

    name: str
    source: str = ""
    description: str = ""
    requires: Condition = ()
    ops: tuple[tuple[str, tuple[Case, ...]], ...] = ()
    reference: str = ""

    def __post_init__(self) -> None:
        if not self.reference:
            object.__setattr__(self, "reference", self.name)

    def cases(self, op: str) -> tuple[Case, ...]:
        return dict(self.ops).get(op, ())

    @property
    def is_fused(self) -> bool:
        """The op table itself (the shipped `fused` profile restates it): nothing to apply."""
        return self.reference == FUSED_NAME


FUSED = Profile(name=FUSED_NAME, source="the op table (ckplan.model.ops)")
