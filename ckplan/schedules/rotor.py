"""Optimal persistent schedules under a memory budget: the rotor DP (Beaumont et al. 2019)."""

from __future__ import annotations

import math
from fractions import Fraction

from ckplan.schedules import grouping
from ckplan.schedules.chain import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    Chain,
    Schedule,
    ScheduleResult,
    Step,
    held_after_forward_bytes,
    in_flight_fraction,
    pipeline_peak_bytes,
    simulate,
)
from ckplan.schedules.segment_replay import replay_runs
from ckplan.schedules.segments import (
    store_all_schedule,
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def schedule_result(
    chain: Chain,
    steps: Schedule,
    budget_bytes: int,
    slot_bytes: int,
    slots: int,
    total_flops: int | None = None,
    in_flight: Fraction = Fraction(1),
    stage_group: int = 1,
) -> ScheduleResult:
    replay = simulate(chain, steps)
    if total_flops is None:
        total_flops = replay.total_flops
    elif total_flops != replay.total_flops:
        raise RuntimeError(
            f"internal error: solver cost {total_flops} != replayed cost {replay.total_flops}"
        )
    held = held_after_forward_bytes(chain, replay)
    peak = pipeline_peak_bytes(chain, replay, in_flight)
    if peak > budget_bytes:
        raise RuntimeError(
            f"internal error: replayed peak {peak} ({in_flight} in flight) exceeds budget "
            f"{budget_bytes}"
        )
    base = sum(chain.forward_flops) + sum(chain.backward_flops)
    return ScheduleResult(
        steps=steps,
        peak_bytes=replay.peak_bytes,
        total_flops=total_flops,
        recompute_flops=total_flops - base,
        budget_bytes=budget_bytes,
        slot_bytes=slot_bytes,
        slots=slots,
        replay=replay,
        in_flight=in_flight,
        held_bytes=held,
        pipeline_peak_bytes=peak,
        stage_group=stage_group,
    )


def optimal_schedule(
    chain: Chain,
    budget_bytes: int,
    slots: int = 500,
    in_flight: int | Fraction = 1,
    group_size: int | None = None,
) -> ScheduleResult | None:
    """Cheapest persistent schedule whose (pipeline) peak fits ``budget_bytes``; None if none fits.

    Source: Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova 2019, "Optimal checkpointing for
    heterogeneous chains: how to train deep neural networks with limited memory" (rotor,
    hal-02352969): optimal persistent schedules have the recursive structure below, solved by a
    dynamic program over (memory, start, end of the sub-chain). derived: the memory terms are
    re-derived for this module's chain model (tape includes the input, pending outputs, explicit
    workspaces) from the accounting in the module docstring; tests check them against
    :func:`brute_force_optimal`, which replays every persistent schedule.

    Sub-problem ``C(i, j, m)``: ``x_i`` and ``δ_j`` are live, reverse stages ``[i, j)`` within
    ``m`` memory (its own bytes: ``x_i``, ``δ_j`` and everything it creates). With
    ``g_p = x_p + fws_p + x_{p+1}`` and ``bwd_i = tape_i + x_{i+1} + bws_i + x_i``:

    * ``j = i + 1``: keep_all(i), backward(i); needs ``m >= max(x_j + g_i, bwd_i)``.
    * "chain": keep_all(i), solve ``C(i+1, j, m - tape_i)``, backward(i);
      cost ``f_i + b_i + C(i+1, j, m - tape_i)``, needs ``m >= max(x_j + g_i, bwd_i)``.
    * "leaf" at ``i < k < j``: keep_input(i), drop(i+1..k-1), ``C(k, j, m - x_i)``, then
      ``C(i, k, m)``; cost ``sum f_i..f_{k-1} + C(k, j, m - x_i) + C(i, k, m)``, needs
      ``m >= x_j + max(g_i, x_i + max_{i<p<k} g_p)``.

    Pipelining (``in_flight = q > 1``, an int or a Fraction): the budget bounds
    :func:`pipeline_peak_bytes`, ``peak + (q - 1) * held``. derived: ``held`` is the sum of the
    items stored on the *first-pass path* (the top problem and the right sub-problems
    ``C(k, n, .)`` it reaches by "chain", storing ``tape_i``, and "leaf", storing ``x_i``, down
    to the base's ``tape_{n-1}``); the waiting micro-batches hold it at *every* instant of the
    step, the forward pass included (before this micro-batch has stored those items). So a
    schedule fits iff, for some ``H``, its held bytes are ``<= H`` and its one-micro-batch peak
    is ``<= B - ceil((q - 1) H)``. For each ``H`` (slots, with ``B - ceil((q - 1) H) >= H + δ_n``)
    the first-pass table ``P_H(i, h)`` reverses ``[i, n)`` from ``x_i`` with held allowance ``h``
    and own memory ``c_H + h``, ``c_H = B - ceil((q - 1) H) - H`` (storing ``w`` takes ``w`` from
    both, so ``c_H`` is invariant down the path):

    * ``i = n - 1``: ``f_i + b_i``; needs ``tape_i <= h`` and ``c_H + h >= max(x_n + g_i, bwd_i)``.
    * "chain": ``f_i + b_i + P_H(i+1, h - tape_i)``; needs ``tape_i <= h`` and the same threshold.
    * "leaf" at ``i < k < n``: ``sum f_i..f_{k-1} + P_H(k, h - x_i) + C(i, k, c_H + h)``; needs
      ``x_i <= h`` and the leaf threshold on ``c_H + h``.

    The answer is ``min_H P_H(0, H)``. The left sub-problems are regular ``C(i, k, .)``: they run
    once the path below them is reversed, within what the path's live items and the waiting
    micro-batches leave.

    Sizes are discretised into slots of ``ceil(budget / slots)`` bytes, every size rounded up,
    so the discretised schedule fits at exact sizes too (the result may miss schedules that fit
    only at exact sizes; ``slots >= budget_bytes`` is exact).

    Implementation: ``C(i, j, .)`` depends only on the stages of ``[i, j)`` and ``x_j``, so equal
    sub-chains (any two stretches of a transformer's identical layers) share one table row: the
    table has one row per *class* of equal sub-chains (about ``3n`` for embedding, ``n - 2``
    identical layers and output, against ``n^2 / 2``), each filled by one NumPy operation over
    (split ``k``) x (memory ``m``). Decisions are not stored: the backtrack recomputes them on its
    path, with the same tie-breaks (the chain option first, then the smallest ``k``). FLOPs are
    divided by their gcd (exact). Work O(classes * n * slots); :mod:`rotor_reference` is the
    first implementation (O(n^3 * slots)), whose costs and schedules this one reproduces. The
    first-pass tables are vectorised over (split, ``H``, ``h``), in blocks of rows ``H``:
    O(n^2 * (slots / q)^2) more work (``H <= slots / q``); exact for Fraction ``q`` (``ceil``).
    The returned costs are the DP's; the peaks are the exact replay of the schedule.

    Where the DP's work would pass :mod:`ckplan.schedules.grouping`'s limits (about a second:
    some 500 stages of equal layers at 500 slots, about 160 with micro-batches in flight) it is
    solved over groups of consecutive equal stages (``group_size`` forces a size);
    ``stage_group`` in the result says how many stages the largest group has.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise ValueError(f"budget_bytes must be an int, got {budget_bytes!r}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be a positive int, got {slots!r}")
    q = in_flight_fraction(in_flight)
    unit = max(1, _ceil_div(budget_bytes, slots))
    mem = budget_bytes // unit
    # No recomputation is the cheapest schedule there is: when it fits at exact sizes, it is the
    # answer, even where rounding sizes up to slots would make the DP miss it.
    # (Its peak in closed form first: the replay of a long chain takes a while.)
    plain = replay_runs(chain, [(0, chain.length, 1, False)])
    if plain.peak_bytes + math.ceil((q - 1) * plain.held_bytes) <= budget_bytes:
        return schedule_result(chain, store_all_schedule(chain), budget_bytes, unit, mem, None, q)
    if group_size is None:
        groups = list(grouping.optimal_groups(chain, mem + 1, q))
    elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    else:
        groups = grouping.stage_groups(chain, group_size)
    if len(groups) == chain.length:
        solved = _solve_persistent(chain, unit, mem, q)
    else:
        solved = _solve_persistent(grouping.grouped_chain(chain, groups), unit, mem, q)
    if solved is None:
        return None
    steps, dp_cost = solved
    if len(groups) < chain.length:
        steps = grouping.expand_schedule(steps, groups)
    largest = max(end - start for start, end in groups)
    return schedule_result(chain, steps, budget_bytes, unit, mem, dp_cost, q, largest)


def _solve_persistent(
    chain: Chain, unit: int, mem: int, in_flight: Fraction = Fraction(1)
) -> tuple[Schedule, int | None] | None:
    """Solve the DP of :func:`optimal_schedule` and backtrack.

    Returns ``(steps, dp_cost)`` (``dp_cost`` None if the float64 fallback was used) or None.
    """
    n = chain.length
    if in_flight == 1:
        table = _Table(chain, unit, mem, n)
        if table.decide(0, n, mem) < 0:
            return None
        steps = table.backtrack(0, n, mem)
        return steps, table.flops(0, n, mem)
    # The first-pass tables need C(i, k, .) for k < n; C(0, n, .) bounds their rows.
    return _solve_pipelined(chain, _Table(chain, unit, mem, n), mem, in_flight)


def regular_table(chain: Chain, unit: int, mem: int, last_j: int):
    """The table ``C(i, j, m)`` of :func:`optimal_schedule` for ``j <= last_j`` at slots of
    ``unit`` bytes and ``m <= mem`` slots, for solvers that build on it
    (:mod:`ckplan.schedules.offload`). Its ``plus`` rows hold ``C`` plus the forward FLOPs of
    the sub-chain, divided by ``scale``; ``backtrack(i, j, m)`` rebuilds a schedule."""
    return _Table(chain, unit, mem, last_j)


class _Table:
    """The regular table ``C(i, j, .)`` for ``j <= last_j``, one row per class of equal
    sub-chains, with the discretised sizes and scaled FLOPs it was built from; see
    :func:`optimal_schedule` for the recursion."""

    def __init__(self, chain: Chain, unit: int, mem: int, last_j: int) -> None:
        import numpy as np

        n = self.n = chain.length
        # Every cost is a sum of stage FLOPs: dividing them by their gcd scales all costs alike.
        self.scale = math.gcd(*chain.forward_flops, *chain.backward_flops) or 1
        f = self.f = [x // self.scale for x in chain.forward_flops]
        b = self.b = [x // self.scale for x in chain.backward_flops]
        a = self.a = [_ceil_div(x, unit) for x in chain.input_bytes]
        tp = self.tp = [_ceil_div(x, unit) for x in chain.tape_bytes]
        fw = [_ceil_div(x, unit) for x in chain.forward_workspace_bytes]
        bw = [_ceil_div(x, unit) for x in chain.backward_workspace_bytes]
        g = self.g = [a[p] + fw[p] + a[p + 1] for p in range(n)]
        self.bwd = [tp[i] + a[i + 1] + bw[i] + a[i] for i in range(n)]
        self.prefix = [0]
        for x in f:
            self.prefix.append(self.prefix[-1] + x)
        self.back = [0]
        for x in b:
            self.back.append(self.back[-1] + x)

        # Exact int64 arithmetic when every finite cost fits (a stage is re-forwarded at most once
        # per enclosing sub-problem, so n * sum(f) + sum(b) bounds any persistent schedule); sums
        # of table entries stay below 2**63, and table entries are clamped to ``inf``.
        self.exact = n * sum(f) + sum(b) < 2**60
        self.dtype, self.inf = (np.int64, 2**61) if self.exact else (np.float64, np.inf)
        self.mem = mem

        # Leaf thresholds: m >= x_j + h(i, k), h(i, k) = max(g_i, x_i + max_{i<p<k} g_p), which
        # is non-decreasing in k; runs[i] lists (first k, h) where h changes.
        self.h_rows: list[list[int]] = []
        self.runs: list[list[tuple[int, int]]] = []
        for i in range(n):
            row, run, pm = [], [], 0
            for k in range(i + 1, n + 1):
                if k > i + 1:
                    pm = max(pm, g[k - 1])
                h = max(g[i], a[i] + pm)
                if not row or h != row[-1]:
                    run.append((k, h))
                row.append(h)
            self.h_rows.append(row)
            self.runs.append(run)

        # Classes: [i, j) and [i', j') are equal when their stages (scaled FLOPs, slot sizes) and
        # x_j are. rows[i][j - i] is the class of [i, j) (index 0 unused), cols[j][k] of [k, j).
        stage: dict[tuple, int] = {}
        kinds = [
            stage.setdefault((f[p], b[p], a[p], tp[p], fw[p], bw[p]), len(stage)) for p in range(n)
        ]
        prefixes: dict[tuple[int, int], int] = {}
        classes: dict[tuple[int, int], int] = {}
        rows = []
        for i in range(n):
            row, head = [-1], -1
            for j in range(i + 1, n + 1):
                head = prefixes.setdefault((head, kinds[j - 1]), len(prefixes))
                row.append(classes.setdefault((head, a[j]), len(classes)))
            rows.append(row)
        self.rows = rows
        self.left = [np.array(row[1:], dtype=np.intp) for row in rows]  # C(i, k), k = i+1..n
        self.cols = [
            np.array([rows[k][j - k] for k in range(j)], dtype=np.intp) for j in range(n + 1)
        ]

        width = mem + 1
        inf = self.inf
        # cost[c]: C of class c over m = 0..mem; plus[c]: C + the forward FLOPs of the sub-chain,
        # the left term of a leaf (exact mode; float mode adds them in the reference's order).
        self.cost = np.full((len(classes), width), inf, dtype=self.dtype)
        self.plus = np.full((len(classes), width), inf, dtype=self.dtype) if self.exact else None
        # Leaf candidates are temporaries of up to n x width entries, growing with j. Allocating
        # and freeing one of the largest size first lets glibc serve them from its heap (its mmap
        # threshold adapts to freed blocks); otherwise each new size is a fresh mmap, and the
        # page faults cost more than the arithmetic (about 3x on a 130-stage chain).
        np.empty(2 * n * width, dtype=self.dtype)
        filled = [False] * len(classes)
        # j ascending, i descending: a sub-chain is filled after the shorter ones it splits into.
        for j in range(1, last_j + 1):
            for i in range(j - 1, -1, -1):
                c = rows[i][j - i]
                if not filled[c]:
                    filled[c] = True
                    self._fill(i, j, c)

    def _fill(self, i: int, j: int, c: int) -> None:
        """One class's row ``C(i, j, .)`` from shorter sub-chains."""
        import numpy as np

        a, tp, f, b, inf, exact = self.a, self.tp, self.f, self.b, self.inf, self.exact
        mem, width = self.mem, self.mem + 1
        best = self.cost[c]
        thr_a = max(a[j] + self.g[i], self.bwd[i])
        if j == i + 1:
            if thr_a <= mem:
                best[thr_a:] = f[i] + b[i]
        else:
            # "chain" option: keep_all(i), C(i+1, j, m - tape_i), backward(i).
            hi = width
            if thr_a <= mem:
                sh = tp[i]
                best[thr_a:] = self.cost[self.rows[i + 1][j - i - 1], thr_a - sh : width - sh]
                best[thr_a:] += f[i] + b[i]
                if exact:
                    np.minimum(best, inf, out=best)
                # Where the chain option costs the no-recompute bound, no leaf is cheaper.
                done = best[thr_a:] == self.base(i, j)
                if done.any():
                    hi = thr_a + int(done.argmax())
            # "leaf" options: keep x_i, advance to x_k, C(k, j, m - x_i), then C(i, k, m).
            lo = a[j] + self.h_rows[i][0]
            if lo < hi:
                sh = a[i]
                right, left = self.cols[j][i + 1 : j], self.left[i][: j - i - 1]
                cand = self.cost[right, lo - sh : hi - sh]
                if exact:
                    cand += self.plus[left, lo:hi]
                else:
                    cand += self.cost[left, lo:hi]
                    prefix = np.array(self.prefix[i + 1 : j], dtype=self.dtype)
                    cand += (prefix - self.prefix[i])[:, None]
                run = self.runs[i]
                for r in range(1, len(run)):
                    k0, h = run[r]
                    if k0 >= j:
                        break
                    k1 = run[r + 1][0] if r + 1 < len(run) else j
                    cand[k0 - i - 1 : k1 - i - 1, : min(a[j] + h, hi) - lo] = inf
                np.minimum(best[lo:hi], cand.min(axis=0), out=best[lo:hi])
                if exact:
                    np.minimum(best, inf, out=best)
        if exact:
            np.add(best, self.prefix[j] - self.prefix[i], out=self.plus[c])

    def base(self, i: int, j: int) -> int:
        """The scaled cost of ``[i, j)`` without recomputation."""
        return self.prefix[j] - self.prefix[i] + self.back[j] - self.back[i]

    def value(self, i: int, j: int, m: int):
        """``C(i, j, m)`` (a Python int in exact mode; >= ``inf`` where infeasible)."""
        v = self.cost[self.rows[i][j - i], m]
        return int(v) if self.exact else float(v)

    def flops(self, i: int, j: int, m: int) -> int | None:
        """``C(i, j, m)`` in FLOPs, None in float mode (the replay's figure is used then)."""
        return self.value(i, j, m) * self.scale if self.exact else None

    def decide(self, i: int, j: int, m: int) -> int:
        """The decision the table took at ``(i, j, m)``: 0 keep_all(i) ("chain" or the one-stage
        base), ``k > 0`` leaf at ``k``, -1 infeasible. The same comparisons as :meth:`_fill`:
        a leaf only if strictly cheaper than the chain option, the smallest such ``k``."""
        a, inf = self.a, self.inf
        if j == i + 1:
            return 0 if self.value(i, j, m) < inf else -1
        best, choice = inf, -1
        if max(a[j] + self.g[i], self.bwd[i]) <= m:
            chain = self.value(i + 1, j, m - self.tp[i]) + self.f[i] + self.b[i]
            if chain < inf:
                best, choice = chain, 0
                if chain == self.base(i, j):
                    return 0
        for k in range(i + 1, j):
            if m < a[j] + self.h_rows[i][k - i - 1]:
                continue
            cand = self.value(k, j, m - a[i]) + self.value(i, k, m)
            cand += self.prefix[k] - self.prefix[i]
            if cand < best:
                best, choice = cand, k
        return choice

    def backtrack(self, i: int, j: int, mem: int) -> Schedule:
        """Rebuild the schedule of ``C(i, j, mem)`` (iteratively: chains can be deep)."""
        steps: list[Step] = []
        stack: list[tuple[int, int, int] | Step] = [(i, j, mem)]
        while stack:
            item = stack.pop()
            if isinstance(item, Step):
                steps.append(item)
                continue
            i, j, m = item
            c = self.decide(i, j, m)
            if c < 0:
                raise RuntimeError(f"internal error: no decision for ({i}, {j}, {m})")
            if j == i + 1:
                steps += [Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)]
            elif c == 0:
                steps.append(Step(FORWARD_KEEP_ALL, i))
                stack.append(Step(BACKWARD, i))
                stack.append((i + 1, j, m - self.tp[i]))
            else:
                steps.append(Step(FORWARD_KEEP_INPUT, i))
                steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, c))
                stack.append((i, c, m))
                stack.append((c, j, m - self.a[i]))
        return tuple(steps)


