"""Properties over random valid models (hypothesis).

Memory grows with seq, micro-batch and layers; no strategy peaks above storing everything;
sweep's best plan fits and nothing that fits is cheaper; check agrees with sweep; JSON is
deterministic and matches tests/json_schema.py; counts stay exact integers at 1T parameters and
1M tokens. CKPLAN_PROPERTY_EXAMPLES sets the examples per property (default 20, a few seconds
each); raise it for a thorough run, e.g. CKPLAN_PROPERTY_EXAMPLES=500 make test.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_schema import CHECK, ESTIMATE, NO_FIT, SCHEDULE, SWEEP, VERIFY, errors

from ckplan.cli import main
from ckplan.model.flops import model_flops_per_iteration
from ckplan.model.frameworks import layout_error
from ckplan.model.memory import activation_bytes_per_layer, parameter_count
from ckplan.model.op import ATTENTION_CORE
from ckplan.model.ops import group_input_bytes
from ckplan.model.spec import ModelSpec, spec_from_mapping
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.search import (
    DEFAULT_RESERVE,
    Candidate,
    candidate_strategies,
    check_plan,
    sweep,
)

EXAMPLES = int(os.environ.get("CKPLAN_PROPERTY_EXAMPLES", "20"))
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def transformers(draw) -> dict:
    """A valid transformer description: every architecture choice and parallel layout, small
    enough that a sweep (with the optimal DP) takes milliseconds."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = draw(st.sampled_from(divisors(heads)))
    tp = draw(
        st.sampled_from([t for t in divisors(heads) if kv_heads % t == 0 or t % kv_heads == 0])
    )
    per_stage = draw(st.integers(1, 6))
    pp = draw(st.sampled_from([1, 2, 3]))
    seq = draw(st.sampled_from([8, 16, 32, 64]))
    hidden = heads * draw(st.sampled_from([8, 16]))
    cp = draw(st.sampled_from([c for c in (1, 2) if seq % c == 0]))
    framework = draw(st.sampled_from(["megatron", "torchtitan", "deepspeed"]))
    zeros = [z for z in range(4) if layout_error(framework, z, tp, pp, cp, 1) is None]
    return {
        "name": "random",
        "layers": pp * per_stage,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "ffn_hidden": draw(st.sampled_from([None, 2 * hidden, 3 * hidden + 8])),
        "vocab": draw(st.sampled_from([0, 64, 1000])),
        "seq": seq,
        "micro_batch": draw(st.integers(1, 4)),
        "dtype_bytes": draw(st.sampled_from([1, 2, 4])),
        "norm": draw(st.sampled_from(["layernorm", "rmsnorm"])),
        "mlp": draw(st.sampled_from(["gelu", "swiglu"])),
        "attention": draw(st.sampled_from(["standard", "flash"])),
        "positions": draw(st.sampled_from(["learned", "rope"])),
        "bias": draw(st.booleans()),
        "dropout": draw(st.sampled_from([0.0, 0.1])),
        "tied_embeddings": draw(st.booleans()),
        "fused_swiglu": draw(st.booleans()),
        "tp": tp,
        "sp": tp > 1 and draw(st.booleans()),
        "pp": pp,
        "cp": cp,
        "dp": draw(st.sampled_from([1, 2, 4])),
        "framework": framework,
        "zero": draw(st.sampled_from(zeros)),
        "virtual_stages": draw(st.sampled_from(divisors(per_stage))),
        "microbatches": draw(st.integers(1, 8)),
    }


@st.composite
def seed_mlps(draw) -> dict:
    """The NumPy MLP (`kind: mlp`), as `ckplan verify` runs it."""
    return {
        "name": "mlp",
        "kind": "mlp",
        "layers": draw(st.integers(1, 12)),
        "hidden": draw(st.integers(1, 64)),
        "ffn_hidden": draw(st.integers(1, 128)),
        "micro_batch": draw(st.integers(1, 16)),
        "dtype_bytes": draw(st.sampled_from([4, 8])),
    }


