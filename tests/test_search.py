"""Plan search: the chosen plan fits and nothing cheaper does; frontier; check/sweep CLI."""

import json

import pytest

from ckplan.model.spec import spec_from_mapping
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.search import DEFAULT_RESERVE, largest_micro_batch, pareto_frontier, sweep

GB = 10**9


@pytest.mark.parametrize(
    ("name", "overrides", "budget"),
    [
        ("gpt2", {"micro_batch": 8}, 7 * GB),
        ("gpt2", {"micro_batch": 8}, 14 * GB),
        ("llama3-8b", {"tp": 4, "sp": True, "pp": 2, "microbatches": 8}, 40 * GB),
        ("megatron-22b", {}, 80 * GB),
        ("llama3-70b", {"tp": 8, "pp": 4, "sp": True, "microbatches": 16}, 80 * GB),
    ],
)
def test_best_fits_and_nothing_cheaper_fits(spec_of, name, overrides, budget):
    result = sweep(spec_of(name, **overrides), budget)
    assert result.best is not None and result.best.fits
    assert result.best.plan.total_bytes <= budget - DEFAULT_RESERVE
    cheapest = min(c.plan.flops.total for c in result.candidates if c.fits)
    assert result.best.plan.flops.total == cheapest


def test_pareto_frontier_is_exactly_the_non_dominated_plans(spec_of):
    result = sweep(spec_of("gpt2", micro_batch=8), 7 * GB)

    def dominated(c):
        return any(
            o.plan.total_bytes <= c.plan.total_bytes
            and o.plan.flops.total <= c.plan.flops.total
            and (o.plan.total_bytes, o.plan.flops.total) != (c.plan.total_bytes, c.plan.flops.total)
            for o in result.candidates
        )

    frontier = set(id(c) for c in pareto_frontier(result.candidates))
    keys_on_frontier = {(c.plan.total_bytes, c.plan.flops.total) for c in result.pareto}
    keys_undominated = {
        (c.plan.total_bytes, c.plan.flops.total) for c in result.candidates if not dominated(c)
    }
    assert keys_on_frontier == keys_undominated
    assert len(frontier) == len(keys_on_frontier)


