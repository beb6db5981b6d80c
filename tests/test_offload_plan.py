"""Offload strategies on models: parsing, plans, step time, sweep and the CLI's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckplan.hardware.host_link import exposed_copy_seconds, host_memory_per_gpu
from ckplan.hardware.step_time import chain_compute_seconds, step_time
from ckplan.inputs.gpus import load_gpu
from ckplan.plan import evaluate
from ckplan.plan.layer_chain import layer_chain
from ckplan.plan.search import activation_budget, offload_optimal_plan, sweep
from ckplan.plan.strategies import StrategyError, parse_strategy
from ckplan.schedules.offload import offload_all, simulate_offload


@pytest.mark.parametrize(
    "text, name, kind",
    [
        ("offload", "offload", "none"),
        ("selective+offload", "selective+offload", "selective"),
        ("offload+optimal", "offload+optimal", "optimal"),
        ("selective+offload+optimal", "selective+offload+optimal", "optimal"),
        ("full+offload", "full+offload", "full"),
        ("offload+full", "full+offload", "full"),
        ("block:4+offload", "block:4+offload", "block"),
        ("selective+full+offload", "selective+uniform:1+offload", "uniform"),
    ],
)
def test_parse_offload_words(spec_of, text, name, kind):
    strategy = parse_strategy(text, spec_of("gpt2"))
    assert strategy.offload and strategy.name == name and strategy.kind == kind


@pytest.mark.parametrize("text", ["revolve:2+offload", "offload+revolve:1"])
def test_offload_of_revolve_is_refused(spec_of, text):
    with pytest.raises(StrategyError, match="revolve re-reads its checkpoints"):
        parse_strategy(text, spec_of("gpt2"))


def test_segment_inputs_come_back_beside_the_backward_after_the_segment(spec_of):
    """uniform:4+offload: each segment's input leaves beside the next layer's forward and comes
    back beside the backward of the layer after the segment, which the time model weighs."""
    spec = spec_of("llama3-8b", seq=16384)
    gpu = load_gpu("rtx-4090")
    plan = evaluate(spec, parse_strategy("uniform:4+offload", spec))
    offloaded = plan.stage_offloads[0][1]
    prefetch = plan.stage_prefetch[0][1]
    inputs = [(i, back) for (i, _), back in zip(offloaded, prefetch, strict=True) if i > 0]
    assert [i for i, _ in inputs] == list(range(1, 33, 4))  # the segments' first layers
    assert all(back == i + 4 for i, back in inputs)  # the backward after the segment
    forward, backward = chain_compute_seconds(spec, gpu, 0)
    exposed = exposed_copy_seconds(forward, backward, offloaded, gpu, prefetch)
    assert step_time(plan, gpu).offload_exposed_seconds == pytest.approx(exposed)
    plain = evaluate(spec, parse_strategy("uniform:4", spec))
    assert plan.flops == plain.flops
    assert plan.activation_bytes < plain.activation_bytes


def test_full_offload_moves_the_checkpointed_inputs(spec_of):
    # Llama 3 8B at 4k tokens: each layer's input is s*b*h*2 bytes; the embedding's tape moves
    # too, the output layer's (the last stage) stays.
    spec = spec_of("llama3-8b", seq=4096, microbatches=2)
    plan = evaluate(spec, parse_strategy("full+offload", spec))
    full = evaluate(spec, parse_strategy("full", spec))
    chain = layer_chain(spec, ())
    layer_input = 4096 * 4096 * 2
    assert chain.input_bytes[1:33] == (layer_input,) * 32
    offloaded = plan.stage_offloads[0][1]
    assert [i for i, _ in offloaded] == list(range(33))
    assert offloaded[0][1] == chain.tape_bytes[0] and offloaded[1][1] == layer_input
    assert plan.host_bytes == chain.tape_bytes[0] + 32 * layer_input
    assert plan.bytes_moved == 2 * plan.host_bytes * 2
    # the plan is the exact replay of full's segment schedule with those items on host
    from ckplan.schedules import segment_schedule
    from ckplan.schedules.offload import offload_stored

    steps = segment_schedule(
        chain, [(0, 1, False)] + [(i, i + 1, True) for i in range(1, 33)] + [(33, 34, False)]
    )
    assert tuple(plan.steps) == steps
    replay = simulate_offload(chain, steps, offload_stored(steps, chain.length))
    assert plan.activation_bytes == replay.device_peak_bytes
    assert plan.host_bytes == replay.host_peak_bytes
    assert plan.flops == full.flops
    # the first pass held every input on device; now at most two (one in flight)
    assert full.activation_bytes - plan.activation_bytes >= 30 * layer_input
    assert "32 checkpointed inputs and 1 tape of 34 stages" in plan.notes[0]


def test_full_offload_copies_hide_behind_a_layer(spec_of):
    # A layer input is 1/17 of its tape: its copy hides behind the next layer's forward and
    # backward on PCIe Gen4 where the tape's copy does not.
    spec = spec_of("llama3-8b", seq=16384)
    gpu = load_gpu("rtx-4090")
    plan = evaluate(spec, parse_strategy("full+offload", spec))
    forward, backward = chain_compute_seconds(spec, gpu, 0)
    exposed = exposed_copy_seconds(forward, backward, plan.stage_offloads[0][1], gpu)
    time = step_time(plan, gpu)
    plain = step_time(evaluate(spec, parse_strategy("full", spec)), gpu)
    assert time.offload_exposed_seconds == pytest.approx(exposed)
    assert time.step_seconds == pytest.approx(plain.step_seconds + exposed)
    assert exposed < 0.01 * plain.step_seconds


def test_offload_plan_is_the_replay(spec_of):
    spec = spec_of("llama3-8b", seq=4096, microbatches=3)
    plan = evaluate(spec, parse_strategy("offload", spec))
    chain = layer_chain(spec, ())
    steps, stages = offload_all(chain)
    replay = simulate_offload(chain, steps, stages)
    assert plan.activation_bytes == replay.device_peak_bytes
    assert plan.host_bytes == replay.host_peak_bytes == sum(chain.tape_bytes[:-1])
    assert plan.bytes_moved == 2 * sum(chain.tape_bytes[:-1]) * 3
    assert plan.flops.recompute == 0
    assert plan.activation_bytes < evaluate(spec, parse_strategy("none", spec)).activation_bytes


def test_offload_step_time_adds_the_exposed_copies(spec_of):
    spec = spec_of("llama3-8b", seq=4096)
    gpu = load_gpu("rtx-4090")
    plan = evaluate(spec, parse_strategy("offload", spec))
    none = evaluate(spec, parse_strategy("none", spec))
    forward, backward = chain_compute_seconds(spec, gpu, 0)
    exposed = exposed_copy_seconds(forward, backward, plan.stage_offloads[0][1], gpu)
    time, plain = step_time(plan, gpu), step_time(none, gpu)
    assert time.offload_exposed_seconds == pytest.approx(exposed) and exposed > 0
    assert time.step_seconds == pytest.approx(plain.step_seconds + exposed)
    assert time.to_dict()["offload_exposed_seconds"] == time.offload_exposed_seconds
    assert "offload_exposed_seconds" not in plain.to_dict()


def test_offload_optimal_needs_a_gpu_and_one_micro_batch_in_flight(spec_of):
    spec = spec_of("gpt2")
    with pytest.raises(StrategyError, match="needs a GPU"):
        evaluate(spec, parse_strategy("offload+optimal", spec), budget=2**30)
    piped = spec_of("gpt2", pp=2, microbatches=4)
    gpu = load_gpu("a100-80gb")
    with pytest.raises(StrategyError, match="pp > 1"):
        evaluate(piped, parse_strategy("offload+optimal", piped), budget=2**30, gpu=gpu)
    # offload alone runs pipelined: the waiting micro-batches keep their tapes on host
    plan = evaluate(piped, parse_strategy("offload", piped))
    assert plan.host_bytes > 0


def test_offload_beats_recomputation_where_copies_hide(spec_of):
    # llama3-8b at 16k tokens on an RTX 4090 (ZeRO-3 over 16 GPUs): a layer's forward takes
    # about as long as its tape's copy over PCIe, so the joint DP offloads instead of recomputing
    spec = spec_of("llama3-8b", seq=16384, dp=16, zero=3, loss="chunked:16")
    gpu = load_gpu("rtx-4090")
    budget = activation_budget(spec, gpu.memory_bytes - 2 * 2**30)
    joint = offload_optimal_plan(spec, budget, gpu)
    rotor = evaluate(spec, parse_strategy("optimal", spec), budget=budget)
    assert joint is not None and rotor is not None
    assert joint.activation_bytes <= budget and joint.host_bytes <= host_memory_per_gpu(gpu)
    assert step_time(joint, gpu).step_seconds < step_time(rotor, gpu).step_seconds
    assert joint.flops.recompute < rotor.flops.recompute


def test_sweep_tries_offload(spec_of):
    spec = spec_of("gpt2", micro_batch=8)
    result = sweep(spec, 16 * 2**30, gpu=load_gpu("a100-80gb"))
    names = {c.plan.strategy for c in result.candidates}
    assert {"offload", "selective+offload", "full+offload"} <= names
    assert any(name.endswith("offload+optimal") for name in names)


def test_sweep_says_how_offload_compares_with_recomputation(spec_of, capsys):
    """Llama 3 8B at 16k tokens on RTX 4090s (ZeRO-3 over 16) under torchtitan, whose jobs
    run the torch snippet's offloading: the fastest fitting offload plan against the fastest
    fitting plan without offloading, as the sweep ranks them."""
    from ckplan.cli import main
    from ckplan.render.time import seconds

    keys = {"seq": 16384, "dp": 16, "zero": 3, "loss": "chunked:16", "framework": "torchtitan"}
    spec = spec_of("llama3-8b", **keys)
    gpu = load_gpu("rtx-4090")
    result = sweep(spec, gpu.memory_bytes, gpu=gpu)
    fitting = [c for c in result.candidates if c.fits and c.exported]
    offload = min((c for c in fitting if c.plan.stage_offloads), key=lambda c: c.time.step_seconds)
    other = min(
        (c for c in fitting if not c.plan.stage_offloads), key=lambda c: c.time.step_seconds
    )
    assert offload.plan.strategy == "offload+optimal"
    assert offload.time.step_seconds < other.time.step_seconds
    sets = [arg for key, value in keys.items() for arg in ("--set", f"{key}={value}")]
    main(["sweep", "llama3-8b", "--gpu", "rtx-4090", *sets, "-q"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"Offload against recomputation: offload+optimal takes "
        f"{seconds(offload.time.step_seconds)}, "
        f"{seconds(other.time.step_seconds - offload.time.step_seconds)}"
    ) in out
    assert (
        f"less than the best recomputation that fits, {other.plan.strategy} "
        f"({seconds(other.time.step_seconds)})"
    ) in out
    exposed = seconds(offload.time.offload_exposed_seconds)
    assert f"copies exposed {exposed}: a " in out and " GiB copy takes " in out


def test_the_comparison_names_the_sweeps_own_best_recomputation(capsys):
    """The QLoRA example at 8k tokens in 24 GB of an H100 (whose layers outrun PCIe, so no
    offload of whole tapes pays): every uniform:K re-runs each layer once (the same step), and
    the sentence comparing offloading with recomputation names the one the sweep calls best
    (least memory among them), not another of the same time."""
    from ckplan.cli import main

    example = Path(__file__).resolve().parents[1] / "examples/fine-tuning/llama3-8b-qlora.yaml"
    args = [str(example), "--budget", "24GB", "--gpu", "h100-sxm", "--seq", "8192"]
    main(["sweep", *args, "-q"])
    out = " ".join(capsys.readouterr().out.split())
    best = out.split("Best plan that fits: ")[1].split(" ")[0]
    assert best.startswith("uniform:")
    assert f"as long as the best recomputation that fits, {best}, which needs no host" in out


def test_cli_json_offload_fields(spec_of, capsys):
    from ckplan.cli import main

    main(["estimate", "gpt2", "--strategy", "offload", "--gpu", "a100-80gb", "--json"])
    data = json.loads(capsys.readouterr().out)
    offload = data["offload"]
    assert offload["host_bytes"] > 0 and offload["bytes_moved"] == 2 * offload["host_bytes"]
    assert offload["offloaded_stages"][0] == "embedding"
    assert offload["exposed_seconds"] == data["time"].get("offload_exposed_seconds", 0.0)


def test_schedule_json_marks_the_offloaded_checkpointed_inputs(capsys):
    from ckplan.cli import main

    main(["schedule", "gpt2", "--strategy", "full+offload", "--json"])
    data = json.loads(capsys.readouterr().out)
    marked = [(step["kind"], step["name"]) for step in data["steps"] if step.get("offload")]
    assert marked[0] == ("forward_keep_all", "embedding")
    assert marked[1:] == [("forward_keep_input", f"layer {i}") for i in range(12)]
    assert data["offload"]["bytes_moved"] == 2 * data["offload"]["host_bytes"]


def test_verify_runs_offload_schedules_on_the_numpy_mlp():
    from ckplan.simple.verify import mlp_spec, verify

    spec = mlp_spec(8, 128, 256, 32)
    names = ["offload", "offload+optimal", "full+offload", "block:3+offload", "uniform:3+offload"]
    names += ["sequential:2+offload", "sqrt+offload"]
    report = verify(spec, names, repeats=1, predict_time=False)
    runs = {run.strategy: run for run in report.runs}
    for name in names:
        run = runs[name]
        assert run.ok and run.gradients_identical and run.offload_ok
        assert run.predicted.offloaded
        assert run.measured.host_peak_bytes == run.predicted.host_peak_bytes > 0
        assert run.measured.bytes_moved == run.predicted.bytes_moved > 0
    # tapes on host: less on device than the plain step
    assert runs["offload"].measured.peak_bytes < runs["none"].measured.peak_bytes


@pytest.mark.parametrize(
    "text", ["offload", "selective+offload", "full+offload", "block:4+offload"]
)
def test_timeline_of_an_offload_plan_peaks_at_its_activations(spec_of, text):
    from ckplan.plan.timeline import memory_timeline

    for layout in ({}, {"pp": 2, "microbatches": 4}):
        spec = spec_of("llama3-8b", seq=4096, **layout)
        plan = evaluate(spec, parse_strategy(text, spec))
        assert memory_timeline(plan).peak_bytes == plan.activation_bytes


def test_simple_formulas_refuse_offload(spec_of):
    spec = spec_of("gpt2")
    with pytest.raises(StrategyError, match="simple formula set has no strategy 'offload'"):
        evaluate(spec, parse_strategy("offload", spec), formula="simple")


def test_joint_plan_within_a_binding_host_memory_mixes_offload_and_recompute(spec_of):
    spec = spec_of("llama3-8b", seq=16384, dp=16, zero=3, loss="chunked:16")
    gpu = load_gpu("rtx-4090").replace(host_memory_bytes=400 * 10**9)
    budget = activation_budget(spec, gpu.memory_bytes - 2 * 2**30)
    joint = offload_optimal_plan(spec, budget, gpu)
    everything = evaluate(spec, parse_strategy("offload", spec))
    assert everything.host_bytes > host_memory_per_gpu(gpu)
    assert 0 < joint.host_bytes <= host_memory_per_gpu(gpu)
    assert joint.flops.recompute > 0 and joint.activation_bytes <= budget


def test_sweep_auto_shapes_skip_a_best_offload_optimal(capsys):
    from ckplan.cli import main

    argv = ["sweep", "llama3-8b", "--gpu", "rtx-4090", "--seq", "16384", "--set", "dp=16"]
    argv += ["--set", "zero=3", "--set", "loss=chunked:16", "--micro-batch", "auto", "--json"]
    code = main([*argv, "--set", "framework=torchtitan"])  # its jobs run the torch snippet's
    data = json.loads(capsys.readouterr().out)
    assert code in (0, None)
    assert data["best"]["strategy"] == "offload+optimal"
    assert "offload+optimal" not in data["max_micro_batch"]
    assert data["best"]["offload"]["host_bytes"] <= data["best"]["host_budget_bytes"]


def test_offload_json_shapes(capsys):
    from json_schema import ESTIMATE, OFFLOAD, SCHEDULE, SWEEP, errors

    from ckplan.cli import main

    shape = ["--gpu", "a100-80gb", "--set", "micro_batch=8", "--json"]
    main(["estimate", "gpt2", "--strategy", "offload", *shape])
    data = json.loads(capsys.readouterr().out)
    assert errors(data, {**ESTIMATE, "offload": {**OFFLOAD, "exposed_seconds": float}}) == []
    main(["schedule", "gpt2", "--strategy", "offload+optimal", *shape])
    data = json.loads(capsys.readouterr().out)
    assert errors(data, {**SCHEDULE, "offload": OFFLOAD}) == []
    marked = [step for step in data["steps"] if step.get("offload")]
    assert len(marked) == len(data["offload"]["offloaded_stages"])
    assert all(step["kind"] == "forward_keep_all" for step in marked)
    main(["sweep", "gpt2", *shape])
    data = json.loads(capsys.readouterr().out)
    assert errors(data, SWEEP) == []
    offloads = [plan for plan in data["plans"] if "offload" in plan]
    assert {plan["strategy"] for plan in offloads} >= {"offload", "selective+offload"}
    assert all(errors(plan["offload"], OFFLOAD) == [] for plan in offloads)
    assert all(isinstance(plan["host_budget_bytes"], int) for plan in offloads)


def test_exports_of_offload_plans(spec_of):
    """full+offload: DeepSpeed's cpu_checkpointing and the torch snippet write it; Megatron-LM
    and torchtitan refuse it with a reason; DeepSpeed refuses stored tapes on host."""
    from ckplan import exports

    spec = spec_of("llama3-8b", framework="deepspeed", dp=8, zero=3)
    full = evaluate(spec, parse_strategy("full+offload", spec))
    config = json.loads(exports.export(full, "deepspeed").text)
    assert config["activation_checkpointing"]["cpu_checkpointing"] is True
    assert config["activation_checkpointing"]["number_checkpoints"] == 32
    plain = evaluate(spec, parse_strategy("full", spec))
    assert (
        json.loads(exports.export(plain, "deepspeed").text)["activation_checkpointing"][
            "cpu_checkpointing"
        ]
        is False
    )
    assert "core_v0.19.0 refuses CPU offloading beside recomputation" in exports.why_not(
        full, "megatron"
    )
    stored = evaluate(spec, parse_strategy("offload", spec))
    assert "at most num_layers - 1 layers" in exports.why_not(stored, "megatron")
    assert "not stored tapes" in exports.why_not(stored, "deepspeed")
    assert "no offloading key" in exports.why_not(full, "torchtitan")
    assert exports.why_not(full, "torch") is None
    text = exports.export(full, "torch").text
    assert "with save_on_cpu(pin_memory=True):\n                hidden = checkpoint(" in text


def test_at_equal_step_time_the_plan_without_offloaded_tapes_wins():
    """QLoRA Llama-3-8B at 8k in 24 GB of an H100: `full+offload` takes the step of the
    recomputation plans that fit (its copies hide), so the sweep's best pins no host memory for
    tapes."""
    from ckplan.inputs.presets import load_spec

    gpu = load_gpu("h100-sxm")
    example = Path(__file__).resolve().parents[1] / "examples/fine-tuning/llama3-8b-qlora.yaml"
    spec = load_spec(str(example))
    result = sweep(spec, 24 * 10**9, gpu=gpu, rank="time")
    by_name = {c.plan.strategy: c for c in result.candidates}
    offload = by_name["full+offload"]
    assert offload.fits and not result.best.plan.stage_offloads
    assert offload.time.step_seconds == result.best.time.step_seconds
    assert offload.plan.total_bytes < result.best.plan.total_bytes


def test_plan_tries_the_joint_dp_on_offloading_layouts():
    """Llama-3-8B at 16k over 16 RTX 4090s with torchtitan, power-capped to 80 % of their rated
    compute (`clock_factor`), so that a layer's compute hides part of its tape's PCIe copy: the
    fastest layouts offload, and the joint keep/offload/recompute DP beats the single offload
    strategies there; shown layouts stay ranked by step time."""
    from ckplan.inputs.presets import load_spec
    from ckplan.plan.layout.search import search_layouts

    gpu = load_gpu("rtx-4090").replace(clock_factor=0.8)
    spec = load_spec("llama3-8b", {"seq": 16384, "framework": "torchtitan"})
    # ten shown: the per-op policies' layouts rank before the offloading ones until the joint
    # DP runs on these, which it does only on the layouts shown
    result = search_layouts(spec, 16, gpu, 16, gpu.memory_bytes, top=10)
    best = result.layouts[0]
    assert best.plan.strategy.endswith("offload+optimal") and best.plan.stage_offloads
    assert best.offload is best.candidate and best.recompute.time.step_seconds > best.seconds
    seconds = [e.seconds for e in result.layouts]
    assert seconds == sorted(seconds)
