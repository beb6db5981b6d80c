"""Tests for ckplan.schedules: replay accounting, optimal DP vs brute force, Revolve, segments."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles.brute_force import brute_force_optimal, enumerate_persistent_schedules

from ckplan.schedules import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    Chain,
    Step,
    beta,
    held_after_forward_bytes,
    optimal_schedule,
    pipeline_peak_bytes,
    revolve_dp_min_forwards,
    revolve_dp_table,
    revolve_min_forwards,
    revolve_schedule,
    segment_schedule,
    simulate,
    store_all_schedule,
)


def KA(i: int) -> Step:
    return Step(FORWARD_KEEP_ALL, i)


def KI(i: int) -> Step:
    return Step(FORWARD_KEEP_INPUT, i)


def D(i: int) -> Step:
    return Step(FORWARD_DROP, i)


def B(i: int) -> Step:
    return Step(BACKWARD, i)


def small_chain() -> Chain:
    return Chain(
        forward_flops=(1, 2, 3),
        backward_flops=(2, 4, 6),
        input_bytes=(2, 3, 4, 1),
        tape_bytes=(5, 6, 7),
        forward_workspace_bytes=(1, 0, 0),
        backward_workspace_bytes=(0, 2, 0),
    )


def four_stage_chain() -> Chain:
    return Chain.uniform(4, forward_flops=1, backward_flops=2, input_bytes=2, tape_bytes=5)


# ------------------------------------------------------------------------------------------
# Chain and Step validation


def test_chain_defaults_and_conversion():
    c = Chain(forward_flops=[1, 2], backward_flops=[2, 4], input_bytes=[1, 1, 0], tape_bytes=[3, 1])
    assert c.forward_flops == (1, 2)
    assert c.forward_workspace_bytes == (0, 0)
    assert c.backward_workspace_bytes == (0, 0)
    assert c.length == len(c) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"forward_flops": (), "backward_flops": (), "input_bytes": (0,), "tape_bytes": ()},
        {
            "forward_flops": (1,),
            "backward_flops": (1, 2),
            "input_bytes": (1, 1),
            "tape_bytes": (1,),
        },
        {"forward_flops": (1,), "backward_flops": (1,), "input_bytes": (1,), "tape_bytes": (1,)},
        {"forward_flops": (-1,), "backward_flops": (1,), "input_bytes": (1, 1), "tape_bytes": (1,)},
        {
            "forward_flops": (1.5,),
            "backward_flops": (1,),
            "input_bytes": (1, 1),
            "tape_bytes": (1,),
        },
        {
            "forward_flops": (True,),
            "backward_flops": (1,),
            "input_bytes": (1, 1),
            "tape_bytes": (1,),
        },
        {"forward_flops": (1,), "backward_flops": (1,), "input_bytes": (4, 1), "tape_bytes": (3,)},
        {
            "forward_flops": (1,),
            "backward_flops": (1,),
            "input_bytes": (1, 1),
            "tape_bytes": (1,),
            "forward_workspace_bytes": (1, 2),
        },
    ],
)
def test_chain_rejects_invalid(kwargs):
    with pytest.raises(ValueError):
        Chain(**kwargs)


def test_step_rejects_invalid():
    with pytest.raises(ValueError):
        Step("forward", 0)
    with pytest.raises(ValueError):
        Step(BACKWARD, -1)


# ------------------------------------------------------------------------------------------
# simulate: hand-computed traces


def test_simulate_store_all_hand_computed():
    c = small_chain()
    r = simulate(c, store_all_schedule(c))
    # initial x0 + δ3 = 3
    # KA0: during 3+1+3=7, after tape0 5 + x1 3 + δ3 1 = 9
    # KA1: during 9+4=13, after 5+6+x2 4+1=16
    # KA2: during 16+1=17, after 5+6+7+1=19 (x3 is dead: the next step is a backward)
    # B2: during 19+0+4=23, after 5+6+δ2 4=15
    # B1: during 15+2+3=20, after 5+3=8
    # B0: during 8+0+2=10, after 2
    assert r.initial_bytes == 3
    assert [(p.during_bytes, p.after_bytes) for p in r.trace] == [
        (7, 9),
        (13, 16),
        (17, 19),
        (23, 15),
        (20, 8),
        (10, 2),
    ]
    assert r.peak_bytes == 23
    assert r.peak_step == 3
    assert r.forward_flops == 6 and r.backward_flops == 12 and r.recompute_flops == 0
    assert r.total_flops == 18
    assert r.layer_forwards == (1, 1, 1)


def test_segment_schedule_all_recompute_hand_computed():
    c = four_stage_chain()
    steps = segment_schedule(c, [(0, 2, True), (2, 4, True)])
    assert steps == (KI(0), D(1), KI(2), D(3), KA(2), KA(3), B(3), B(2), KA(0), KA(1), B(1), B(0))
    r = simulate(c, steps)
    during = [p.during_bytes for p in r.trace]
    after = [p.after_bytes for p in r.trace]
    assert during == [4, 6, 6, 6, 6, 9, 14, 11, 6, 11, 14, 9]
    assert after == [4, 4, 6, 4, 9, 12, 9, 4, 9, 12, 7, 2]
    assert r.peak_bytes == 14
    assert r.recompute_flops == 4
    assert r.layer_forwards == (2, 2, 2, 2)


def test_segment_schedule_last_segment_stored_hand_computed():
    c = four_stage_chain()
    steps = segment_schedule(c, [(0, 2, True), (2, 4, False)])
    assert steps == (KI(0), D(1), KA(2), KA(3), B(3), B(2), KA(0), KA(1), B(1), B(0))
    r = simulate(c, steps)
    assert [p.during_bytes for p in r.trace] == [4, 6, 6, 9, 14, 11, 6, 11, 14, 9]
    assert r.peak_bytes == 14
    assert r.recompute_flops == 2
    assert r.layer_forwards == (2, 2, 1, 1)


def test_segment_schedule_store_all_and_full_recompute():
    c = four_stage_chain()
    assert segment_schedule(c, [(0, 4, False)]) == store_all_schedule(c)
    assert simulate(c, store_all_schedule(c)).peak_bytes == 22  # 4 tapes + δ3
    full = simulate(c, segment_schedule(c, [(i, i + 1, True) for i in range(4)]))
    assert full.recompute_flops == sum(c.forward_flops)
    # during backward(3): inputs x0..x2 (6) + tape3 (5) + δ3 (2) = 13
    assert full.peak_bytes == 13


@pytest.mark.parametrize(
    "segments",
    [
        [(0, 2, True), (3, 4, True)],  # gap (an inclusive-end mistake)
        [(0, 2, True), (1, 4, True)],  # overlap
        [(0, 3, True)],  # does not cover
        [(0, 0, True), (0, 4, True)],  # empty
        [(0, 5, False)],  # past the end
        [(0, 4)],  # malformed
    ],
)
def test_segment_schedule_rejects_bad_segments(segments):
    with pytest.raises(ValueError):
        segment_schedule(four_stage_chain(), segments)


# ------------------------------------------------------------------------------------------
# simulate: invalid schedules


@pytest.mark.parametrize(
    "steps",
    [
        (),  # nothing backpropagated
        (D(1), KA(0), KA(1), B(1), B(0)),  # x1 not live
        (KA(0), KI(1), B(1), B(0)),  # backward without its tape
        (KA(0), KA(1), B(0), B(1)),  # backwards out of order
        (KA(0), KA(1), B(1)),  # stage 0 never backpropagated
        (KA(0), KA(1), B(1), B(0), B(0)),  # backward twice
        (KA(0), KA(1), B(1), KA(1), B(0)),  # forward of an already backpropagated stage
        (KA(0), KA(0), KA(1), B(1), B(0)),  # tape already live
        (KI(0), KI(1), KA(0), KA(1), B(1), B(0)),  # recomputing a live checkpoint x1
        (KA(0), KA(1), KA(2), B(1), B(0)),  # stage out of range
        (KA(0), KA(1), B(1), ("backward", 0)),  # not a Step
        (KA(0), D(1), B(1), B(0)),  # dropped stage has no tape
    ],
)
def test_simulate_rejects_invalid(steps):
    c = Chain.uniform(2, forward_flops=1, backward_flops=1, input_bytes=1, tape_bytes=2)
    with pytest.raises(ValueError):
        simulate(c, steps)


def test_simulate_pending_output_dies_unless_consumed():
    c = Chain.uniform(2, forward_flops=1, backward_flops=1, input_bytes=3, tape_bytes=3)
    # KI(0) followed by KA(0): x1 is not consumed, so it is freed at once.
    r = simulate(c, (KI(0), KA(0), KA(1), B(1), B(0)))
    assert r.trace[0].after_bytes == 3  # only the checkpoint x0 (δ2 is 0 bytes)
    assert r.recompute_flops == 1


# ------------------------------------------------------------------------------------------
# Optimal DP vs brute force


def test_enumeration_counts_are_schroeder_numbers():
    counts = [sum(1 for _ in enumerate_persistent_schedules(n)) for n in range(1, 8)]
    assert counts == [1, 2, 6, 22, 90, 394, 1806]
    c = Chain.uniform(5, forward_flops=1, backward_flops=1, input_bytes=1, tape_bytes=2)
    for steps in enumerate_persistent_schedules(5):
        simulate(c, steps)  # every enumerated schedule is valid


@st.composite
def chains(draw, max_stages=7, max_size=6, unit=1):
    n = draw(st.integers(1, max_stages))
    ints = st.integers(0, max_size)
    inp = [draw(ints) * unit for _ in range(n + 1)]
    tape = [inp[i] + draw(ints) * unit for i in range(n)]
    fws = [draw(st.integers(0, 3)) * unit for _ in range(n)]
    bws = [draw(st.integers(0, 3)) * unit for _ in range(n)]
    f = [draw(st.integers(0, 9)) for _ in range(n)]
    b = [draw(st.integers(0, 9)) for _ in range(n)]
    return Chain(f, b, inp, tape, fws, bws)


def _check_against_brute_force(chain: Chain, budget: int, slots: int) -> None:
    dp = optimal_schedule(chain, budget, slots=slots)
    bf = brute_force_optimal(chain, budget)
    assert (dp is None) == (bf is None), (chain, budget, dp, bf)
    if dp is None:
        return
    replay = simulate(chain, dp.steps)
    assert dp.peak_bytes == replay.peak_bytes <= budget
    assert dp.total_flops == replay.total_flops == bf.total_flops
    assert dp.recompute_flops == replay.recompute_flops
    assert bf.peak_bytes <= budget


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=chains(), data=st.data())
def test_dp_matches_brute_force_exact_bytes(chain, data):
    top = simulate(chain, store_all_schedule(chain)).peak_bytes
    budget = data.draw(st.integers(0, top + 2))
    _check_against_brute_force(chain, budget, slots=max(budget, 1))  # 1 byte per slot


def test_dp_matches_brute_force_discretised_slots():
    rng = random.Random(1234)
    for _ in range(60):
        unit = rng.choice([3, 7, 1000, 2**20])
        n = rng.randint(1, 6)
        inp = [rng.randint(0, 5) * unit for _ in range(n + 1)]
        tape = [inp[i] + rng.randint(0, 5) * unit for i in range(n)]
        fws = [rng.randint(0, 2) * unit for _ in range(n)]
        bws = [rng.randint(0, 2) * unit for _ in range(n)]
        f = [rng.randint(1, 20) for _ in range(n)]
        b = [rng.randint(1, 40) for _ in range(n)]
        chain = Chain(f, b, inp, tape, fws, bws)
        slots = rng.randint(1, 60)
        # budget = slots * unit: slot size is exactly `unit`, every size is a whole number of slots
        _check_against_brute_force(chain, slots * unit, slots=slots)


def test_dp_default_slots_fits_budget_and_cost_matches_replay():
    rng = random.Random(7)
    for _ in range(3):
        n = rng.randint(15, 30)
        inp = [rng.randint(1, 10**9) for _ in range(n + 1)]
        tape = [inp[i] + rng.randint(0, 10**10) for i in range(n)]
        f = [rng.randint(1, 10**12) for _ in range(n)]
        b = [2 * x for x in f]
        chain = Chain(f, b, inp, tape)
        top = simulate(chain, store_all_schedule(chain)).peak_bytes
        previous = None
        for frac in (0.1, 0.3, 0.6, 1.5):
            r = optimal_schedule(chain, int(top * frac))
            if r is None:
                continue
            replay = simulate(chain, r.steps)
            assert r.peak_bytes == replay.peak_bytes <= int(top * frac)
            assert r.total_flops == replay.total_flops
            assert r.recompute_flops == replay.recompute_flops
            assert r.layer_forwards == replay.layer_forwards
            if previous is not None:
                assert r.total_flops <= previous
            previous = r.total_flops
        assert previous == sum(f) + sum(b)  # 1.5 x store-all: no recompute


def test_dp_unlimited_memory_has_no_recompute():
    c = small_chain()
    top = simulate(c, store_all_schedule(c)).peak_bytes
    exact = optimal_schedule(c, top, slots=top)
    assert exact.recompute_flops == 0
    assert exact.total_flops == sum(c.forward_flops) + sum(c.backward_flops)
    loose = optimal_schedule(c, 10**12)  # default 500 slots
    assert loose.recompute_flops == 0
    assert loose.layer_forwards == (1, 1, 1)


def test_dp_too_little_memory_is_infeasible():
    c = small_chain()
    assert optimal_schedule(c, 0) is None
    # backward(2) alone needs tape2 + δ3 + δ2 = 7 + 1 + 4 = 12 bytes
    assert optimal_schedule(c, 11, slots=11) is None
    assert brute_force_optimal(c, 11) is None
    with pytest.raises(ValueError):
        optimal_schedule(c, -1)
    with pytest.raises(ValueError):
        optimal_schedule(c, 10, slots=0)


def test_dp_uses_recompute_when_tight():
    c = four_stage_chain()
    r = optimal_schedule(c, 14, slots=14)
    assert r is not None and r.peak_bytes <= 14
    assert 0 < r.recompute_flops <= 2  # no worse than the (recompute, store) segment plan


def test_dp_float_fallback_for_huge_costs():
    f = [10**18] * 6
    c = Chain(f, [2 * x for x in f], [1] * 7, [3] * 6)
    top = simulate(c, store_all_schedule(c)).peak_bytes
    r = optimal_schedule(c, top - 4, slots=top)
    bf = brute_force_optimal(c, top - 4)
    assert r is not None
    assert r.total_flops == simulate(c, r.steps).total_flops == bf.total_flops


# ------------------------------------------------------------------------------------------
# Revolve


def test_beta():
    assert beta(2, 3) == 10
    assert beta(3, -1) == 0
    assert beta(0, 5) == 1


def test_revolve_small_values():
    # s = 1: recompute from x0 each time, l(l-1)/2 extra forwards
    for n in range(1, 30):
        assert revolve_min_forwards(n, 1) == n * (n - 1) // 2
    # plenty of slots: one advance per step except the last, l - 1
    for n in range(1, 12):
        assert revolve_min_forwards(n, n) == n - 1
    assert revolve_min_forwards(1, 0) == 0
    with pytest.raises(ValueError):
        revolve_min_forwards(2, 0)
    with pytest.raises(ValueError):
        revolve_dp_min_forwards(3, 0)


def test_revolve_closed_form_equals_dp():
    table = revolve_dp_table(200, 10)
    for s in range(1, 11):
        for n in range(1, 201):
            assert revolve_min_forwards(n, s) == table[n][s], (n, s)
    assert revolve_dp_min_forwards(37, 4) == revolve_min_forwards(37, 4)


def _max_live_checkpoints(steps) -> int:
    live = {0}
    most = 1
    for stp in steps:
        if stp.kind == FORWARD_KEEP_INPUT:
            live.add(stp.stage)
        elif stp.kind in (FORWARD_KEEP_ALL, BACKWARD):
            live.discard(stp.stage)
        most = max(most, len(live))
    return most


def test_revolve_schedule_recompute_matches_closed_form():
    for n in range(1, 41):
        c = Chain.uniform(n, forward_flops=1, backward_flops=2, input_bytes=4, tape_bytes=9)
        for s in range(1, 9):
            steps = revolve_schedule(c, s)
            r = simulate(c, steps)
            assert r.recompute_flops == revolve_min_forwards(n, s), (n, s)
            assert sum(r.layer_forwards) == n + revolve_min_forwards(n, s)
            assert _max_live_checkpoints(steps) <= s


def test_revolve_schedule_heterogeneous_and_invalid_slots():
    c = small_chain()
    r = simulate(c, revolve_schedule(c, 2))
    assert r.layer_forwards[2] == 1  # the last stage is never re-advanced
    with pytest.raises(ValueError):
        revolve_schedule(c, 0)


def test_dp_never_worse_than_revolve_or_segments():
    c = Chain.uniform(7, forward_flops=3, backward_flops=6, input_bytes=2, tape_bytes=2)
    for s in range(1, 7):
        rv = simulate(c, revolve_schedule(c, s))
        dp = optimal_schedule(c, rv.peak_bytes, slots=rv.peak_bytes)
        assert dp is not None and dp.total_flops <= rv.total_flops
    for seg in ([(0, 3, True), (3, 7, True)], [(0, 4, True), (4, 7, False)]):
        sg = simulate(c, segment_schedule(c, seg))
        dp = optimal_schedule(c, sg.peak_bytes, slots=sg.peak_bytes)
        assert dp is not None and dp.total_flops <= sg.total_flops


def test_brute_force_stage_limit():
    c = Chain.uniform(9, forward_flops=1, backward_flops=1, input_bytes=1, tape_bytes=1)
    with pytest.raises(ValueError):
        brute_force_optimal(c, 100)


# ------------------------------------------------------------------------------------------
# Pipelining (1F1B): in_flight micro-batches, in_flight - 1 of them holding their forward


def test_held_and_pipeline_peak_hand_computed():
    c = small_chain()
    r = simulate(c, store_all_schedule(c))
    # after KA2: tapes 5 + 6 + 7 and δ3 (1), which arrives only with the backward
    assert held_after_forward_bytes(c, r) == 18
    assert pipeline_peak_bytes(c, r) == pipeline_peak_bytes(c, r, 1) == r.peak_bytes == 23
    assert pipeline_peak_bytes(c, r, 2) == 23 + 18
    assert pipeline_peak_bytes(c, r, Fraction(5, 2)) == 23 + 27
    assert pipeline_peak_bytes(c, r, Fraction(5, 4)) == 23 + 5  # 4.5 rounded up
    # keep x0, drop to x2: the first pass holds x0 (2) + tape2 (7)
    r2 = simulate(c, (KI(0), D(1), KA(2), B(2), KA(0), KA(1), B(1), B(0)))
    assert held_after_forward_bytes(c, r2) == 9


def test_pipeline_forward_pass_is_charged_the_whole_held():
    # Stage 0's forward workspace (10) sets the one-micro-batch peak 12 before anything is
    # stored; the waiting micro-batch already holds its 2 bytes then, so 14 is needed, not 12.
    c = Chain((1, 1), (1, 1), (1, 1, 0), (1, 1), (10, 0), (0, 0))
    for budget in (12, 13):
        assert optimal_schedule(c, budget, slots=budget, in_flight=2) is None
        assert brute_force_optimal(c, budget, in_flight=2) is None
    r = optimal_schedule(c, 14, slots=14, in_flight=2)
    assert r is not None and r.peak_bytes == 12 and r.held_bytes == 2
    assert r.pipeline_peak_bytes == 14


def _random_chain(rng: random.Random, n: int, unit: int = 1) -> Chain:
    inp = [rng.randint(0, 6) * unit for _ in range(n + 1)]
    tape = [inp[i] + rng.randint(0, 6) * unit for i in range(n)]
    fws = [rng.randint(0, 3) * unit for _ in range(n)]
    bws = [rng.randint(0, 3) * unit for _ in range(n)]
    f = [rng.randint(0, 9) for _ in range(n)]
    b = [rng.randint(0, 9) for _ in range(n)]
    return Chain(f, b, inp, tape, fws, bws)


def _check_pipelined(chain: Chain, budget: int, slots: int, in_flight) -> None:
    dp = optimal_schedule(chain, budget, slots=slots, in_flight=in_flight)
    bf = brute_force_optimal(chain, budget, in_flight=in_flight)
    assert (dp is None) == (bf is None), (chain, budget, in_flight, dp, bf)
    if dp is None:
        return
    replay = simulate(chain, dp.steps)
    held = held_after_forward_bytes(chain, replay)
    assert dp.peak_bytes == replay.peak_bytes
    assert dp.held_bytes == held and dp.in_flight == in_flight
    assert dp.pipeline_peak_bytes == replay.peak_bytes + math.ceil((in_flight - 1) * held)
    assert replay.peak_bytes + (in_flight - 1) * held <= budget  # exact, Fraction included
    assert dp.total_flops == replay.total_flops == bf.total_flops
    assert bf.pipeline_peak_bytes <= budget


@pytest.mark.parametrize("in_flight", [1, 2, 3, Fraction(5, 2)])
def test_pipelined_dp_matches_brute_force_exact_bytes(in_flight):
    rng = random.Random(f"pipelined-{in_flight}")
    for _ in range(100):
        chain = _random_chain(rng, rng.randint(1, 6))
        top = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), in_flight)
        budget = rng.randint(0, top + 2)
        _check_pipelined(chain, budget, max(budget, 1), in_flight)  # 1 byte per slot


def test_pipelined_dp_matches_brute_force_discretised_slots():
    rng = random.Random(99)
    for _ in range(40):
        unit = rng.choice([3, 1000, 2**20])
        chain = _random_chain(rng, rng.randint(1, 6), unit)
        slots = rng.randint(1, 80)
        in_flight = rng.choice([2, 3, Fraction(5, 2), Fraction(7, 3)])
        # every size is a whole number of slots: the discretisation is exact
        _check_pipelined(chain, slots * unit, slots, in_flight)


def test_pipelined_default_slots_fit_and_cost_grows_with_in_flight():
    rng = random.Random(3)
    for _ in range(3):
        n = rng.randint(15, 30)
        inp = [rng.randint(1, 10**9) for _ in range(n + 1)]
        tape = [inp[i] + rng.randint(0, 10**10) for i in range(n)]
        fws = [rng.randint(0, 10**9) for _ in range(n)]
        f = [rng.randint(1, 10**12) for _ in range(n)]
        chain = Chain(f, [2 * x for x in f], inp, tape, fws)
        budget = simulate(chain, store_all_schedule(chain)).peak_bytes
        previous = 0
        for in_flight in (1, Fraction(3, 2), 2, 4):
            r = optimal_schedule(chain, budget, in_flight=in_flight)
            if r is None:
                break
            replay = simulate(chain, r.steps)
            assert r.pipeline_peak_bytes == pipeline_peak_bytes(chain, replay, in_flight)
            assert r.pipeline_peak_bytes <= budget
            assert r.total_flops == replay.total_flops >= previous
            previous = r.total_flops


def test_in_flight_one_is_unchanged():
    rng = random.Random(11)
    for _ in range(20):
        chain = _random_chain(rng, rng.randint(1, 8))
        top = simulate(chain, store_all_schedule(chain)).peak_bytes
        budget = rng.randint(0, top)
        plain = optimal_schedule(chain, budget, slots=max(budget, 1))
        for one in (1, Fraction(1)):
            again = optimal_schedule(chain, budget, slots=max(budget, 1), in_flight=one)
            assert (plain is None) == (again is None)
            if plain is not None:
                assert again.steps == plain.steps
                assert again.pipeline_peak_bytes == again.peak_bytes == plain.peak_bytes


@pytest.mark.parametrize("bad", [0, Fraction(1, 2), 2.0, True, "2"])
def test_in_flight_rejects_invalid(bad):
    c = small_chain()
    with pytest.raises(ValueError):
        optimal_schedule(c, 50, in_flight=bad)
    with pytest.raises(ValueError):
        brute_force_optimal(c, 50, in_flight=bad)
    with pytest.raises(ValueError):
        pipeline_peak_bytes(c, simulate(c, store_all_schedule(c)), bad)