# First-pass rows H are filled in blocks of at most this many rows and this many entries
# (stages x rows x allowances h), which bounds the table and the per-stage candidates (16 MiB
# each) and the columns h > H a row computes for nothing.
_FIRST_PASS_ROWS = 32
_FIRST_PASS_BLOCK = 1 << 21


def _least_held(n: int, r: _Table) -> list[int]:
    """``least[i]``: the fewest slots a first-pass path from node ``i`` can hold (``P(i, h)`` is
    infinite below it): ``tape_{n-1}`` at the base, then ``tape_i`` or ``x_i`` plus the rest."""
    least = [0] * n
    least[n - 1] = r.tp[n - 1]
    for i in range(n - 2, -1, -1):
        least[i] = min(r.tp[i] + least[i + 1], r.a[i] + min(least[i + 1 :]))
    return least


def _first_pass_rows(n: int, r: _Table, mem: int, in_flight: Fraction) -> list[int]:
    """Held allowances ``H`` worth a row: at least what any path holds, and the own memory must
    hold the held items and ``δ_n`` (a row whose schedule holds less is beaten by a lower row)."""
    rows = []
    held = _least_held(n, r)[0]
    while mem - math.ceil((in_flight - 1) * held) >= held + r.a[n]:
        rows.append(held)
        held += 1
    return rows


