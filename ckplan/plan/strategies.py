"""Strategies: the `--strategy` grammar (DESIGN.md) parsed and checked against a model."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckplan.model.spec import ModelSpec
from ckplan.quoting import quote

FORMULAS = ("derived", "seed")


class StrategyError(ValueError):
    """A strategy string that names no strategy, or does not fit the model."""


@dataclass(frozen=True)
class Strategy:
    """A parsed `--strategy`: `kind` with its integer `size` (K, N or C) where it takes one."""

    kind: str  # none | full | uniform | sequential | sqrt | selective | block | revolve | optimal
    size: int | None = None
    selective: bool = False  # attention core recomputed on top of `kind`

    @property
    def name(self) -> str:
        base = self.kind if self.size is None else f"{self.kind}:{self.size}"
        if self.selective and self.kind != "selective":
            return f"selective+{base}"
        return base


_SIZED = ("uniform", "sequential", "block", "revolve")
_PLAIN = ("none", "full", "sqrt", "selective", "optimal")
STRATEGY_HELP = (
    "none, full, uniform:K, sequential:K, sqrt, selective, block:N, revolve:C, optimal, "
    "or selective+ any of these (e.g. selective+uniform:4)"
)


def parse_strategy(text: str, spec: ModelSpec) -> Strategy:
    """Parse a `--strategy` value and check its size against the layers of one pipeline stage."""
    selective = False
    body = text.strip()
    if body.startswith("selective+"):
        selective, body = True, body.removeprefix("selective+")
    match = re.fullmatch(r"([a-z]+)(?::(-?[0-9]{1,18}))?", body)
    kind = match.group(1) if match else ""
    size = int(match.group(2)) if match and match.group(2) is not None else None
    if not match or kind not in _SIZED + _PLAIN or (kind in _PLAIN) != (size is None):
        raise StrategyError(f"unknown strategy {quote(text)}: expected one of {STRATEGY_HELP}")
    if selective and kind == "selective":
        raise StrategyError(f"strategy {quote(text)}: selective cannot combine with itself")
    layers = spec.layers_per_stage
    if kind in ("uniform", "sequential") and not 1 <= size <= layers:
        raise StrategyError(f"strategy {quote(text)}: K must be in 1..{layers} (layers per stage)")
    if kind == "block" and not 0 <= size <= layers:
        raise StrategyError(f"strategy {quote(text)}: N must be in 0..{layers} (layers per stage)")
    if kind == "revolve" and size < 1:
        raise StrategyError(f"strategy {quote(text)}: C must be at least 1 checkpoint slot")
    if kind == "none" and selective:
        return Strategy("selective")
    if kind == "full" and selective:
        kind, size = "uniform", 1  # full recompute already re-runs the attention core
    return Strategy(kind, size, selective or kind == "selective")
