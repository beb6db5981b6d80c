"""The fast rotor DP against its first implementation (rotor_reference) and brute force.

"Identical" means: both return None, or both return the same schedule, step for step (so the
same cost, replayed peak and held bytes). Ties between schedules of equal cost are broken the
same way (the chain option first, then the smallest split), so this holds even where several
schedules are optimal. It is checked where the reference computes in exact int64 arithmetic;
beyond 2**60 FLOPs it falls back to float64, where the fast DP is exact more often (FLOPs divided
by their gcd) and is checked against brute force instead.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from oracles.brute_force import brute_force_optimal
from oracles.rotor_reference import optimal_schedule as reference_schedule

from ckplan.inputs.presets import load_spec
from ckplan.plan import layer_chain
from ckplan.plan.evaluate import in_flight_microbatches
from ckplan.schedules import (
    Chain,
    pipeline_peak_bytes,
    simulate,
    store_all_schedule,
)
from ckplan.schedules.rotor import _Table, optimal_schedule


def _heterogeneous(rng: random.Random, n: int, unit: int) -> Chain:
    inp = [rng.randint(0, 6) * unit for _ in range(n + 1)]
    tape = [inp[i] + rng.randint(0, 6) * unit for i in range(n)]
    fws = [rng.randint(0, 3) * unit for _ in range(n)]
    bws = [rng.randint(0, 3) * unit for _ in range(n)]
    f = [rng.randint(0, 9) for _ in range(n)]
    b = [rng.randint(0, 9) for _ in range(n)]
    return Chain(f, b, inp, tape, fws, bws)


def _stage(rng: random.Random, unit: int) -> tuple[int, ...]:
    """(forward, backward, input, tape beyond the input, forward and backward workspace)."""
    sizes = [rng.randint(0, 5) * unit for _ in range(4)]
    return (rng.randint(0, 9), rng.randint(0, 20), *sizes)


def _layered(rng: random.Random, n: int, unit: int) -> Chain:
    """A head stage, n - 2 equal layers (a few replaced, or a repeating pair), a tail stage:
    the shapes the planner builds (embedding, layers, output), where sub-chains repeat."""
    layer = _stage(rng, unit)
    stages = [_stage(rng, unit)] + [layer] * (n - 2) + [_stage(rng, unit)]
    if rng.random() < 0.3:
        other = _stage(rng, unit)
        stages = [other if p % 2 and 0 < p < n - 1 else s for p, s in enumerate(stages)]
    for _ in range(rng.choice([0, 0, 1, 2])):
        stages[rng.randrange(n)] = _stage(rng, unit)
    inp = [s[2] for s in stages] + [rng.randint(0, 3) * unit]
    return Chain(
        [s[0] for s in stages],
        [s[1] for s in stages],
        inp,
        [inp[p] + s[3] for p, s in enumerate(stages)],
        [s[4] for s in stages],
        [s[5] for s in stages],
    )


def _assert_identical(chain: Chain, budget: int, slots: int, in_flight) -> None:
    fast = optimal_schedule(chain, budget, slots, in_flight)
    slow = reference_schedule(chain, budget, slots, in_flight)
    assert (fast is None) == (slow is None), (chain, budget, slots, in_flight)
    if fast is not None:
        assert fast.steps == slow.steps, (chain, budget, slots, in_flight)
        assert fast.total_flops == slow.total_flops
        assert fast.pipeline_peak_bytes == slow.pipeline_peak_bytes <= budget
        assert fast.held_bytes == slow.held_bytes


@pytest.mark.parametrize("in_flight", [1, 2, 3, Fraction(5, 2)])
@pytest.mark.parametrize("shape", ["heterogeneous", "layered"])
def test_identical_to_reference_on_random_chains(shape, in_flight):
    rng = random.Random(f"{shape}-{in_flight}")
    build = _heterogeneous if shape == "heterogeneous" else _layered
    for _ in range(60):
        n = rng.randint(2, 24)
        unit = rng.choice([1, 1, 1000, 2**20])
        chain = build(rng, n, unit)
        top = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), in_flight)
        budget = rng.randint(0, top + unit)
        # exact slots (one byte each, when small enough) or a coarse grid that rounds sizes up
        slots = rng.choice([max(1, min(budget, 400)), rng.randint(1, 80)])
        _assert_identical(chain, budget, slots, in_flight)


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2", {}),
        ("llama3-8b", {"layers": 24}),
        ("llama3-70b", {"layers": 16, "tp": 8, "sp": True, "pp": 2, "microbatches": 8}),
    ],
)
def test_identical_to_reference_on_planner_chains(preset, overrides):
    spec = load_spec(preset, overrides)
    for selective in (False, True):
        chain = layer_chain(spec, selective)
        in_flight = in_flight_microbatches(spec)
        top = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), in_flight)
        for fraction in (0.05, 0.15, 0.3, 0.6, 0.95):
            _assert_identical(chain, int(top * fraction), 120, in_flight)


def test_equal_sub_chains_share_one_row():
    """Embedding, n - 2 equal layers, output: about 3n classes instead of n^2 / 2."""
    n = 60
    layers = Chain.uniform(n - 2, forward_flops=3, backward_flops=6, input_bytes=4, tape_bytes=20)
    chain = Chain(
        (1, *layers.forward_flops, 7),
        (0, *layers.backward_flops, 14),
        (2, *layers.input_bytes[:-1], 4, 0),
        (5, *layers.tape_bytes, 30),
    )
    table = _Table(chain, 1, 400, n)
    assert table.cost.shape[0] <= 3 * n
    assert table.scale == 1


def test_huge_flops_against_brute_force():
    """Costs beyond 2**60 whose gcd is 1: the float64 fallback still finds the optimum here
    (the costs are far apart), checked by brute force and the exact replay."""
    rng = random.Random(60)
    for _ in range(20):
        n = rng.randint(2, 6)
        chain = _heterogeneous(rng, n, 1)
        f = [10**18 + rng.randint(0, 10**6) * 10**9 + 1 for _ in range(n)]
        chain = Chain(f, [2 * x + 1 for x in f], chain.input_bytes, chain.tape_bytes)
        top = simulate(chain, store_all_schedule(chain)).peak_bytes
        budget = rng.randint(0, top)
        fast = optimal_schedule(chain, budget, max(budget, 1))
        exact = brute_force_optimal(chain, budget)
        assert (fast is None) == (exact is None)
        if fast is not None:
            assert fast.total_flops == simulate(chain, fast.steps).total_flops
            assert fast.total_flops == exact.total_flops
            assert fast.peak_bytes <= budget


def test_gcd_scaling_keeps_costs_exact():
    f = [6 * 10**18] * 6
    chain = Chain(f, [2 * x for x in f], [1] * 7, [3] * 6)
    table = _Table(chain, 1, 20, 6)
    assert table.scale == 6 * 10**18 and table.exact
    top = simulate(chain, store_all_schedule(chain)).peak_bytes
    result = optimal_schedule(chain, top - 4, slots=top)
    assert result.total_flops == brute_force_optimal(chain, top - 4).total_flops


def test_pipelined_row_pruning_keeps_the_reference_answer():
    """Many first-pass rows (fine slots, two micro-batches in flight): the rows skipped by the
    lower bounds never hold the answer, ties included (the smallest held allowance wins)."""
    spec = load_spec("llama3-70b", {"layers": 48, "tp": 8, "sp": True, "pp": 2, "microbatches": 8})
    chain = layer_chain(spec, False)
    in_flight = in_flight_microbatches(spec)
    top = pipeline_peak_bytes(chain, simulate(chain, store_all_schedule(chain)), in_flight)
    for fraction in (0.25, 0.5, 0.8):
        _assert_identical(chain, int(top * fraction), 1000, in_flight)