def _solve_pipelined(
    chain: Chain, r: _Table, mem: int, in_flight: Fraction
) -> tuple[Schedule, int | None] | None:
    """``min_H P_H(0, H)`` (the smallest ``H`` among equal costs), then that row again with
    its decisions.

    Rows are evaluated in blocks, most promising first, and a row is skipped once a lower bound
    on ``P_H(0, H)`` exceeds the best cost found (:func:`_first_pass_bounds`); the skipped rows
    cost more than the answer, so the answer is that of the full search over every row.
    """
    import numpy as np

    n = chain.length
    rows = _first_pass_rows(n, r, mem, in_flight)
    if not rows:
        return None
    bounds = _first_pass_bounds(r, mem, in_flight, rows)
    order = sorted(range(len(rows)), key=lambda index: (bounds[index], rows[index]))
    best = None  # (cost, H)
    start = 0
    while start < len(order) and bounds[order[start]] < r.inf:
        if best is not None and bounds[order[start]] > best[0]:
            break
        end = start + 1
        while (
            end < len(order)
            and end - start < _FIRST_PASS_ROWS
            and (best is None or bounds[order[end]] <= best[0])
            and (end + 1 - start) * (max(rows[k] for k in order[start : end + 1]) + 1) * n
            <= _FIRST_PASS_BLOCK
        ):
            end += 1
        block = sorted(rows[k] for k in order[start:end])
        table, _ = _first_pass_block(r, mem, in_flight, block, record=False)
        tops = table[0][np.arange(len(block)), block]
        for held, top in zip(block, tops.tolist(), strict=True):
            if top < r.inf and (best is None or (top, held) < best):
                best = (top, held)
        start = end
    if best is None:
        return None
    held = best[1]
    table, choice = _first_pass_block(r, mem, in_flight, [held], record=True)
    c = mem - math.ceil((in_flight - 1) * held) - held
    steps = _backtrack_first_pass(n, r, choice[:, 0, :], c, held)
    return steps, (int(table[0, 0, held]) * r.scale if r.exact else None)


