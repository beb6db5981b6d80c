"""Periodic stretches of a chain: where the stages repeat with a short period.

A model whose layers alternate kinds (dense and MoE every other layer, Gemma 2's local and
global attention) has no long stretch of *equal* stages, but long stretches where stage ``p``
equals stage ``p + P`` for a small period ``P``. The closed-form replay
(:mod:`ckplan.schedules.segment_replay`) and the grouping of very deep chains
(:mod:`ckplan.schedules.grouping`) work on such stretches as they do on runs of equal stages:
inside one, a sum over ``P`` consecutive stages is the same wherever it starts, and a prefix sum
(of tapes, of FLOPs) grows by the same amount every ``P`` stages.

Sequences here are of hashable items (a stage's figures as a tuple, a layer's kind); they are
interned to small ints first, so that comparing them runs in C.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import compress
from operator import ne

MAX_PERIOD = 12  # the longest period looked for in a chain (Gemma 2: 2; every-3rd-MoE: 3)
FEW = 7  # positions that may break a period (a chain's ends) for it to be taken at once


def intern(items: Sequence[Hashable]) -> list[int]:
    """Each item as a small int, equal items equal ints (numbered in order of first appearance)."""
    ids = {item: index for index, item in enumerate(dict.fromkeys(items))}
    return list(map(ids.__getitem__, items))


def mismatches(ids: Sequence[int], period: int) -> int:
    """How many ``i`` have ``ids[i] != ids[i + period]``."""
    return sum(map(ne, ids, ids[period:]))


def bulk_period(ids: Sequence[int], max_period: int = MAX_PERIOD) -> int:
    """The period of most of the sequence: the smallest ``P <= max_period`` with at most
    ``FEW`` positions unlike the one ``P`` after them (the ends of a chain, embedding and
    output, break the period of its layers only there), else the ``P`` with the fewest such
    positions plus ``P`` (shorter periods preferred on a tie). Any period keeps the callers
    exact; a good one only makes them faster."""
    n = len(ids)
    best, best_score = 1, mismatches(ids, 1) + 1
    if best_score <= FEW + 1:  # runs of equal stages: the common case, decided at once
        return 1
    for period in range(2, min(max_period, n - 1) + 1):
        score = mismatches(ids, period) + period
        if score <= FEW + period:
            return period
        if score < best_score:
            best, best_score = period, score
    return best


def periodic_ends(ids: Sequence[int], period: int) -> list[int]:
    """For each ``p``, the last ``q >= p`` such that ``ids[p..q]`` is ``period``-periodic
    (``ids[r] == ids[r + period]`` whenever ``p <= r < r + period <= q``). With ``period = 1``,
    the end of the run of equal items at ``p``."""
    n = len(ids)
    # The positions r unlike the one ``period`` on (and the last ``period``, which have none):
    # for p up to such an r, the stretch ends at r + period - 1.
    fails = list(compress(range(n), map(ne, ids, ids[period:])))
    fails.extend(range(max(0, n - period), n))
    ends: list[int] = []
    p = 0
    for fail in fails:
        if fail >= p:
            ends.extend([min(n - 1, fail + period - 1)] * (fail + 1 - p))
            p = fail + 1
    return ends
