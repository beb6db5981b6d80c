"""Periodic stretches (schedules/periodic.py) and the fast paths built on them: period detection
against brute force, and the closed-form replay of segment plans on chains whose stages
alternate, against the step-by-step replay, whatever period it is given."""

from __future__ import annotations

import importlib

from hypothesis import given, settings
from hypothesis import strategies as st

from ckplan.schedules import (
    Chain,
    held_after_forward_bytes,
    replay_runs,
    segment_runs,
    segment_schedule,
    simulate,
)
from ckplan.schedules.periodic import (
    bulk_period,
    intern,
    mismatches,
    periodic_ends,
    smallest_period,
)

segment_replay_module = importlib.import_module("ckplan.schedules.segment_replay")
small_sequences = st.lists(st.integers(0, 2), max_size=24)


def _is_periodic(items, period) -> bool:
    return all(items[i] == items[i + period] for i in range(len(items) - period))


@settings(max_examples=300, deadline=None)
@given(small_sequences)
def test_smallest_period_is_brute_force(items):
    expected = next((p for p in range(1, len(items) + 1) if _is_periodic(items, p)), 1)
    assert smallest_period(items) == expected


@settings(max_examples=300, deadline=None)
@given(small_sequences, st.integers(1, 6))
def test_periodic_ends_is_brute_force(items, period):
    ids = intern(items)
    ends = periodic_ends(ids, period)
    for p in range(len(items)):
        expected = max(q for q in range(p, len(items)) if _is_periodic(items[p : q + 1], period))
        assert ends[p] == expected


@settings(max_examples=200, deadline=None)
@given(small_sequences)
def test_bulk_period_scores_best(items):
    ids = intern(items)
    best = bulk_period(ids)
    assert 1 <= best <= max(1, len(ids))
    if mismatches(ids, 1) + 1 > 8:
        scores = {p: mismatches(ids, p) + p for p in range(1, min(12, len(ids) - 1) + 1)}
        assert scores[best] == min(scores.values())
        assert best == min(p for p, s in scores.items() if s == scores[best])


def test_bulk_period_of_alternating_layers():
    layers = ["embedding", *(["dense", "moe"] * 500), "output"]
    assert bulk_period(intern(layers)) == 2
    layers = ["embedding", *(["dense", "dense", "moe"] * 300), "output"]
    assert bulk_period(intern(layers)) == 3
    assert bulk_period(intern(["embedding", *["dense"] * 1000, "output"])) == 1


@st.composite
def periodic_chains_and_runs(draw):
    """A chain: a head, a pattern of 1-4 stage kinds repeated, a tail; and segment runs, every
    K stages (K often not a multiple of the pattern) or random cuts."""
    sizes = st.integers(0, 6)
    kind = st.tuples(*[st.integers(0, 5)] * 2, *[sizes] * 4)
    pattern = draw(st.lists(kind, min_size=1, max_size=4))
    repeats = draw(st.integers(1, 12))
    kinds = [draw(kind), *(pattern * repeats), draw(kind)][: draw(st.integers(1, 50))]
    n = len(kinds)
    inputs = [k[2] for k in kinds] + [draw(sizes)]
    chain = Chain(
        [k[0] for k in kinds],
        [k[1] for k in kinds],
        inputs,
        [inputs[p] + k[3] for p, k in enumerate(kinds)],
        [k[4] for k in kinds],
        [k[5] for k in kinds],
    )
    if draw(st.booleans()):
        size, offset = draw(st.integers(1, n)), draw(st.integers(0, 2))
        bounds = sorted({0, n, *range(min(offset, n), n, size)})
    else:
        bounds = sorted({0, n, *draw(st.sets(st.integers(1, max(1, n - 1))))})
    flags = draw(st.lists(st.booleans(), min_size=len(bounds), max_size=len(bounds)))
    if draw(st.booleans()):
        flags = [flags[0]] * len(flags)  # one kind of segment: long runs
    segments = [(bounds[k], bounds[k + 1], flags[k]) for k in range(len(bounds) - 1)]
    return chain, segments, draw(st.integers(1, 5))


@settings(max_examples=400, deadline=None)
@given(periodic_chains_and_runs())
def test_replay_runs_on_periodic_chains_equals_simulate(case):
    """The closed form is exact whatever period it works with (the detected one, or any other
    forced on it): only its speed depends on the period."""
    chain, segments, forced = case
    runs = segment_runs(segments)
    replay = simulate(chain, segment_schedule(chain, segments))
    expected = (
        replay.peak_bytes,
        replay.recompute_flops,
        held_after_forward_bytes(chain, replay),
        replay.forward_flops,
    )
    detect = segment_replay_module.bulk_period
    try:
        for period in (None, forced):
            segment_replay_module._TERMS.clear()
            if period is not None:
                segment_replay_module.bulk_period = lambda ids, period=period: period
            closed = replay_runs(chain, runs)
            assert (
                closed.peak_bytes,
                closed.recompute_flops,
                closed.held_bytes,
                closed.forward_flops,
            ) == expected
    finally:
        segment_replay_module.bulk_period = detect
        segment_replay_module._TERMS.clear()
