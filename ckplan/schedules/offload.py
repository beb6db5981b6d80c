"""Activation offloading to host memory, planned jointly with recomputation.

Source: Beaumont, Eyraud-Dubois, Shilova 2021, "Efficient Combination of Rematerialization and
Offloading for Training DNNs" (NeurIPS 2021): a stage's stored tape may be copied to host memory
after its forward and copied back before its backward, the copies overlapping compute; a dynamic
program chooses, per stage, to keep, offload or recompute. derived: the accounting below is this
package's chain model (:mod:`ckplan.schedules.chain`) extended by two asynchronous copies.

Offload model (exact; implemented by :func:`simulate_offload`)
--------------------------------------------------------------
An offload schedule is a persistent schedule (its :class:`~ckplan.schedules.chain.Step` list,
replayed by :func:`~ckplan.schedules.chain.simulate`) plus the set of *offloaded* stages. For an
offloaded stage ``i``:

O1. ``forward_keep_all(i)`` must run once, on the first pass, and the step right after it must
    be a forward of stage ``i + 1`` (so ``i < n - 1``). When ``forward_keep_all(i)`` ends, a
    device-to-host copy of ``tape_i`` starts; ``tape_bytes[i]`` host bytes (pinned) are
    allocated then. The copy runs during that next step (the copy engine beside the compute
    stream); ``tape_i`` counts on device through that step's during-figure and is freed at its
    end (not in its after-figure).
O2. The step right before ``backward(i)`` is ``backward(i + 1)`` (always so in a persistent
    schedule). When it starts, a host-to-device copy of ``tape_i`` starts: its device buffer
    counts from that step's during-figure on (it is then the live tape); the host copy is freed
    when the step ends.
O3. Between the two copies ``tape_i`` is on host only: every device figure strictly between
    them is the plain replay's less ``tape_bytes[i]``.

Each copy overlaps exactly one compute step, one copy per direction per step (PCIe and
NVLink-C2C are full duplex); the host peak is the most host bytes allocated at any step; bytes
moved are ``2 * tape_bytes[i]`` per offloaded stage.

Checkpointed inputs (``full+offload``, ``uniform:K+offload``) follow the same rules with ``x_i``
in place of ``tape_i``: ``forward_keep_input(i)`` runs once, on the first pass, followed by a
forward of stage ``i + 1``; ``x_i`` is copied out during that forward (on device through its
during-figure, ``input_bytes[i]`` host bytes from its start) and copied back during the step
right before the first re-forward of stage ``i`` (counted on device from that step's start, its
host bytes freed at its end). While a copy is out, two layer inputs are on device: the one in
flight and the next layer's own input; Transformer Engine's CPU offload handler (Megatron-Core
``cpu_offloading``) double-buffers the same way, one group offloading while the next computes,
and torchtune's ``OffloadActivations(use_streams=True)`` keeps up to ``max_fwd_stash_size``
offloaded tensors alive until their copies end (pytorch/torchtune,
``torchtune/training/_activation_offloading.py``). :func:`offload_window` finds both steps.

Time: a copy of ``t`` seconds overlapping a compute step of ``c`` seconds delays the compute
stream by ``max(0, t - c)`` (:func:`exposed_transfer`): the next step waits for the offload to
free its buffer, and ``backward(i)`` waits for its tape. Per offloaded stage ``i`` the exposed
time is ``exposed(copy_i, forward_{i+1}) + exposed(copy_i, backward_{i+1})``
(:func:`offload_exposed_cost`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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

# Costs beyond this bound would overflow the DP's int64 tables (entries are clamped to 2**61).
MAX_EXACT_COST = 2**60
# The joint DP's work grows with the square of the stages (about a second at 386 stages and 500
# slots, benchmarks/bench_schedules.py); the plans refuse longer chains rather than wait.
JOINT_MAX_STAGES = 512


def exposed_transfer(transfer: int | float, overlapped: int | float) -> int | float:
    """Time a copy of ``transfer`` adds to the step it overlaps, whose compute takes
    ``overlapped``: ``max(0, transfer - overlapped)``.

    derived: the copy engine runs beside the compute stream (CUDA streams; torch
    ``save_on_cpu`` and Megatron-LM's ``--cpu-offloading`` overlap the copies with the next
    layer); the step cannot end before its copy does.
    """
    return max(0, transfer - overlapped)


def offload_exposed_cost(
    forward: Sequence[int | float],
    backward: Sequence[int | float],
    copy: Sequence[int | float],
    offloaded: Iterable[int],
) -> int | float:
    """Exposed copy time of the ``offloaded`` stages: the offload of ``tape_i`` overlaps the
    forward of stage ``i + 1``, its prefetch the backward of stage ``i + 1``.

    derived: rules O1 and O2 of the module docstring with :func:`exposed_transfer`.
    """
    return sum(
        exposed_transfer(copy[i], forward[i + 1]) + exposed_transfer(copy[i], backward[i + 1])
        for i in offloaded
    )


def transfer_seconds(bytes_moved: int, bytes_per_second: float) -> float:
    """Seconds one copy of ``bytes_moved`` takes over a host link of ``bytes_per_second``.

    derived: a bulk copy streams at the link's effective rate (no per-copy latency modelled:
    the copies here are megabytes, the latency microseconds).
    """
    return bytes_moved / bytes_per_second


@dataclass(frozen=True)
class OffloadReplay:
    """What :func:`simulate_offload` measured: device and host figures per step (exact ints)."""

    replay: Replay  # the plain replay (every tape on device)
    offloaded: tuple[int, ...]
    device_peak_bytes: int
    host_peak_bytes: int
    bytes_moved: int  # device -> host and back, both directions counted
    device_trace: tuple[tuple[int, int], ...]  # (during, after) per step
    host_trace: tuple[tuple[int, int], ...]  # (during, after) per step
    offloaded_bytes: tuple[int, ...] = ()  # bytes each offloaded stage moves one way

    @property
    def total_flops(self) -> int:
        return self.replay.total_flops

    @property
    def recompute_flops(self) -> int:
        return self.replay.recompute_flops


def offload_windows(steps: Sequence[Step], n: int) -> OffloadWindows:
    """Where each stage's first forward, second forward and backward run in ``steps``: what
    :func:`offload_window` reads, found in one pass."""
    first: dict[int, int] = {}
    again: dict[int, int] = {}
    keep_all: dict[int, int] = {}
    backward: dict[int, int] = {}
    last_forward = len(steps)
    for t, st in enumerate(steps):
        i = st.stage
        if st.kind == BACKWARD:
            backward.setdefault(i, t)
            continue
        if i == n - 1 and last_forward == len(steps):
            last_forward = t
        if i not in first:
            first[i] = t
        elif i not in again:
            again[i] = t
        if st.kind == FORWARD_KEEP_ALL:
            keep_all[i] = keep_all.get(i, 0) + 1
    return OffloadWindows(tuple(steps), n, first, again, keep_all, backward, last_forward)


@dataclass(frozen=True)
class OffloadWindows:
    """Step indices of a schedule per stage (:func:`offload_windows`)."""

    steps: Schedule
    n: int
    first: dict
    again: dict
    keep_all: dict
    backward: dict
    last_forward: int


def offload_window(
    steps: Sequence[Step], n: int, i: int, windows: OffloadWindows | None = None
) -> tuple[int, int, bool]:
    """``(start, prefetch, tape)`` of the offloaded stage ``i`` in ``steps``: the index of the
    first-pass forward that stores it (its copy out overlaps step ``start + 1``), the index of
    the step its copy back overlaps, and whether the tape moves (``forward_keep_all``) or the
    checkpointed input ``x_i`` (``forward_keep_input``).

    derived: rules O1-O3 and their checkpointed-input form (module docstring). Raises
    ``ValueError`` for a stage the rules do not let move.
    """
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n - 1:
        raise ValueError(f"offloaded stage {i!r}: expected a stage in 0..{n - 2}")
    w = windows if windows is not None else offload_windows(tuple(steps), n)
    steps = w.steps
    start = w.first.get(i)
    kind = steps[start].kind if start is not None else None
    if (
        start is None
        or start > w.last_forward
        or kind not in (FORWARD_KEEP_ALL, FORWARD_KEEP_INPUT)
        or (kind == FORWARD_KEEP_ALL and w.keep_all.get(i) != 1)
    ):
        raise ValueError(
            f"offloaded stage {i}: forward_keep_all({i}) or forward_keep_input({i}) must run "
            "once, on the first pass, as its first forward"
        )
    tape = kind == FORWARD_KEEP_ALL
    nxt = steps[start + 1]
    if nxt.kind == BACKWARD or nxt.stage != i + 1:
        raise ValueError(
            f"offloaded stage {i}: the step after {steps[start]} must be a forward "
            f"of stage {i + 1}, got {nxt}"
        )
    if tape:
        end = w.backward[i]
        if steps[end - 1] != Step(BACKWARD, i + 1):
            raise ValueError(
                f"offloaded stage {i}: the step before backward({i}) must be backward({i + 1})"
            )
        return start, end - 1, True
    reuse = w.again.get(i)
    if reuse is None or reuse - 1 <= start + 1:
        raise ValueError(
            f"offloaded stage {i}: x_{i} is read again before its copy to host could end"
        )
    return start, reuse - 1, False


def simulate_offload(
    chain: Chain, steps: Sequence[Step], offloaded: Iterable[int]
) -> OffloadReplay:
    """Replay ``steps`` with the tapes (or checkpointed inputs) of ``offloaded`` on host (module
    docstring, O1-O3).

    derived: the device figures are :func:`simulate`'s with ``tape_i`` (or ``x_i``) removed
    strictly between the step its offload overlaps and the step its prefetch overlaps. Raises
    ``ValueError`` for an invalid schedule or an offload the rules do not allow.
    """
    steps = tuple(steps)
    replay = simulate(chain, steps)
    n = chain.length
    stages = sorted(set(offloaded))
    during = [point.during_bytes for point in replay.trace]
    after = [point.after_bytes for point in replay.trace]
    host_during = [0] * len(steps)
    host_after = [0] * len(steps)
    # each offload's bytes leave the device (and sit on the host) over a run of steps: added
    # as differences at the run's ends and summed once, not step by step (a deep chain's
    # windows are as long as the chain)
    device_off = [0] * (len(steps) + 1)
    host_on = [0] * (len(steps) + 1)
    moved = []
    windows = offload_windows(steps, n)
    for i in stages:
        start, prefetch, tape = offload_window(steps, n, i, windows)
        nbytes = chain.tape_bytes[i] if tape else chain.input_bytes[i]
        moved.append(nbytes)
        after[start + 1] -= nbytes
        if start + 2 < prefetch:  # off the device from step start + 2 to prefetch - 1
            device_off[start + 2] += nbytes
            device_off[prefetch] -= nbytes
        host_after[start] += nbytes
        if start + 1 < prefetch:  # on the host from step start + 1 to prefetch - 1
            host_on[start + 1] += nbytes
            host_on[prefetch] -= nbytes
        host_during[prefetch] += nbytes
    off = on = 0
    for t in range(len(steps)):
        off += device_off[t]
        on += host_on[t]
        during[t] -= off
        after[t] -= off
        host_during[t] += on
        host_after[t] += on
    device_peak = max([replay.initial_bytes, *during, *after])
    return OffloadReplay(
        replay=replay,
        offloaded=tuple(stages),
        device_peak_bytes=device_peak,
        host_peak_bytes=max([0, *host_during, *host_after]),
        bytes_moved=2 * sum(moved),
        device_trace=tuple(zip(during, after, strict=True)),
        host_trace=tuple(zip(host_during, host_after, strict=True)),
        offloaded_bytes=tuple(moved),
    )


def offload_all(chain: Chain) -> tuple[Schedule, tuple[int, ...]]:
    """Store every tape, offload every stage's but the last one's (its backward follows at
    once): the ``offload`` strategy, no recomputation."""
    return store_all_schedule(chain), tuple(range(chain.length - 1))


def offload_stored(steps: Sequence[Step], n: int) -> tuple[int, ...]:
    """The stages ``0..n-2`` whose first forward stores their tape or their input on the first
    pass and is followed by the next stage's forward: every stage a ``STRATEGY+offload`` moves
    (``full+offload``: each layer's checkpointed input; the stored stages' tapes too).

    derived: the stages :func:`offload_window` accepts; on a segment schedule, every stage but
    the last whose input or tape the first pass keeps.
    """
    windows = offload_windows(tuple(steps), n)
    out = []
    for i in range(n - 1):
        try:
            offload_window(steps, n, i, windows)
        except ValueError:
            continue
        out.append(i)
    return tuple(out)


@dataclass(frozen=True)
class OffloadResult:
    """A schedule of :func:`optimal_offload_schedule` with its exact replay.

    ``cost`` is the DP's objective, compute (every forward, recomputation included, and every
    backward) plus exposed copies, in the units of the chain's costs; it equals the replay's
    ``total_flops + exposed_cost``.
    """

    steps: Schedule
    offloaded: tuple[int, ...]
    cost: int
    exposed_cost: int
    replay: OffloadReplay
    budget_bytes: int
    host_budget_bytes: int | None
    slot_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.replay.device_peak_bytes

    @property
    def host_peak_bytes(self) -> int:
        return self.replay.host_peak_bytes


_KEEP, _OFFLOAD, _NONE = -2, -3, -1
_INF = 2**61


def optimal_offload_schedule(
    chain: Chain,
    budget_bytes: int,
    copy_cost: Sequence[int],
    host_budget_bytes: int | None = None,
    slots: int = 500,
    host_slots: int = 64,
) -> OffloadResult | None:
    """The cheapest schedule over {keep, offload, recompute} whose device peak fits
    ``budget_bytes`` and host peak ``host_budget_bytes`` (None: unlimited); None if none fits.

    Source: Beaumont, Eyraud-Dubois, Shilova 2021 (NeurIPS), the joint dynamic program over
    rematerialization and offloading, on the persistent schedules of Beaumont et al. 2019
    (rotor). derived: the recursion below is re-derived for this package's chain model and the
    offload rules of the module docstring; tests check it against an exhaustive search.

    The chain's FLOPs are the compute costs (any unit: FLOPs, or nanoseconds per stage), and
    ``copy_cost[i]`` what one copy of ``tape_i`` takes in the same unit. Offloads happen on the
    first-pass path (the top problem and the right sub-problems it reaches), where a tape is
    stored until the end of the forward pass; the recomputed segments it leaves are rotor's
    regular sub-problems ``C(i, k, m)`` (:func:`~ckplan.schedules.rotor.regular_table`).

    ``P(i, m, h, e)``: ``x_i`` and ``δ_n`` live, reverse ``[i, n)`` in ``m`` device bytes and
    ``h`` host bytes, where ``e`` bytes (the previous stage's offloaded tape, else 0) are on
    device during the first step (its offload) and the last step (its prefetch). With
    ``g_p = x_p + fws_p + x_{p+1}``, ``bwd_i = tape_i + x_{i+1} + bws_i + x_i`` and
    ``T_i = max(x_n + g_i + e, bwd_i + e)``:

    * ``i = n - 1``: ``f_i + b_i`` if ``m >= T_i``.
    * keep: ``f_i + b_i + P(i+1, m - tape_i, h, 0)`` if ``m >= T_i``.
    * offload (``i < n - 1``): ``f_i + b_i + X_i + P(i+1, m, h - tape_i, tape_i)`` if
      ``m >= T_i``, with ``X_i = exposed(c_i, f_{i+1}) + exposed(c_i, b_{i+1})``.
    * recompute, leaf at ``i < k < n``: ``f_i + ... + f_{k-1} + P(k, m - x_i, h, 0) +
      C(i, k, m)`` if ``m >= x_n + max(g_i + e, x_i + max_{i<p<k} g_p)`` and, with ``e > 0``,
      ``m >= bwd_i + e`` (the prefetch overlaps ``C``'s last step, ``backward(i)``, whose own
      bytes are ``bwd_i``).

    Device sizes are rounded up to slots of ``ceil(budget / slots)`` bytes and host sizes to
    ``ceil(host_budget / host_slots)`` bytes, so the schedule fits at exact sizes too
    (``slots >= budget_bytes`` is exact for the device); storing everything on device, the
    cheapest schedule, is returned whenever it fits at exact sizes. The host dimension is solved
    only when the best schedule without it exceeds the host budget. Ties: keep, then offload,
    then the smallest ``k``. The result's peaks are the exact replay (:func:`simulate_offload`).
    """
    for name, value in (("budget_bytes", budget_bytes), ("host_budget_bytes", host_budget_bytes)):
        if value is None and name == "host_budget_bytes":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    for name, value in (("slots", slots), ("host_slots", host_slots)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    n = chain.length
    copy = _copy_costs(copy_cost, n)
    bound = n * (sum(chain.forward_flops) + sum(chain.backward_flops)) + 2 * sum(copy)
    if bound >= MAX_EXACT_COST:
        raise ValueError(
            f"costs too large for the exact offload DP (n * total + copies = {bound} >= 2**60): "
            "give them in a coarser unit"
        )
    unit = max(1, -(-budget_bytes // slots))
    mem = budget_bytes // unit
    # Storing everything on device is the cheapest schedule there is: when it fits at exact
    # sizes it is the answer, even where rounding sizes up to slots would make the DP miss it.
    plain = store_all_schedule(chain)
    if simulate(chain, plain).peak_bytes <= budget_bytes:
        found = (plain, (), sum(chain.forward_flops) + sum(chain.backward_flops))
    else:
        found = _solve(chain, copy, unit, mem, None, 0)
    if found is not None and host_budget_bytes is not None:
        replay = simulate_offload(chain, found[0], found[1])
        if replay.host_peak_bytes > host_budget_bytes:
            host_unit = max(1, -(-host_budget_bytes // host_slots))
            found = _solve(chain, copy, unit, mem, host_unit, host_budget_bytes // host_unit)
    if found is None:
        return None
    steps, stages, cost = found
    replay = simulate_offload(chain, steps, stages)
    exposed = offload_exposed_cost(chain.forward_flops, chain.backward_flops, copy, stages)
    if cost != replay.total_flops + exposed:
        raise RuntimeError(
            f"internal error: DP cost {cost} != replayed {replay.total_flops} + {exposed}"
        )
    if replay.device_peak_bytes > budget_bytes or (
        host_budget_bytes is not None and replay.host_peak_bytes > host_budget_bytes
    ):
        raise RuntimeError("internal error: the replayed peaks exceed the budgets")
    return OffloadResult(
        steps, stages, cost, exposed, replay, budget_bytes, host_budget_bytes, unit
    )


def _copy_costs(copy_cost: Sequence[int], n: int) -> tuple[int, ...]:
    if isinstance(copy_cost, (str, bytes)) or len(copy_cost) != n:
        raise ValueError(f"copy_cost must be a sequence of {n} integers (one per stage)")
    out = []
    for k, value in enumerate(copy_cost):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"copy_cost[{k}] must be an int >= 0, got {value!r}")
        out.append(int(value))
    return tuple(out)


def _solve(chain: Chain, copy: tuple[int, ...], unit: int, mem: int, host_unit, host_mem: int):
    """The table ``P`` of :func:`optimal_offload_schedule` and its backtrack: ``(steps,
    offloaded stages, cost)`` or None."""
    import numpy as np

    from ckplan.schedules.rotor import regular_table

    n = chain.length
    f, b = chain.forward_flops, chain.backward_flops
    r = regular_table(chain, unit, mem, n - 1)
    a, tp, g, bwd = r.a, r.tp, r.g, r.bwd
    hp = [-(-x // host_unit) for x in chain.tape_bytes] if host_unit else [0] * n
    rows, width = host_mem + 1, mem + 1
    table = [[None, None] for _ in range(n)]  # table[i][flag]: (rows, width) int64
    later = np.full((n, rows, width), _INF, dtype=np.int64)  # table[k][0], stacked for the leaves
    choice = [[None, None] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        flags = (0, 1) if i > 0 else (0,)
        bests, choices, thresholds = {}, {}, {}
        for flag in flags:
            e = tp[i - 1] if flag else 0
            best = np.full((rows, width), _INF, dtype=np.int64)
            chosen = np.full((rows, width), _NONE, dtype=np.int32)
            thr = max(a[n] + g[i] + e, bwd[i] + e)
            thresholds[flag] = thr
            if thr <= mem:
                if i == n - 1:
                    best[:, thr:] = f[i] + b[i]
                else:
                    best[:, thr:] = table[i + 1][0][:, thr - tp[i] : width - tp[i]] + (f[i] + b[i])
                np.minimum(best, _INF, out=best)
                chosen[best < _INF] = _KEEP
                if i < n - 1 and hp[i] < rows:
                    extra = exposed_transfer(copy[i], f[i + 1]) + exposed_transfer(
                        copy[i], b[i + 1]
                    )
                    cand = np.full((rows, width), _INF, dtype=np.int64)
                    cand[hp[i] :, thr:] = table[i + 1][1][: rows - hp[i], thr:] + (
                        f[i] + b[i] + extra
                    )
                    better = cand < best
                    best[better] = cand[better]
                    chosen[better] = _OFFLOAD
            bests[flag], choices[flag] = best, chosen
        # Leaves: keep x_i, advance to x_k, P(k, m - x_i, h, 0), then C(i, k, m), every k at
        # once: candidates[k - i - 1] over (h, m); the first of equal minima is the smallest k.
        if i < n - 1:
            count = n - 1 - i
            gs = np.array(g[i + 1 : n - 1], dtype=np.int64)
            # pm[k - i - 1] = max(g_p for i < p < k), 0 for k = i + 1
            pm = np.concatenate(([0], np.maximum.accumulate(gs))) if count > 1 else np.zeros(1)
            plus = r.plus[r.left[i][:count]]
            left = np.where(plus < r.inf, plus * r.scale, _INF)
            shift = a[i]
            # every threshold is at least a[i]: the entries under it are set below, per flag
            leaves = np.empty((count, rows, width), dtype=np.int64)
            np.add(
                later[i + 1 : n, :, : width - shift], left[:, None, shift:], out=leaves[..., shift:]
            )
            slots_m = np.arange(width)
            for flag in flags:  # thresholds grow with e: flag 1 masks what flag 0 did and more
                e = tp[i - 1] if flag else 0
                thr = a[n] + np.maximum(g[i] + e, a[i] + pm)
                if e:
                    thr = np.maximum(thr, bwd[i] + e)
                below = slots_m[None, :] < thr[:, None]  # (count, width): m under the threshold
                np.copyto(leaves, _INF, where=below[:, None, :])
                c_best = leaves.min(axis=0)  # sums of two entries <= 2**61 stay below 2**63
                better = c_best < bests[flag]
                if better.any():
                    k_best = leaves.argmin(axis=0)
                    bests[flag][better] = c_best[better]
                    choices[flag][better] = (k_best + i + 1)[better]
        for flag in flags:
            table[i][flag], choice[i][flag] = bests[flag], choices[flag]
        later[i] = bests[0]
    top = int(table[0][0][host_mem, mem])
    if top >= _INF:
        return None
    steps: list[Step] = []
    after: list = []
    stages = []
    i, flag, h, m = 0, 0, host_mem, mem
    while True:
        c = int(choice[i][flag][h, m])
        if c == _NONE:
            raise RuntimeError(f"internal error: no offload decision at ({i}, {flag}, {h}, {m})")
        if c in (_KEEP, _OFFLOAD):
            steps.append(Step(FORWARD_KEEP_ALL, i))
            if i == n - 1:
                steps.append(Step(BACKWARD, i))
                break
            after.append(Step(BACKWARD, i))
            if c == _KEEP:
                i, flag, m = i + 1, 0, m - tp[i]
            else:
                stages.append(i)
                i, flag, h = i + 1, 1, h - hp[i]
        else:
            steps.append(Step(FORWARD_KEEP_INPUT, i))
            steps.extend(Step(FORWARD_DROP, p) for p in range(i + 1, c))
            after.append((i, c, m))
            i, flag, m = c, 0, m - a[i]
    for item in reversed(after):
        if isinstance(item, Step):
            steps.append(item)
        else:
            steps.extend(r.backtrack(*item))
    return tuple(steps), tuple(stages), top


def first_pass_stages(steps: Sequence[Step], n: int) -> tuple[int, ...]:
    """Stages whose ``forward_keep_all`` runs before the first forward of stage ``n - 1``: the
    tapes an offload may move (rule O1)."""
    out = []
    for st in steps:
        if st.kind != BACKWARD and st.stage == n - 1:
            break
        if st.kind == FORWARD_KEEP_ALL:
            out.append(st.stage)
    return tuple(out)
