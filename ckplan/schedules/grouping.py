"""Very deep chains: the optimal DP over groups of consecutive stages.

The rotor DP costs O(classes * n * slots), and its pipelined first pass O(n^2 * (slots / q)^2):
seconds at a few hundred stages, hours at 10,000. Beyond the limits below the DP runs on a chain
of groups of ``g`` consecutive equal stages, each group one stage whose schedule steps expand to
its members. The answer is the cheapest schedule that treats each group as a unit, a feasible
schedule (its exact replay fits the budget) but not always the optimum of the full chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ckplan.schedules.chain import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_INPUT,
    Chain,
    Schedule,
    Step,
)
from ckplan.schedules.periodic import bulk_period, intern, periodic_ends

# What the DP may cost before it runs on groups instead (about a second each on one core):
DP_MAX_WORK = 4 * 10**8  # leaf candidates of the regular table, sum over classes of n * slots
DP_MAX_CELLS = 15 * 10**6  # kept table entries, classes * slots (two int64 tables: 240 MB)
FIRST_PASS_MAX_WORK = 4 * 10**9  # first-pass entries before pruning, n^2 / 2 * (slots / q)^2
COUNTED_STAGES = 600  # chains are first grouped down to this many stages, then classes counted


def stage_kinds(chain: Chain) -> list[tuple[int, ...]]:
    """What makes two stages of ``chain`` equal to the DP, stage by stage: their forward and
    backward FLOPs, input, tape and workspace bytes."""
    return list(
        zip(
            chain.forward_flops,
            chain.backward_flops,
            chain.input_bytes[: chain.length],
            chain.tape_bytes,
            chain.forward_workspace_bytes,
            chain.backward_workspace_bytes,
            strict=True,
        )
    )


def stage_groups(chain: Chain, size: int, periodic: bool = True) -> list[tuple[int, int]]:
    """Groups ``[p, q)`` covering the chain in order: each run of equal stages cut into groups
    of ``size`` (its last group shorter); stages unlike their neighbours (embedding, output)
    stay alone. ``size = 1``: one group per stage. Where the stages alternate with a period
    ``P`` > 1, groups of whole periods instead (:func:`_periodic_groups`), unless not
    ``periodic``."""
    n = chain.length
    if size == 1:
        return [(p, p + 1) for p in range(n)]
    kinds = stage_kinds(chain)
    ids = intern(kinds)
    period = bulk_period(ids) if periodic else 1
    if period > 1:
        return _periodic_groups(ids, period, size)
    runs, start = [], 0
    for p in range(1, n + 1):
        if p == n or kinds[p] != kinds[start]:
            runs.append((start, p))
            start = p
    return [(p, min(p + size, end)) for start, end in runs for p in range(start, end, size)]


def _periodic_groups(ids: list[int], period: int, size: int) -> list[tuple[int, int]]:
    """``stage_groups`` where the stages repeat with ``period`` > 1 (layers that alternate
    kinds, :mod:`ckplan.schedules.periodic`): each periodic stretch cut into groups of whole
    periods, ``ceil(size / period)`` of them (its last group shorter), so that its groups are
    equal as runs of equal stages' are; stages outside such stretches stay alone."""
    n = len(ids)
    ends = periodic_ends(ids, period)
    length = -(-size // period) * period
    groups: list[tuple[int, int]] = []
    p = 0
    while p < n:
        end = ends[p] + 1
        if end - p < 2 * period:  # no repetition here (embedding, output)
            groups.append((p, p + 1))
            p += 1
            continue
        groups.extend((q, min(q + length, end)) for q in range(p, end, length))
        p = end
    return groups


def dp_work(chain: Chain, width: int, in_flight) -> tuple[int, int, int]:
    """(regular work, regular cells, first-pass work) of the DP on ``chain`` with ``width``
    memory slots: the counts its limits above are about. Classes of equal sub-chains are
    counted as the DP forms them (bytes here, so that the count bounds the DP's, in slots)."""
    n = chain.length
    stage = intern(stage_kinds(chain))
    heads: dict[tuple[int, int], int] = {}
    classes: dict[tuple[int, int], int] = {}
    work = 0
    for i in range(n):
        head = -1
        for j in range(i + 1, n + 1):
            head = heads.setdefault((head, stage[j - 1]), len(heads))
            key = (head, chain.input_bytes[j])
            if key not in classes:
                classes[key] = len(classes)
                work += (j - i) * width
    first_pass = 0 if in_flight == 1 else int(n * n // 2 * (width / in_flight) ** 2)
    return work, len(classes) * width, first_pass


def _within(work: tuple[int, int, int]) -> bool:
    regular, cells, first_pass = work
    return regular <= DP_MAX_WORK and cells <= DP_MAX_CELLS and first_pass <= FIRST_PASS_MAX_WORK


@lru_cache(maxsize=16)
def optimal_groups(chain: Chain, width: int, in_flight) -> tuple[tuple[int, int], ...]:
    """The groups the optimal DP runs on: one per stage when its work is within the limits
    above, else the smallest group size that brings it there."""
    size = max(1, -(-chain.length // COUNTED_STAGES))
    # First the groups of equal stages alone, as long as there are few enough to count: an
    # alternating chain of a few hundred stages keeps its exact DP (no equal neighbours to
    # group); beyond, or where that is over the limits, groups of whole periods.
    runs = stage_groups(chain, size, periodic=False)
    if len(runs) <= 2 * COUNTED_STAGES and runs != stage_groups(chain, size):
        coarse = chain if len(runs) == chain.length else grouped_chain(chain, runs)
        if _within(dp_work(coarse, width, in_flight)):
            return tuple(runs)
    while True:
        groups = stage_groups(chain, size)
        coarse = chain if size == 1 else grouped_chain(chain, groups)
        if len(groups) == 1 or _within(dp_work(coarse, width, in_flight)):
            return tuple(groups)
        size = max(size + 1, size * 5 // 4)


def grouped_chain(chain: Chain, groups: Sequence[tuple[int, int]]) -> Chain:
    """One stage per group ``[p, q)``: its FLOPs summed, input ``x_p``, tape the members' tapes,
    and workspaces that cover every step of the members.

    derived from the replay rules (chain module docstring), ``T`` the members' tapes up to a
    stage: the members' forwards, any kind, hold at most ``T(p..r-1) + x_r + fws_r + x_{r+1}``
    beyond the rest of the chain's live set (a kept ``x_p`` is within ``tape_p``), the group's
    forward ``x_p + fws + x_q``; their backwards ``T(p..r) + x_{r+1} + bws_r + x_r``, the
    group's ``tape + x_q + bws + x_p``. So the group's replayed peak bounds its members', and
    the expanded schedule fits wherever the grouped one does (``optimal_schedule`` replays it
    exactly to make sure). One-stage groups are the stages themselves."""
    a, t = chain.input_bytes, chain.tape_bytes
    fws, bws = chain.forward_workspace_bytes, chain.backward_workspace_bytes
    forward, backward, inputs, tapes, forward_ws, backward_ws = [], [], [], [], [], []
    for p, q in groups:
        held, forward_peak, backward_peak = 0, 0, 0
        for r in range(p, q):
            forward_peak = max(forward_peak, held + a[r] + fws[r] + a[r + 1])
            held += t[r]
            backward_peak = max(backward_peak, held + a[r + 1] + bws[r] + a[r])
        forward.append(sum(chain.forward_flops[p:q]))
        backward.append(sum(chain.backward_flops[p:q]))
        inputs.append(a[p])
        tapes.append(held)
        forward_ws.append(max(0, forward_peak - a[p] - a[q]))
        backward_ws.append(max(0, backward_peak - held - a[q] - a[p]))
    return Chain(forward, backward, (*inputs, a[-1]), tapes, forward_ws, backward_ws)


def expand_schedule(steps: Schedule, groups: Sequence[tuple[int, int]]) -> Schedule:
    """The grouped chain's schedule on the stages themselves: a group's keep_all keeps all its
    members, keep_input keeps the first member's input and drops the rest, drop drops them all,
    backward runs the members' backwards last to first."""
    out: list[Step] = []
    for step in steps:
        p, q = groups[step.stage]
        if step.kind == BACKWARD:
            out.extend(Step(BACKWARD, r) for r in range(q - 1, p - 1, -1))
        elif step.kind == FORWARD_KEEP_INPUT:
            out.append(Step(FORWARD_KEEP_INPUT, p))
            out.extend(Step(FORWARD_DROP, r) for r in range(p + 1, q))
        else:
            out.extend(Step(step.kind, r) for r in range(p, q))
    return tuple(out)
