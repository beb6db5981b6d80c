"""The mixed DP (full tape, a per-op policy's tape or recompute, per stage) against brute force."""

from __future__ import annotations

import random

import pytest
from oracles.brute_force import brute_force_optimal
from oracles.policy_mix_brute_force import brute_force_mixed

from ckplan.schedules import Chain, simulate
from ckplan.schedules.policy_mix import mixed_chain, optimal_mixed_schedule
from ckplan.schedules.rotor import optimal_schedule
from ckplan.schedules.segments import store_all_schedule


def random_variants(rng, n):
    """A chain and a policy variant of it: the policy keeps fewer bytes (still the input) and
    pays a re-run in its backward, with its own backward workspace."""
    inp = [rng.randint(0, 5) for _ in range(n + 1)]
    tape = [inp[i] + rng.randint(0, 8) for i in range(n)]
    fws = [rng.randint(0, 2) for _ in range(n)]
    bws = [rng.randint(0, 2) for _ in range(n)]
    f = [rng.randint(1, 20) for _ in range(n)]
    b = [rng.randint(1, 40) for _ in range(n)]
    full = Chain(f, b, inp, tape, fws, bws)
    small = [inp[i] + rng.randint(0, tape[i] - inp[i]) for i in range(n)]
    rerun = [b[i] + rng.randint(0, f[i]) for i in range(n)]
    pbws = [bws[i] + rng.randint(0, 2) for i in range(n)]
    policy = Chain(f, rerun, inp, small, fws, pbws)
    return full, policy


def _check(variants, budget, slots=None):
    dp = optimal_mixed_schedule(variants, budget, slots=slots or max(budget, 1))
    bf = brute_force_mixed(variants, budget)
    assert (dp is None) == (bf is None), (variants, budget, dp, bf)
    if dp is None:
        return
    replay = simulate(mixed_chain(variants, dp.choice), dp.steps)
    assert dp.peak_bytes == replay.peak_bytes <= budget
    assert dp.cost == replay.total_flops == bf[0]


def test_dp_matches_brute_force_two_variants():
    rng = random.Random(2019)
    for _ in range(70):
        n = rng.randint(1, 5)
        variants = random_variants(rng, n)
        top = simulate(variants[0], store_all_schedule(variants[0])).peak_bytes
        _check(variants, rng.randint(0, top + 2))


def test_dp_matches_brute_force_six_stages():
    rng = random.Random(6)
    for _ in range(3):
        variants = random_variants(rng, 6)
        top = simulate(variants[0], store_all_schedule(variants[0])).peak_bytes
        _check(variants, rng.randint(top // 2, top))


def test_dp_matches_brute_force_three_variants_small():
    rng = random.Random(11)
    for _ in range(25):
        n = rng.randint(1, 4)
        full, policy = random_variants(rng, n)
        _, other = random_variants(rng, n)
        other = Chain(
            full.forward_flops,
            other.backward_flops,
            full.input_bytes,
            [max(x, a) for x, a in zip(other.tape_bytes, full.input_bytes[:-1], strict=False)],
            full.forward_workspace_bytes,
            other.backward_workspace_bytes,
        )
        top = simulate(full, store_all_schedule(full)).peak_bytes
        _check([full, policy, other], rng.randint(0, top + 2))


def test_one_variant_is_rotor():
    rng = random.Random(5)
    for _ in range(30):
        n = rng.randint(1, 6)
        full, _ = random_variants(rng, n)
        top = simulate(full, store_all_schedule(full)).peak_bytes
        budget = rng.randint(0, top + 2)
        dp = optimal_mixed_schedule([full], budget, slots=max(budget, 1))
        rotor = brute_force_optimal(full, budget)
        assert (dp is None) == (rotor is None)
        if dp is not None:
            assert dp.cost == rotor.total_flops
            assert dp.cost == optimal_schedule(full, budget, slots=max(budget, 1)).total_flops


def test_discretised_slots_fit_and_never_beat_exact():
    rng = random.Random(3)
    for _ in range(40):
        n = rng.randint(2, 5)
        variants = random_variants(rng, n)
        variants = [
            Chain(
                c.forward_flops,
                c.backward_flops,
                [x * 7 for x in c.input_bytes],
                [x * 7 for x in c.tape_bytes],
                [x * 7 for x in c.forward_workspace_bytes],
                [x * 7 for x in c.backward_workspace_bytes],
            )
            for c in variants
        ]
        top = simulate(variants[0], store_all_schedule(variants[0])).peak_bytes
        budget = rng.randint(0, top + 10)
        coarse = optimal_mixed_schedule(variants, budget, slots=5)
        bf = brute_force_mixed(variants, budget)
        if coarse is not None:
            assert coarse.peak_bytes <= budget
            assert coarse.cost >= bf[0]


def test_hand_computed_mix_beats_both():
    """Two stages: forward 10, input 1, scalar output; full tape 5 (backward 10), policy tape 2
    (backward 12, the policy's re-run). Storing both in full peaks during backward(1) at
    5 + 5 + δ_1 (1) = 11. Budget 8: one full tape and one policy tape peak at 5 + 2 + 1 = 8,
    cost 20 + 10 + 12 = 42; the policy on both costs 20 + 24 = 44; recomputing stage 0 (keep
    x_0, store stage 1 in full: 1 + 5 + 1 = 7) costs 20 + 10 + 10 + 10 = 50."""
    full = Chain([10, 10], [10, 10], [1, 1, 0], [5, 5])
    policy = Chain([10, 10], [12, 12], [1, 1, 0], [2, 2])
    assert simulate(full, store_all_schedule(full)).peak_bytes == 11
    dp = optimal_mixed_schedule([full, policy], 8, slots=8)
    assert dp.cost == 42 and dp.peak_bytes == 8
    assert sorted(dp.choice) == [0, 1] and dp.replay.recompute_flops == 0
    assert optimal_schedule(full, 8, slots=8).total_flops == 50
    assert optimal_schedule(policy, 8, slots=8).total_flops == 44
    assert brute_force_mixed([full, policy], 8)[0] == 42


@pytest.mark.parametrize(
    "args, message",
    [
        (([], 5), "non-empty"),
        (([Chain([1], [1], [1, 0], [1]), Chain([2], [1], [1, 0], [1])], 5), "forward_flops"),
        (([Chain([1], [1], [1, 0], [1])], -1), "budget_bytes"),
    ],
)
def test_rejects(args, message):
    with pytest.raises(ValueError, match=message):
        optimal_mixed_schedule(*args)
