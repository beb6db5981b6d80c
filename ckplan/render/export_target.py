"""Which `ckplan export` target writes a plan under torchtitan: the `Export:` line of
`ckplan plan` and the `export` field of `plan --json` and `sweep --json` (docs/output.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExportTarget:
    """Which `ckplan export` writes a plan under torchtitan: `target` (`torchtitan`, `torch`,
    or None when none does), the command-line options that select it, and why."""

    target: str | None
    options: str | None
    reason: str

    @property
    def line(self) -> str:
        """The `Export:` line of `ckplan plan` (without its label and full stop)."""
        if self.target is None:
            return f"no export writes it; {self.reason}"
        if self.target == "torchtitan":
            return f"{self.options} writes it ({self.reason})"
        return f"{self.options} writes it, {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        """`export` in `plan --json` and `sweep --json` (docs/output.md)."""
        return {"target": self.target, "options": self.options, "reason": self.reason}


def export_choice(plan) -> ExportTarget | None:
    """Under torchtitan, which `ckplan export --to` target writes `plan`: torchtitan's own
    configuration (at the release the model runs, `framework_version`), else the torch snippet,
    run with torchtitan's activation checkpointing off, and why the configuration cannot; None
    under other frameworks, whose plans the search keeps to what their configuration runs."""
    from ckplan import exports
    from ckplan.model.torchtitan_ac import spec_release

    if plan.spec.framework != "torchtitan":
        return None
    release = spec_release(plan.spec)
    flag = "" if release == "0.3" else " --torchtitan-version 0.2"
    because = exports.why_not(plan, "torchtitan", release)
    if because is None:
        return ExportTarget(
            "torchtitan", f"--to torchtitan{flag}", f"torchtitan {release}'s configuration"
        )
    cannot = f"torchtitan {release}'s configuration cannot express {because}"
    if exports.why_not(plan, "torch") is None:
        return ExportTarget(
            "torch",
            "--to torch",
            f"to run with torchtitan's activation checkpointing off; {cannot}",
        )
    return ExportTarget(None, None, cannot)


def export_target(plan) -> str | None:
    """The `Export:` line's text for `plan` (`export_choice`), None outside torchtitan."""
    choice = export_choice(plan)
    return None if choice is None else choice.line


def export_dict(plan) -> dict[str, Any] | None:
    """Which export writes `plan` (`export_choice`), as JSON; None outside torchtitan."""
    choice = export_choice(plan)
    return None if choice is None else choice.to_dict()
