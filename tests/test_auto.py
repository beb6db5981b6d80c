"""`--seq auto` and `--micro-batch auto`: the largest value that fits, by binary search
(`plan.search.largest_fitting`), agrees with trying every value, and rests on memory growing
with seq and micro-batch, checked here on the grid the search walks."""

from __future__ import annotations

import json

import pytest

from ckplan.inputs.gpus import load_gpu
from ckplan.plan import evaluate, parse_strategy, search
from ckplan.plan.search import (
    SEQ_GRANULE,
    auto_step,
    fitting_plan,
    largest_fitting,
    largest_fitting_any,
)

GIB = 2**30
CLASSIC = ("none", "selective", "full", "sqrt", "uniform:3", "block:2", "selective+sequential:2")
MODELS = [
    ("gpt2", {}),
    ("llama3-8b", {"training": "qlora"}),
    ("llama3-8b", {"tp": 2, "sp": True, "pp": 2, "microbatches": 4}),
    ("llama3-8b", {"cp": 2}),
    ("mixtral-8x7b", {"ep": 8, "dp": 8}),
]


# ---- memory is monotone on the grid the search walks -------------------------------------------


@pytest.mark.parametrize(("name", "overrides"), MODELS)
def test_reserved_peak_grows_with_seq_on_the_search_grid(spec_of, name, overrides):
    spec = spec_of(name, **overrides)
    step = auto_step(spec, "seq")
    for strategy_name in CLASSIC:
        strategy = parse_strategy(strategy_name, spec)
        peaks = [
            evaluate(spec.replace(seq=units * step), strategy).budgeted_bytes
            for units in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
        ]
        assert peaks == sorted(peaks), (name, overrides, strategy_name, peaks)


@pytest.mark.parametrize(("name", "overrides"), MODELS)
def test_reserved_peak_grows_with_micro_batch(spec_of, name, overrides):
    spec = spec_of(name, **{**overrides, "seq": 1024})
    for strategy_name in CLASSIC:
        strategy = parse_strategy(strategy_name, spec)
        peaks = [
            evaluate(spec.replace(micro_batch=b), strategy).budgeted_bytes
            for b in (1, 2, 3, 4, 5, 8, 13, 16, 32)
        ]
        assert peaks == sorted(peaks), (name, overrides, strategy_name, peaks)


@pytest.mark.parametrize("usable_gib", [6, 10, 20])
def test_optimal_fitting_is_monotone_in_seq(spec_of, usable_gib):
    """`optimal` is solved for the budget at each value; a shorter sequence fits whenever a
    longer one does."""
    spec = spec_of("gpt2")
    strategy = parse_strategy("optimal", spec)
    fits = [
        fitting_plan(spec.replace(seq=units * SEQ_GRANULE), strategy, usable_gib * GIB) is not None
        for units in range(1, 80, 3)
    ]
    assert fits == sorted(fits, reverse=True)


# ---- the binary search agrees with trying every value -----------------------------------------


def _brute(spec, strategy, usable, key, limit, gpu=None):
    step = auto_step(spec, key)
    found = 0
    for units in range(1, limit + 1):
        if fitting_plan(spec.replace(**{key: units * step}), strategy, usable, gpu) is not None:
            found = units * step
    return found


@pytest.mark.parametrize("strategy_name", ["none", "selective", "full", "sqrt", "optimal"])
@pytest.mark.parametrize("usable_gib", [3, 5, 9])
def test_largest_seq_agrees_with_brute_force(spec_of, strategy_name, usable_gib):
    spec = spec_of("gpt2", micro_batch=2)
    strategy = parse_strategy(strategy_name, spec)
    usable = usable_gib * GIB
    found = largest_fitting(spec, strategy, usable, "seq")
    limit = 48
    assert found < limit * SEQ_GRANULE  # the edge lies inside the brute-force range
    assert found == _brute(spec, strategy, usable, "seq", limit)


@pytest.mark.parametrize("strategy_name", ["none", "full", "uniform:4", "optimal"])
@pytest.mark.parametrize("usable_gib", [4, 8, 12])
def test_largest_micro_batch_agrees_with_brute_force(spec_of, strategy_name, usable_gib):
    spec = spec_of("gpt2", seq=1024)
    strategy = parse_strategy(strategy_name, spec)
    usable = usable_gib * GIB
    found = largest_fitting(spec, strategy, usable, "micro_batch")
    assert found < 64
    assert found == _brute(spec, strategy, usable, "micro_batch", 64)


