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


# ---- sac+mixed on models ---------------------------------------------------------------------


def _llama(spec_of, **overrides):
    keys = {"framework": "torchtitan", "seq": 16384, "micro_batch": 2, "dp": 8, "zero": 3}
    return spec_of("llama3-8b", **{**keys, **overrides})


@pytest.mark.parametrize(
    "text, name",
    [("sac+mixed", "sac+mixed"), ("mixed+sac", "sac+mixed"), ("sac:attention+mixed", None)],
)
def test_parse_mixed(spec_of, text, name):
    from ckplan.plan.strategies import MIXED, parse_strategy

    strategy = parse_strategy(text, _llama(spec_of))
    assert strategy.kind == MIXED and strategy.policy
    assert strategy.name == (name or "sac:attention+mixed")


@pytest.mark.parametrize(
    "text, message",
    [
        ("mixed", "name the policy"),
        ("selective+mixed", "name the policy"),
        ("sac+block:2+mixed", "one layer-level strategy"),
    ],
)
def test_parse_mixed_refused(spec_of, text, message):
    from ckplan.plan.strategies import StrategyError, parse_strategy

    with pytest.raises(StrategyError, match=message):
        parse_strategy(text, _llama(spec_of))


def test_mixed_plan_is_the_exact_replay_and_its_time_per_stage(spec_of):
    """The plan's peak is the replay of its schedule on the mixed chain (each layer's tape from
    the full or the policy's chain), its FLOPs the replay's with the policy's re-runs counted
    as recompute, and its step time re-runs the policy only in the layers that store its tape."""
    from ckplan.hardware.step_time import chain_stage_times, micro_batch_time, step_time
    from ckplan.inputs.gpus import load_gpu
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.layer_chain import layer_chain
    from ckplan.plan.search import activation_budget
    from ckplan.plan.strategies import parse_strategy

    spec = _llama(spec_of)
    gpu = load_gpu("h100-sxm")
    budget = activation_budget(spec, 75 * 2**30)
    plan = evaluate(spec, parse_strategy("sac+mixed", spec), budget=budget, gpu=gpu)
    mask = plan.stage_policy[0][1]
    layers = [on for on, name in zip(mask, plan.stage_names, strict=True) if "layer" in name]
    assert any(layers) and not all(layers)  # a real mix at this budget
    full, policy = layer_chain(spec, ()), layer_chain(spec, plan.recompute_groups)
    chain = mixed_chain((full, policy), [int(on) for on in mask])
    replay = simulate(chain, plan.steps)
    assert plan.activation_bytes == replay.peak_bytes <= budget
    rerun = sum(
        policy.backward_flops[i] - full.backward_flops[i] for i in range(len(mask)) if mask[i]
    )
    assert plan.flops.recompute == (replay.recompute_flops + rerun) * spec.microbatches
    assert plan.flops.total == replay.total_flops * spec.microbatches
    stages = chain_stage_times(spec, gpu, 0, plan.recompute_groups)
    per_stage = micro_batch_time(stages, replay.layer_forwards, mask)
    everywhere = micro_batch_time(stages, replay.layer_forwards, True)
    nowhere = micro_batch_time(stages, replay.layer_forwards, False)
    assert nowhere.recompute.total < per_stage.recompute.total < everywhere.recompute.total
    assert step_time(plan, gpu).step_seconds > 0


def test_mixed_beats_optimal_and_sac_optimal_on_llama(spec_of):
    """Llama 3 8B, 16k tokens, micro-batch 2, FSDP over 8 H100s (docs/strategies.md): the mix
    is at least as fast as both DPs it generalises, in the step time it minimises."""
    from ckplan.hardware.step_time import step_time
    from ckplan.inputs.gpus import load_gpu
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.search import activation_budget
    from ckplan.plan.strategies import parse_strategy

    spec = _llama(spec_of)
    gpu = load_gpu("h100-sxm")
    budget = activation_budget(spec, 75 * 2**30)
    times = {}
    for name in ("optimal", "sac+optimal", "sac+mixed"):
        plan = evaluate(spec, parse_strategy(name, spec), budget=budget, gpu=gpu)
        times[name] = step_time(plan, gpu).step_seconds if plan else float("inf")
    assert times["sac+mixed"] < min(times["optimal"], times["sac+optimal"])