def test_optimal_is_never_worse_than_a_fitting_segment_plan(spec_of):
    """The DP is optimal among persistent schedules, which include every segment plan; with 500
    slots it can only lose plans that fit by less than the rounding of sizes up to a slot."""
    spec = spec_of("gpt2", micro_batch=8)
    for budget in (7 * GB, 9 * GB, 14 * GB):
        result = sweep(spec, budget)
        optimal = [c for c in result.candidates if "optimal" in c.plan.strategy]
        assert optimal and optimal[0].fits
        activation_budget = result.usable_bytes - optimal[0].plan.model_states.total
        slot = -(-activation_budget // 500)
        slack = (spec.layers + 4) * slot  # every live size rounded up by less than one slot
        comfortable = [
            c
            for c in result.candidates
            if c.headroom_bytes >= slack and "optimal" not in c.plan.strategy
        ]
        assert optimal[0].plan.flops.total <= min(c.plan.flops.total for c in comfortable)


def test_min_memory_segment_far_below_sqrt_for_transformers(spec_of):
    """A transformer layer stores ~17-57x its input, so the least-memory K is small; for the
    NumPy MLP (a layer stores only its input) it is sqrt-like. (Llama-3-70B: K = 3, not 2, as
    the loss's backward, fp32 logits and their bf16 gradient, 47 layer inputs' worth, runs while
    all L/K segment inputs are stored.)"""
    result = sweep(spec_of("llama3-70b"), 80 * GB)
    assert result.min_memory_segment <= 3 < round(80**0.5)
    mlp = spec_from_mapping(
        {"name": "m", "kind": "mlp", "layers": 64, "hidden": 64, "micro_batch": 8, "dtype_bytes": 8}
    )
    assert abs(sweep(mlp, 10 * GB).min_memory_segment - 8) <= 2


def test_nothing_fits(spec_of):
    result = sweep(spec_of("llama3-70b"), 80 * GB)
    assert result.best is None
    assert result.smallest.plan.total_bytes == min(c.plan.total_bytes for c in result.candidates)


def test_largest_micro_batch_is_the_edge(spec_of):
    spec = spec_of("gpt2")
    strategy = parse_strategy("full", spec)
    usable = 8 * GB
    size = largest_micro_batch(spec, strategy, usable)
    assert size >= 1
    assert evaluate(spec.replace(micro_batch=size), strategy).total_bytes <= usable
    assert evaluate(spec.replace(micro_batch=size + 1), strategy).total_bytes > usable


def test_sweep_cli_json_and_exit(cli):
    code, out, _ = cli("sweep", "gpt2", "--budget", "14GB", "--batch", "8", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["budget_bytes"] == 14 * GB and data["best"]["fits"]
    assert {"strategy", "memory", "flops", "overhead", "fits"} <= set(data["plans"][0])
    assert data["pareto"] and all(
        isinstance(p["memory"]["total_bytes"], int) for p in data["pareto"]
    )


def test_sweep_cli_nothing_fits(cli):
    code, out, _ = cli("sweep", "llama3-70b", "--budget", "80GB")
    out = " ".join(out.split())  # the console wraps its lines
    assert code == 1
    assert "Nothing fits" in out and "Model states alone" in out


def test_sweep_micro_batch_auto(cli):
    code, out, _ = cli("sweep", "gpt2", "--budget", "40GiB", "--micro-batch", "auto", "--json")
    sizes = json.loads(out)["max_micro_batch"]
    assert code == 0 and sizes["full"] > sizes["none"] >= 1


def test_check_cli(cli, tmp_path):
    code, out, _ = cli("check", "gpt2", "gpt2-xl", "--budget", "80GB", "--json")
    data = json.loads(out)
    assert code == 0 and [r["fits"] for r in data["results"]] == [True, True]
    code, out, _ = cli("check", "gpt2", "llama3-8b", "--budget", "40GB")
    assert code == 1 and "1 of 2 fit" in out
    (tmp_path / "a.yaml").write_text(
        "name: a\nlayers: 2\nhidden: 64\nheads: 4\nseq: 32\nmicro_batch: 1\n"
    )
    (tmp_path / "b.yaml").write_text(
        "name: b\nlayers: 2\nhidden: 64\nheads: 4\nseq: 32\nmicro_batch: 1\n"
    )
    code, out, _ = cli("check", str(tmp_path / "*.yaml"), "--budget", "4GB", "--json")
    assert code == 0 and len(json.loads(out)["results"]) == 2
    code, out, _ = cli("check", "gpt2", "--budget", "8GB", "--strategy", "full", "--json")
    assert code == 0 and json.loads(out)["results"][0]["plan"]["strategy"] == "full"


def _revolve_only_budget():
    """Llama-3-8B, ZeRO-3 over 8 GPUs, and the budget that revolve:1, the reference schedule
    of least memory, alone fits: (spec, budget)."""
    from ckplan.inputs.presets import load_spec

    spec = load_spec("llama3-8b", {"dp": 8, "zero": 3})
    least = sweep(spec, 10**13).smallest
    assert least.plan.strategy == "revolve:1" and not least.exported
    return spec, DEFAULT_RESERVE + least.plan.budgeted_bytes


REVOLVE_ONLY = ["llama3-8b", "--set", "dp=8", "--set", "zero=3"]


def test_check_names_a_plan_an_export_writes_and_the_reference_beside_it(cli):
    """At a budget that revolve:1 alone fits (Llama-3-8B, ZeRO-3 over 8 GPUs) no plan an
    export writes fits: check names the smallest of them, which does not fit (exit 1), and
    reports revolve:1 beside it. With nothing fitting (no ZeRO) it names the smallest plan an
    export writes and reports the least memory of all."""
    from ckplan.inputs.presets import load_spec
    from ckplan.plan.search import check_plan

    spec, budget = _revolve_only_budget()
    result = sweep(spec, budget)
    assert result.best is None and result.reference.plan.strategy == "revolve:1"
    checked = check_plan(spec, budget)
    assert checked.candidate.exported and not checked.candidate.fits
    assert checked.candidate.plan.strategy == result.smallest_written.plan.strategy
    assert checked.reference.plan.strategy == "revolve:1" and checked.reference.fits
    argv = ["check", *REVOLVE_ONLY, "--budget", str(budget)]
    code, out, _ = cli(*argv, "-q")
    assert code == 1 and "(smallest: revolve:1)" not in out
    assert "revolve:1 fits (" in out and "where no plan a megatron export writes does" in out
    code, out, _ = cli(*argv, "--json")
    result = json.loads(out)["results"][0]
    assert code == 1 and not result["fits"]
    assert result["plan"]["strategy"] == checked.candidate.plan.strategy
    assert result["reference"]["strategy"] == "revolve:1" and result["reference"]["fits"]
    code, out, _ = cli(*argv, "-f", "markdown")
    assert code == 1 and "revolve:1 fits (" in out

    code, out, _ = cli("check", "llama3-8b", "--budget", "40GB", "--json")
    result = json.loads(out)["results"][0]
    nothing = sweep(load_spec("llama3-8b", {}), 40 * GB)
    assert code == 1 and nothing.best is None and nothing.smallest.plan.strategy == "revolve:1"
    assert result["plan"]["strategy"] == nothing.smallest_written.plan.strategy != "revolve:1"
    assert result["reference"]["strategy"] == "revolve:1"
    less = result["plan"]["memory"]["total_bytes"] - result["reference"]["memory"]["total_bytes"]
    assert less > 0
    code, out, _ = cli("check", "llama3-8b", "--budget", "40GB", "-q")
    assert "the least memory of any plan is revolve:1's" in out
    # a plan an export writes fits: nothing is reported beside it
    code, out, _ = cli("check", *REVOLVE_ONLY, "--budget", "80GB", "--json")
    result = json.loads(out)["results"][0]
    assert code == 0 and result["fits"] and result["reference"] is None


def test_sweep_names_no_reference_as_its_best_plan(cli):
    """Where revolve:1 alone fits, sweep has no best plan (exit 1, as check): it names the
    smallest plan an export writes in its verdict and revolve:1 on a line of its own and as
    `reference` in its JSON, the same plan check reports."""
    spec, budget = _revolve_only_budget()
    least = sweep(spec, budget).smallest_written
    argv = ["sweep", *REVOLVE_ONLY, "--budget", str(budget)]
    code, out, _ = cli(*argv, "-q")
    assert code == 1 and "Best plan that fits" not in out
    written = "plan a megatron export writes"
    assert f"No {written} fits: the smallest {written} reaches" in " ".join(out.split())
    assert f"({least.plan.strategy})" in out
    assert "revolve:1 fits (" in out and "where no plan a megatron export writes does" in out
    assert "revolve:1: a reference schedule no export writes" in out
    code, out, _ = cli(*argv, "--json")
    data = json.loads(out)
    assert code == 1 and data["best"] is None and data["export"] is None
    assert data["reference"]["strategy"] == "revolve:1" and data["reference"]["fits"]
    code, out, _ = cli("check", *REVOLVE_ONLY, "--budget", str(budget), "--json")
    assert json.loads(out)["results"][0]["reference"] == data["reference"]
    code, out, _ = cli(*argv, "-f", "markdown")
    assert code == 1 and "revolve:1 fits (" in out
    # a plan an export writes fits: no reference
    code, out, _ = cli("sweep", *REVOLVE_ONLY, "--budget", "80GB", "--json")
    data = json.loads(out)
    assert code == 0 and data["best"] is not None and data["reference"] is None


def test_choose_names_a_plan_an_export_writes_and_a_reference_that_comes_first():
    """`choose` by an order that puts the least memory first, at a budget every plan fits:
    revolve:1 comes first but no export writes it, so the best is the plan an export writes of
    least memory, and revolve:1 is the reference; by FLOPs (the sweep's order) nothing comes
    before the best and there is no reference."""
    from ckplan.plan.search import choose, cost_key

    spec, _ = _revolve_only_budget()
    result = sweep(spec, 10**13)
    assert all(c.fits for c in result.candidates)
    chosen = choose(result.candidates, lambda c: c.plan.total_bytes)
    assert chosen.best.exported and chosen.best is chosen.least
    assert chosen.best.plan.total_bytes == result.smallest_written.plan.total_bytes
    assert chosen.reference.plan.strategy == "revolve:1"
    by_flops = choose(result.candidates, cost_key("flops"))
    assert by_flops.reference is None and by_flops.best is result.best


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["sweep", "gpt2", "--budget", "40"], "cannot parse size '40'"),
        (["sweep", "gpt2", "--budget", "40 G"], "cannot parse size"),
        (["sweep", "gpt2", "--budget", "-1GB"], "cannot parse size"),
        (["sweep", "gpt2", "--budget", "4GB", "--reserve", "8GB"], "must be smaller than --budget"),
        (["sweep", "gpt2", "--budget", "4GB", "--micro-batch", "7"], "only 'auto'"),
        (["check", "nothing*.yaml", "--budget", "4GB"], "matches no file"),
        (["check", "gpt2", "--budget", "4GB", "--strategy", "nope"], "unknown strategy"),
        (["schedule", "gpt2"], "needs --budget"),
        (["sweep", "gpt2"], "--budget SIZE (or --gpu NAME"),
    ],
)
def test_search_bad_input(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and out == ""


def test_schedule_cli(cli):
    code, out, _ = cli("schedule", "gpt2", "--budget", "14GB", "--batch", "8")
    assert code == 0 and "backward" in out and "output+loss" in out
    code, out, _ = cli("schedule", "gpt2", "--strategy", "uniform:4", "--json")
    data = json.loads(out)
    assert code == 0 and data["strategy"] == "uniform:4"
    kinds = [step["kind"] for step in data["steps"]]
    assert kinds.count("forward_keep_input") == 3 and kinds.count("backward") == 14
    code, _, err = cli("schedule", "gpt2", "--budget", "4GB")
    assert code == 1 and "no auto schedule fits" in err


def test_longest_seq_fits_and_one_granule_more_does_not(spec_of):
    """--seq auto: the longest sequence (in SEQ_GRANULE steps) whose plan fits, per strategy;
    memory grows with s, so one step more is over."""
    from ckplan.plan.search import SEQ_GRANULE, longest_seq

    spec = spec_of("gpt2", micro_batch=4)
    usable = 6 * 2**30
    for name in ("none", "full", "selective"):
        strategy = parse_strategy(name, spec)
        tokens = longest_seq(spec, strategy, usable)
        assert tokens % SEQ_GRANULE == 0 and tokens > 0
        fitting = evaluate(spec.replace(seq=tokens), strategy).budgeted_bytes
        over = evaluate(spec.replace(seq=tokens + SEQ_GRANULE), strategy).budgeted_bytes
        assert fitting <= usable < over
    assert longest_seq(spec, parse_strategy("none", spec), 2**20) == 0


def test_sweep_seq_auto_in_json(cli):
    code, out, err = cli("sweep", "gpt2", "--budget", "8GB", "--seq", "auto", "--json")
    assert code == 0, err
    seqs = json.loads(out)["max_seq"]
    assert seqs["full"] > seqs["none"] > 0


def test_sweep_seq_auto_when_nothing_fits(cli):
    code, out, _ = cli("sweep", "llama3-70b", "--budget", "8GB", "--seq", "auto", "--json")
    data = json.loads(out)
    assert code == 1 and data["best"] is None
    assert set(data["max_seq"].values()) == {0}


def test_optimal_note_iff_the_exports_refuse_it():
    """Under a tight budget the rotor DP's optimal schedule nests (Llama-3-8B, ZeRO-3 over 8
    GPUs, 256 MiB above the budget revolve:1 alone fits): no export writes it, its notes say so
    and the sweep reports it as the reference, never as its best; with more memory it is one
    level of segments again (some recomputing the embedding stage with layers), noted iff the
    exports refuse it."""
    from ckplan.exports.segments import layer_segments
    from ckplan.plan.search import activation_budget

    spec, budget = _revolve_only_budget()
    noted = []
    for extra in range(0, 2**32 + 1, 2**28):
        usable = budget + extra - DEFAULT_RESERVE
        plan = evaluate(
            spec, parse_strategy("optimal", spec), budget=activation_budget(spec, usable)
        )
        if plan is None:
            continue
        unwritten = any("no export writes" in note for note in plan.notes)
        assert unwritten == isinstance(layer_segments(plan), str), extra
        noted.append(unwritten)
    assert True in noted and False in noted
    nested = sweep(spec, budget + 2**28)
    assert nested.reference.plan.strategy == "optimal" and nested.reference.fits
    assert nested.best is None or nested.best.exported


def test_sweep_names_no_optimal_that_recomputes_the_embedding_with_layers():
    """Llama-3-8B, ZeRO-3 over 8 GPUs at 28,265,414,656 bytes: the DP's optimal schedule is
    the one of fewest FLOPs that fits, but its first recomputed range starts at the embedding
    stage, which no launcher checkpoints with the layers. The note says so in the exports' own
    words, the sweep names a plan Megatron-LM writes and reports optimal beside it."""
    from ckplan import exports
    from ckplan.inputs.presets import load_spec

    spec = load_spec("llama3-8b", {"dp": 8, "zero": 3})
    result = sweep(spec, 28265414656)
    assert result.best.plan.strategy == "uniform:5"
    assert exports.why_not(result.best.plan, "megatron") is None
    reference = result.reference.plan
    assert reference.strategy == "optimal" and result.reference.fits
    assert reference.flops.total < result.best.plan.flops.total
    phrase = "it recomputes the embedding stage together with layers"
    assert f"optimal: no export writes it; {phrase}" in reference.notes
    for target in set(exports.TARGETS) - {"yaml"}:
        assert phrase in exports.why_not(reference, target), target


# The launcher targets of `ckplan export` for each framework's jobs (docs/exports.md): its own
# configuration, and the torch snippet where the job's code wraps its layers itself.
FRAMEWORK_TARGETS = {
    "megatron": ("megatron",),
    "torchtitan": ("torchtitan", "torch"),
    "deepspeed": ("deepspeed", "torch"),
    "hf": ("torch", "peft", "torchtune"),
}


@pytest.mark.parametrize(
    "model, keys, framework, gigabytes",
    [
        ("gpt2", {}, "megatron", 8),
        ("gpt2", {}, "hf", 8),
        ("llama3-8b", {"dp": 8, "zero": 3}, "megatron", 28.265414656),
        ("llama3-8b", {"dp": 8, "zero": 3}, "megatron", 40),
        ("llama3-8b", {"dp": 8, "zero": 3}, "megatron", 80),
        ("llama3-8b", {"dp": 8, "zero": 3}, "torchtitan", 40),
        ("llama3-8b", {"dp": 8, "zero": 3}, "torchtitan", 80),
        ("llama3-8b", {"dp": 8, "zero": 3}, "deepspeed", 28.265414656),
        ("llama3-8b", {"dp": 8, "zero": 3}, "deepspeed", 40),
        ("llama3-8b", {"dp": 8, "zero": 3}, "hf", 40),
        ("llama3-8b", {"dp": 8, "zero": 3}, "hf", 80),
        ("mixtral-8x7b", {"dp": 8, "zero": 1, "ep": 8, "tp": 2, "sp": True}, "megatron", 80),
        ("mixtral-8x7b", {"dp": 8, "zero": 1, "ep": 8, "pp": 4, "microbatches": 8}, "megatron",
         40),
        ("mixtral-8x7b", {"dp": 8, "zero": 1, "ep": 8}, "megatron", 80),
    ],
)  # fmt: skip
def test_every_plan_the_sweep_names_is_one_an_export_of_its_framework_writes(
    model, keys, framework, gigabytes
):
    """The sweep's best plan (`search.choose`) is written by `ckplan export` to one of the
    framework's targets; where none fits, the plan of least memory it names is."""
    from ckplan import exports
    from ckplan.inputs.presets import load_spec

    spec = load_spec(model, {**keys, "framework": framework})
    result = sweep(spec, round(gigabytes * 10**9))
    named = (result.best or result.smallest_written).plan
    written = []
    for target in FRAMEWORK_TARGETS[framework]:
        try:
            written.append(exports.export(named, target).text)
        except exports.ExportError:
            continue
    assert written, named.strategy
