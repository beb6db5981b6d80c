"""The rotor DP as first written (one vectorised operation per sub-chain): the reference the fast
DP of :mod:`ckplan.schedules.rotor` is tested and benchmarked against. Not used by the planner."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

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
from ckplan.schedules.rotor import schedule_result
from ckplan.schedules.segments import (
    store_all_schedule,
)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def optimal_schedule(
    chain: Chain, budget_bytes: int, slots: int = 500, in_flight: int | Fraction = 1
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
    only at exact sizes; ``slots >= budget_bytes`` is exact). The table is vectorised with NumPy
    over the memory axis and the split point: O(n^3 * slots) work, O(n^2 * slots) memory. The
    first-pass tables are vectorised over (split, ``H``, ``h``), in blocks of rows ``H``:
    O(n^2 * (slots / q)^2) more work (``H <= slots / q``); exact for Fraction ``q`` (``ceil``).
    The returned costs are the DP's; the peaks are the exact replay of the schedule.
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
    plain = store_all_schedule(chain)
    if pipeline_peak_bytes(chain, simulate(chain, plain), q) <= budget_bytes:
        return schedule_result(chain, plain, budget_bytes, unit, mem, None, q)
    solved = _solve_persistent(chain, unit, mem, q)
    if solved is None:
        return None
    steps, dp_cost = solved
    return schedule_result(chain, steps, budget_bytes, unit, mem, dp_cost, q)


class _Rotor(NamedTuple):
    """The regular table ``C(i, k, .)`` (``table[i][k - i]``, decisions in ``what``) and the
    discretised sizes it was built from."""

    a: list[int]
    tp: list[int]
    g: list[int]
    bwd: list[int]
    prefix: list[int]
    runs: list[list[tuple[int, int]]]
    table: list
    what: list
    exact: bool
    inf: int | float


def _solve_persistent(
    chain: Chain, unit: int, mem: int, in_flight: Fraction = Fraction(1)
) -> tuple[Schedule, int | None] | None:
    """Solve the DP of :func:`optimal_schedule` and backtrack.

    Returns ``(steps, dp_cost)`` (``dp_cost`` None if the float64 fallback was used) or None.
    """
    n = chain.length
    if in_flight == 1:
        rotor = _rotor_table(chain, unit, mem, n)
        if rotor.what[0][n, mem] < 0:
            return None
        steps = _backtrack(rotor.what, rotor.a, rotor.tp, 0, n, mem)
        return steps, (int(rotor.table[0][n, mem]) if rotor.exact else None)
    # The first-pass tables need C(i, k, .) for k < n only.
    return _solve_pipelined(chain, _rotor_table(chain, unit, mem, n - 1), mem, in_flight)


def _rotor_table(chain: Chain, unit: int, mem: int, last_j: int) -> _Rotor:
    """Fill the rotor-style table for ``j <= last_j``; see :func:`optimal_schedule`.

    Loop order: ``j`` ascending, ``i`` descending, so that ``C(k, j)`` (``k > i``) sits in a
    contiguous per-``j`` buffer and ``C(i, k)`` (``k < j``) in the table row of ``i``; each
    ``(i, j)`` is one vectorised operation over (split ``k``) x (memory ``m``).
    """
    import numpy as np

    n = chain.length
    f, b = chain.forward_flops, chain.backward_flops
    a = [_ceil_div(x, unit) for x in chain.input_bytes]
    tp = [_ceil_div(x, unit) for x in chain.tape_bytes]
    fw = [_ceil_div(x, unit) for x in chain.forward_workspace_bytes]
    bw = [_ceil_div(x, unit) for x in chain.backward_workspace_bytes]
    g = [a[p] + fw[p] + a[p + 1] for p in range(n)]
    bwd = [tp[i] + a[i + 1] + bw[i] + a[i] for i in range(n)]

    # Exact int64 arithmetic when every finite cost fits (a stage is re-forwarded at most once
    # per enclosing sub-problem, so n * sum(f) + sum(b) bounds any persistent schedule); sums of
    # two table entries and a prefix stay below 2**63, and table entries are clamped to ``inf``.
    exact = n * sum(f) + sum(b) < 2**60
    if exact:
        dtype, inf = np.int64, 2**61
    else:
        dtype, inf = np.float64, np.inf
    width = mem + 1
    # Row i holds C(i, k, .) at index k - i (k = i..n; index 0 unused): half of an n x n table.
    # what[i][k - i, m]: 0 = keep_all(i) ("chain" or the single-stage base), k' > 0 = leaf at k'.
    table = [np.full((n + 1 - i, width), inf, dtype=dtype) for i in range(n)]
    what = [
        np.full((n + 1 - i, width), -1, dtype=np.int16 if n < 2**15 else np.int32) for i in range(n)
    ]
    column = np.full((n + 1, width), inf, dtype=dtype)  # C(., j, .) for the current j
    prefix = [0]
    for x in f:
        prefix.append(prefix[-1] + x)
    prefix_arr = np.array(prefix, dtype=dtype)
    back = [0]
    for x in b:
        back.append(back[-1] + x)

    # Leaf thresholds: m >= x_j + h(i, k), h(i, k) = max(g_i, x_i + max_{i<p<k} g_p), which is
    # non-decreasing in k; runs[i] lists (first k, h) where h changes, to mask whole row blocks.
    h_rows: list[list[int]] = []
    runs: list[list[tuple[int, int]]] = []
    for i in range(n):
        row, run, pm = [], [], 0
        for k in range(i + 1, n + 1):
            if k > i + 1:
                pm = max(pm, g[k - 1])
            h = max(g[i], a[i] + pm)
            if not row or h != row[-1]:
                run.append((k, h))
            row.append(h)
        h_rows.append(row)
        runs.append(run)

    for j in range(1, last_j + 1):
        column.fill(inf)
        i = j - 1
        thr = max(a[j] + g[i], bwd[i])
        if thr <= mem:
            column[i, thr:] = f[i] + b[i]
            what[i][j - i, thr:] = 0
        table[i][j - i] = column[i]
        for i in range(j - 2, -1, -1):
            best = column[i]
            choice = what[i][j - i]
            # "chain" option: keep_all(i), C(i+1, j, m - tape_i), backward(i).
            thr_a = max(a[j] + g[i], bwd[i])
            if thr_a <= mem:
                sh = tp[i]
                best[thr_a:] = column[i + 1, thr_a - sh : width - sh] + (f[i] + b[i])
                if exact:
                    np.minimum(best, inf, out=best)
                choice[thr_a:] = np.where(best[thr_a:] < inf, 0, -1)
            # "leaf" options: keep x_i, advance to x_k, C(k, j, m - x_i), then C(i, k, m).
            # Where the chain option already costs the no-recompute bound, no leaf is better.
            hi = width
            if thr_a <= mem:
                done = best[thr_a:] == prefix[j] - prefix[i] + back[j] - back[i]
                if done.any():
                    hi = thr_a + int(done.argmax())
            lo = a[j] + h_rows[i][0]
            if lo < hi:
                sh = a[i]
                cand = column[i + 1 : j, lo - sh : hi - sh] + table[i][1 : j - i, lo:hi]
                cand += (prefix_arr[i + 1 : j] - prefix[i])[:, None]
                run = runs[i]
                for r in range(1, len(run)):
                    k0, h = run[r]
                    if k0 >= j:
                        break
                    k1 = run[r + 1][0] if r + 1 < len(run) else j
                    cand[k0 - i - 1 : k1 - i - 1, : min(a[j] + h, hi) - lo] = inf
                low = cand.min(axis=0)
                better = low < best[lo:hi]
                if better.any():
                    k_best = (cand == low).argmax(axis=0) + (i + 1)
                    best[lo:hi] = np.where(better, low, best[lo:hi])
                    choice[lo:hi] = np.where(better, k_best, choice[lo:hi])
            if exact:
                np.minimum(best, inf, out=best)
            table[i][j - i] = best

    return _Rotor(a, tp, g, bwd, prefix, runs, table, what, exact, inf)


# First-pass rows H are filled in blocks of at most this many rows and this many entries
# (stages x rows x allowances h), which bounds the table and the per-stage candidates (16 MiB
# each) and the columns h > H a row computes for nothing.
_FIRST_PASS_ROWS = 32
_FIRST_PASS_BLOCK = 1 << 21


def _least_held(n: int, r: _Rotor) -> list[int]:
    """``least[i]``: the fewest slots a first-pass path from node ``i`` can hold (``P(i, h)`` is
    infinite below it): ``tape_{n-1}`` at the base, then ``tape_i`` or ``x_i`` plus the rest."""
    least = [0] * n
    least[n - 1] = r.tp[n - 1]
    for i in range(n - 2, -1, -1):
        least[i] = min(r.tp[i] + least[i + 1], r.a[i] + min(least[i + 1 :]))
    return least


def _first_pass_rows(n: int, r: _Rotor, mem: int, in_flight: Fraction) -> list[int]:
    """Held allowances ``H`` worth a row: at least what any path holds, and the own memory must
    hold the held items and ``δ_n`` (a row whose schedule holds less is beaten by a lower row)."""
    rows = []
    held = _least_held(n, r)[0]
    while mem - math.ceil((in_flight - 1) * held) >= held + r.a[n]:
        rows.append(held)
        held += 1
    return rows


def _solve_pipelined(
    chain: Chain, r: _Rotor, mem: int, in_flight: Fraction
) -> tuple[Schedule, int | None] | None:
    """``min_H P_H(0, H)`` over blocks of rows, then one row again with its decisions."""
    import numpy as np

    n = chain.length
    rows = _first_pass_rows(n, r, mem, in_flight)
    no_recompute = sum(chain.forward_flops) + sum(chain.backward_flops)
    best = None  # (cost, H)
    start = 0
    while start < len(rows):
        end = start + 1
        while (
            end < len(rows)
            and end - start < _FIRST_PASS_ROWS
            and (end + 1 - start) * (rows[end] + 1) * n <= _FIRST_PASS_BLOCK
        ):
            end += 1
        block = rows[start:end]
        table, _ = _first_pass_block(chain, r, mem, in_flight, block, record=False)
        tops = table[0][np.arange(len(block)), block]
        at = int(tops.argmin())
        if tops[at] < r.inf and (best is None or tops[at] < best[0]):
            best = (tops[at], block[at])
            if best[0] <= no_recompute:
                break
        start = end
    if best is None:
        return None
    held = best[1]
    table, choice = _first_pass_block(chain, r, mem, in_flight, [held], record=True)
    c = mem - math.ceil((in_flight - 1) * held) - held
    steps = _backtrack_first_pass(n, r, choice[:, 0, :], c, held)
    return steps, (int(table[0, 0, held]) if r.exact else None)


def _first_pass_block(chain: Chain, r: _Rotor, mem: int, in_flight: Fraction, block, record):
    """``P_H(i, h)`` for the rows ``H`` in ``block`` (ascending) and ``h <= max(block)``, as an
    array ``[i, row, h]``, with the decisions (0: keep_all, k > 0: leaf at k) if ``record``.

    Entries with ``h > H`` are never read (children have smaller allowances); their own memory
    may exceed ``mem`` and reads past the regular table see ``inf``.
    """
    import numpy as np

    n = chain.length
    f, b = chain.forward_flops, chain.backward_flops
    a, tp, g, bwd, prefix, runs, inf = r.a, r.tp, r.g, r.bwd, r.prefix, r.runs, r.inf
    dtype = r.table[0].dtype
    nb, nh = len(block), block[-1] + 1
    c = np.array([mem - math.ceil((in_flight - 1) * held) - held for held in block])
    own = c[:, None] + np.arange(nh)[None, :]  # own memory of a node with allowance h, per row
    table = np.full((n, nb, nh), inf, dtype=dtype)
    choice = np.full((n, nb, nh), -1, dtype=np.int32) if record else None
    prefix_arr = np.array(prefix, dtype=dtype)
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
        if lo >= nh:
            continue
        ks = n - 1 - i
        # C(i, k, .) + f_i + ... + f_{k-1} for k = i+1..n-1, padded with inf past ``mem``.
        left = np.full((ks, mem + 1 + nh), inf, dtype=dtype)
        left[:, : mem + 1] = r.table[i][1 : n - i] + (prefix_arr[i + 1 : n] - prefix[i])[:, None]
        run = runs[i]
        for q, (k0, h) in enumerate(run):
            if k0 >= n:
                break
            k1 = min(run[q + 1][0], n) if q + 1 < len(run) else n
            left[k0 - i - 1 : k1 - i - 1, : a[n] + h] = inf  # leaf threshold x_n + h(i, k)
        windows = np.lib.stride_tricks.sliding_window_view(left, nh - lo, axis=1)
        cand = windows[:, c + lo, :]  # at own memory c_H + h, h >= lo: (k, row, h - lo)
        cand += table[i + 1 : n, :, lo - sh : nh - sh]
        if record:
            k_rel = cand.argmin(axis=0)
            low = np.take_along_axis(cand, k_rel[None], axis=0)[0]
        else:
            low = cand.min(axis=0)
        sub = best[:, lo:]
        better = low < sub
        sub[better] = low[better]
        if record:
            choice[i][:, lo:][better] = (k_rel + (i + 1))[better]
        if r.exact:
            np.minimum(best, inf, out=best)
    return table, choice


def _backtrack_first_pass(n: int, r: _Rotor, choice, c: int, held: int) -> Schedule:
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
            steps.extend(_backtrack(r.what, r.a, r.tp, *item))
    return tuple(steps)


def _backtrack(what, a: list[int], tp: list[int], i: int, j: int, mem: int) -> Schedule:
    """Rebuild the schedule of ``C(i, j, mem)`` from the decision table (iteratively: chains can
    be deep)."""
    steps: list[Step] = []
    stack: list[tuple[int, int, int] | Step] = [(i, j, mem)]
    while stack:
        item = stack.pop()
        if isinstance(item, Step):
            steps.append(item)
            continue
        i, j, m = item
        c = int(what[i][j - i, m])
        if c < 0:
            raise RuntimeError(f"internal error: no decision for ({i}, {j}, {m})")
        if j == i + 1:
            steps += [Step(FORWARD_KEEP_ALL, i), Step(BACKWARD, i)]
        elif c == 0:
            steps.append(Step(FORWARD_KEEP_ALL, i))
            stack.append(Step(BACKWARD, i))
            stack.append((i + 1, j, m - tp[i]))
        else:
            steps.append(Step(FORWARD_KEEP_INPUT, i))
            steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, c))
            stack.append((i, c, m))
            stack.append((c, j, m - a[i]))
    return tuple(steps)