def spec(mapping: dict, **changes) -> ModelSpec:
    return spec_from_mapping({**mapping, **changes})


def every_strategy(model: ModelSpec) -> list:
    """The sweep's candidates plus Revolve with every slot count up to the stage's length."""
    names = {s.name for s in candidate_strategies(model)}
    extra = [f"revolve:{c}" for c in range(1, model.layers_per_stage + 3)]
    extra += [f"selective+revolve:{c}" for c in range(1, model.layers_per_stage + 3)]
    return candidate_strategies(model) + [
        parse_strategy(name, model) for name in extra if name not in names
    ]


def peaks(model: ModelSpec, strategies) -> dict[str, int]:
    """Each plan's per-GPU bytes. Totals, not activations: a plan reports the pipeline stage
    whose states + activations peak, and another stage (more states, fewer activations) can take
    that place while every stage grows."""
    return {s.name: evaluate(model, s).total_bytes for s in strategies}


# ---- memory is monotone --------------------------------------------------------------------


@PROPERTY
@given(transformers())
def test_memory_grows_with_seq(mapping):
    small = spec(mapping)
    large = spec(mapping, seq=2 * mapping["seq"])
    strategies = every_strategy(small)
    before, after = peaks(small, strategies), peaks(large, strategies)
    assert all(after[name] >= before[name] for name in before), mapping


@PROPERTY
@given(st.one_of(transformers(), seed_mlps()))
def test_memory_grows_with_micro_batch(mapping):
    small = spec(mapping)
    large = spec(mapping, micro_batch=mapping["micro_batch"] + 1)
    strategies = every_strategy(small)
    before, after = peaks(small, strategies), peaks(large, strategies)
    assert all(after[name] >= before[name] for name in before), mapping


@PROPERTY
@given(transformers())
def test_memory_grows_with_layers(mapping):
    """One more layer per pipeline stage (per virtual stage, to keep the layout valid), the same
    strategy with K, N and C fixed (sqrt's K = round(sqrt L) included): the peak memory
    never falls. Except `sequential:K`, for a reason (next test). (Total bytes, not
    activations: a plan reports the stage whose states + activations peak, and the added
    layers' states can move that peak to a stage that holds fewer activations.)"""
    small = spec(mapping)
    step = mapping["pp"] * mapping["virtual_stages"]
    large = spec(mapping, layers=mapping["layers"] + step)
    strategies = [s for s in every_strategy(small) if s.kind != "sequential"]

    def totals(model):
        return {s.name: evaluate(model, s).total_bytes for s in strategies}

    before, after = totals(small), totals(large)
    assert all(after[name] >= before[name] for name in before), mapping


@PROPERTY
@given(transformers(), st.integers(1, 6))
def test_sequential_memory_grows_with_whole_segments(mapping, size):
    """`sequential:K` stores its last segment (torch.utils.checkpoint_sequential). One more layer
    can shrink that segment and the peak with it: sequential:2 stores both layers' tapes at L = 2
    but one at L = 3, where the first segment is recomputed. What holds: the peak grows when
    whole segments are added (L -> L + K per stage); in totals, as in the test above."""
    small = spec(mapping)
    size = min(size, small.layers_per_stage)
    step = mapping["pp"] * mapping["virtual_stages"] * size
    large = spec(mapping, layers=mapping["layers"] + step)
    for name in (f"sequential:{size}", f"selective+sequential:{size}"):
        before = evaluate(small, parse_strategy(name, small)).total_bytes
        assert evaluate(large, parse_strategy(name, large)).total_bytes >= before, (
            name,
            mapping,
        )


def test_sequential_is_not_monotone_in_layers_one_at_a_time(spec_of):
    """The counterexample behind the property above, pinned."""
    two, three = spec_of("gpt2", layers=2), spec_of("gpt2", layers=3)
    strategy = "sequential:2"
    assert (
        evaluate(three, parse_strategy(strategy, three)).activation_bytes
        < evaluate(two, parse_strategy(strategy, two)).activation_bytes
    )


