"""Periodic stretches (schedules/periodic.py) and the fast paths built on them: period detection
against brute force, and the closed-form replay of segment plans on chains whose stages
alternate, against the step-by-step replay, whatever period it is given."""

from __future__ import annotations

import importlib
import random

from chains import chain_of_stages
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.brute_force import brute_force_optimal

from ckplan.inputs.presets import load_spec
from ckplan.plan import evaluate, layer_chain, parse_strategy
from ckplan.schedules import (
    Chain,
    held_after_forward_bytes,
    optimal_schedule,
    pipeline_peak_bytes,
    replay_runs,
    segment_runs,
    segment_schedule,
    simulate,
    store_all_schedule,
)
from ckplan.schedules.grouping import grouped_chain, stage_groups
from ckplan.schedules.periodic import (
    bulk_period,
    intern,
    mismatches,
    periodic_ends,
)

segment_replay_module = importlib.import_module("ckplan.schedules.segment_replay")
small_sequences = st.lists(st.integers(0, 2), max_size=40)


def _is_periodic(items, period) -> bool:
    return all(items[i] == items[i + period] for i in range(len(items) - period))


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
    periods = range(1, max(1, min(12, len(ids) - 1)) + 1)
    few = [p for p in periods if mismatches(ids, p) <= 7]
    if few:
        assert best == few[0]
    else:
        scores = {p: mismatches(ids, p) + p for p in periods}
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
    chain = chain_of_stages(kinds, draw(sizes), tape_includes_input=True)
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
            segment_replay_module._EQUAL_TERMS.clear()
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
        segment_replay_module._EQUAL_TERMS.clear()


# ---- the optimal DP over groups of whole periods ----------------------------------------

grouping_module = importlib.import_module("ckplan.schedules.grouping")


def _alternating(layers: int, period: int = 2) -> Chain:
    """Embedding, `layers` layers cycling through `period` kinds, output (the planner's shape)."""
    kinds = [(5 + k, 10 + 2 * k, 4, 24 + 3 * k, 2, 8 + k) for k in range(period)]
    body = [kinds[i % period] for i in range(layers)]
    stages = [(1, 0, 1, 3, 0, 0), *body, (9, 18, 4, 40, 0, 30)]
    return chain_of_stages(stages, 0)


def test_alternating_groups_are_whole_periods():
    chain = _alternating(40)
    groups = stage_groups(chain, 4)
    assert groups[0] == (0, 1) and groups[-1] == (41, 42)
    inner = groups[1:-1]
    assert [q - p for p, q in inner] == [4] * 10
    coarse = grouped_chain(chain, groups)
    assert len(set(zip(coarse.forward_flops[1:-1], coarse.tape_bytes[1:-1], strict=True))) == 1
    three = stage_groups(_alternating(30, period=3), 4)
    assert {q - p for p, q in three[1:-1]} == {6}
    assert stage_groups(chain, 1) == [(p, p + 1) for p in range(42)]


def test_period_groups_fit_and_never_beat_the_optimum():
    """Brute force needs chains of at most 7 stages, too short for a period to be detected:
    the period is forced (any grouping gives a valid, fitting schedule)."""
    rng = random.Random(5)
    detect = grouping_module.bulk_period
    found = 0
    try:
        for _ in range(60):
            period = rng.choice([2, 3])
            grouping_module.bulk_period = lambda ids, period=period: period
            grouping_module.optimal_groups.cache_clear()
            chain = _alternating(rng.randint(2, 5), period)
            in_flight = rng.choice([1, 2])
            top = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), in_flight)
            budget = rng.randint(0, top)
            size = rng.randint(2, 4)
            grouped = optimal_schedule(chain, budget, max(budget, 1), in_flight, group_size=size)
            if grouped is None:
                continue
            found += 1
            exact = brute_force_optimal(chain, budget, in_flight)
            replay = simulate(chain, grouped.steps)
            assert exact is not None and grouped.total_flops >= exact.total_flops
            assert grouped.total_flops == replay.total_flops
            assert grouped.pipeline_peak_bytes == pipeline_peak_bytes(chain, replay, in_flight)
            assert grouped.pipeline_peak_bytes <= budget
    finally:
        grouping_module.bulk_period = detect
        grouping_module.optimal_groups.cache_clear()
    assert found > 15


def test_small_alternating_chains_run_the_exact_dp():
    chain = _alternating(60)
    budget = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), 1) // 3
    default = optimal_schedule(chain, budget, 200)
    exact = optimal_schedule(chain, budget, 200, group_size=1)
    assert default is not None and default.stage_group == 1
    assert default.steps == exact.steps


def test_deep_alternating_optimal_answers_on_groups():
    spec = load_spec("gpt2", {"layers": 3000, "experts": 8, "moe_layers": "0-:2"})
    none = evaluate(spec, parse_strategy("none", spec))
    budget = none.activation_bytes // 4
    plan = evaluate(spec, parse_strategy("optimal", spec), budget=budget)
    assert plan is not None and plan.activation_bytes <= budget
    assert any("optimal over groups of up to" in note for note in plan.notes)
    replay = simulate(layer_chain(spec, False), plan.steps)
    assert replay.peak_bytes == plan.activation_bytes


def test_layouts_differing_in_dp_and_zero_share_their_chain():
    """The chain is built once for dp = 1, ZeRO 0: equal to the one built from each layout."""
    from ckplan.plan.layer_chain import _layer_chain, recompute_groups

    for preset, keys in [
        ("llama3-8b", {"dp": 8, "zero": 3}),
        ("mixtral-8x7b", {"dp": 16, "zero": 1, "ep": 8}),
        ("deepseek-v3", {"dp": 32, "zero": 2, "ep": 32, "tp": 4, "sp": True}),
        ("gemma2-9b", {"dp": 4, "zero": 3, "pp": 2, "framework": "torchtitan"}),
    ]:
        spec = load_spec(preset, keys)
        for selective in (False, True):
            for stage in range(spec.pp):
                built = _layer_chain(spec, recompute_groups(selective), stage)
                assert layer_chain(spec, selective, stage=stage) == built
