"""Micro-batches in flight per pipeline rank, against Megatron-LM's interleaved schedule."""

import json
from fractions import Fraction

import pytest

from ckplan.plan import evaluate, in_flight_microbatches, parse_strategy
from ckplan.plan.evaluate import interleaved_gradient_excess, megatron_in_flight_forwards
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


# ---- the micro-batch group size (microbatch_group_size) ------------------------------------


def schedule_table(m, v, group):
    """get_schedule_table (megatron/core/pipeline_parallel/schedules.py, core_v0.19.0): the
    (micro-batch, chunk) order of a rank's forwards, groups of `group` micro-batches per chunk,
    the last group the rest."""
    table = []
    for low in range(0, m, group):
        high = m if low + group >= m else low + group
        table += [(mb, chunk) for chunk in range(v) for mb in range(low, high)]
    return table


def rank_order(p, v, m, rank, group):
    """forward_backward_pipelining_with_interleaving (core_v0.19.0) on rank `rank`: the warm-up
    forwards, then per step one forward and one backward, then the cool-down backwards; the
    k-th backward runs the table's k-th entry on the chunk counted from the end
    (get_model_chunk_id with forward=False). Items: (kind, micro-batch, virtual stage)."""
    warmup, remaining = megatron_warmup(p, v, m, rank, group)
    table = schedule_table(m, v, group)
    forwards = [("F", mb, chunk * p + rank) for mb, chunk in table]
    backwards = [("B", mb, (v - 1 - chunk) * p + rank) for mb, chunk in table]
    order = forwards[:warmup]
    for k in range(remaining):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[remaining:]