# ---- storing everything is the most memory any strategy needs ------------------------------


@PROPERTY
@given(st.one_of(transformers(), seed_mlps()))
def test_no_strategy_without_selective_peaks_above_none(mapping):
    """Recomputation never holds more than storing everything: segments, block, Revolve (per
    GPU, the peak stage's states + activations). Module recomputation is the property below:
    a rebuilt module output (Megatron-Core's `layernorm`) sits beside the tapes, e.g. one
    layer, h = 8, s = 32, 1-byte values: 256 bytes, the norm's output, above `none`."""
    model = spec(mapping)
    none = evaluate(model, parse_strategy("none", model)).total_bytes
    for strategy in every_strategy(model):
        if not (strategy.selective or strategy.mlp or strategy.modules):
            assert evaluate(model, strategy).total_bytes <= none, (strategy.name, mapping)


@PROPERTY
@given(transformers())
def test_selective_peaks_at_most_the_kept_core_input_above_none(mapping):
    """Module recomputation (`selective`, `mlp`) keeps each module's input beside the tapes it
    rebuilds. Selective recomputation keeps Q, K, V (the core's input) and, in the layer's backward,
    rebuilds the core's saved tensors, counted in full beside the kept input: an upper bound
    (memory.layer_backward_walk; docs/validation.md), since kernels that save their inputs as
    they are share those storages. So `selective` can peak above `none`, by at most the kept
    input, where the attention core's backward is a layer's peak (small h, flash attention's
    fp32 statistics): e.g. h = 8, one head, s = 8, 1-byte values, flash: 1,280 vs 1,088 bytes,
    192 = the QKV output. Conservative for a capacity check: it never says "fits" wrongly.
    Megatron-Core's other modules (`layernorm`, ...) rebuild their outputs beside these tapes and
    have no such bound: with them the peak may rise by what they rebuild (a norm's output)."""
    model = spec(mapping)
    none = evaluate(model, parse_strategy("none", model)).total_bytes
    for strategy in every_strategy(model):
        if (strategy.selective or strategy.mlp) and not strategy.modules:
            # each module keeps its input beside the tapes it rebuilds (the MLP: fc1's input)
            kept = sum(group_input_bytes(model.chain, group) for group in strategy.groups)
            assert evaluate(model, strategy).total_bytes <= none + kept, (
                strategy.name,
                mapping,
            )


def test_selective_can_peak_above_none_by_the_kept_core_input():
    """The counterexample to `selective <= none`, pinned (see the property above)."""
    model = spec_from_mapping(
        {"name": "tiny", "layers": 1, "hidden": 8, "heads": 1, "seq": 8, "micro_batch": 1}
        | {"ffn_hidden": 16, "dtype_bytes": 1, "attention": "flash", "bias": False}
    )
    none = evaluate(model, parse_strategy("none", model)).activation_bytes
    selective = evaluate(model, parse_strategy("selective", model)).activation_bytes
    assert (none, selective) == (1088, 1280)
    assert selective - none == group_input_bytes(model, ATTENTION_CORE) == 192


# ---- sweep, check ------------------------------------------------------------------------------


