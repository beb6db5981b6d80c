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
from ckplan.model.layers import stage_chunk_layers
from ckplan.model.spec import spec_from_mapping
from ckplan.plan import evaluate, layer_chain, parse_strategy
from ckplan.plan.evaluate import _segment_runs, pipeline_stages, run_segments
from ckplan.plan.layer_chain import layer_offset
from ckplan.plan.search import REVOLVE_MAX_STEPS, candidate_strategies, revolve_slots, sweep
from ckplan.schedules import (
    Chain,
    SegmentSteps,
    held_after_forward_bytes,
    replay_runs,
    revolve_min_forwards,
    schedule_segments,
    segment_replay,
    segment_runs,
    segment_schedule,
    simulate,
)
from ckplan.schedules.revolve import _best_advance, _revolve_cost
from ckplan.simple.formulas import optimal_segment

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


@settings(max_examples=300, deadline=None)
@given(chains_and_segments())
def test_segment_steps_read_their_segments_from_the_runs(case):
    """`schedule_segments` of lazily built steps, read from their runs, equals its reading of
    the same steps built out, for every segmentation (stored segments merged)."""
    chain, segments = case
    lazy = SegmentSteps(chain, segment_runs(segments))
    built = tuple(segment_schedule(chain, segments))
    assert schedule_segments(lazy, chain.length) == schedule_segments(built, chain.length)
    assert schedule_segments(lazy, chain.length + 1) is None  # not a cover of that chain


def test_segment_steps_segments_by_hand():
    """Two stored segments side by side read as one; recomputed ones stay apart."""
    chain = Chain.uniform(6, forward_flops=1, backward_flops=2, input_bytes=1, tape_bytes=2)
    segments = [(0, 1, False), (1, 2, False), (2, 4, True), (4, 6, True)]
    lazy = SegmentSteps(chain, segment_runs(segments))
    assert schedule_segments(lazy, 6) == [(0, 2, False), (2, 4, True), (4, 6, True)]


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


def reference_segments(spec, chain, strategy, stage):
    """The segments evaluate's runs stand for, one by one: the embedding; over the stage,
    `block:K` re-runs its first K layers one by one, `every:K` every K-th layer alone; the
    others equal segments of the strategy's size over each model chunk (the whole stage
    without interleaving), `sequential` storing each chunk's last; the output layer stored."""
    offset = layer_offset(spec, stage == 0)
    output = 1 if spec.vocab and chain.input_bytes[-1] == 0 else 0
    n_layers = chain.length - offset - output
    chunks = [n for n in stage_chunk_layers(spec, stage) if n] if spec.virtual_stages > 1 else []
    if strategy.kind in ("block", "every") or sum(chunks) != n_layers:
        chunks = [n_layers]
    size = {"full": 1, "sqrt": max(1, optimal_segment(spec.layers_per_stage))}.get(
        strategy.kind, strategy.size
    )
    segments = [(0, offset, False)]
    start = offset
    for span in chunks:
        if strategy.kind == "block":
            for i in range(min(size, span)):
                segments.append((start + i, start + i + 1, True))
            segments.append((start + min(size, span), start + span, False))
        elif strategy.kind == "every":
            for i in range(span):
                segments.append((start + i, start + i + 1, (i + 1) % size == 0))
        else:
            for first in range(0, span, size):
                last = first + size >= span
                keep = strategy.kind == "sequential" and last
                segments.append((start + first, start + min(first + size, span), not keep))
        start += span
    segments.append((start, chain.length, False))
    return [segment for segment in segments if segment[1] > segment[0]]


def merged(segments):
    """Consecutive stored segments as one (stored layers need no boundary between them)."""
    out = []
    for start, end, recompute in segments:
        if out and not recompute and not out[-1][2] and out[-1][1] == start:
            out[-1] = (out[-1][0], end, False)
        else:
            out.append((start, end, recompute))
    return out


@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("gpt2", {}),
        ("llama3-8b", {"layers": 13, "pp": 1}),
        ("llama3-8b", {"pp": 4, "microbatches": 4}),
        ("llama3-8b", {"pp": 4, "virtual_stages": 2, "microbatches": 8}),
        ("llama3-8b", {"layers": 24, "pp": 2, "virtual_stages": 4, "microbatches": 4}),
    ],
)
def test_planner_runs_are_the_planner_segments(preset, overrides):
    """evaluate's runs expand to exactly the reference segments, for every candidate strategy
    on every pipeline stage, model chunks included."""
    spec = load_spec(preset, overrides)
    for strategy in candidate_strategies(spec):
        if strategy.kind in ("none", "selective", "revolve", "optimal", "mixed"):
            continue
        if strategy.offload or strategy.policy:
            continue
        for stage in pipeline_stages(spec):
            chain = layer_chain(spec, strategy.groups, stage=stage)
            expanded = run_segments(_segment_runs(spec, chain, strategy, stage))
            expected = reference_segments(spec, chain, strategy, stage)
            assert merged(expanded) == merged(expected), (strategy.name, stage)


def test_uniform_segments_restart_at_each_model_chunk():
    """Interleaving, two chunks of three layers on a stage: `uniform:2` checkpoints each
    chunk from its first layer (segments of 2 and 1, twice), never across the chunk boundary
    (Megatron-LM's TransformerBlock per chunk)."""
    spec = load_spec("llama3-8b", {"layers": 24, "pp": 4, "virtual_stages": 2, "microbatches": 8})
    strategy = parse_strategy("uniform:2", spec)
    chain = layer_chain(spec, strategy.groups, stage=1)
    recomputed = [
        (start, end)
        for start, end, again in run_segments(_segment_runs(spec, chain, strategy, 1))
        if again
    ]
    assert recomputed == [(0, 2), (2, 3), (3, 5), (5, 6)]


def test_uniform_segments_wider_than_a_chunk_cost_no_more_than_storing_all():
    """A segment cannot outlive its chunk: `uniform:2` over one-layer chunks is `uniform:1`,
    and holds no more than `none` where FSDP2's accumulated gradients (torchtitan, ZeRO-2,
    interleaved) sit beside the schedule's fullest point (a case found by
    test_properties.py)."""
    mapping = {
        "name": "tiny", "layers": 4, "hidden": 8, "heads": 1, "kv_heads": 1, "vocab": 0,
        "seq": 8, "micro_batch": 1, "dtype_bytes": 1, "norm": "layernorm", "mlp": "gelu",
        "attention": "standard", "positions": "learned", "bias": False, "dropout": 0.0,
        "tied_embeddings": False, "pp": 2, "cp": 2, "dp": 1, "framework": "torchtitan",
        "zero": 2, "virtual_stages": 2, "microbatches": 1,
    }  # fmt: skip
    spec = spec_from_mapping(mapping)
    total = {
        name: evaluate(spec, parse_strategy(name, spec)).total_bytes
        for name in ("none", "uniform:1", "uniform:2")
    }
    assert total["uniform:2"] == total["uniform:1"] <= total["none"]
