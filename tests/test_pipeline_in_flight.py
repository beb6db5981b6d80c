"""Micro-batches in flight per pipeline rank, against Megatron-LM's interleaved schedule."""

from fractions import Fraction

import pytest

from ckplan.plan import evaluate, in_flight_microbatches, parse_strategy
from ckplan.plan.evaluate import megatron_in_flight_forwards
from ckplan.plan.layer_chain import layer_chain
from ckplan.schedules import held_after_forward_bytes, simulate, store_all_schedule


def megatron_warmup(p, v, m, rank, group):
    """get_pp_rank_microbatches (megatron/core/pipeline_parallel/schedules.py, main at
    6e091e1b68), training branch, as written there: (warmup, remaining)."""
    total = m * v
    if v == 1:
        warmup = p - rank - 1
    else:
        warmup = (p - rank - 1) * 2
        warmup += (v - 1) * group
    if warmup >= total:
        warmup = total
    return warmup, total - warmup


def live_peak(p, v, m, rank, group):
    """Brute force: walk the rank's loop (warmup forwards; per remaining step one forward, then
    one backward; cool-down backwards), counting chunk forwards held, and return the most."""
    warmup, remaining = megatron_warmup(p, v, m, rank, group)
    live = peak = 0
    for _ in range(warmup):
        live += 1
        peak = max(peak, live)
    for _ in range(remaining):
        live += 1
        peak = max(peak, live)
        live -= 1
    for _ in range(warmup):
        live -= 1
    assert live == 0
    return peak


# (p, v, m, rank, group, chunk forwards held), by hand from the formula:
HAND = [
    (4, 8, 4, 3, 4, 29),  # gpt3_7b tp1 pp4 memory_speed, last rank: 7·4 warmup + 1
    (4, 8, 4, 0, 4, 32),  # first rank: 2·3 + 28 = 34 >= 32, all forwards first
    (4, 8, 4, 1, 4, 32),  # 2·2 + 28 = 32 = m·v: all forwards first
    (4, 8, 4, 2, 4, 31),  # 2·1 + 28 + 1
    (4, 2, 4, 3, 4, 5),  # m = p, v = 2: 4 + 1
    (4, 2, 4, 0, 4, 8),  # 6 + 4 = 10 >= 8: all forwards first
    (2, 2, 4, 0, 2, 5),  # 2 + 2 + 1
    (2, 2, 4, 1, 2, 3),  # 0 + 2 + 1
    (8, 4, 16, 0, 8, 39),  # 14 + 24 + 1
    (8, 4, 16, 7, 8, 25),  # 24 + 1
    (4, 2, 8, 3, 8, 9),  # microbatch_group_size_per_vp_stage 8: 8 + 1
    (4, 1, 8, 0, 4, 4),  # 1F1B: p - rank
    (4, 1, 8, 3, 4, 1),
    (4, 1, 2, 0, 4, 2),  # fewer micro-batches than p
]


@pytest.mark.parametrize(("p", "v", "m", "rank", "group", "held"), HAND)
def test_in_flight_forwards_by_hand_and_by_walking_the_schedule(p, v, m, rank, group, held):
    assert megatron_in_flight_forwards(p, v, m, rank, group) == held
    assert live_peak(p, v, m, rank, group) == held


def test_in_flight_forwards_match_the_schedule_everywhere():
    for p in (2, 3, 4, 8):
        for v in (1, 2, 3, 8):
            for m in range(p, 3 * p + 1):
                for rank in range(p):
                    expected = live_peak(p, v, m, rank, p)
                    assert megatron_in_flight_forwards(p, v, m, rank) == expected


def test_first_stage_is_korthikanti_when_micro_batches_are_many():
    """Korthikanti et al. 2022 §4.2.3: the first stage holds p·(1 + (p - 1)/(p·v))."""
    for p, v in ((4, 2), (8, 3), (16, 4)):
        forwards = megatron_in_flight_forwards(p, v, 4 * p, 0)
        assert Fraction(forwards, v) == p * (1 + Fraction(p - 1, p * v))


def test_spec_in_flight_is_chunk_forwards_over_v(spec_of):
    spec = spec_of("megatron-175b", virtual_stages=3, microbatches=64)
    p = spec.pp
    assert in_flight_microbatches(spec, p - 1) == Fraction((3 - 1) * p + 1, 3)
    assert in_flight_microbatches(spec, 0) == Fraction(2 * (p - 1) + 2 * p + 1, 3)
    few = spec.replace(microbatches=p)  # m = p: the first rank runs all its forwards first
    assert in_flight_microbatches(few, 0) == p


def test_interleaved_last_stage_waits_with_layers_only(spec_of):
    """The last rank's peak: one micro-batch's store-all replay (its layers, output layer and
    loss) plus (chunk forwards - v)/v micro-batches of layers only, what a middle stage's
    micro-batch holds (same layers, no output layer)."""
    spec = spec_of("gpt2", pp=4, virtual_stages=3, microbatches=4, layers=12)
    last = spec.pp - 1
    strategy = parse_strategy("none", spec)
    chain = layer_chain(spec, strategy.groups, stage=last)
    replay = simulate(chain, store_all_schedule(chain))
    middle = layer_chain(spec, strategy.groups, stage=1)
    layers_held = held_after_forward_bytes(middle, simulate(middle, store_all_schedule(middle)))
    assert held_after_forward_bytes(chain, replay, output_held=False) == layers_held
    waiting = Fraction(megatron_in_flight_forwards(4, 3, 4, last) - 3, 3)
    assert waiting == Fraction(2 * 4 + 1 - 3, 3)
    expected = replay.peak_bytes + -(-waiting.numerator * layers_held // waiting.denominator)
    plan = evaluate(spec, strategy)
    assert plan.peak_stage == last  # GPT-2's 50257-row output layer and fp32 logits
    assert plan.activation_bytes == expected