@PROPERTY
@given(transformers(), st.floats(0.05, 1.5))
def test_sweep_best_fits_and_nothing_that_fits_is_cheaper(mapping, fraction):
    """Budget: a fraction of storing everything. The best plan fits and is one an export of the
    model's framework writes, and no plan of the sweep such an export writes, nor any segment
    plan outside it, fits for fewer FLOPs; a plan none writes that does (a nested revolve:C,
    under Megatron-LM an optimal schedule) is the sweep's reference, which fits where the best
    does not or needs fewer FLOPs."""
    model = spec(mapping)
    none = evaluate(model, parse_strategy("none", model)).total_bytes
    budget = DEFAULT_RESERVE + int(none * fraction)
    result = sweep(model, budget)
    fitting = [c for c in result.candidates if c.fits and c.exported]
    assert (result.best is None) == (not fitting)
    reference = result.reference
    assert reference is None or not reference.exported
    if result.best is None:
        if any(c.fits for c in result.candidates):
            assert reference is not None and reference.fits
        return
    assert result.best.fits and result.best.exported
    assert result.best.plan.budgeted_bytes <= result.usable_bytes
    cheapest = result.best.plan.flops.total
    assert all(c.plan.flops.total >= cheapest for c in fitting)
    if reference is not None:
        assert reference.fits and reference.plan.flops.total <= cheapest
    for strategy in every_strategy(model):
        candidate = Candidate(evaluate(model, strategy), result.usable_bytes)
        if candidate.fits and candidate.exported:  # an export of the model's framework writes it
            assert candidate.plan.flops.total >= cheapest, (strategy.name, cheapest)


@PROPERTY
@given(transformers(), st.floats(0.05, 1.5))
def test_check_agrees_with_sweep(mapping, fraction):
    model = spec(mapping)
    none = evaluate(model, parse_strategy("none", model)).total_bytes
    budget = DEFAULT_RESERVE + int(none * fraction)
    result = sweep(model, budget)
    checked = check_plan(model, budget)
    # check names the sweep's best (else its least plan an export writes) and its reference
    expected = result.best or result.smallest_written
    assert checked.candidate.exported and checked.candidate.fits == (result.best is not None)
    for got, want in ((checked.candidate, expected), (checked.reference, result.reference)):
        assert (got is None) == (want is None)
        if got is not None:
            assert (got.plan.strategy, got.plan.total_bytes, got.plan.flops) == (
                want.plan.strategy,
                want.plan.total_bytes,
                want.plan.flops,
            )


# ---- JSON ----------------------------------------------------------------------------------------