def test_offload_counts_host_memory_with_a_gpu(spec_of):
    """With a GPU an offload plan must also fit the host memory its tapes pin."""
    spec = spec_of("gpt2", seq=1024)
    gpu = load_gpu("rtx-4090").replace(host_memory_bytes=8 * 10**9)
    strategy = parse_strategy("offload", spec)
    with_host = largest_fitting(spec, strategy, 20 * GIB, "micro_batch", gpu)
    assert with_host == _brute(spec, strategy, 20 * GIB, "micro_batch", 64, gpu)
    assert with_host <= largest_fitting(spec, strategy, 20 * GIB, "micro_batch")


def test_context_parallel_seq_is_a_multiple_of_two_cp(spec_of):
    spec = spec_of("llama3-8b", cp=256, dp=1)
    step = auto_step(spec, "seq")
    assert step == 512 and step % (2 * spec.cp) == 0
    assert largest_fitting(spec, parse_strategy("full", spec), 70 * GIB, "seq") % step == 0


def test_nothing_fits_is_zero_and_a_bad_key_is_refused(spec_of):
    spec = spec_of("gpt2")
    assert largest_fitting(spec, parse_strategy("full", spec), 2**20, "seq") == 0
    assert largest_fitting_any(spec, 2 * GIB + 2**20, 2 * GIB, "micro_batch") == 0
    with pytest.raises(ValueError, match="key must be one of seq, micro_batch"):
        largest_fitting(spec, parse_strategy("full", spec), GIB, "layers")


def test_any_plan_reaches_at_least_every_strategy(spec_of):
    spec = spec_of("gpt2")
    total, kept = 8 * 10**9, 2 * GIB
    reach = largest_fitting_any(spec, total, kept, "seq")
    for name in ("none", "full", "sqrt", "optimal"):
        assert largest_fitting(spec, parse_strategy(name, spec), total - kept, "seq") <= reach
    assert search.sweep(spec.replace(seq=reach), total, kept).best is not None
    over = search.sweep(spec.replace(seq=reach + SEQ_GRANULE), total, kept)
    assert over.best is None


# ---- the commands --------------------------------------------------------------------------


def test_estimate_seq_auto(cli, spec_of):
    code, out, err = cli("estimate", "gpt2", "--budget", "8GB", "-s", "full", "--seq", "auto")
    assert code == 0, err
    assert "Longest sequence that fits with full: 6,144 tokens" in out
    code, out, _ = cli(
        "estimate", "gpt2", "--budget", "8GB", "-s", "full", "--seq", "auto", "--json"
    )
    data = json.loads(out)
    assert data["max_seq"] == 6144 and data["model"]["seq"] == 6144 and data["fits"]


def test_estimate_micro_batch_auto_with_optimal(cli):
    argv = ["estimate", "gpt2", "--budget", "24GB", "-s", "optimal", "--micro-batch", "auto"]
    code, out, err = cli(*argv, "--json")
    data = json.loads(out)
    assert code == 0, err
    assert data["max_micro_batch"] == data["model"]["micro_batch"] > 1 and data["fits"]
    code, out, _ = cli(*argv)
    assert f"Largest micro-batch that fits with optimal: {data['max_micro_batch']}" in out


def test_estimate_auto_when_nothing_fits(cli):
    code, out, _ = cli("estimate", "llama3-8b", "--budget", "24GB", "--seq", "auto", "--json")
    data = json.loads(out)
    assert code == 1 and data["max_seq"] == 0 and not data["fits"]
    assert data["model"]["seq"] == SEQ_GRANULE


def test_sweep_auto_reports_optimal_and_the_best_at_the_largest(cli):
    code, out, err = cli("sweep", "gpt2", "--budget", "8GB", "--seq", "auto", "--json")
    data = json.loads(out)
    assert code == 0, err
    seqs, reach = data["max_seq"], data["best_at_max_seq"]
    assert seqs["optimal"] >= seqs["full"] > seqs["none"] > 0
    assert reach["seq"] >= max(seqs.values()) and reach["best"]["fits"]
    code, out, _ = cli("sweep", "gpt2", "--budget", "8GB", "--seq", "auto", "-q")
    assert f"Longest sequence a plan a megatron export writes fits: {reach['seq']:,} tokens" in out