def replay(p, v, m, group, forward=1, backward=2):
    """Brute force: run every rank's order with its dependencies (a virtual stage's forward
    after the previous stage's, its backward after the next stage's backward and its own
    forward), each rank one item at a time, a forward `forward` and a backward `backward`
    time units. Returns (makespan or None on a deadlock, chunk forwards each rank held at most)."""
    orders = [rank_order(p, v, m, rank, group) for rank in range(p)]
    last = p * v - 1
    finished, free, at, live, peaks = {}, [0] * p, [0] * p, [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while at[rank] < len(orders[rank]):
                kind, mb, stage = orders[rank][at[rank]]
                if kind == "F":
                    needs = [("F", mb, stage - 1)] if stage else []
                else:
                    needs = [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < last else [])
                if any(need not in finished for need in needs):
                    break
                start = max([free[rank]] + [finished[need] for need in needs])
                free[rank] = start + (forward if kind == "F" else backward)
                finished[(kind, mb, stage)] = free[rank]
                live[rank] += 1 if kind == "F" else -1
                peaks[rank] = max(peaks[rank], live[rank])
                at[rank] += 1
                progress = True
    done = all(at[rank] == len(orders[rank]) for rank in range(p))
    return (max(free) if done else None), peaks


def megatron_accepts(p, m, group):
    """The interleaved schedule's checks (core_v0.19.0): N in [p, m], m mod N 0 or >= p."""
    return p <= group <= m and not 0 < m % group < p


REPLAYED = [(2, 2, 4), (2, 2, 5), (3, 2, 9), (4, 2, 8), (4, 2, 10), (4, 3, 12), (4, 4, 16)]


@pytest.mark.parametrize(("p", "v", "m"), REPLAYED)
def test_group_in_flight_matches_the_replayed_schedule(p, v, m):
    for group in range(p, m + 1):
        if not megatron_accepts(p, m, group):
            continue
        _, peaks = replay(p, v, m, group)
        assert peaks == [megatron_in_flight_forwards(p, v, m, r, group) for r in range(p)]


@pytest.mark.parametrize(("p", "v", "m"), REPLAYED)
def test_group_leaves_the_bubble_at_p_minus_1_chunk_steps(p, v, m):
    """Derived by the replay: with a forward f and a backward b per chunk, every group Megatron
    accepts ends the iteration at (m·v + p - 1)·(f + b), the m·v chunk steps plus the
    (p - 1)/v micro-batches of bubble of `ckplan.hardware.step_time`; a group it refuses stalls
    (a later end) or deadlocks. The step time does not depend on the group."""
    for group in range(1, m + 1):
        span, _ = replay(p, v, m, group)
        if megatron_accepts(p, m, group):
            assert span == (m * v + p - 1) * 3
        else:
            assert span is None or span > (m * v + p - 1) * 3


def test_first_stage_holds_v_minus_1_chunk_forwards_more_per_group_micro_batch():
    """2·(p - 1) + (v - 1)·N + 1: the Llama 3 405B layout (p 16, v 8, m 32) holds 143 chunk
    forwards at N = 16 and 255 = all 256 - 1 at N = 32 (one backward is already due)."""
    assert megatron_in_flight_forwards(16, 8, 32, 0, 16) == 2 * 15 + 7 * 16 + 1 == 143
    assert megatron_in_flight_forwards(16, 8, 32, 0, 32) == 2 * 15 + 7 * 32 + 1 == 255
    assert megatron_in_flight_forwards(16, 8, 16, 0, 16) == 16 * 8  # all forwards first


def test_spec_group_enters_the_in_flight_count(spec_of):
    spec = spec_of("llama3-8b", pp=4, virtual_stages=2, microbatches=16)
    grouped = spec.replace(microbatch_group_size=8)
    assert spec.microbatch_group == 4 and grouped.microbatch_group == 8
    assert in_flight_microbatches(spec, 0) == Fraction(2 * 3 + 4 + 1, 2)
    assert in_flight_microbatches(grouped, 0) == Fraction(2 * 3 + 8 + 1, 2)
    assert spec.replace(microbatch_group_size=4).microbatch_group == spec.microbatch_group


@pytest.mark.parametrize("group", [None, 2, 4, 8])
def test_group_sets_the_last_stage_memory(spec_of, group):
    """As test_interleaved_last_stage_waits_with_layers_only, with the last rank's
    (v - 1)·N + 1 chunk forwards (p 2, v 3, m 8): N = 2 (the default, p) holds 5, N = 4 holds
    9, N = 8 holds 17; GPT-2's output layer keeps the peak on the last stage."""
    spec = spec_of("gpt2", pp=2, virtual_stages=3, microbatches=8, layers=6)
    if group is not None:
        spec = spec.replace(microbatch_group_size=group)
    last, n = spec.pp - 1, group or 2
    strategy = parse_strategy("none", spec)
    chain = layer_chain(spec, strategy.groups, stage=last)
    replay_ = simulate(chain, store_all_schedule(chain))
    # what each waiting chunk forward holds: the stage's layers without the output layer
    layers_held = held_after_forward_bytes(chain, replay_, output_held=False)
    waiting = Fraction((3 - 1) * n + 1 - 3, 3)
    expected = replay_.peak_bytes + -(-waiting.numerator * layers_held // waiting.denominator)
    plan = evaluate(spec, strategy)
    assert plan.peak_stage == last
    assert plan.activation_bytes == expected


def test_estimate_reports_the_group_and_its_memory(cli, spec_of):
    layout = ["--set", "pp=2", "--set", "virtual_stages=3", "--set", "microbatches=8"]
    answers = {}
    for group in (2, 8):
        code, out, err = cli(
            "estimate", "gpt2", "--set", "layers=6", *layout,
            "--set", f"microbatch_group_size={group}", "--json",
        )  # fmt: skip
        assert code == 0, err
        answer = json.loads(out)
        assert answer["model"]["microbatch_group_size"] == group
        answers[group] = answer["memory"]["activation_bytes"]
    for group, answer in answers.items():  # test_group_sets_the_last_stage_memory's plans
        spec = spec_of(
            "gpt2", layers=6, pp=2, virtual_stages=3, microbatches=8, microbatch_group_size=group
        )
        assert answer == evaluate(spec, parse_strategy("none", spec)).activation_bytes
    assert answers[8] > answers[2]
    code, out, _ = cli("estimate", "gpt2", "--set", "layers=6", *layout, "--json")
    assert json.loads(out)["memory"]["activation_bytes"] == answers[2]


def test_interleaved_gradients_of_one_chunk_at_a_time_when_groups_are_whole():
    """N = M = 16, p = 16, v = 8, rank 1 (the Llama 3 405B layouts at 16,384 GPUs): all 128
    chunk forwards come first; each chunk's backwards run back to back and its REDUCE_GRAD
    frees its gradients, so the first backward holds 128 tapes and one chunk's gradients."""
    excess = interleaved_gradient_excess
    assert excess(16, 8, 16, 1, 16, 1, 1) == 1
    # gradients 100 times a tape: chunk 7's reduce, after its 16th backward, holds 112 tapes
    # and its gradients twice (accumulated, and copied into the reduce-scatter input):
    # 2·100 + 112 - 128 beyond the activation peak
    assert excess(16, 8, 16, 1, 16, 1, 100) == 184


def test_interleaved_gradients_of_every_chunk_when_the_steady_phase_reaches_them():
    """M = 32, N = 16 (the 8,192-GPU layout): 140 warm-up forwards, then 116 forward-backward
    steps; the 113th backward is chunk 0's first, with all 8 chunks accumulating and 141
    tapes held: the whole stage's gradients beside the activation peak. One chunk (v = 1)
    holds its gradients from its first backward to the end."""
    excess = interleaved_gradient_excess
    assert excess(16, 8, 32, 1, 16, 1, 1) == 8
    assert excess(4, 1, 8, 0, None, 5, 7) == 7