def _first_pass_bounds(r: _Table, mem: int, in_flight: Fraction, rows: list[int]) -> list:
    """A lower bound on ``P_H(0, H)`` for each row ``H``: the larger of two relaxations.

    derived: (1) without the held allowance the first pass is the regular recursion, so
    ``P_H(0, H) >= C(0, n, c_H + H)``; (2) with unlimited own memory every left sub-problem
    ``C(i, k, .)`` costs at least its no-recompute cost, so ``P_H(0, H) >= base(0, n) + E(0, H)``
    with ``E(i, h)`` the least forward FLOPs of the leaves' advances ``f_i + ... + f_{k-1}``
    over first-pass paths that store at most ``h`` slots (``tape_i`` by "chain", ``x_i`` by a
    leaf, ``tape_{n-1}`` at the end): ``E(n-1, h) = 0`` for ``h >= tape_{n-1}``,
    ``E(i, h) = min(E(i+1, h - tape_i), min_k F(i, k) + E(k, h - x_i))``.
    """
    import numpy as np

    n, a, tp, inf = r.n, r.a, r.tp, r.inf
    nh = rows[-1] + 1
    extra = np.full((n, nh), inf, dtype=r.dtype)
    if tp[n - 1] < nh:
        extra[n - 1, tp[n - 1] :] = 0
    for i in range(n - 2, -1, -1):
        best = extra[i]
        if tp[i] < nh:
            best[tp[i] :] = extra[i + 1, : nh - tp[i]]
        if a[i] < nh:
            advance = np.array([r.prefix[k] - r.prefix[i] for k in range(i + 1, n)], r.dtype)
            leaf = (extra[i + 1 : n, : nh - a[i]] + advance[:, None]).min(axis=0)
            np.minimum(best[a[i] :], leaf, out=best[a[i] :])
        if r.exact:
            np.minimum(best, inf, out=best)
    base = r.base(0, n)
    bounds = []
    for held in rows:
        relaxed = r.value(0, r.n, mem - math.ceil((in_flight - 1) * held))
        free = extra[0, held]
        free = base + int(free) if r.exact and free < inf else (base + float(free))
        bounds.append(max(relaxed, min(free, inf)))
    return bounds