def test_sweep_micro_batch_auto_with_a_gpu(cli):
    argv = ["sweep", "llama3-8b", "--gpu", "rtx-4090", "--set", "training=qlora"]
    code, out, err = cli(*argv, "--micro-batch", "auto", "--json")
    data = json.loads(out)
    assert code == 0, err
    assert data["best_at_max_micro_batch"]["micro_batch"] >= max(data["max_micro_batch"].values())


def test_check_seq_auto(cli):
    code, out, err = cli("check", "gpt2", "gpt2-xl", "--budget", "48GB", "--seq", "auto", "--json")
    data = json.loads(out)
    assert code == 0, err
    for result in data["results"]:
        assert result["max_seq"] > 0 and result["fits"]
        assert result["max_seq"] % SEQ_GRANULE == 0
    code, out, _ = cli("check", "gpt2", "--budget", "24GB", "--seq", "auto", "-s", "full")
    assert code == 0 and "max seq" in out


def test_check_seq_auto_reaches_as_far_as_a_plan_an_export_writes(cli):
    """GPT-2 in 8 GB: revolve:1, a reference no export writes, fits a longer sequence than any
    plan an export writes; check's and sweep's --seq auto stop where one of those still fits,
    and one sequence further the sweep names no plan but reports revolve:1 beside it."""
    from ckplan.inputs.presets import load_spec

    spec = load_spec("gpt2", {})
    total, kept = 8 * 10**9, search.DEFAULT_RESERVE
    written = largest_fitting_any(spec, total, kept, "seq")
    revolve = parse_strategy("revolve:1", spec)
    reach = search.largest_fitting(spec, revolve, total - kept, "seq")
    assert 0 < written < reach
    assert not search.Candidate(evaluate(spec.replace(seq=reach), revolve), 0).exported
    beyond = search.sweep(spec.replace(seq=written + SEQ_GRANULE), total, kept)
    assert beyond.best is None and beyond.reference.fits
    assert beyond.reference.plan.strategy.startswith("revolve:")
    code, out, err = cli("check", "gpt2", "--budget", "8GB", "--seq", "auto", "--json")
    result = json.loads(out)["results"][0]
    assert code == 0, err
    assert result["max_seq"] == written and result["fits"] and result["reference"] is None
    assert not any("no export writes" in note for note in result["plan"]["notes"])
    code, out, err = cli("sweep", "gpt2", "--budget", "8GB", "--seq", "auto", "--json")
    at = json.loads(out)["best_at_max_seq"]
    assert code == 0, err
    assert at["seq"] == written and not any("no export writes" in n for n in at["best"]["notes"])


def test_check_micro_batch_auto_exit_codes(cli):
    argv = ["check", "gpt2", "llama3-70b", "--budget", "24GB", "--micro-batch", "auto"]
    code, out, _ = cli(*argv, "--json")
    data = json.loads(out)
    assert code == 1
    assert [r["max_micro_batch"] > 0 for r in data["results"]] == [True, False]
    code, out, _ = cli(*argv)
    assert code == 1 and "none fits" in out


def test_plan_seq_auto(cli):
    argv = ["plan", "gpt2", "--gpus", "2", "--gpu", "rtx-4090", "--top", "1", "--seq", "auto"]
    code, out, err = cli(*argv, "--json")
    data = json.loads(out)
    assert code == 0, err
    assert data["max_seq"] > 1024 and data["max_seq"] % SEQ_GRANULE == 0
    code, out, _ = cli(*argv, "-q")
    assert f"Longest sequence that fits with 2 GPUs: {data['max_seq']:,} tokens" in out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["estimate", "gpt2", "--budget", "8GB", "--seq", "auto", "--micro-batch", "auto"],
            "--seq auto and --micro-batch auto: give one of them",
        ),
        (["estimate", "gpt2", "--seq", "auto"], "--seq auto needs --budget SIZE or --gpu NAME"),
        (
            ["estimate", "gpt2", "--micro-batch", "auto"],
            "--micro-batch auto needs --budget SIZE or --gpu NAME",
        ),
        (["check", "gpt2", "--seq", "auto"], "--budget SIZE (or --gpu NAME, which sets it)"),
        (
            ["sweep", "gpt2", "--budget", "8GB", "--batch", "2", "--micro-batch", "auto"],
            "--batch 2 and --micro-batch auto disagree",
        ),
        (
            [
                *("plan", "gpt2", "--gpus", "2", "--gpu", "rtx-4090"),
                *("--micro-batch", "auto", "--set", "micro_batch=2"),
            ],
            "--micro-batch auto and --set micro_batch=2 disagree",
        ),
        (["check", "gpt2", "--budget", "8GB", "--micro-batch", "max"], "only 'auto' is accepted"),
    ],
)
def test_auto_bad_input(cli, argv, fragment):
    code, out, err = cli(*argv)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and out == ""


