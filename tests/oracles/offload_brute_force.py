"""Exhaustive search over offload schedules: the oracle the joint DP is tested against."""

from __future__ import annotations

from itertools import combinations

from ckplan.schedules import Chain
from ckplan.schedules.offload import (
    first_pass_stages,
    offload_exposed_cost,
    simulate_offload,
)
from oracles.brute_force import BRUTE_FORCE_MAX_STAGES, enumerate_persistent_schedules


def brute_force_offload(chain: Chain, budget_bytes: int, copy_cost, host_budget_bytes=None):
    """(cost, steps, offloaded, replay) of the cheapest persistent schedule with any set of its
    first-pass tapes offloaded whose device peak fits ``budget_bytes`` (and host peak
    ``host_budget_bytes``), or None.

    derived: independent of the DP's equations: every candidate's peaks come from
    :func:`simulate_offload` (a set the rules refuse is skipped), its cost from the replay's
    FLOPs plus :func:`offload_exposed_cost`. Exact bytes.
    """
    n = chain.length
    if n > BRUTE_FORCE_MAX_STAGES:
        raise ValueError(f"brute force is limited to {BRUTE_FORCE_MAX_STAGES} stages, got {n}")
    best = None
    for steps in enumerate_persistent_schedules(n):
        candidates = [i for i in first_pass_stages(steps, n) if i < n - 1]
        for size in range(len(candidates) + 1):
            for stages in combinations(candidates, size):
                try:
                    replay = simulate_offload(chain, steps, stages)
                except ValueError:
                    continue
                if replay.device_peak_bytes > budget_bytes:
                    continue
                if host_budget_bytes is not None and replay.host_peak_bytes > host_budget_bytes:
                    continue
                cost = replay.total_flops + offload_exposed_cost(
                    chain.forward_flops, chain.backward_flops, copy_cost, stages
                )
                if best is None or cost < best[0]:
                    best = (cost, steps, stages, replay)
    return best
