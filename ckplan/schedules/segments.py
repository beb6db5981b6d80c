"""Simple schedules: store everything, or segments (Chen et al. 2016; Megatron block)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ckplan.schedules.chain import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    Chain,
    Schedule,
    Step,
)


def store_all_schedule(chain: Chain) -> Schedule:
    """No recomputation: ``forward_keep_all`` every stage, then backward in reverse.

    derived: the plain training step (no checkpointing); peak = all tapes + x_n + δ_n, etc.
    """
    n = chain.length
    return tuple(Step(FORWARD_KEEP_ALL, i) for i in range(n)) + tuple(
        Step(BACKWARD, i) for i in reversed(range(n))
    )


def _check_segments(
    n: int, segments: Sequence[tuple[int, int, bool]]
) -> list[tuple[int, int, bool]]:
    # Fast path for what planners pass (tuples of two ints and a bool, in order); anything else
    # takes the checks below, which name the first bad segment.
    expected = 0
    for seg in segments:
        if type(seg) is not tuple or len(seg) != 3 or type(seg[2]) is not bool:
            break
        start, end, _ = seg
        if type(start) is not int or type(end) is not int or start != expected or end <= start:
            break
        expected = end
    else:
        if expected == n:
            return list(segments)
    out = []
    expected = 0
    for idx, seg in enumerate(segments):
        try:
            start, end, recompute = seg
        except (TypeError, ValueError):
            raise ValueError(
                f"segment {idx}: expected (start, end, recompute), got {seg!r}"
            ) from None
        if not (isinstance(start, int) and isinstance(end, int)) or isinstance(start, bool):
            raise ValueError(f"segment {idx}: start and end must be ints, got {seg!r}")
        if start != expected:
            raise ValueError(
                f"segment {idx} starts at {start}, expected {expected} "
                "(segments are half-open [start, end) and must cover 0..n-1 in order)"
            )
        if end <= start:
            raise ValueError(f"segment {idx}: end {end} must be > start {start}")
        out.append((start, end, bool(recompute)))
        expected = end
    if expected != n:
        raise ValueError(f"segments cover stages 0..{expected - 1}, expected 0..{n - 1}")
    return out


def segment_schedule(chain: Chain, segments: Sequence[tuple[int, int, bool]]) -> Schedule:
    """Segment checkpointing: half-open segments ``[start, end)`` covering ``0..n-1`` in order.

    A *store* segment (``recompute=False``) runs ``forward_keep_all`` on its stages. A *recompute*
    segment runs ``forward_keep_input(start)`` then ``forward_drop`` on the rest; in the backward
    pass it re-runs ``forward_keep_all(start..end-1)`` from its stored input and backprops the
    segment (the tape of every stage must exist for its backward, so re-forwarding keep-all is the
    cheapest re-forward). Segments are processed in reverse in the backward pass.

    Source: Chen, Xu, Zhang, Guestrin 2016, "Training Deep Nets with Sublinear Memory Cost", §4
    (segments, one extra forward); ``torch.utils.checkpoint_sequential`` keeps the last segment
    (= last segment stored); Megatron ``--recompute-method block`` = first segments recomputed.
    """
    segs = _check_segments(chain.length, segments)
    steps: list[Step] = []
    for start, end, recompute in segs:
        if recompute:
            steps.append(Step(FORWARD_KEEP_INPUT, start))
            steps.extend(Step(FORWARD_DROP, i) for i in range(start + 1, end))
        else:
            steps.extend(Step(FORWARD_KEEP_ALL, i) for i in range(start, end))
    for start, end, recompute in reversed(segs):
        if recompute:
            steps.extend(Step(FORWARD_KEEP_ALL, i) for i in range(start, end))
        steps.extend(Step(BACKWARD, i) for i in reversed(range(start, end)))
    return tuple(steps)


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


class _RangeMax:
    """Maximum of ``values[lo:hi]`` in O(1) (a sparse table: maxima over power-of-two spans)."""

    def __init__(self, values: Sequence[int]) -> None:
        self.levels = [list(values)]
        span = 1
        while 2 * span <= len(values):
            last = self.levels[-1]
            self.levels.append([max(last[p], last[p + span]) for p in range(len(last) - span)])
            span *= 2

    def __call__(self, lo: int, hi: int) -> int:
        level = (hi - lo).bit_length() - 1
        row = self.levels[level]
        return max(row[lo], row[hi - (1 << level)])


class _SegmentTerms(NamedTuple):
    tapes: list[int]  # T[p]: tape bytes of stages 0..p-1
    forwards: list[int]  # F[p]: forward FLOPs of stages 0..p-1
    step: _RangeMax  # V[p] = x_p + forward workspace_p + x_{p+1}
    tape_step: _RangeMax  # U[p] = T[p] + V[p]
    backward: _RangeMax  # W[p] = T[p+1] + x_{p+1} + backward workspace_p + x_p
    run_end: list[int]  # the last stage q >= p such that stages p..q are all equal
    backwards: int  # backward FLOPs of the chain


_TERMS: dict[int, tuple[Chain, _SegmentTerms]] = {}  # by id(chain); a few recent chains


def _segment_terms(chain: Chain) -> _SegmentTerms:
    entry = _TERMS.get(id(chain))
    if entry is not None and entry[0] is chain:
        return entry[1]
    n, a, t = chain.length, chain.input_bytes, chain.tape_bytes
    fws, bws = chain.forward_workspace_bytes, chain.backward_workspace_bytes
    tapes, forwards = [0], [0]
    for p in range(n):
        tapes.append(tapes[-1] + t[p])
        forwards.append(forwards[-1] + chain.forward_flops[p])
    step = [a[p] + fws[p] + a[p + 1] for p in range(n)]
    kinds = list(zip(chain.forward_flops, chain.backward_flops, a[:n], t, fws, bws, strict=True))
    run_end = list(range(n))
    for p in range(n - 2, -1, -1):
        if kinds[p] == kinds[p + 1]:
            run_end[p] = run_end[p + 1]
    terms = _SegmentTerms(
        tapes,
        forwards,
        _RangeMax(step),
        _RangeMax([tapes[p] + step[p] for p in range(n)]),
        _RangeMax([tapes[p + 1] + a[p + 1] + bws[p] + a[p] for p in range(n)]),
        run_end,
        sum(chain.backward_flops),
    )
    if len(_TERMS) >= 8:
        _TERMS.clear()
    _TERMS[id(chain)] = (chain, terms)
    return terms


def segment_replay(chain: Chain, segments: Sequence[tuple[int, int, bool]]) -> SegmentReplay:
    """:func:`simulate` of :func:`segment_schedule` in closed form: O(1) per segment.

    derived from the replay rules (chain module docstring), with ``K`` the bytes the segments
    before ``[st, en)`` keep (their tapes, or the input of a recompute segment), ``T`` the prefix
    sums of tapes and ``V``, ``U``, ``W`` as in :class:`_SegmentTerms`. Every after-figure is at
    most the next step's during-figure, so the peak is the largest during-figure:

    * forward pass, store segment: ``x_n + K + max_p (T[p] - T[st] + V[p])``;
      recompute segment: ``x_n + K + max(V[st], x_st + max_{p > st} V[p])``;
    * backward pass, re-forward of a recompute segment (``x_st`` absorbed by ``tape_st``):
      ``x_en + K + max_p (T[p] - T[st] + V[p])``; backward of stage ``p`` (either kind):
      ``K + T[p+1] - T[st] + x_{p+1} + backward workspace_p + x_p``.

    The held bytes are ``K`` after the last segment. Of consecutive equal segments over equal
    stages only the last is evaluated (the others differ by a smaller ``K``). Tests check every
    figure against :func:`simulate` on random chains and segmentations.
    """
    segs = _check_segments(chain.length, segments)
    terms = _segment_terms(chain)
    a, T = chain.input_bytes, terms.tapes
    last = a[chain.length]
    kept = 0  # K: bytes the earlier segments keep
    peak = 0
    recompute = 0
    index = 0
    while index < len(segs):
        start, end, recomputed = segs[index]
        # Equal segments over equal stages (x_end included) have equal terms but for K, which
        # only grows: of a run of them, the last peaks highest.
        run = index
        limit = terms.run_end[start]
        if end <= limit:
            size = end - start
            while run + 1 < len(segs):
                after = segs[run + 1]
                if after[2] != recomputed or after[1] - after[0] != size or after[1] > limit:
                    break
                run += 1
        if run > index:
            skipped = run - index
            kept += skipped * (a[start] if recomputed else T[end] - T[start])
            if recomputed:
                recompute += skipped * (terms.forwards[end] - terms.forwards[start])
            start, end, recomputed = segs[run]
        index = run + 1
        if recomputed:
            forward = terms.step(start, start + 1)
            if end > start + 1:
                forward = max(forward, a[start] + terms.step(start + 1, end))
            again = a[end] + kept - T[start] + terms.tape_step(start, end)
            peak = max(peak, last + kept + forward, again)
            recompute += terms.forwards[end] - terms.forwards[start]
        else:
            peak = max(peak, last + kept - T[start] + terms.tape_step(start, end))
        peak = max(peak, kept - T[start] + terms.backward(start, end))
        kept += a[start] if recomputed else T[end] - T[start]
    base = terms.forwards[-1]
    return SegmentReplay(
        peak_bytes=peak,
        held_bytes=kept,
        forward_flops=base + recompute,
        backward_flops=terms.backwards,
        recompute_flops=recompute,
    )


class SegmentSteps(Sequence):
    """The steps of :func:`segment_schedule`, built on first use: a sweep evaluates hundreds of
    segment plans from :func:`segment_replay` and shows the steps of at most one. Compares equal
    to the tuple of its steps."""

    def __init__(self, chain: Chain, segments: Sequence[tuple[int, int, bool]]) -> None:
        self._chain, self._segments = chain, segments  # checked when the steps are built
        self._steps: Schedule | None = None

    def steps(self) -> Schedule:
        if self._steps is None:
            self._steps = segment_schedule(self._chain, self._segments)
        return self._steps

    def __len__(self) -> int:
        again = sum(end - start for start, end, recomputed in self._segments if recomputed)
        return 2 * self._chain.length + again

    def __getitem__(self, index):
        return self.steps()[index]

    def __iter__(self):
        return iter(self.steps())

    def __eq__(self, other) -> bool:
        return self.steps() == (other.steps() if isinstance(other, SegmentSteps) else other)

    def __hash__(self) -> int:
        return hash(self.steps())

    def __repr__(self) -> str:
        return f"SegmentSteps({len(self)} steps)"
