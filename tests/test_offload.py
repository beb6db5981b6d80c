"""Offloading tapes to host memory: the exact replay, the joint DP against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
from oracles.brute_force import brute_force_optimal
from oracles.offload_brute_force import brute_force_offload

from ckplan.schedules import BACKWARD, FORWARD_KEEP_ALL, Chain, Step, simulate, store_all_schedule
from ckplan.schedules.offload import (
    exposed_transfer,
    offload_all,
    offload_exposed_cost,
    optimal_offload_schedule,
    simulate_offload,
)


def uniform(n=4, tape=5, inp=2):
    return Chain.uniform(n, forward_flops=10, backward_flops=20, input_bytes=inp, tape_bytes=tape)


def test_offload_all_hand_computed():
    # x_0 = 2 bytes, x_4 = δ_4 = 0, tapes 5. Store-all peaks in backward(3): four tapes and
    # δ_3, 22 bytes. Offloaded, tape_0 is on device during forward(1) (its copy) and freed after.
    chain = uniform()
    steps, stages = offload_all(chain)
    assert stages == (0, 1, 2)
    assert simulate(chain, steps).peak_bytes == 4 * 5 + 2
    replay = simulate_offload(chain, steps, stages)
    # forward(1): tape_0 (in flight) + x_1 + x_2 = 9; after: tape_1 + x_2 = 7
    assert replay.device_trace[1] == (9, 7)
    # backward(3): tape_3 + tape_2 (its copy back overlaps at once) + δ_3 = 12
    assert replay.device_trace[4] == (12, 7)
    # backward(1): δ_2 + tape_1 + tape_0 (prefetch) + δ_1 = 14; after: tape_0 + δ_1
    assert replay.device_trace[-2] == (14, 7)
    assert replay.device_peak_bytes == 14
    assert replay.host_peak_bytes == 15
    assert replay.bytes_moved == 30
    assert replay.host_trace[0] == (0, 5)
    assert replay.host_trace[-1] == (0, 0)


def test_exposed_transfer():
    assert exposed_transfer(5, 3) == 2
    assert exposed_transfer(3, 5) == 0
    chain = uniform()
    assert offload_exposed_cost(chain.forward_flops, chain.backward_flops, [15] * 4, (0, 2)) == 10


@pytest.mark.parametrize(
    "steps, stages, message",
    [
        (None, (3,), "0..2"),
        (None, (-1,), "0..2"),
        ("recompute", (1,), "once, on the first pass"),
    ],
)
def test_simulate_offload_rejects(steps, stages, message):
    chain = uniform()
    if steps is None:
        steps = store_all_schedule(chain)
    else:  # stage 1 stored only by a recomputation after the first pass
        from ckplan.schedules import FORWARD_DROP, FORWARD_KEEP_INPUT

        steps = (
            Step(FORWARD_KEEP_INPUT, 0),
            Step(FORWARD_DROP, 1),
            Step(FORWARD_KEEP_ALL, 2),
            Step(FORWARD_KEEP_ALL, 3),
            Step(BACKWARD, 3),
            Step(BACKWARD, 2),
            Step(FORWARD_KEEP_ALL, 0),
            Step(FORWARD_KEEP_ALL, 1),
            Step(BACKWARD, 1),
            Step(BACKWARD, 0),
        )
    with pytest.raises(ValueError, match=message):
        simulate_offload(chain, steps, stages)


def random_chain(rng, n, unit=1):
    inp = [rng.randint(0, 5) * unit for _ in range(n + 1)]
    tape = [inp[i] + rng.randint(0, 6) * unit for i in range(n)]
    fws = [rng.randint(0, 2) * unit for _ in range(n)]
    bws = [rng.randint(0, 2) * unit for _ in range(n)]
    f = [rng.randint(1, 20) for _ in range(n)]
    b = [rng.randint(1, 40) for _ in range(n)]
    return Chain(f, b, inp, tape, fws, bws)


def _check(chain, budget, copy, host=None, slots=None):
    dp = optimal_offload_schedule(
        chain,
        budget,
        copy,
        host_budget_bytes=host,
        slots=slots or max(budget, 1),
        host_slots=max(host or 1, 1),
    )
    bf = brute_force_offload(chain, budget, copy, host)
    assert (dp is None) == (bf is None), (chain, budget, copy, host, dp, bf)
    if dp is None:
        return
    replay = simulate_offload(chain, dp.steps, dp.offloaded)
    assert dp.peak_bytes == replay.device_peak_bytes <= budget
    if host is not None:
        assert replay.host_peak_bytes <= host
    exposed = offload_exposed_cost(chain.forward_flops, chain.backward_flops, copy, dp.offloaded)
    assert dp.cost == replay.total_flops + exposed == bf[0]
    assert dp.exposed_cost == exposed


def test_dp_matches_brute_force_exact_bytes():
    rng = random.Random(2021)
    for _ in range(120):
        n = rng.randint(1, 6)
        chain = random_chain(rng, n)
        copy = [rng.randint(0, 60) for _ in range(n)]
        top = simulate(chain, store_all_schedule(chain)).peak_bytes
        budget = rng.randint(0, top + 2)
        _check(chain, budget, copy)


def test_dp_matches_brute_force_with_host_budget():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(2, 5)
        chain = random_chain(rng, n)
        copy = [rng.randint(0, 15) for _ in range(n)]
        top = simulate(chain, store_all_schedule(chain)).peak_bytes
        budget = rng.randint(top // 3, top)
        host = rng.randint(0, sum(chain.tape_bytes))
        _check(chain, budget, copy, host)


def test_dp_discretised_slots_fit():
    rng = random.Random(99)
    for _ in range(40):
        n = rng.randint(1, 6)
        chain = random_chain(rng, n, unit=1000)
        copy = [rng.randint(0, 60) for _ in range(n)]
        top = simulate(chain, store_all_schedule(chain)).peak_bytes
        budget = rng.randint(top // 2, top + 1)
        dp = optimal_offload_schedule(chain, budget, copy, slots=37)
        if dp is None:
            continue
        assert dp.peak_bytes <= budget
        bf = brute_force_offload(chain, budget, copy)
        assert bf[0] <= dp.cost


def test_free_copies_beat_recomputation():
    # Copies that hide behind compute: offloading every tape but the last costs nothing and
    # needs no recomputation, where rotor alone must recompute.
    chain = uniform(6)
    budget = 20
    rotor = brute_force_optimal(chain, budget)
    dp = optimal_offload_schedule(chain, budget, [5] * 6)
    assert dp is not None and dp.exposed_cost == 0
    assert dp.replay.recompute_flops == 0
    assert rotor is None or rotor.recompute_flops > 0


def test_slow_copies_fall_back_to_rotor():
    chain = uniform(6)
    budget = 20
    rotor = brute_force_optimal(chain, budget)
    dp = optimal_offload_schedule(chain, budget, [10**6] * 6)
    assert dp is not None and dp.offloaded == ()
    assert dp.cost == rotor.total_flops


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget_bytes": -1}, "budget_bytes"),
        ({"copy_cost": [1, 2]}, "copy_cost must be a sequence of 4"),
        ({"copy_cost": [1, 2, -3, 4]}, r"copy_cost\[2\]"),
        ({"slots": 0}, "slots"),
        ({"host_budget_bytes": True}, "host_budget_bytes"),
    ],
)
def test_dp_rejects(kwargs, message):
    args = {"chain": uniform(), "budget_bytes": 30, "copy_cost": [1] * 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        optimal_offload_schedule(**args)


def test_replay_invariants_over_every_offload_schedule():
    # For every persistent schedule of small chains and every set of first-pass tapes: the
    # device peak never exceeds the plain replay's, every offloaded tape is on host at once
    # (the first pass ends before any comes back), and each crosses the link twice.
    from itertools import combinations

    from oracles.brute_force import enumerate_persistent_schedules

    from ckplan.schedules.offload import first_pass_stages

    rng = random.Random(5)
    for n in range(2, 6):
        chain = random_chain(rng, n)
        for steps in enumerate_persistent_schedules(n):
            plain = simulate(chain, steps).peak_bytes
            candidates = [i for i in first_pass_stages(steps, n) if i < n - 1]
            for size in range(len(candidates) + 1):
                for stages in combinations(candidates, size):
                    try:
                        replay = simulate_offload(chain, steps, stages)
                    except ValueError:
                        continue
                    on_host = sum(chain.tape_bytes[i] for i in stages)
                    assert replay.device_peak_bytes <= plain
                    assert replay.host_peak_bytes == on_host
                    assert replay.bytes_moved == 2 * on_host
                    assert replay.host_trace[-1] == (0, 0)


def _traces_step_by_step(chain, steps, stages):
    """The definition, one step at a time: each offloaded tape (or checkpointed input) leaves
    the device after the step its copy overlaps and is back at its prefetch's step; on the host
    from its copy's step to its prefetch's."""
    from ckplan.schedules.offload import offload_window, offload_windows

    replay = simulate(chain, steps)
    during = [point.during_bytes for point in replay.trace]
    after = [point.after_bytes for point in replay.trace]
    host_during, host_after = [0] * len(steps), [0] * len(steps)
    windows = offload_windows(tuple(steps), chain.length)
    for i in stages:
        start, prefetch, tape = offload_window(steps, chain.length, i, windows)
        nbytes = chain.tape_bytes[i] if tape else chain.input_bytes[i]
        after[start + 1] -= nbytes
        for t in range(start + 2, prefetch):
            during[t] -= nbytes
            after[t] -= nbytes
        host_after[start] += nbytes
        for t in range(start + 1, prefetch):
            host_during[t] += nbytes
            host_after[t] += nbytes
        host_during[prefetch] += nbytes
    return tuple(zip(during, after, strict=True)), tuple(zip(host_during, host_after, strict=True))


def test_offload_traces_equal_the_step_by_step_definition():
    """`simulate_offload` sums each copy's window by differences; the traces equal adding it
    step by step, over random segment schedules and random sets of the stages they offload."""
    from ckplan.schedules import segment_schedule
    from ckplan.schedules.offload import offload_stored

    rng = random.Random(11)
    checked = 0
    for _ in range(300):
        n = rng.randint(2, 10)
        chain = random_chain(rng, n)
        cuts = sorted({0, n, *rng.sample(range(1, n), rng.randint(0, n - 1))})
        segments = [(a, b, rng.random() < 0.5) for a, b in itertools.pairwise(cuts)]
        steps = segment_schedule(chain, segments)
        stored = offload_stored(steps, n)
        if not stored:
            continue
        stages = sorted(rng.sample(stored, rng.randint(1, len(stored))))
        replay = simulate_offload(chain, steps, stages)
        device, host = _traces_step_by_step(chain, steps, stages)
        assert replay.device_trace == device and replay.host_trace == host
        checked += 1
    assert checked > 200


def full_recompute(chain):
    from ckplan.schedules import segment_schedule

    return segment_schedule(chain, [(i, i + 1, True) for i in range(chain.length)])


def test_checkpointed_inputs_offloaded_hand_computed():
    # Full recomputation of 4 stages, x_i = 2 bytes, tapes 5: the first pass keeps x_0..x_3
    # (8 bytes). Offloaded, x_i is on device during forward(i + 1) (its copy) and comes back
    # during the backward before stage i is re-run.
    from ckplan.schedules.offload import offload_stored, offload_window

    chain = uniform()
    steps = full_recompute(chain)
    stages = offload_stored(steps, 4)
    assert stages == (0, 1, 2)
    assert offload_window(steps, 4, 1) == (1, 7, False)  # copy out beside step 2, back beside 7
    plain = simulate(chain, steps)
    replay = simulate_offload(chain, steps, stages)
    # forward_keep_input(2): x_1 in flight + x_2 + x_3 (its output) = 6 (two inputs on device
    # with the copy in flight); after: x_0, x_1 on host, x_2 and x_3 on device = 4
    assert replay.device_trace[2] == (6, 4)
    # backward(3): tape_3 + δ_4 (0) + x_2 (prefetched) + δ_3 = 9, plain 13 less x_0 and x_1
    assert plain.trace[5][1:] == (13, 8) and replay.device_trace[5] == (9, 4)
    assert replay.device_peak_bytes == 11 < plain.peak_bytes == 13
    assert replay.host_peak_bytes == 6 and replay.bytes_moved == 12
    assert replay.offloaded_bytes == (2, 2, 2)
    assert replay.host_trace[0] == (0, 2) and replay.host_trace[-1] == (0, 0)


def test_checkpointed_input_read_again_at_once_is_refused():
    from ckplan.schedules import FORWARD_DROP, FORWARD_KEEP_INPUT

    chain = uniform(n=3)
    # two-layer segment [0, 2): x_0 comes back beside backward(2), x_1 is not a checkpoint
    steps = (
        Step(FORWARD_KEEP_INPUT, 0),
        Step(FORWARD_DROP, 1),
        Step(FORWARD_KEEP_ALL, 2),
        Step(BACKWARD, 2),
        Step(FORWARD_KEEP_ALL, 0),
        Step(FORWARD_KEEP_ALL, 1),
        Step(BACKWARD, 1),
        Step(BACKWARD, 0),
    )
    replay = simulate_offload(chain, steps, (0,))
    assert replay.host_trace[3] == (2, 0) and replay.bytes_moved == 4
    with pytest.raises(ValueError, match="once, on the first pass"):
        simulate_offload(chain, steps, (1,))
    # x_0 re-read by the step after its copy's: the copy could not end before
    steps = (
        Step(FORWARD_KEEP_INPUT, 0),
        Step(FORWARD_DROP, 1),
        Step(FORWARD_KEEP_ALL, 0),
        Step(FORWARD_KEEP_ALL, 1),
        Step(FORWARD_KEEP_ALL, 2),
        Step(BACKWARD, 2),
        Step(BACKWARD, 1),
        Step(BACKWARD, 0),
    )
    simulate(chain, steps)
    with pytest.raises(ValueError, match="read again before its copy"):
        simulate_offload(chain, steps, (0,))


def test_checkpoint_offloads_over_every_persistent_schedule():
    # Every persistent schedule of chains of up to five stages, every set of stages whose first
    # forward keeps their input or tape: the device trace is the plain one less each offloaded
    # item from the end of the step after its first forward to the step before its next use
    # (counted here from the steps themselves), every item is on host at once at the end of
    # the first pass, and each crosses the link twice.
    from itertools import combinations

    from oracles.brute_force import enumerate_persistent_schedules

    from ckplan.schedules import BACKWARD as BWD
    from ckplan.schedules import FORWARD_KEEP_INPUT

    rng = random.Random(7)
    checked = 0
    for n in range(2, 6):
        chain = random_chain(rng, n)
        for steps in enumerate_persistent_schedules(n):
            plain = simulate(chain, steps)
            uses = {}  # stage -> step indices of its forwards and its backward
            for t, st in enumerate(steps):
                uses.setdefault(st.stage, []).append(t)
            kept = {
                i: steps[uses[i][0]].kind
                for i in range(n - 1)
                if steps[uses[i][0]].kind in (FORWARD_KEEP_INPUT, FORWARD_KEEP_ALL)
            }
            for size in range(1, len(kept) + 1):
                for stages in combinations(sorted(kept), size):
                    try:
                        replay = simulate_offload(chain, steps, stages)
                    except ValueError:
                        continue
                    checked += 1
                    during = [p.during_bytes for p in plain.trace]
                    after = [p.after_bytes for p in plain.trace]
                    total = 0
                    for i in stages:
                        tape = kept[i] == FORWARD_KEEP_ALL
                        nbytes = chain.tape_bytes[i] if tape else chain.input_bytes[i]
                        total += nbytes
                        start = uses[i][0]
                        back = (
                            steps.index(Step(BWD, i)) if tape else uses[i][1]
                        ) - 1  # the step its copy back overlaps
                        after[start + 1] -= nbytes
                        for t in range(start + 2, back):
                            during[t] -= nbytes
                            after[t] -= nbytes
                    assert list(replay.device_trace) == list(zip(during, after, strict=True))
                    assert replay.host_peak_bytes == total
                    assert replay.bytes_moved == 2 * total
                    assert replay.host_trace[-1] == (0, 0)
    assert checked > 100
