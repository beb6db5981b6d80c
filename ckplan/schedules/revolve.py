"""Revolve: binomial checkpointing with a fixed number of slots (Griewank & Walther 2000)."""

from __future__ import annotations

import math
from functools import lru_cache

from ckplan.schedules.chain import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    Chain,
    Schedule,
    Step,
)


def beta(s: int, t: int) -> int:
    """``beta(s, t) = C(s + t, s)``: steps reversible with ``s`` checkpoints, ``t`` re-advances.

    Source: Griewank & Walther 2000, "Algorithm 799: Revolve", ACM TOMS 26(1), §2 (binomial
    reversal schedules; Griewank 1992). Defined as 0 for ``t < 0``.
    """
    if s < 0:
        raise ValueError("beta: s must be >= 0")
    if t < 0:
        return 0
    return math.comb(s + t, s)


def revolve_min_forwards(l: int, s: int) -> int:  # noqa: E741 (the paper's name)
    """Minimal number of extra forward steps to reverse ``l`` steps with ``s`` checkpoints.

    Closed form ``r*l - beta(s+1, r-1)`` with ``r`` the integer such that
    ``beta(s, r-1) < l <= beta(s, r)``. Source: Griewank & Walther 2000, "Algorithm 799:
    Revolve", ACM TOMS 26(1), §2, the proposition on the minimal number of extra forward steps
    (checked here against :func:`revolve_dp_table` for l <= 200, s <= 10). ``s`` counts the slot
    holding the initial state; the ``l`` taping forwards that precede each reverse step are not
    counted (in this package's chain model: the recompute count in stage forwards).
    Raises ``ValueError`` when ``s == 0 and l >= 2`` (not reversible).
    """
    if l < 0 or s < 0:
        raise ValueError("revolve_min_forwards: l and s must be >= 0")
    if l <= 1:
        return 0
    if s == 0:
        raise ValueError("cannot reverse more than one step with 0 checkpoints")
    r = 0
    while beta(s, r) < l:
        r += 1
    return r * l - beta(s + 1, r - 1)


@lru_cache(maxsize=8)
def revolve_dp_table(l_max: int, s_max: int) -> tuple[tuple[int | None, ...], ...]:
    """Table ``p[l][s]`` (``l <= l_max``, ``s <= s_max``) of the textbook Revolve recursion.

    ``p(0, s) = p(1, s) = 0``; ``p(l, 0)`` undefined (None) for ``l >= 2``;
    ``p(l, s) = min over 1 <= j < l of j + p(l - j, s - 1) + p(j, s)``: advance ``j`` steps,
    store a checkpoint there, reverse the right part with one slot fewer, then the left part.
    Source: Griewank 1992, "Achieving logarithmic growth of temporal and spatial complexity in
    reverse automatic differentiation", Optim. Methods Softw. 1 (the recursion behind binomial
    checkpointing, Griewank & Walther 2000, §2).
    """
    p: list[list[int | None]] = [[0] * (s_max + 1) for _ in range(l_max + 1)]
    for ll in range(2, l_max + 1):
        p[ll][0] = None
        for s in range(1, s_max + 1):
            best = None
            for j in range(1, ll):
                right = p[ll - j][s - 1]
                if right is None:
                    continue
                cand = j + right + p[j][s]
                if best is None or cand < best:
                    best = cand
            p[ll][s] = best
    return tuple(tuple(row) for row in p)


def revolve_dp_min_forwards(l: int, s: int) -> int:  # noqa: E741 (the paper's name)
    """:func:`revolve_dp_table` at ``(l, s)``; ``ValueError`` where not reversible."""
    if l < 0 or s < 0:
        raise ValueError("revolve_dp_min_forwards: l and s must be >= 0")
    value = revolve_dp_table(l, s)[l][s]
    if value is None:
        raise ValueError("cannot reverse more than one step with 0 checkpoints")
    return value


@lru_cache(maxsize=65536)
def _revolve_cost(l: int, s: int) -> int | None:  # noqa: E741
    if l >= 2 and s == 0:
        return None
    return revolve_min_forwards(l, s)


def _advance_cost(length: int, s: int, adv: int) -> int | None:
    right = _revolve_cost(length - adv, s - 1)
    return None if right is None else adv + right + _revolve_cost(adv, s)


def _best_advance(length: int, s: int) -> int:
    """The first ``adv`` in ``1..length-1`` minimising ``adv + t(length - adv, s - 1) +
    t(adv, s)``, ``t`` = :func:`revolve_min_forwards`, by bisection instead of a scan.

    derived: ``t(l, s)`` is convex in ``l`` (0 up to ``l = 1``, then linear with slope ``r`` on
    ``beta(s, r-1) < l <= beta(s, r)``, continuous by Pascal's rule), so the cost is convex in
    ``adv`` and its first minimum is the first ``adv`` whose forward difference is ``>= 0``.
    With ``s = 1`` the right part has no slot left: only ``adv = length - 1`` is feasible.
    """
    if s == 1:
        return length - 1
    low, high = 1, length - 1  # the answer lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if _advance_cost(length, s, middle + 1) - _advance_cost(length, s, middle) >= 0:
            high = middle
        else:
            low = middle + 1
    return low


def revolve_schedule(chain: Chain, slots_count: int) -> Schedule:
    """Binomial (Revolve) schedule with ``slots_count`` checkpoint slots for stored inputs.

    Homogeneous view: every stage counts as one step. ``x_0`` occupies one slot. To reverse stages
    ``[i, j)`` with ``s`` slots: if ``j = i + 1`` run ``forward_keep_all(i), backward(i)``; else
    keep ``x_i`` (``forward_keep_input``), advance with ``forward_drop`` to ``x_k``, reverse
    ``[k, j)`` with ``s - 1`` slots, then ``[i, k)`` with ``s``. The split ``k`` minimises
    ``(k - i) + t(j - k, s - 1) + t(k - i, s)`` with ``t`` the closed form of
    :func:`revolve_min_forwards`, so the schedule re-advances each step several times and its
    recompute count (stage forwards beyond one each) equals ``t(n, slots_count)``.
    Source: Griewank & Walther 2000, "Algorithm 799: Revolve", ACM TOMS 26(1), §2-3.
    """
    n = chain.length
    if isinstance(slots_count, bool) or not isinstance(slots_count, int) or slots_count < 1:
        raise ValueError(f"revolve needs at least one checkpoint slot, got {slots_count!r}")
    steps: list[Step] = []
    stack: list[tuple[int, int, int] | Step] = [(0, n, slots_count)]
    while stack:
        item = stack.pop()
        if isinstance(item, Step):
            steps.append(item)
            continue
        i, j, s = item
        length = j - i
        if length == 1:
            steps += [Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)]
            continue
        k = i + _best_advance(length, s)
        steps.append(Step(FORWARD_KEEP_INPUT, i))
        steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, k))
        stack.append((i, k, s))
        stack.append((k, j, s - 1))
    return tuple(steps)
