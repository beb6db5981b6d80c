"""Segment schedules replayed in closed form: what :func:`simulate` measures for
:func:`segment_schedule`, in O(1) per run of equal segments over equal stages.

A sweep evaluates about a thousand segment plans (uniform:K, sequential:K, block:N, with and
without selective recompute); replaying each step by step costs O(n) per plan, minutes on a
10,000-layer stage. Plans are described as *runs* ``(start, size, count, recompute)``: ``count``
consecutive segments of ``size`` stages from ``start`` (``block:N`` is one run of N one-stage
segments, ``uniform:K`` one run of ``L // K`` segments and a shorter one).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from math import gcd
from operator import add
from typing import NamedTuple

from ckplan.cache import BoundedCache
from ckplan.schedules.chain import Chain
from ckplan.schedules.periodic import bulk_period, intern, periodic_ends
from ckplan.schedules.segments import check_segments

Segment = tuple[int, int, bool]  # (start, end, recompute)
Run = tuple[int, int, int, bool]  # (start, size, count, recompute)


def segment_runs(segments: Sequence[Segment]) -> list[Run]:
    """Runs of consecutive segments of equal size and kind."""
    runs: list[Run] = []
    for start, end, recompute in segments:
        if runs:
            first, size, count, kind = runs[-1]
            if kind == recompute and end - start == size and first + size * count == start:
                runs[-1] = (first, size, count + 1, kind)
                continue
        runs.append((start, end - start, 1, recompute))
    return runs


def run_forwards(n: int, runs: Sequence[Run]) -> tuple[int, ...]:
    """Forwards of each of the n stages under a segment schedule: one, and one more in a
    recomputed segment (derived: a recompute segment re-runs its stages once in backward)."""
    forwards = [1] * n
    for start, size, count, recompute in runs:
        if recompute:
            forwards[start : start + size * count] = [2] * (size * count)
    return tuple(forwards)


def _check_runs(n: int, runs: Sequence[Run]) -> None:
    expected = 0
    for index, run in enumerate(runs):
        try:
            start, size, count, recompute = run
        except (TypeError, ValueError):
            message = f"run {index}: expected (start, size, count, recompute), got {run!r}"
            raise ValueError(message) from None
        values = (start, size, count)
        if any(type(v) is not int for v in values) or not isinstance(recompute, bool):
            raise ValueError(f"run {index}: expected three ints and a bool, got {run!r}")
        if start != expected or size < 1 or count < 1:
            raise ValueError(
                f"run {index} {run!r}: runs start where the previous ends ({expected}), "
                "with size and count >= 1"
            )
        expected = start + size * count
    if expected != n:
        raise ValueError(f"runs cover stages 0..{expected - 1}, expected 0..{n - 1}")


class SegmentReplay(NamedTuple):
    """What :func:`simulate` would measure for a segment schedule (the figures planners read)."""

    peak_bytes: int
    held_bytes: int  # what the schedule keeps between its forward and backward passes
    forward_flops: int
    backward_flops: int
    recompute_flops: int

    @property
    def total_flops(self) -> int:
        return self.forward_flops + self.backward_flops


class _Terms(NamedTuple):
    """Per-chain sums and per-stage terms (module docstring of :func:`replay_runs`)."""

    tapes: list[int]  # T[p]: tape bytes of stages 0..p-1
    forwards: list[int]  # F[p]: forward FLOPs of stages 0..p-1
    step: list[int]  # V[p] = x_p + forward workspace_p + x_{p+1}
    tape_step: list[int]  # U[p] = T[p] + V[p]
    backward: list[int]  # W[p] = T[p+1] + x_{p+1} + backward workspace_p + x_p
    period: int  # P: the period of most of the chain's stages (1: runs of equal stages)
    stretch_end: list[int]  # the last stage q >= p such that stages p..q are P-periodic
    backwards: int  # backward FLOPs of the chain


# By identity (hashing a long chain costs more than a lookup saves; an entry keeps its chain
# alive, so its id is not reused): `ckplan plan` returns to each of a few thousand chains. By
# value: equal chains built for other specs (dp, ZeRO).
_TERMS = BoundedCache(max_entries=1024, max_weight=1_000_000)
_EQUAL_TERMS = BoundedCache(max_entries=16, max_weight=1_000_000)


def _terms(chain: Chain) -> _Terms:
    entry = _TERMS.get(id(chain))
    if entry is not None and entry[0] is chain:
        return entry[1]
    terms = _EQUAL_TERMS.get(chain)
    if terms is None:
        terms = _build_terms(chain)
        _EQUAL_TERMS.put(chain, terms, chain.length)
    _TERMS.put(id(chain), (chain, terms), chain.length)
    return terms


def _build_terms(chain: Chain) -> _Terms:
    n, a, t = chain.length, chain.input_bytes, chain.tape_bytes
    fws, bws = chain.forward_workspace_bytes, chain.backward_workspace_bytes
    tapes = list(accumulate(t, initial=0))
    forwards = list(accumulate(chain.forward_flops, initial=0))
    step = list(map(add, map(add, a[:n], fws), a[1:]))
    # A stage with its successor's input (V and W read it): equal keys P apart make V, W - T
    # and U - T periodic, and the prefix sums grow by the same amount every P stages.
    keys = intern(
        list(zip(chain.forward_flops, chain.backward_flops, a[:n], t, fws, bws, a[1:], strict=True))
    )
    period = bulk_period(keys)
    stretch_end = periodic_ends(keys, period)
    terms = _Terms(
        tapes,
        forwards,
        step,
        list(map(add, tapes, step)),
        list(map(add, map(add, map(add, tapes[1:], a[1:]), bws), a)),
        period,
        stretch_end,
        sum(chain.backward_flops),
    )
    return terms


def _range_max(terms: _Terms, values: list[int], lo: int, hi: int) -> int:
    """``max(values[lo:hi])`` for ``values`` V, U or W, one P-periodic stretch at a time:
    inside a stretch V repeats every P stages and U, W grow (T does not decrease), so the
    maximum is among its last P stages."""
    best = values[lo]
    p, period, ends = lo, terms.period, terms.stretch_end
    while p < hi:
        top = min(hi - 1, ends[p])
        best = max(best, max(values[max(p, top - period + 1) : top + 1]))
        p = top + 1
    return best


def replay_runs(chain: Chain, runs: Sequence[Run]) -> SegmentReplay:
    """:func:`simulate` of :func:`segment_schedule` for the segments of ``runs``, in closed form.

    derived from the replay rules (chain module docstring), with ``K`` the bytes the segments
    before ``[st, en)`` keep (their tapes, or the input of a recompute segment), ``T`` the prefix
    sums of tapes and ``V``, ``U``, ``W`` as in :class:`_Terms`. Every after-figure is at most the
    next step's during-figure, so the peak is the largest during-figure:

    * forward pass, store segment: ``x_n + K + max_p (T[p] - T[st] + V[p])``;
      recompute segment: ``x_n + K + max(V[st], x_st + max_{p > st} V[p])``;
    * backward pass, re-forward of a recompute segment (``x_st`` absorbed by ``tape_st``):
      ``x_en + K + max_p (T[p] - T[st] + V[p])``; backward of stage ``p`` (either kind):
      ``K + T[p+1] - T[st] + x_{p+1} + backward workspace_p + x_p``.

    The held bytes are ``K`` after the last segment. Equal segments over equal stages (``x_en``
    included) have equal terms but for ``K``, which only grows: of such a stretch only the last
    is evaluated. Likewise in a P-periodic stretch (:mod:`ckplan.schedules.periodic`): segment
    ``i`` and segment ``i + m``, ``m = P / gcd(size, P)``, have equal terms but for ``K``, so
    whole cycles of ``m`` segments are skipped, their ``K`` and FLOPs added ``cycles`` times.
    Tests check every figure against :func:`simulate` on random chains and runs.
    """
    _check_runs(chain.length, runs)
    terms = _terms(chain)
    a, T, F = chain.input_bytes, terms.tapes, terms.forwards
    last = a[chain.length]
    kept = 0  # K: bytes the earlier segments keep
    peak = 0
    recompute = 0
    period = terms.period
    for start, size, count, recomputed in runs:
        cycle = period // gcd(size, period)  # m: segments until they repeat
        while count:
            # Of the segments inside the periodic stretch at `start`, skip all but the last cycle.
            inside = min(count, (terms.stretch_end[start] - start + 1) // size)
            cycles = inside // cycle - 1
            if cycles > 0:
                span = cycle * size
                if recomputed:
                    kept += cycles * sum(a[start : start + span : size])
                    recompute += cycles * (F[start + span] - F[start])
                else:
                    kept += cycles * (T[start + span] - T[start])
                start += cycles * span
                count -= cycles * cycle
            end = start + size
            base = kept - T[start]
            if recomputed:
                forward = terms.step[start]
                if size > 1:
                    forward = max(forward, a[start] + _range_max(terms, terms.step, start + 1, end))
                again = a[end] + base + _range_max(terms, terms.tape_step, start, end)
                peak = max(peak, last + kept + forward, again)
                recompute += F[end] - F[start]
            else:
                peak = max(peak, last + base + _range_max(terms, terms.tape_step, start, end))
            peak = max(peak, base + _range_max(terms, terms.backward, start, end))
            kept += a[start] if recomputed else T[end] - T[start]
            start, count = end, count - 1
    return SegmentReplay(
        peak_bytes=peak,
        held_bytes=kept,
        forward_flops=F[-1] + recompute,
        backward_flops=terms.backwards,
        recompute_flops=recompute,
    )


def segment_replay(chain: Chain, segments: Sequence[Segment]) -> SegmentReplay:
    """:func:`replay_runs` for a list of ``(start, end, recompute)`` segments."""
    return replay_runs(chain, segment_runs(check_segments(chain.length, segments)))