def test_plan_micro_batch_auto(cli):
    """The largest micro-batch some layout fits with, and the fastest layouts there (all at
    that micro-batch)."""
    argv = ["plan", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--global-batch", "64"]
    argv += ["--top", "3", "--micro-batch", "auto"]
    code, out, err = cli(*argv, "--json")
    data = json.loads(out)
    assert code == 0, err
    largest = data["max_micro_batch"]
    assert 64 % largest == 0 and data["layouts"]
    assert {layout["micro_batch"] for layout in data["layouts"]} == {largest}
    code, out, _ = cli(*argv, "-q")
    assert f"Largest micro-batch that fits with 8 GPUs: {largest:,}" in out


@pytest.mark.parametrize(("model", "gpus", "global_batch"), [("gpt2", 2, 12), ("llama3-8b", 8, 16)])
def test_largest_micro_batch_layouts_by_brute_force(spec_of, model, gpus, global_batch):
    """Against the ranked search at every divisor of the global batch: the largest at which
    it finds a layout with that micro-batch."""
    from ckplan.plan.layout.search import largest_micro_batch_layouts, search_layouts
    from ckplan.plan.layout.space import divisors

    spec, gpu = spec_of(model, seq=8192), load_gpu("rtx-4090")
    budget = gpu.memory_bytes
    found = largest_micro_batch_layouts(spec, gpus, gpu, global_batch, budget)
    fitting = [
        n
        for n in divisors(global_batch)
        if search_layouts(
            spec, gpus, gpu, global_batch, budget, top=1, constraints={"micro_batch": n}
        ).layouts
    ]
    assert found == max(fitting, default=0)


@pytest.mark.parametrize(("model", "gpus"), [("gpt2", 2), ("llama3-8b", 8)])
def test_longest_seq_layouts_is_the_edge_of_the_layout_search(spec_of, model, gpus):
    """The existence check agrees with the ranked search on both sides of the edge (a layout
    whose only fitting plan is the DP's counts, however slow)."""
    from ckplan.plan.layout.search import any_layout_fits, longest_seq_layouts, search_layouts

    spec, gpu = spec_of(model), load_gpu("h100-sxm")
    longest = longest_seq_layouts(spec, gpus, gpu, gpus, gpu.memory_bytes)
    assert longest > 0
    for seq, fits in ((longest, True), (longest + SEQ_GRANULE, False)):
        at = spec.replace(seq=seq)
        found = search_layouts(at, gpus, gpu, gpus, gpu.memory_bytes, top=1)
        assert bool(found.layouts) == fits == any_layout_fits(at, gpus, gpu, gpus, gpu.memory_bytes)


def test_auto_json_matches_the_schema(cli):
    from json_schema import CHECK_MAX_MICRO_BATCH, ESTIMATE_MAX_SEQ, SWEEP_MAX_SEQ, errors

    budget = ["--budget", "8GB"]
    _, out, _ = cli("estimate", "gpt2", *budget, "--seq", "auto", "-s", "full", "--json")
    assert errors(json.loads(out), ESTIMATE_MAX_SEQ) == []
    _, out, _ = cli("sweep", "gpt2", *budget, "--seq", "auto", "--json")
    assert errors(json.loads(out), SWEEP_MAX_SEQ) == []
    _, out, _ = cli("check", "gpt2", "llama3-8b", *budget, "--micro-batch", "auto", "--json")
    assert errors(json.loads(out), CHECK_MAX_MICRO_BATCH) == []
