"""Shortcuts that must give exactly what the step-by-step replay gives: the closed-form replay
of segment plans, lazily built steps, Revolve's split by binary search, and the sweep's sampling
of revolve candidates on very deep stages."""

from __future__ import annotations

import random

import pytest
from chains import chain_of_stages
from hypothesis import given, settings
from hypothesis import strategies as st

from ckplan.inputs.presets import load_spec
from ckplan.plan import evaluate, layer_chain, parse_strategy
from ckplan.plan.evaluate import _segment_runs, _segments
from ckplan.plan.search import REVOLVE_MAX_STEPS, candidate_strategies, revolve_slots, sweep
from ckplan.schedules import (
    Chain,
    SegmentSteps,
    held_after_forward_bytes,
    replay_runs,
    revolve_min_forwards,
    segment_replay,
    segment_runs,
    segment_schedule,
    simulate,
)
from ckplan.schedules.revolve import _best_advance, _revolve_cost

GB = 10**9


@st.composite
def chains_and_segments(draw):
    """A chain, often of equal stages between a head and a tail (where equal segments are
    summarised), and a segmentation: random cuts or every K stages."""
    n = draw(st.integers(1, 14))
    sizes = st.integers(0, 6)
    kind = st.tuples(*[st.integers(0, 5)] * 2, *[sizes] * 4)
    if draw(st.booleans()):
        head, layer, tail = draw(kind), draw(kind), draw(kind)
        kinds = ([head] + [layer] * (n - 2) + [tail])[:n]
    else:
        kinds = [draw(kind) for _ in range(n)]
    chain = chain_of_stages(kinds, draw(sizes), tape_includes_input=True)
    if draw(st.booleans()):
        size, offset = draw(st.integers(1, n)), draw(st.integers(0, 1))
        bounds = sorted({0, n, *range(offset, n, size)})
    else:
        bounds = [0, *sorted(draw(st.sets(st.integers(1, max(1, n - 1))))), n]
        bounds = sorted(set(bounds))
    flags = draw(st.lists(st.booleans(), min_size=len(bounds), max_size=len(bounds)))
    segments = [(bounds[k], bounds[k + 1], flags[k]) for k in range(len(bounds) - 1)]
    return chain, segments


@settings(max_examples=400, deadline=None)
@given(chains_and_segments())
def test_segment_replay_equals_simulate(case):
    chain, segments = case
    replay = simulate(chain, segment_schedule(chain, segments))
    closed = segment_replay(chain, segments)
    assert closed.peak_bytes == replay.peak_bytes
    assert closed.held_bytes == held_after_forward_bytes(chain, replay)
    assert closed.forward_flops == replay.forward_flops
    assert closed.backward_flops == replay.backward_flops
    assert closed.recompute_flops == replay.recompute_flops


def test_segment_replay_hand_computed():
    """Two stages, x = (2, 3, 1), tapes (5, 6), no workspaces, one recompute segment: the
    re-forward of stage 1 holds δ_2, tape_0 and x_1 and makes x_2: 1 + 5 + 3 + 1 = 10; the
    backward of stage 1 holds tape_0, tape_1, δ_2 and makes δ_1: 5 + 6 + 1 + 3 = 15."""
    chain = Chain((1, 2), (2, 4), (2, 3, 1), (5, 6))
    closed = segment_replay(chain, [(0, 2, True)])
    assert closed.peak_bytes == 15
    assert closed.held_bytes == 2
    assert closed.recompute_flops == 3


def test_segment_replay_rejects_bad_segments():
    chain = Chain.uniform(3, forward_flops=1, backward_flops=2, input_bytes=1, tape_bytes=2)
    with pytest.raises(ValueError, match="starts at 1"):
        segment_replay(chain, [(1, 3, True)])
    with pytest.raises(ValueError, match="cover stages"):
        segment_replay(chain, [(0, 2, True)])


def test_segment_steps_are_the_schedule():
    chain = Chain.uniform(5, forward_flops=1, backward_flops=2, input_bytes=1, tape_bytes=2)
    segments = [(0, 2, True), (2, 4, False), (4, 5, True)]
    steps = SegmentSteps(chain, segment_runs(segments))
    schedule = segment_schedule(chain, segments)
    assert len(steps) == len(schedule) == 13  # 5 forwards, 3 re-forwards, 5 backwards
    assert steps == schedule and schedule == steps
    assert tuple(steps) == schedule and steps[3] == schedule[3]
    assert simulate(chain, steps).peak_bytes == simulate(chain, schedule).peak_bytes


