"""`ckplan plan`: the layouts it prints fit and take the time it says when `estimate` evaluates
them with the same keys, ranked as `estimate --gpu` times them; its JSON, CSV and Markdown."""

import csv
import io
import json
import shlex

import pytest
from json_schema import LAYOUTS, SWEEP, errors

SMALL = ["plan", "gpt2", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "16"]


def estimate(cli, model, layout, extra=()):
    """`ckplan estimate` of a printed layout with its --set keys and plan."""
    argv = ["estimate", model, "--gpu", "h100-sxm", "--strategy", layout["strategy"], "--json"]
    for arg in layout["set"]:
        argv += ["--set", arg]
    code, out, err = cli(*argv, *extra)
    return code, json.loads(out), err


@pytest.mark.parametrize(
    "argv, shared",
    [
        (SMALL, ["--budget", "3.5GB"]),
        (SMALL, ["--budget", "5GB", "--seq", "2048"]),
        (["plan", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm", "--global-batch", "32",
          "--top", "4"], ["--seq", "8192"]),
    ],
)  # fmt: skip
def test_every_printed_layout_fits_and_times_as_estimate_says(cli, argv, shared):
    code, out, err = cli(*argv, *shared, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layouts"]
    times = []
    for layout in data["layouts"]:
        assert layout["fits"] and layout["memory"]["headroom_bytes"] >= 0
        code, plan, err = estimate(cli, argv[1], layout, shared)
        assert code == 0, err
        assert plan["fits"] is True
        if layout["strategy"].startswith("optimal"):
            # estimate's DP runs at its default slots; the search's plan fits the same budget
            times.append(layout["time"]["step_seconds"])
            continue
        assert plan["memory"]["total_bytes"] == layout["memory"]["total_bytes"]
        assert plan["time"]["step_seconds"] == pytest.approx(
            layout["time"]["step_seconds"], rel=1e-12
        )
        times.append(plan["time"]["step_seconds"])
    assert times == sorted(times)  # the ranking is estimate --gpu's


def test_json_schema(cli):
    code, out, _ = cli(*SMALL, "--budget", "3.5GB", "--json", "--top", "3")
    assert code == 0
    data = json.loads(out)
    assert errors(data, LAYOUTS) == []
    assert {"gpus", "gpu", "layouts", "rejected"} <= data.keys()
    assert data["gpus"] == 8 and data["gpu"] == "h100-sxm" and data["global_batch"] == 16
    assert len(data["layouts"]) == 3
    for layout in data["layouts"]:
        for key in ("tp", "pp", "cp", "dp", "ep", "zero", "sp", "virtual_stages"):
            assert key in layout
        assert layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"] == 8
        assert layout["micro_batch"] * layout["microbatches"] * layout["dp"] == 16
        assert sum(layout["stage_layers"]) == 12 and len(layout["stage_layers"]) == layout["pp"]
        assert {"strategy", "fits", "memory", "time", "set"} <= layout.keys()
        assert layout["time"]["mfu"] > 0
    rejected = data["rejected"]
    assert rejected["counts"]["layouts"] >= rejected["counts"]["evaluated"] > 0
    for r in rejected["layouts"]:
        assert r["reason"] in ("model_states", "memory", "slower") and r["why"]


def test_table_names_the_fastest_and_how_to_check_it(cli):
    code, out, _ = cli(*SMALL, "--budget", "3.5GB", "--top", "3")
    assert code == 0
    assert "the fastest layouts" in out and "Fastest: tp " in out
    assert (
        "Check it: ckplan estimate gpt2 --gpu h100-sxm --budget 3.5GB --seq 1024 --strategy" in out
    )
    assert "layouts:" in out and "evaluated" in out


def test_csv_and_markdown(cli):
    code, out, _ = cli(*SMALL, "--format", "csv", "--top", "2")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 2 and rows[0]["rank"] == "1"
    assert float(rows[0]["step_seconds"]) <= float(rows[1]["step_seconds"])
    code, out, _ = cli(*SMALL, "--format", "markdown", "--top", "2")
    assert code == 0 and out.startswith("**gpt2 on 8 x h100-sxm") and "| # |" in out


def test_set_fixes_layout_keys(cli):
    code, out, _ = cli(*SMALL, "--set", "tp=2", "--set", "pp=2", "--json")
    assert code == 0
    layouts = json.loads(out)["layouts"]
    assert layouts and all(x["tp"] == 2 and x["pp"] == 2 for x in layouts)


def test_uneven_pipeline_of_llama3_405b(cli):
    """Llama 3 405B over PP 16 on 16,384 GPUs (TP 8, so DP 128 at CP 1): 126 layers as 7,
    8 x 14, 7 with the embedding and loss counted as layers (Megatron's
    account_for_embedding/loss_in_pipeline_split)."""
    code, out, err = cli(
        "plan", "llama3-405b", "--gpus", "16384", "--gpu", "h100-sxm", "--seq", "8192",
        "--global-batch", "2048", "--set", "tp=8", "--set", "pp=16", "--set", "cp=1", "--json",
        "--top", "1",
    )  # fmt: skip
    assert code == 0, err
    layout = json.loads(out)["layouts"][0]
    assert layout["stage_layers"] == [7] + [8] * 14 + [7]
    assert layout["account_for_embedding_in_pipeline_split"] is True
    assert layout["dp"] == 128


def test_nothing_fits_is_exit_1_with_the_nearest_layout(cli):
    code, out, err = cli("plan", "gpt3-175b", "--gpus", "2", "--gpu", "h100-sxm", "--json")
    assert code == 1
    data = json.loads(out)
    assert errors(data, LAYOUTS) == []
    assert data["layouts"] == [] and data["rejected"]["nearest"]["over_bytes"] > 0
    assert err.startswith("error: no layout of 2 GPUs fits") and len(err.splitlines()) == 1
    # advice from the nearest layout: more GPUs, how laid out, and the memory that results
    assert data["advice"] and all(line.startswith("--gpus ") for line in data["advice"])
    more = int(data["advice"][0].split()[1].replace(",", ""))
    assert more > 2 and "per GPU with full recomputation" in data["advice"][0]


def test_the_check_command_printed_reproduces_the_fastest(cli):
    """The table's "Check it:" line, run as printed (model options included), evaluates the
    fastest layout to the step time and memory `plan --json` gives it."""
    argv = [*SMALL, "--budget", "3.5GB", "--set", "dropout=0", "--profile", "torch-eager"]
    code, out, _ = cli(*argv, "--top", "1", "--json")
    assert code == 0
    fastest = json.loads(out)["layouts"][0]
    code, out, _ = cli(*argv, "--top", "1")
    line = next(x for x in out.splitlines() if x.startswith("Check it: "))
    command = shlex.split(line.removeprefix("Check it: "))
    assert command[:2] == ["ckplan", "estimate"] and "--profile" in command
    code, out, err = cli(*command[1:], "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["fits"] and plan["strategy"] == fastest["strategy"]
    assert plan["memory"]["total_bytes"] == fastest["memory"]["total_bytes"]
    assert plan["time"]["step_seconds"] == pytest.approx(fastest["time"]["step_seconds"], rel=1e-12)


def test_offload_beats_recomputation_where_its_copies_hide(cli):
    """Llama 3 8B at 16k tokens on RTX 4090s (PCIe Gen4) under torchtitan (`save_on_cpu`
    around the layers): a layer's tape copies in about the time its forward takes, so tapes on
    host beat recomputing; plan says by how much against the layout's best recomputation, and
    what the copies expose. (Megatron-LM tries no offload plan: frameworks.offload_strategies.)"""
    argv = ["plan", "llama3-8b", "--gpus", "32", "--gpu", "rtx-4090", "--seq", "16384"]
    argv += ["--set", "framework=torchtitan"]
    code, out, err = cli(*argv, "--json", "--top", "2")
    assert code == 0, err
    data = json.loads(out)
    assert errors(data, LAYOUTS) == []
    best = data["layouts"][0]
    # the fastest layout without offloading, from a search that tries no offload plan
    without = data["without_offload"]
    assert without["offload"] is None and "offload" not in without["strategy"]
    assert without["time"]["step_seconds"] > best["time"]["step_seconds"]
    offload = best["offload"]
    assert best["strategy"] == offload["strategy"] and "offload" in best["strategy"]
    assert offload["recompute_strategy"] is not None
    assert offload["step_seconds"] < offload["recompute_step_seconds"]
    assert offload["step_seconds"] == best["time"]["step_seconds"]
    assert offload["exposed_seconds"] == best["time"]["offload_exposed_seconds"] > 0
    code, out, _ = cli(*argv, "--top", "2")
    line = next(line for line in out.splitlines() if line.startswith("Offload: "))
    assert "less than the best recomputation on this layout" in line
    assert "copies exposed" in line and "beside a layer's forward" in line
    assert "; without offloading the fastest is " in line
    check = next(x for x in out.splitlines() if x.startswith("Check it: "))
    command = shlex.split(check.removeprefix("Check it: "))
    code, plan, err = cli(*command[1:], "--json")
    assert code == 0, err
    assert json.loads(plan)["strategy"] == best["strategy"]
    assert json.loads(plan)["time"]["step_seconds"] == pytest.approx(offload["step_seconds"])


def test_under_torchtitan_the_plan_names_the_export_that_writes_it():
    """Under torchtitan `plan` offers plans its configuration cannot express (offloading,
    `optimal`, scoped policies) when they are faster: the verdict names the target that writes
    the plan and, when that is the torch snippet, why torchtitan's configuration cannot."""
    from ckplan import exports
    from ckplan.inputs.presets import load_spec
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy
    from ckplan.render.layouts import export_target

    spec = load_spec("llama3-8b", {"framework": "torchtitan", "dp": 8, "zero": 3})
    native = evaluate(spec, parse_strategy("full", spec))
    assert exports.why_not(native, "torchtitan") is None
    assert export_target(native).startswith("--to torchtitan writes it")
    blocks = evaluate(spec, parse_strategy("block:4", spec))
    because = exports.why_not(blocks, "torchtitan")
    assert because is not None and exports.why_not(blocks, "torch") is None
    assert export_target(blocks) == (
        "--to torch writes it, to run with torchtitan's activation checkpointing off; "
        f"torchtitan 0.3's configuration cannot express {because}"
    )
    old = evaluate(spec.replace(framework_version="2024.12"), parse_strategy("full", spec))
    assert "--torchtitan-version 0.2" in export_target(old)
    deepspeed = spec.replace(framework="deepspeed")
    assert export_target(evaluate(deepspeed, parse_strategy("full", deepspeed))) is None


def test_plan_and_sweep_json_carry_the_export_line(cli):
    """`plan --json` says which export writes the fastest layout's plan as the `Export:` line
    does (target, options, reason), and `sweep --json` the same for its best plan; null under
    another framework."""
    from ckplan.inputs.presets import load_spec
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.strategies import parse_strategy
    from ckplan.render.export_target import export_choice

    torchtitan = ["--set", "framework=torchtitan"]
    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "8"]
    code, out, err = cli(*argv, *torchtitan, "--top", "1", "-q")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("Export: "))
    code, out, err = cli(*argv, *torchtitan, "--top", "1", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert errors(data, LAYOUTS) == []
    export = data["export"]
    assert set(export) == {"target", "options", "reason"}
    assert export["target"] in ("torchtitan", "torch")
    assert line.startswith(f"Export: {export['options']} writes it")
    assert export["reason"] in line
    assert export["options"].startswith(f"--to {export['target']}")
    code, out, err = cli(*argv, "--set", "framework=deepspeed", "--top", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["export"] is None

    sweep = ["sweep", "llama3-8b", "--gpu", "h100-sxm", "--set", "dp=8", "--set", "zero=3"]
    code, out, err = cli(*sweep, *torchtitan, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert errors(data, SWEEP) == []
    spec = load_spec("llama3-8b", {"framework": "torchtitan", "dp": 8, "zero": 3})
    best = evaluate(spec, parse_strategy(data["best"]["strategy"], spec))
    assert data["export"] == export_choice(best).to_dict()
    # no export writes a plan: target and options null, the reason says why
    mixed = evaluate(spec, parse_strategy("sac-fused+block:2", spec))
    assert export_choice(mixed).to_dict() == {
        "target": None,
        "options": None,
        "reason": export_choice(mixed).reason,
    }
    assert "cannot express" in export_choice(mixed).reason


def test_plan_names_no_schedule_no_export_writes_and_reports_it_as_sweep_does(cli):
    """Llama-3-8B on 8 H100s laid out tp 1, dp 8, ZeRO-3, 256 MiB above the budget that
    revolve:1 alone fits: the one schedule that fits is the DP's optimal, which nests there and
    no export writes. plan names no layout (exit 1, as sweep and check) and reports that
    schedule on a line of its own and as the nearest layout's `reference`, the plan sweep and
    check report; at 80 GB the layout's plan is one an export writes and nothing is beside it."""
    from ckplan.inputs.presets import load_spec
    from ckplan.plan.search import DEFAULT_RESERVE, sweep

    layout = ["--set", "tp=1", "--set", "pp=1", "--set", "cp=1", "--set", "dp=8"]
    layout += ["--set", "zero=3"]
    spec = load_spec("llama3-8b", {"dp": 8, "zero": 3})
    budget = DEFAULT_RESERVE + sweep(spec, 10**13).smallest.plan.budgeted_bytes + 2**28
    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "8"]
    argv += ["--budget", str(budget), *layout]
    code, out, _ = cli(*argv, "--json")
    data = json.loads(out)
    assert code == 1 and errors(data, LAYOUTS) == [] and data["layouts"] == []
    reference = data["rejected"]["nearest"]["reference"]
    assert reference["strategy"] == "optimal" and reference["fits"]
    assert any("no export writes" in note for note in reference["notes"])
    code, out, _ = cli("sweep", "llama3-8b", "--budget", str(budget), *layout, "--json")
    swept = json.loads(out)
    assert code == 1 and swept["best"] is None
    assert swept["reference"]["strategy"] == "optimal"
    assert swept["reference"]["memory"] == reference["memory"]
    code, out, _ = cli("check", "llama3-8b", "--budget", str(budget), *layout, "--json")
    assert code == 1 and json.loads(out)["results"][0]["reference"]["strategy"] == "optimal"
    code, out, _ = cli(*argv, "-q")
    out = " ".join(out.split())  # the console wraps its lines
    assert code == 1 and "no schedule a megatron export writes fits (the DP ran)" in out
    assert "optimal fits (" in out and "where no plan a megatron export writes does" in out
    code, out, _ = cli(*argv[:-12], "--budget", "80GB", *layout, "--json")
    data = json.loads(out)
    assert code == 0 and data["layouts"]
    for shown in data["layouts"]:
        assert shown["reference"] is None and shown["fits"]
        assert errors(shown, LAYOUTS["layouts"][0]) == []


def test_plan_names_no_per_stage_optimal_schedule_under_a_pipeline(cli):
    """Llama-3-70B on 64 H100s at 8k tokens: under a pipeline each stage has its own optimal
    schedule and every launcher applies one setting to every stage, so the DP's plan on
    tp 2 · pp 8 · cp 2 · dp 2 (the fastest step of all) carries the no-export note in the
    exports' own words and is only a reference; the fastest layouts `plan` names are plans
    `export --to megatron` writes."""
    from ckplan import exports
    from ckplan.inputs.presets import load_spec
    from ckplan.plan.evaluate import evaluate
    from ckplan.plan.search import Candidate, activation_budget
    from ckplan.plan.strategies import parse_strategy

    argv = ["plan", "llama3-70b", "--gpus", "64", "--gpu", "h100-sxm", "--seq", "8192"]
    argv += ["--global-batch", "512", "--top", "3", "--json"]
    code, out, err = cli(*argv)
    assert code == 0, err
    data = json.loads(out)
    for layout in data["layouts"]:
        assert layout["pp"] == 1 or not layout["strategy"].endswith("optimal"), layout
        sets = [arg for key in layout["set"] for arg in ("--set", key)]
        code, _, err = cli(
            "export", "llama3-70b", "--plan", layout["strategy"], "--to", "megatron",
            "--seq", "8192", "--budget", str(data["budget_bytes"]), *sets,
        )  # fmt: skip
        assert code == 0, (layout["strategy"], err)
    keys = {"tp": 2, "sp": True, "pp": 8, "cp": 2, "dp": 2, "zero": 1, "seq": 8192}
    spec = load_spec("llama3-70b", {**keys, "micro_batch": 1, "microbatches": 256})
    budget = activation_budget(spec, data["usable_bytes"])
    plan = evaluate(spec, parse_strategy("optimal", spec), budget=budget)
    phrase = "each pipeline stage has its own optimal schedule"
    assert any(phrase in note and "no export writes" in note for note in plan.notes)
    assert not Candidate(plan, data["usable_bytes"]).exported
    for target in set(exports.TARGETS) - {"yaml"}:
        assert phrase in exports.why_not(plan, target), target


def test_plan_names_a_plan_megatrons_flags_write_and_reports_the_dp_schedule_beside_it(cli):
    """Llama-3-8B on 8 H100s laid out tp 1, dp 8, ZeRO-3 at 30 GB: the DP's optimal schedule
    is the fastest that fits, but its recomputed segments are neither Megatron-LM's uniform nor
    block method, so under framework megatron `plan` names the fastest plan `export --to
    megatron` writes, as `sweep` does (`search.choose`), and reports the schedule beside it
    with the export that writes it (--to torch)."""
    from ckplan import exports
    from ckplan.inputs.presets import load_spec
    from ckplan.plan import evaluate, parse_strategy

    layout = ["--set", "tp=1", "--set", "pp=1", "--set", "cp=1", "--set", "dp=8"]
    layout += ["--set", "zero=3"]
    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "8"]
    code, out, err = cli(*argv, "--budget", "30GB", *layout, "--json")
    assert code == 0, err
    (shown,) = json.loads(out)["layouts"]
    reference = shown["reference"]
    assert reference["strategy"] == "optimal" and reference["fits"]
    assert reference["time"]["step_seconds"] < shown["time"]["step_seconds"]
    assert any("--to torch writes it" in note for note in reference["notes"])
    spec = load_spec("llama3-8b", {"seq": 8192, "dp": 8, "zero": 3})
    plan = evaluate(spec, parse_strategy(shown["strategy"], spec))
    assert exports.why_not(plan, "megatron") is None
    code, out, _ = cli(*argv, "--budget", "30GB", *layout, "-q")
    out = " ".join(out.split())  # the console wraps its lines
    assert f"optimal does better than {shown['strategy']}" in out
