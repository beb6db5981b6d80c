"""Optimal persistent schedules where each stage also chooses its tape: the rotor DP with
several ways to store a stage.

A *tape variant* of a chain is the same chain with other tapes, backward costs and backward
workspaces: a per-op policy (``ckplan.model.op_policy``) keeps fewer of a layer's tensors, and
its backward first re-runs the ops it did not keep. The forward of a stage, its input and its
output are the same in every variant. A *mixed chain* takes each stage from one variant.

In a persistent schedule each stage's tape is stored exactly once (by its one
``forward_keep_all``, consumed by its one backward), so a schedule together with one variant
per stage is replayed exactly by :func:`~ckplan.schedules.chain.simulate` on the mixed chain
(:func:`mixed_chain`); the DP below chooses both.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ckplan.schedules.chain import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    Chain,
    Replay,
    Schedule,
    Step,
    simulate,
)
from ckplan.schedules.segments import store_all_schedule

# Chains longer than this are refused: the table holds n * (n + 1) rows of slots.
MIX_MAX_STAGES = 160
MAX_EXACT_COST = 2**60
_INF = 2**61


def check_variants(variants: Sequence[Chain]) -> tuple[Chain, ...]:
    """Validate tape variants: at least one, all of one length, with equal forward FLOPs,
    inputs and forward workspaces (only tapes, backward FLOPs and backward workspaces differ)."""
    variants = tuple(variants)
    if not variants or not all(isinstance(v, Chain) for v in variants):
        raise ValueError("variants must be a non-empty sequence of Chain")
    first = variants[0]
    for k, v in enumerate(variants[1:], 1):
        for field in ("forward_flops", "input_bytes", "forward_workspace_bytes"):
            if getattr(v, field) != getattr(first, field):
                raise ValueError(f"variant {k} differs from variant 0 in {field}")
    return variants


def mixed_chain(variants: Sequence[Chain], choice: Sequence[int]) -> Chain:
    """The chain whose stage ``i`` is stage ``i`` of ``variants[choice[i]]``.

    derived: the variants share forwards and inputs (:func:`check_variants`); a stage's tape,
    backward FLOPs and backward workspace are those of the variant that stores it."""
    variants = check_variants(variants)
    n = variants[0].length
    if len(choice) != n or any(not 0 <= v < len(variants) for v in choice):
        raise ValueError(f"choice must give one variant in 0..{len(variants) - 1} per stage")
    base = variants[0]
    return Chain(
        forward_flops=base.forward_flops,
        backward_flops=tuple(variants[v].backward_flops[i] for i, v in enumerate(choice)),
        input_bytes=base.input_bytes,
        tape_bytes=tuple(variants[v].tape_bytes[i] for i, v in enumerate(choice)),
        forward_workspace_bytes=base.forward_workspace_bytes,
        backward_workspace_bytes=tuple(
            variants[v].backward_workspace_bytes[i] for i, v in enumerate(choice)
        ),
    )


@dataclass(frozen=True)
class MixResult:
    """A schedule of :func:`optimal_mixed_schedule`: its steps, the variant each stage's tape
    comes from, the DP's cost (equal to the replay's FLOPs) and the exact replay on the mixed
    chain."""

    steps: Schedule
    choice: tuple[int, ...]
    chain: Chain
    replay: Replay
    cost: int
    budget_bytes: int
    slot_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.replay.peak_bytes


def optimal_mixed_schedule(
    variants: Sequence[Chain], budget_bytes: int, slots: int = 500
) -> MixResult | None:
    """The cheapest persistent schedule, with one tape variant per stage, whose peak fits
    ``budget_bytes``; None if none fits.

    Source: Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova 2019 (rotor, hal-02352969), the
    recursion of :func:`~ckplan.schedules.rotor.optimal_schedule` with its "chain" option taken
    over every variant. derived: in a persistent schedule each stage is stored once, so the
    variant chosen where ``C(i, j, m)`` stores stage ``i`` is independent of every other
    choice; tests check the DP against every schedule and every variant vector.

    With ``g_p = x_p + fws_p + x_{p+1}`` and, for variant ``v``,
    ``bwd^v_i = tape^v_i + x_{i+1} + bws^v_i + x_i``:

    * store ``i`` as variant ``v``: ``f_i + b^v_i + C(i+1, j, m - tape^v_i)`` (``f_i + b^v_i``
      for ``j = i + 1``) if ``m >= max(x_j + g_i, bwd^v_i)``;
    * leaf at ``i < k < j``: ``f_i + ... + f_{k-1} + C(k, j, m - x_i) + C(i, k, m)`` if
      ``m >= x_j + max(g_i, x_i + max_{i<p<k} g_p)``.

    Sizes are rounded up to slots of ``ceil(budget / slots)`` bytes (``slots >= budget_bytes``
    is exact); storing every stage as its cheapest-backward variant, the cheapest schedule
    there is, is returned whenever it fits at exact sizes, and storing every stage as one
    variant, at exact sizes, whenever it fits and is cheaper than the DP's schedule. Ties:
    variants in their order, then the smallest ``k`` (a leaf only when strictly cheaper). The
    result's peak is the replay's.
    """
    variants = check_variants(variants)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    n = variants[0].length
    if n > MIX_MAX_STAGES:
        raise ValueError(f"the mixed DP plans chains of at most {MIX_MAX_STAGES} stages, got {n}")
    f = variants[0].forward_flops
    backs = [v.backward_flops for v in variants]
    bound = n * sum(f) + sum(max(col) for col in zip(*backs, strict=True))
    if bound >= MAX_EXACT_COST:
        raise ValueError(
            f"costs too large for the exact mixed DP (n * total = {bound} >= 2**60): give them "
            "in a coarser unit"
        )
    unit = max(1, -(-budget_bytes // slots))
    mem = budget_bytes // unit
    cheapest = tuple(
        min(range(len(variants)), key=lambda v, i=i: (backs[v][i], v)) for i in range(n)
    )
    plain = store_all_schedule(variants[0])
    if simulate(mixed_chain(variants, cheapest), plain).peak_bytes <= budget_bytes:
        found = (plain, cheapest, sum(f) + sum(backs[v][i] for i, v in enumerate(cheapest)))
    else:
        found = _MixTable(variants, unit, mem).solve()
        # every stage stored as one variant, at exact sizes: the slots' rounding may miss it
        for v in range(len(variants)):
            uniform = (v,) * n
            if simulate(mixed_chain(variants, uniform), plain).peak_bytes <= budget_bytes:
                cost = sum(f) + sum(backs[v])
                if found is None or cost < found[2]:
                    found = (plain, uniform, cost)
    if found is None:
        return None
    steps, choice, cost = found
    chain = mixed_chain(variants, choice)
    replay = simulate(chain, steps)
    if cost != replay.total_flops:
        raise RuntimeError(f"internal error: DP cost {cost} != replayed {replay.total_flops}")
    if replay.peak_bytes > budget_bytes:
        raise RuntimeError("internal error: the replayed peak exceeds the budget")
    return MixResult(steps, tuple(choice), chain, replay, cost, budget_bytes, unit)


class _MixTable:
    """``C(i, j, m)`` of :func:`optimal_mixed_schedule`: one int64 row over ``m`` per class of
    equal sub-chains."""

    def __init__(self, variants: tuple[Chain, ...], unit: int, mem: int) -> None:
        import numpy as np

        base = variants[0]
        n = self.n = base.length
        self.mem = mem
        self.f = base.forward_flops
        self.b = [v.backward_flops for v in variants]
        a = self.a = [-(-x // unit) for x in base.input_bytes]
        fw = [-(-x // unit) for x in base.forward_workspace_bytes]
        self.tp = [[-(-x // unit) for x in v.tape_bytes] for v in variants]
        bw = [[-(-x // unit) for x in v.backward_workspace_bytes] for v in variants]
        self.g = [a[p] + fw[p] + a[p + 1] for p in range(n)]
        self.bwd = [
            [tp[i] + a[i + 1] + bws[i] + a[i] for i in range(n)]
            for tp, bws in zip(self.tp, bw, strict=True)
        ]
        self.prefix = [0, *itertools.accumulate(self.f)]
        # h[i][k - i - 1] = max(g_i, x_i + max_{i<p<k} g_p): the leaf threshold less x_j
        self.h = []
        for i in range(n):
            row, pm = [], 0
            for k in range(i + 1, n + 1):
                if k > i + 1:
                    pm = max(pm, self.g[k - 1])
                row.append(max(self.g[i], a[i] + pm))
            self.h.append(row)
        # Classes (as rotor.optimal_schedule's table): C(i, j, .) depends only on the stages of
        # [i, j), in every variant, and on x_j, so equal sub-chains (stretches of identical
        # layers) share one row; cls[i, j] is the row of [i, j).
        kinds: dict[tuple, int] = {}
        stage = [
            kinds.setdefault(
                (
                    self.f[p],
                    a[p],
                    fw[p],
                    *(x for v in range(len(variants)) for x in self._of(v, p)),
                ),
                len(kinds),
            )
            for p in range(n)
        ]
        heads: dict[tuple[int, int], int] = {}
        classes: dict[tuple[int, int], int] = {}
        cls = np.zeros((n + 1, n + 1), dtype=np.intp)
        for i in range(n):
            head = -1
            for j in range(i + 1, n + 1):
                head = heads.setdefault((head, stage[j - 1]), len(heads))
                cls[i, j] = classes.setdefault((head, a[j]), len(classes))
        self.cls = cls
        width = mem + 1
        self.cost = np.full((len(classes), width), _INF, dtype=np.int64)
        filled = np.zeros(len(classes), dtype=bool)
        for j in range(1, n + 1):
            for i in range(j - 1, -1, -1):
                if not filled[cls[i, j]]:
                    filled[cls[i, j]] = True
                    self._fill(i, j)

    def _of(self, v: int, p: int) -> tuple[int, int, int]:
        """(backward cost, tape slots, backward figure) of stage ``p`` stored as variant ``v``."""
        return self.b[v][p], self.tp[v][p], self.bwd[v][p]

    def row(self, i: int, j: int):
        """``C(i, j, .)`` over m = 0..mem."""
        return self.cost[self.cls[i, j]]

    def _keep(self, i: int, j: int, v: int):
        """(threshold, candidate row over m >= threshold) of storing ``i`` as variant ``v``."""
        width = self.mem + 1
        thr = max(self.a[j] + self.g[i], self.bwd[v][i])
        if thr > self.mem:
            return thr, None
        cost = self.f[i] + self.b[v][i]
        if j == i + 1:
            return thr, cost
        sh = self.tp[v][i]
        return thr, self.row(i + 1, j)[thr - sh : width - sh] + cost

    def _fill(self, i: int, j: int) -> None:
        import numpy as np

        width = self.mem + 1
        best = self.row(i, j)
        for v in range(len(self.b)):
            thr, cand = self._keep(i, j, v)
            if cand is not None:
                np.minimum(best[thr:], cand, out=best[thr:])
        if j > i + 1:
            a = self.a
            lo = a[j] + self.h[i][0]
            if lo <= self.mem:
                ks = range(i + 1, j)
                right = self.cost[self.cls[i + 1 : j, j], lo - a[i] : width - a[i]]
                left = self.cost[self.cls[i, i + 1 : j], lo:]
                forward = np.array([self.prefix[k] - self.prefix[i] for k in ks], dtype=np.int64)
                cand = right + left + forward[:, None]
                for k in ks:
                    thr = a[j] + self.h[i][k - i - 1]
                    if thr > lo:
                        cand[k - i - 1, : min(thr, width) - lo] = _INF
                np.minimum(best[lo:], cand.min(axis=0), out=best[lo:])
        np.minimum(best, _INF, out=best)

    def decide(self, i: int, j: int, m: int) -> tuple[int, int]:
        """(variant stored, 0) or (-1, leaf k) at ``(i, j, m)``; the comparisons of
        :meth:`_fill` (variants in order, then a strictly cheaper leaf, the smallest ``k``)."""
        best, pick = _INF, None
        for v in range(len(self.b)):
            thr = max(self.a[j] + self.g[i], self.bwd[v][i])
            if thr > m:
                continue
            cost = self.f[i] + self.b[v][i]
            if j > i + 1:
                cost += int(self.row(i + 1, j)[m - self.tp[v][i]])
            if cost < best:
                best, pick = cost, (v, 0)
        for k in range(i + 1, j):
            if m < self.a[j] + self.h[i][k - i - 1]:
                continue
            cand = int(self.row(k, j)[m - self.a[i]]) + int(self.row(i, k)[m])
            cand += self.prefix[k] - self.prefix[i]
            if cand < best:
                best, pick = cand, (-1, k)
        if best >= _INF or pick is None:
            raise RuntimeError(f"internal error: no decision at ({i}, {j}, {m})")
        return pick

    def solve(self) -> tuple[Schedule, tuple[int, ...], int] | None:
        n, mem = self.n, self.mem
        top = int(self.row(0, n)[mem])
        if top >= _INF:
            return None
        steps: list[Step] = []
        choice = [0] * n
        stack: list = [(0, n, mem)]
        while stack:
            item = stack.pop()
            if isinstance(item, Step):
                steps.append(item)
                continue
            i, j, m = item
            v, k = self.decide(i, j, m)
            if v >= 0:
                choice[i] = v
                steps.append(Step(FORWARD_KEEP_ALL, i))
                stack.append(Step(BACKWARD, i))
                if j > i + 1:
                    stack.append((i + 1, j, m - self.tp[v][i]))
            else:
                steps.append(Step(FORWARD_KEEP_INPUT, i))
                steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, k))
                stack.append((i, k, m))
                stack.append((k, j, m - self.a[i]))
        return tuple(steps), tuple(choice), top


def stored_variants(steps: Schedule, choice: Sequence[int]) -> dict[int, int]:
    """How many stages store each variant (every stage stores its tape once)."""
    out: dict[int, int] = {}
    for st in steps:
        if st.kind == FORWARD_KEEP_ALL:
            out[choice[st.stage]] = out.get(choice[st.stage], 0) + 1
    return out


def recomputed_stages(steps: Schedule) -> tuple[int, ...]:
    """Stages forwarded more than once (re-run whole in the backward pass)."""
    counts: dict[int, int] = {}
    for st in steps:
        if st.kind != BACKWARD:
            counts[st.stage] = counts.get(st.stage, 0) + 1
    return tuple(sorted(i for i, c in counts.items() if c > 1))


__all__ = [
    "MIX_MAX_STAGES",
    "MixResult",
    "check_variants",
    "mixed_chain",
    "optimal_mixed_schedule",
    "recomputed_stages",
    "stored_variants",
]