def test_plan_steps_replay_to_the_plan():
    """A plan's lazily built steps replay to the peak and recompute it reports."""
    spec = load_spec("llama3-8b", {"layers": 12})
    for name in ("none", "uniform:4", "sequential:3", "block:5", "selective+uniform:2"):
        strategy = parse_strategy(name, spec)
        plan = evaluate(spec, strategy)
        assert isinstance(plan.steps, SegmentSteps)
        replay = simulate(layer_chain(spec, strategy.selective), plan.steps)
        assert replay.peak_bytes == plan.activation_bytes
        assert replay.recompute_flops * spec.microbatches <= plan.flops.recompute


def _advance_by_scan(length: int, s: int) -> int:
    best_adv, best_cost = -1, None
    for adv in range(1, length):
        right = _revolve_cost(length - adv, s - 1)
        if right is None:
            continue
        cost = adv + right + _revolve_cost(adv, s)
        if best_cost is None or cost < best_cost:
            best_adv, best_cost = adv, cost
    return best_adv


def test_revolve_split_by_binary_search_equals_the_scan():
    for length in range(2, 300):
        for slots in range(1, 12):
            assert _best_advance(length, slots) == _advance_by_scan(length, slots)


def test_revolve_slots_sampling():
    for layers in (1, 32, 128, 256, 340):  # every C up to about 350 layers per stage
        kept, skipped = revolve_slots(layers)
        assert skipped == [] and kept == list(range(1, len(kept) + 1))
    kept, skipped = revolve_slots(2000)
    assert skipped == list(range(1, len(skipped) + 1)) and kept[0] == skipped[-1] + 1
    total = sum(2 * 2002 + revolve_min_forwards(2002, c) for c in kept)
    assert total <= REVOLVE_MAX_STEPS


def test_deep_stage_sweep_says_what_it_sampled():
    spec = load_spec("llama3-70b", {"layers": 2000, "tp": 8, "sp": True})
    result = sweep(spec, 80 * GB)
    assert any(note.startswith("revolve:1..") for note in result.notes)
    names = {c.plan.strategy for c in result.candidates}
    assert "revolve:1" not in names and "uniform:1" in names and "block:2000" in names


def test_random_segment_plans_on_planner_chains():
    """The planner's own chains (embedding, layers, output) under random segmentations."""
    rng = random.Random(12)
    for preset in ("gpt2", "llama3-8b"):
        spec = load_spec(preset, {"layers": 9})
        for selective in (False, True):
            chain = layer_chain(spec, selective)
            for _ in range(20):
                cuts = sorted(rng.sample(range(1, chain.length), rng.randint(0, 5)))
                bounds = [0, *cuts, chain.length]
                segments = [
                    (bounds[k], bounds[k + 1], rng.random() < 0.7) for k in range(len(cuts) + 1)
                ]
                replay = simulate(chain, segment_schedule(chain, segments))
                assert segment_replay(chain, segments).peak_bytes == replay.peak_bytes


@settings(max_examples=300, deadline=None)
@given(chains_and_segments())
def test_runs_replay_equals_simulate(case):
    """The same plans given as runs (equal consecutive segments merged)."""
    chain, segments = case
    runs = segment_runs(segments)
    assert [
        seg for s, z, c, r in runs for seg in [(s + k * z, s + (k + 1) * z, r) for k in range(c)]
    ] == segments
    replay = simulate(chain, segment_schedule(chain, segments))
    closed = replay_runs(chain, runs)
    assert (closed.peak_bytes, closed.recompute_flops) == (
        replay.peak_bytes,
        replay.recompute_flops,
    )
    assert closed.held_bytes == held_after_forward_bytes(chain, replay)


def test_runs_reject_bad_input():
    chain = Chain.uniform(4, forward_flops=1, backward_flops=2, input_bytes=1, tape_bytes=2)
    for runs in ([(0, 2, 1, True)], [(1, 1, 3, True)], [(0, 0, 4, True)], [(0, 2, 2, 1)], [(0, 4)]):
        with pytest.raises(ValueError):
            replay_runs(chain, runs)


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2", {}),
        ("llama3-8b", {"layers": 13, "pp": 1}),
        ("llama3-8b", {"pp": 4, "microbatches": 4}),
    ],
)
def test_planner_runs_are_the_planner_segments(preset, overrides):
    """evaluate's runs expand to exactly its segment lists, for every candidate strategy."""
    spec = load_spec(preset, overrides)
    for strategy in candidate_strategies(spec):
        if strategy.kind in ("none", "selective", "revolve"):
            continue
        for first_stage in (True, False) if spec.pp > 1 else (True,):
            chain = layer_chain(spec, strategy.selective, first_stage)
            runs = _segment_runs(spec, chain, strategy, first_stage)
            expanded = [
                (start + k * size, start + (k + 1) * size, recompute)
                for start, size, count, recompute in runs
                for k in range(count)
            ]
            assert expanded == _segments(spec, chain, strategy, first_stage), strategy.name
