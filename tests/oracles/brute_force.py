"""Exhaustive search over persistent schedules: the oracle the DP is tested against."""

from __future__ import annotations

from collections.abc import Iterator
from fractions import Fraction
from functools import lru_cache

from ckplan.schedules.chain import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    Chain,
    Schedule,
    ScheduleResult,
    Step,
    in_flight_fraction,
    pipeline_peak_bytes,
    simulate,
)
from ckplan.schedules.rotor import (
    schedule_result,
)

# Stages in the exhaustive search; 7 stages have 1806 persistent schedules (a Schröder number).
BRUTE_FORCE_MAX_STAGES = 8


def enumerate_persistent_schedules(n: int) -> Iterator[Schedule]:
    """Every persistent schedule of an ``n``-stage chain (the decision structure of rotor).

    To reverse ``[i, j)`` from ``x_i``: either store the tape of stage ``i`` and continue, or keep
    ``x_i`` and advance (dropping) to any ``k`` in ``(i, j)``, reverse ``[k, j)``, then ``[i, k)``.
    Counts are the large Schröder numbers 1, 2, 6, 22, 90, 394, 1806, ...
    Source: Beaumont et al. 2019 (rotor), the characterisation of persistent schedules.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a chain needs at least one stage, got {n!r}")
    yield from _persistent_schedules(0, n)


@lru_cache(maxsize=4096)
def _persistent_schedules(i: int, j: int) -> tuple[Schedule, ...]:
    if j == i + 1:
        return ((Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)),)
    out: list[Schedule] = []
    head_all = (Step(FORWARD_KEEP_ALL, i),)
    tail = (Step(BACKWARD, i),)
    out.extend(head_all + rest + tail for rest in _persistent_schedules(i + 1, j))
    for k in range(i + 1, j):
        head = (Step(FORWARD_KEEP_INPUT, i), *(Step(FORWARD_DROP, p) for p in range(i + 1, k)))
        for right in _persistent_schedules(k, j):
            out.extend(head + right + left for left in _persistent_schedules(i, k))
    return tuple(out)


def brute_force_optimal(
    chain: Chain, budget_bytes: int, in_flight: int | Fraction = 1
) -> ScheduleResult | None:
    """Exhaustive search: replay every persistent schedule, keep the cheapest that fits.

    derived: independent of the DP's memory equations — each candidate's peak and cost come from
    :func:`simulate` (with ``in_flight`` micro-batches, its :func:`pipeline_peak_bytes` must
    fit). Exact bytes, no discretisation. For chains of at most ``BRUTE_FORCE_MAX_STAGES``
    stages (1806 schedules at 7 stages).
    """
    n = chain.length
    if n > BRUTE_FORCE_MAX_STAGES:
        raise ValueError(f"brute force is limited to {BRUTE_FORCE_MAX_STAGES} stages, got {n}")
    q = in_flight_fraction(in_flight)
    best: tuple[int, Schedule] | None = None
    for steps in enumerate_persistent_schedules(n):
        replay = simulate(chain, steps)
        if pipeline_peak_bytes(chain, replay, q) > budget_bytes:
            continue
        if best is None or replay.total_flops < best[0]:
            best = (replay.total_flops, steps)
    if best is None:
        return None
    return schedule_result(chain, best[1], budget_bytes, 1, budget_bytes, in_flight=q)
