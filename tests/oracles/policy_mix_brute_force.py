"""Exhaustive search over persistent schedules and tape variants: the mixed DP's oracle."""

from __future__ import annotations

import itertools

from ckplan.schedules.chain import Chain, simulate
from ckplan.schedules.policy_mix import mixed_chain
from oracles.brute_force import BRUTE_FORCE_MAX_STAGES, enumerate_persistent_schedules


def brute_force_mixed(variants: list[Chain], budget_bytes: int):
    """(cost, steps, choice) of the cheapest schedule and variant vector that fits, or None.

    derived: independent of the DP's memory equations: every variant vector's mixed chain
    (one variant per stage) replays every persistent schedule with :func:`simulate`; exact
    bytes, no discretisation.
    """
    n = variants[0].length
    if n > BRUTE_FORCE_MAX_STAGES:
        raise ValueError(f"brute force is limited to {BRUTE_FORCE_MAX_STAGES} stages, got {n}")
    schedules = list(enumerate_persistent_schedules(n))
    best = None
    for choice in itertools.product(range(len(variants)), repeat=n):
        chain = mixed_chain(variants, choice)
        for steps in schedules:
            replay = simulate(chain, steps)
            if replay.peak_bytes > budget_bytes:
                continue
            if best is None or replay.total_flops < best[0]:
                best = (replay.total_flops, steps, choice)
    return best