def _first_pass_block(r: _Table, mem: int, in_flight: Fraction, block, record):
    """``P_H(i, h)`` for the rows ``H`` in ``block`` (ascending) and ``h <= max(block)``, as an
    array ``[i, row, h]``, with the decisions (0: keep_all, k > 0: leaf at k) if ``record``.

    Entries with ``h > H`` are never read (children have smaller allowances); their own memory
    may exceed ``mem`` and reads past the regular table see ``inf``.
    """
    import numpy as np

    n = r.n
    f, b, a, tp, g, bwd, runs, inf = r.f, r.b, r.a, r.tp, r.g, r.bwd, r.runs, r.inf
    nb, nh = len(block), block[-1] + 1
    c = np.array([mem - math.ceil((in_flight - 1) * held) - held for held in block])
    own = c[:, None] + np.arange(nh)[None, :]  # own memory of a node with allowance h, per row
    table = np.full((n, nb, nh), inf, dtype=r.dtype)
    choice = np.full((n, nb, nh), -1, dtype=np.int32) if record else None
    least = _least_held(n, r)
    for i in range(n - 1, -1, -1):
        best = table[i]
        # "chain" (the base at i = n - 1): keep_all(i), P(i+1, h - tape_i), backward(i).
        w = tp[i]
        if w < nh:
            if i == n - 1:
                best[:, w:] = f[i] + b[i]
            else:
                best[:, w:] = table[i + 1][:, : nh - w] + (f[i] + b[i])
            best[own < max(a[n] + g[i], bwd[i])] = inf
            if r.exact:
                np.minimum(best, inf, out=best)
            if record:
                choice[i][best < inf] = 0
        # "leaf" at i < k < n: keep x_i, advance to x_k, P(k, h - x_i), then C(i, k, own).
        if i == n - 1:
            continue
        sh = a[i]
        lo = sh + min(least[i + 1 :])  # P(k, h - x_i) is infinite below
        # P is non-increasing in h; where the chain option costs the no-recompute bound in
        # every row, no leaf is cheaper.
        done = best == r.base(i, n)
        hi = int(done.argmax(axis=1).max()) if done.any(axis=1).all() else nh
        if lo >= hi:
            continue
        ks = n - 1 - i
        # C(i, k, .) + f_i + ... + f_{k-1} for k = i+1..n-1, padded with inf past ``mem``.
        left = np.full((ks, mem + 1 + nh), inf, dtype=r.dtype)
        if r.exact:
            left[:, : mem + 1] = r.plus[r.left[i][:ks]]
        else:
            prefix = np.array(r.prefix[i + 1 : n], dtype=r.dtype)
            left[:, : mem + 1] = r.cost[r.left[i][:ks]] + (prefix - r.prefix[i])[:, None]
        run = runs[i]
        for q, (k0, h) in enumerate(run):
            if k0 >= n:
                break
            k1 = min(run[q + 1][0], n) if q + 1 < len(run) else n
            left[k0 - i - 1 : k1 - i - 1, : a[n] + h] = inf  # leaf threshold x_n + h(i, k)
        windows = np.lib.stride_tricks.sliding_window_view(left, hi - lo, axis=1)
        cand = windows[:, c + lo, :]  # at own memory c_H + h, lo <= h < hi: (k, row, h - lo)
        cand += table[i + 1 : n, :, lo - sh : hi - sh]
        if record:
            k_rel = cand.argmin(axis=0)
            low = np.take_along_axis(cand, k_rel[None], axis=0)[0]
        else:
            low = cand.min(axis=0)
        sub = best[:, lo:hi]
        better = low < sub
        sub[better] = low[better]
        if record:
            choice[i][:, lo:hi][better] = (k_rel + (i + 1))[better]
        if r.exact:
            np.minimum(best, inf, out=best)
    return table, choice


def _backtrack_first_pass(n: int, r: _Table, choice, c: int, held: int) -> Schedule:
    """Walk the first-pass path from ``(0, held)``, then the left sub-problems and backwards it
    left behind, innermost first."""
    steps: list[Step] = []
    after: list[tuple[int, int, int] | Step] = []
    i, h = 0, held
    while True:
        k = int(choice[i, h])
        if k < 0:
            raise RuntimeError(f"internal error: no first-pass decision for ({i}, {h})")
        if i == n - 1:
            steps += [Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)]
            break
        if k == 0:
            steps.append(Step(FORWARD_KEEP_ALL, i))
            after.append(Step(BACKWARD, i))
            i, h = i + 1, h - r.tp[i]
        else:
            steps.append(Step(FORWARD_KEEP_INPUT, i))
            steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, k))
            after.append((i, k, c + h))
            i, h = k, h - r.a[i]
    for item in reversed(after):
        if isinstance(item, Step):
            steps.append(item)
        else:
            steps.extend(r.backtrack(*item))
    return tuple(steps)