def test_mixed_refused_with_pipeline_stages(spec_of):
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import StrategyError, parse_strategy

    spec = _llama(spec_of, pp=2)
    with pytest.raises(StrategyError, match="pp > 1"):
        evaluate(spec, parse_strategy("sac+mixed", spec), budget=2**36)


def test_sweep_with_a_gpu_tries_mixed(spec_of):
    from ckplan.inputs.gpus import load_gpu
    from ckplan.plan.search import sweep

    gpu = load_gpu("h100-sxm")
    # torchtitan 0.3.0's policy, sac-fused, beside full-tape layers: no export writes it
    result = sweep(_llama(spec_of), gpu.memory_bytes, 2 * 2**30, gpu=gpu)
    names = {c.plan.strategy for c in result.candidates}
    assert "sac-fused" in names and not names & {"sac-fused+mixed", "sac+mixed"}
    # the release of December 2024 runs sac, which --to torch writes beside full-tape layers
    old = _llama(spec_of, framework_version="2024.12")
    names = {c.plan.strategy for c in sweep(old, gpu.memory_bytes, 2 * 2**30, gpu=gpu).candidates}
    assert "sac+mixed" in names and not any(name.startswith("sac-fused") for name in names)
    assert "sac+mixed" not in {c.plan.strategy for c in sweep(old, 80 * 2**30).candidates}
    speed = sweep(_llama(spec_of, framework="deepspeed"), gpu.memory_bytes, 2 * 2**30, gpu=gpu)
    assert "sac+mixed" in {c.plan.strategy for c in speed.candidates}


def test_sac_fused_mixed_says_no_export_writes_it(spec_of):
    """Asked for by name, `sac-fused+mixed` (and `+block:N`, `+optimal`) is evaluated, and its
    notes say that no export writes it; every target refuses it when it mixes layers.
    `sac+mixed` carries the note exactly where the torch snippet refuses its schedule."""
    from ckplan import exports
    from ckplan.inputs.gpus import load_gpu
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy

    spec = _llama(spec_of)
    gpu = load_gpu("h100-sxm")
    for name in ("sac-fused+mixed", "sac-fused+block:4", "sac-fused+optimal"):
        plan = evaluate(spec, parse_strategy(name, spec), budget=48 * 2**30, gpu=gpu)
        assert any(note.startswith(f"no export writes {name}:") for note in plan.notes), name
        mixes = name.endswith("block:4") or 0 < sum(dict(plan.stage_policy).get(0, ())) < 34
        mixes = mixes or (name.endswith("optimal") and plan.flops.recompute > 0)
        if mixes:
            for target in ("torchtitan", "torch"):
                assert exports.why_not(plan, target) is not None, (name, target)
    # sac+mixed is written layer by layer (--to torch) where its schedule has one level of
    # ranges of layers; at 48 GiB it nests, at 70 GiB it recomputes the embedding with layers
    for gib, unwritten in ((48, True), (60, False), (70, True)):
        plain = evaluate(spec, parse_strategy("sac+mixed", spec), budget=gib * 2**30, gpu=gpu)
        assert not any(note.startswith("no export writes") for note in plain.notes), gib
        noted = any("no export writes" in note for note in plain.notes)
        assert noted == unwritten == (exports.why_not(plain, "torch") is not None), gib


def test_mixed_with_a_policy_of_ones_own_is_never_slower_than_the_policy(spec_of):
    """`sac:OP,...+mixed` can store the policy's tape in every layer, so within the budget the
    policy alone fits, its DP (step time) is at most the policy's; its FLOPs-ranked plan without
    a GPU fits too."""
    from ckplan.hardware.step_time import step_time
    from ckplan.inputs.gpus import load_gpu
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy

    spec = _llama(spec_of)
    gpu = load_gpu("h100-sxm")
    alone = evaluate(spec, parse_strategy("sac:k_proj,v_proj", spec))
    budget = alone.activation_bytes
    mixed = evaluate(spec, parse_strategy("sac:k_proj,v_proj+mixed", spec), budget=budget, gpu=gpu)
    assert mixed.activation_bytes <= budget
    # the DP's time is whole nanoseconds per stage: allow their rounding
    assert step_time(mixed, gpu).step_seconds <= step_time(alone, gpu).step_seconds + 1e-6
    by_flops = evaluate(spec, parse_strategy("sac:k_proj,v_proj+mixed", spec), budget=budget)
    assert by_flops.activation_bytes <= budget
    assert by_flops.flops.total <= alone.flops.total
