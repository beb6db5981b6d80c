"""JSON for "no schedule fits" (exit 1), so that a CI job reading `--json` always gets JSON.

The shape is the command's usual one with the plan's figures null, `fits: false` and the reason
in `notes`, as `sweep --json` answers `"best": null` when nothing fits.
"""

from __future__ import annotations

from typing import Any

from ckplan import __version__
from ckplan.model.memory import model_state_bytes
from ckplan.model.spec import ModelSpec


def _no_plan(spec: ModelSpec, strategy: str, activation_budget: int, reason: str) -> dict:
    return {
        "strategy": strategy,
        "formula": "derived",
        "memory": None,
        "parameters": None,
        "flops": None,
        "overhead": None,
        "notes": [reason],
        "model_state_bytes": model_state_bytes(spec).total,
        "activation_budget_bytes": activation_budget,
        "fits": False,
    }


def estimate_no_fit_dict(
    spec: ModelSpec, strategy: str, usable_bytes: int, activation_budget: int, reason: str
) -> dict[str, Any]:
    """`estimate --strategy optimal --budget B --json` when no schedule fits."""
    return {
        "ckplan_version": __version__,
        "model": spec.to_dict(),
        **_no_plan(spec, strategy, activation_budget, reason),
        "usable_bytes": usable_bytes,
        "headroom_bytes": None,
    }


def schedule_no_fit_dict(
    spec: ModelSpec, strategy: str, activation_budget: int, reason: str, stages: list[str]
) -> dict[str, Any]:
    """`schedule --budget B --json` when no schedule fits."""
    return {**_no_plan(spec, strategy, activation_budget, reason), "stages": stages, "steps": []}