def run_json(argv: list[str]) -> tuple[int, dict, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    text = out.getvalue()
    return code, json.loads(text), text


@settings(PROPERTY, max_examples=max(1, EXAMPLES // 2))
@given(transformers(), st.floats(0.05, 1.5))
def test_json_is_deterministic_schema_valid_and_check_agrees_with_sweep(mapping, fraction):
    """Through the real CLI, on a model file: every command's JSON twice (byte-identical), each
    valid against the JSON schema, and `check`'s verdict and plan equal `sweep`'s best."""
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder, "model.yaml"))
        Path(path).write_text(yaml.safe_dump({k: v for k, v in mapping.items() if v is not None}))
        model = spec(mapping)
        none = evaluate(model, parse_strategy("none", model)).total_bytes
        budget = str(DEFAULT_RESERVE + int(none * fraction))
        commands = {
            "estimate": (["estimate", path, "--strategy", "selective+full", "--json"], ESTIMATE),
            "sweep": (["sweep", path, "--budget", budget, "--json"], SWEEP),
            "check": (["check", path, "--budget", budget, "--json"], CHECK),
            "schedule": (["schedule", path, "--strategy", "sqrt", "--json"], SCHEDULE),
        }
        answers = {}
        for name, (argv, schema) in commands.items():
            code, data, text = run_json(argv)
            assert run_json(argv)[2] == text, f"{name}: JSON differs between runs"
            assert errors(data, schema) == [], (name, errors(data, schema)[:5])
            answers[name] = (code, data)
    (sweep_code, swept), (check_code, checked) = answers["sweep"], answers["check"]
    best = swept["best"]
    # sweep and check name a plan an export writes, and the same reference beside it
    assert best is None or not any("no export writes" in n for n in best["notes"])
    assert sweep_code == check_code == (0 if best else 1)
    result = checked["results"][0]
    assert result["fits"] == (best is not None)
    assert result["reference"] == swept["reference"]
    if best:
        assert result["plan"] == best
    for plan in swept["plans"]:
        memory, flops = plan["memory"], plan["flops"]
        assert memory["total_bytes"] == memory["activation_bytes"] + memory["model_state_bytes"]
        assert flops["total"] == flops["forward"] + flops["backward"] + flops["recompute"]
        assert sum(memory["breakdown"].values()) == memory["per_layer_activation_bytes"]
        assert memory["reserved_bytes"] >= memory["budgeted_bytes"] >= memory["total_bytes"]
        assert plan["fits"] == (memory["budgeted_bytes"] <= swept["usable_bytes"])


def test_verify_json_matches_the_schema():
    argv = ["verify", "--layers", "4", "--hidden", "8", "--ffn-hidden", "16", "--batch", "4"]
    code, data, _ = run_json([*argv, "--repeats", "1", "--json"])
    # Arrays this small miss the peak tolerance by Python's object headers (exit 1, said so).
    assert code in (0, 1) and errors(data, VERIFY) == []
    assert data["runs"][0]["strategy"] == "none"


def test_does_not_fit_json_matches_the_schema_and_is_deterministic():
    argv = ["schedule", "gpt2", "--budget", "4.5GB", "--batch", "32", "--json"]
    code, data, text = run_json(argv)
    assert code == 1 and errors(data, NO_FIT) == [] and run_json(argv)[2] == text
    argv = ["estimate", "gpt2", "-s", "optimal", "--budget", "4.5GB", "--batch", "32", "--json"]
    code, data, text = run_json(argv)
    assert code == 1 and errors(data, NO_FIT) == [] and run_json(argv)[2] == text
    assert errors(data, {"ckplan_version": str, "model": ESTIMATE["model"]}) == []


# ---- exact integers at 1T parameters and 1M tokens -----------------------------------------------


@st.composite
def trillion_parameter_gpts(draw) -> dict:
    """GPT-style (Korthikanti's setting: B = 2, F = 4h, dropout, standard attention) with about a
    trillion parameters or more and up to 2^20 tokens per sequence."""
    head_dim = 128
    heads = draw(st.integers(200, 256))
    t = draw(st.sampled_from([1, 8]))
    heads -= heads % t
    return {
        "name": "gpt-1t",
        "layers": draw(st.integers(128, 256)),
        "hidden": heads * head_dim,
        "heads": heads,
        "vocab": draw(st.integers(32_000, 262_144)),
        "seq": draw(st.sampled_from([2**20, 2**20 - 1000, 999_983, 2**19 + 1])),
        "micro_batch": draw(st.integers(1, 8)),
        "dropout": 0.1,
        "tp": t,
        "sp": t > 1,
    }


@PROPERTY
@given(trillion_parameter_gpts(), st.integers(1, 4096))
def test_counts_are_exact_integers_at_a_trillion_parameters(mapping, global_batch):
    """Korthikanti Table 2 (34sbh + 5as²b per layer, /t with SP) and App. A
    (72Bslh²(1 + s/6h + V/12hl) = 72Bslh² + 12Bs²lh + 6BshV) hold to the last byte and FLOP,
    far beyond float precision (2^53), and the CLI's JSON carries the same integers."""
    model = spec(mapping)
    s, b, h, a, t = model.seq, model.micro_batch, model.hidden, model.heads, model.tp
    L, V, B = model.layers, model.vocab, global_batch
    assert parameter_count(model).total >= 10**12
    assert activation_bytes_per_layer(model) == (34 * s * b * h + 5 * a * s * s * b) // t
    exact = 72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V
    assert model_flops_per_iteration(model, B) == exact
    assert exact > 2**53  # beyond what a float holds exactly
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "gpt-1t.yaml")
        path.write_text(yaml.safe_dump(mapping))
        code, data, _ = run_json(["estimate", str(path), "--json"])
    assert code == 0 and data["parameters"]["total"] == parameter_count(model).total
    assert data["memory"]["per_layer_activation_bytes"] == activation_bytes_per_layer(model)
    flops = data["flops"]
    assert flops["total"] == flops["forward"] + flops["backward"] + flops["recompute"]
