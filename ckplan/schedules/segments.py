"""Simple schedules: store everything, or segments (Chen et al. 2016; Megatron block)."""

from __future__ import annotations

from collections.abc import Sequence

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


def check_segments(
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
    segs = check_segments(chain.length, segments)
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


def runs_segments(runs: Sequence[tuple[int, int, int, bool]]) -> list[tuple[int, int, bool]]:
    """The segments of runs of equal segments (start, size, count, recompute), in order."""
    return [
        (start + k * size, start + (k + 1) * size, recompute)
        for start, size, count, recompute in runs
        for k in range(count)
    ]


class SegmentSteps(Sequence):
    """The steps of :func:`segment_schedule` for runs of equal segments
    (:mod:`ckplan.schedules.segment_replay`), built on first use: a sweep evaluates hundreds of
    segment plans from :func:`segment_replay.replay_runs` and shows the steps of at most one.
    Compares equal to the tuple of its steps."""

    def __init__(self, chain: Chain, runs: Sequence[tuple[int, int, int, bool]]) -> None:
        self._chain, self._runs = chain, runs  # checked when the steps are built
        self._steps: Schedule | None = None

    @property
    def runs(self) -> Sequence[tuple[int, int, int, bool]]:
        return self._runs

    def steps(self) -> Schedule:
        if self._steps is None:
            self._steps = segment_schedule(self._chain, runs_segments(self._runs))
        return self._steps

    def __len__(self) -> int:
        again = sum(size * count for _, size, count, recompute in self._runs if recompute)
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


def schedule_segments(steps, stages: int) -> list[tuple[int, int, bool]] | None:
    """The segments whose `segment_schedule` is exactly `steps`, or None when `steps` is not a
    one-level segment schedule (some range re-run twice, or steps in another order). Derived:
    the inverse of `segment_schedule`, checked by rebuilding; what every launcher export is
    written from (ckplan.plan.export_limits, ckplan.exports.segments). Steps built from runs
    of segments (`SegmentSteps`) are read from their runs without building them: they are the
    runs' `segment_schedule` by construction, so only the stored segments' merge is left."""
    if isinstance(steps, SegmentSteps):
        return _segments_of_runs(steps.runs, stages)
    forward = []  # the first forward pass: stages 0..n-1, each once
    for step in steps:
        if step.kind == BACKWARD or (forward and step.stage != forward[-1].stage + 1):
            break
        forward.append(step)
    segments: list[tuple[int, int, bool]] = []
    for step in forward:
        if step.kind == FORWARD_KEEP_ALL:
            segments.append((step.stage, step.stage + 1, False))
        elif step.kind == FORWARD_KEEP_INPUT:
            segments.append((step.stage, step.stage + 1, True))
        elif step.kind == FORWARD_DROP and segments and segments[-1][2]:
            start, _, _ = segments[-1]
            segments[-1] = (start, step.stage + 1, True)
        else:
            return None
    merged = _merge_stored(segments)
    chain = Chain.uniform(stages, forward_flops=0, backward_flops=0, input_bytes=0, tape_bytes=0)
    try:
        rebuilt = segment_schedule(chain, merged)
    except ValueError:
        return None
    return merged if tuple(rebuilt) == tuple(steps) else None


def _merge_stored(segments) -> list[tuple[int, int, bool]]:
    """`segments` with consecutive stored ones merged into one (a stored stage's steps are the
    same in a segment of its own or in a longer stored one)."""
    merged: list[tuple[int, int, bool]] = []
    for start, end, recompute in segments:
        if merged and not recompute and not merged[-1][2] and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end, False)
        else:
            merged.append((start, end, recompute))
    return merged


def _segments_of_runs(runs, stages: int) -> list[tuple[int, int, bool]] | None:
    """`schedule_segments` of a `SegmentSteps` of `runs` (start, size, count, recompute) over
    `stages` chain stages: the runs' segments, stored ones merged; None where they do not
    cover the chain in order (their steps would not build)."""
    try:
        segments = check_segments(stages, runs_segments(runs))
    except ValueError:
        return None
    return _merge_stored(segments)
