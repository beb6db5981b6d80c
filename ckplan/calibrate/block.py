"""One layer built for calibration, and the error calibrate raises (torch needed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class CalibrationError(ValueError):
    """A model calibrate cannot build or measure; one line."""


@dataclass
class Block:
    """One built layer: its module, how to run it, and the input storages that are not
    activations (an attention mask, RoPE's cos and sin)."""

    layer: torch.nn.Module
    forward: Callable  # (x, recorder) -> output
    exclude: set[int] = field(default_factory=set)
