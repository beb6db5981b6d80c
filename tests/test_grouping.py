"""The optimal DP over groups of stages (very deep chains): valid, fitting, never cheaper than
the exact optimum, and the exact DP wherever its work is within the limits."""

from __future__ import annotations

import random
from fractions import Fraction

from oracles.brute_force import brute_force_optimal

from ckplan.inputs.presets import load_spec
from ckplan.plan import evaluate, layer_chain, parse_strategy
from ckplan.schedules import (
    Chain,
    optimal_schedule,
    pipeline_peak_bytes,
    simulate,
    store_all_schedule,
)
from ckplan.schedules.grouping import (
    _within,
    dp_work,
    expand_schedule,
    grouped_chain,
    optimal_groups,
    stage_groups,
)


def _random_chain(rng: random.Random, n: int) -> Chain:
    inp = [rng.randint(0, 6) for _ in range(n + 1)]
    tape = [inp[i] + rng.randint(0, 6) for i in range(n)]
    fws = [rng.randint(0, 3) for _ in range(n)]
    bws = [rng.randint(0, 3) for _ in range(n)]
    return Chain(
        [rng.randint(0, 9) for _ in range(n)],
        [rng.randint(1, 9) for _ in range(n)],
        inp,
        tape,
        fws,
        bws,
    )


def _layered(n: int) -> Chain:
    """Embedding, n - 2 equal layers, output (the planner's shape)."""
    return Chain(
        (1, *[5] * (n - 2), 9),
        (0, *[10] * (n - 2), 18),
        (1, *[4] * (n - 2), 4, 0),
        (3, *[24] * (n - 2), 40),
        (0, *[2] * (n - 2), 0),
        (0, *[8] * (n - 2), 30),
    )


def test_groups_keep_unlike_stages_alone():
    chain = _layered(12)
    assert stage_groups(chain, 1) == [(p, p + 1) for p in range(12)]
    assert stage_groups(chain, 4) == [(0, 1), (1, 5), (5, 9), (9, 11), (11, 12)]


def test_one_stage_groups_are_the_chain():
    chain = _random_chain(random.Random(1), 7)
    assert grouped_chain(chain, stage_groups(chain, 1)) == chain


def test_grouped_chain_hand_computed():
    """Two stages x = (2, 3, 1), tapes (5, 6), workspaces fws (1, 4), bws (2, 0), as one group:
    forward of stage 1 holds tape_0 + x_1 + 4 + x_2 = 13 beyond the rest, the group's forward
    x_0 + fws + x_2 so fws = 10; backward of stage 0 holds tape_0 + x_1 + 2 + x_0 = 12, of
    stage 1 11 + 1 + 0 + 3 = 15 = tape 11 + x_2 + bws + x_0, so bws = 1."""
    chain = Chain((1, 2), (2, 4), (2, 3, 1), (5, 6), (1, 4), (2, 0))
    group = grouped_chain(chain, [(0, 2)])
    assert group == Chain((3,), (6,), (2, 1), (11,), (10,), (1,))


def test_grouped_schedules_fit_and_never_beat_the_optimum():
    rng = random.Random(21)
    found = 0
    for _ in range(150):
        n = rng.randint(2, 7)
        chain = _random_chain(rng, n)
        in_flight = rng.choice([1, 2, Fraction(5, 2)])
        top = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), in_flight)
        budget = rng.randint(0, top)
        size = rng.randint(2, n)
        grouped = optimal_schedule(chain, budget, max(budget, 1), in_flight, group_size=size)
        exact = brute_force_optimal(chain, budget, in_flight)
        if grouped is None:
            continue
        found += 1
        replay = simulate(chain, grouped.steps)
        assert exact is not None and grouped.total_flops >= exact.total_flops
        assert grouped.total_flops == replay.total_flops
        assert grouped.pipeline_peak_bytes == pipeline_peak_bytes(chain, replay, in_flight)
        assert grouped.pipeline_peak_bytes <= budget
        assert grouped.stage_group == max(q - p for p, q in stage_groups(chain, size))
    assert found > 30


def test_expand_schedule_of_the_grouped_store_all():
    chain = _layered(6)
    groups = stage_groups(chain, 2)
    coarse = grouped_chain(chain, groups)
    assert expand_schedule(store_all_schedule(coarse), groups) == store_all_schedule(chain)


def test_exact_dp_within_the_limits_grouped_beyond():
    assert optimal_groups(_layered(300), 501, 1) == tuple((p, p + 1) for p in range(300))
    deep = _layered(3000)
    groups = optimal_groups(deep, 501, 1)
    assert 1 < len(groups) < 3000 and groups[0] == (0, 1) and groups[-1] == (2999, 3000)
    assert _within(dp_work(grouped_chain(deep, list(groups)), 501, 1))
    piped = optimal_groups(_layered(300), 1001, Fraction(2))
    assert len(piped) < 300


def test_deep_stage_optimal_says_it_ran_on_groups():
    spec = load_spec("gpt2", {"layers": 1500})
    none = evaluate(spec, parse_strategy("none", spec))
    plan = evaluate(spec, parse_strategy("optimal", spec), budget=none.activation_bytes // 4)
    assert plan is not None and plan.activation_bytes <= none.activation_bytes // 4
    assert any("optimal over groups of up to" in note for note in plan.notes)
    replay = simulate(layer_chain(spec, False), plan.steps)
    assert replay.peak_bytes == plan.activation_bytes
