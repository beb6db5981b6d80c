"""Megatron-Core's custom pipeline layout (`pipeline_layout`, --pipeline-model-parallel-layout):
parsed as megatron/core/transformer/pipeline_parallel_layer_layout.py parses it, its chunks on
the stages in Megatron's order, and memory and step time from each chunk's layers."""

import json
from fractions import Fraction

import pytest
from megatron_args import LAYER_CHARS, MegatronArgError, parse_layout_str
from test_pipeline_in_flight import live_peak, rank_order

from ckplan.model.layers import stage_chunk_layers, stage_layer_indices
from ckplan.model.pipeline_layout import LayoutError, parse_layout, parse_layout_list
from ckplan.model.spec import SpecError
from ckplan.plan import evaluate, in_flight_microbatches, parse_strategy
from ckplan.plan.evaluate import megatron_in_flight_forwards, megatron_in_flight_weight

PARSED = [
    "Ettt|(tt|)*29,m|L",
    "Et|(tt|)*30mL",
    "E(t|)*3L",
    "Et*3|t*2,L",
    "(Et|)*2L",
    "E|t|(|)*2tL",
    "((t|)*2)*2",  # nested parentheses: the inner group unrolls, the outer ')' is left
    "Et|*2tL",  # '|*2' unrolls to '||'
]


@pytest.mark.parametrize("text", PARSED)
def test_parse_is_megatrons(text):
    by_name = {name: char for char, name in LAYER_CHARS.items()}
    try:
        expected = ["".join(by_name[layer] for layer in chunk) for chunk in parse_layout_str(text)]
    except MegatronArgError:
        with pytest.raises(LayoutError, match="invalid layer character"):
            parse_layout_list(text)
        return
    assert list(parse_layout_list(text)) == expected


def test_chunks_go_to_rank_i_mod_p():
    """Megatron's 1D-to-2D conversion: chunk i on rank i mod p as its virtual chunk i div p."""
    layout = parse_layout("Et|tt|ttt|ttttL", 2)
    assert layout.chunks == (("Et", "ttt"), ("tt", "ttttL"))
    assert layout.chunk_counts(0) == (1, 3) and layout.chunk_counts(1) == (2, 4)
    assert layout.stage_items(0) == (0, 3, 4, 5)  # layer ids in flat order: 1, 2, 3, 4
    assert layout.stage_items(1) == (1, 2, 6, 7, 8, 9)


def test_repetition_bomb_is_refused_before_it_is_built():
    with pytest.raises(LayoutError, match="expands to more than"):
        parse_layout_list("E(t|)*999999999999L")
    with pytest.raises(LayoutError, match="expands to more than"):
        parse_layout_list("Et*99999999L")


# ---- the hand-computed layout -----------------------------------------------------------
# GPT-2's 12 layers on p 2, v 2: chunks Ettt | tt | tt | tttttL, so rank 0 holds chunks 0 and 2
# (layers 0-2 and 5-6), rank 1 chunks 1 and 3 (layers 3-4 and 7-11).
HAND = "Ettt|tt|tt|tttttL"


def test_hand_layout_places_the_layers(spec_of):
    spec = spec_of("gpt2", pp=2, pipeline_layout=HAND, microbatches=4)
    assert spec.virtual_stages == 2
    assert spec.stage_layer_counts == (5, 7) and spec.layers_per_stage == 7
    assert stage_layer_indices(spec, 0) == (0, 1, 2, 5, 6)
    assert stage_layer_indices(spec, 1) == (3, 4, 7, 8, 9, 10, 11)
    assert stage_chunk_layers(spec, 0) == (3, 2) and stage_chunk_layers(spec, 1) == (2, 5)


def test_hand_layout_in_flight(spec_of):
    """By hand (p 2, v 2, m 4, group 2; table chunks 0 0 1 1 0 0 1 1, the k-th backward on
    chunk 1 - table[k]). Rank 0, chunks of 3 and 2 layers: 4 warm-up forwards hold
    3 + 3 + 2 + 2 = 10; the steady steps add 3, 3, 2, 2 and free 2, 2, 3, 3: 13, 14, 14, 13,
    so 14 of its 5 layers = 2.8 micro-batches (the equal-chunk count says 5/2). Rank 1, chunks
    of 2 and 5: warm-up 2 + 2 = 4, then 9, 9, 6, 6, 9, 9: 9/7 (the equal-chunk count: 3/2)."""
    assert megatron_in_flight_weight((3, 2), 2, 4, 0, 2) == 14
    assert megatron_in_flight_weight((2, 5), 2, 4, 1, 2) == 9
    spec = spec_of("gpt2", pp=2, pipeline_layout=HAND, microbatches=4)
    assert in_flight_microbatches(spec, 0) == Fraction(14, 5)
    assert in_flight_microbatches(spec, 1) == Fraction(9, 7)


def weighted_walk(weights, p, m, rank, group):
    """Brute force from test_pipeline_in_flight.rank_order: each forward adds its chunk's
    weight, each backward frees it; the most held."""
    v = len(weights)
    live = peak = 0
    for kind, _, stage in rank_order(p, v, m, rank, group):
        chunk = stage // p
        live += weights[chunk] if kind == "F" else -weights[chunk]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (2, 3, 6), (3, 2, 9), (4, 2, 8), (4, 3, 12)])
def test_in_flight_weight_walks_megatrons_order(p, v, m):
    for weights in [
        (1,) * v,
        tuple(range(1, v + 1)),
        tuple(range(v, 0, -1)),
        (0,) + (3,) * (v - 1),
    ]:
        for rank in range(p):
            for group in (p, m):
                expected = weighted_walk(weights, p, m, rank, group)
                assert megatron_in_flight_weight(weights, p, m, rank, group) == expected
                if len(set(weights)) == 1:  # equal chunks: the plain count
                    assert expected == weights[0] * live_peak(p, v, m, rank, group)
                    assert expected == weights[0] * megatron_in_flight_forwards(
                        p, v, m, rank, group
                    )


def test_uneven_layout_memory_and_notes(spec_of):
    """The plan's peak on each stage is the store-all replay plus (in flight - 1) of what a
    micro-batch holds, in flight weighted by the chunks."""
    spec = spec_of("gpt2", pp=2, pipeline_layout=HAND, microbatches=4)
    plan = evaluate(spec, parse_strategy("none", spec))
    even = spec_of("gpt2", pp=2, virtual_stages=2, microbatches=4)
    assert plan.activation_bytes != evaluate(even, parse_strategy("none", even)).activation_bytes
    held = in_flight_microbatches(spec, plan.peak_stage)
    assert f"{float(held):g} micro-batch" in plan.notes[0]


# ---- an even layout is the plain virtual_stages ---------------------------------------------

EVEN = {"pp": 4, "microbatches": 8}
EVEN_LAYOUT = "Etttt|(tttt|)*6ttttL"  # llama3-8b's 32 layers, 8 chunks of 4 on p 4: v 2


@pytest.mark.parametrize("strategy", ["none", "full", "selective", "uniform:2"])
def test_even_layout_equals_plain_virtual_stages(spec_of, strategy):
    plain = spec_of("llama3-8b", virtual_stages=2, **EVEN)
    layout = spec_of("llama3-8b", pipeline_layout=EVEN_LAYOUT, **EVEN)
    assert layout.virtual_stages == 2
    for stage in range(4):
        assert stage_layer_indices(layout, stage) == stage_layer_indices(plain, stage)
        assert in_flight_microbatches(layout, stage) == in_flight_microbatches(plain, stage)
    a = evaluate(plain, parse_strategy(strategy, plain))
    b = evaluate(layout, parse_strategy(strategy, layout))
    assert (a.activation_bytes, a.model_states, a.flops, a.peak_stage, a.notes) == (
        b.activation_bytes, b.model_states, b.flops, b.peak_stage, b.notes,
    )  # fmt: skip


def test_even_layout_estimate_equals_plain(cli):
    """The whole answer, step time and bubble included, but the key itself."""
    answers = []
    for keys in (["virtual_stages=2"], [f"pipeline_layout={EVEN_LAYOUT}"]):
        sets = [
            word for key in ["pp=4", "tp=2", "microbatches=8", *keys] for word in ("--set", key)
        ]
        code, out, err = cli("estimate", "llama3-8b", *sets, "--gpu", "h100-sxm", "--json")
        assert code == 0, err
        answer = json.loads(out)
        answer["model"].pop("pipeline_layout")
        answers.append(answer)
    assert answers[0]["time"]["bubble_seconds"] > 0
    assert answers[0] == answers[1]


def test_uneven_layout_bubble_waits_for_the_largest_chunk(spec_of):
    from ckplan.hardware.step_time import bubble_steps

    spec = spec_of("gpt2", pp=2, pipeline_layout=HAND, microbatches=4)
    assert bubble_steps(spec, 0) == 1 * 3 / 5 and bubble_steps(spec, 1) == 5 / 7
    plain = spec_of("gpt2", pp=2, virtual_stages=2, microbatches=4)
    assert bubble_steps(plain, 1) == 1 / 2


# ---- Megatron's rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"pipeline_layout": "Ettt|tt|tt|tttttL", "pp": 3}, "4 chunks, which pp \\(3\\) must"),
        ({"pipeline_layout": "Ettt|tt|tt|tttttx"}, "invalid layer character 'x'"),
        ({"pipeline_layout": "tEtt|tt|tt|tttttL"}, "must start with the embedding"),
        ({"pipeline_layout": "Ettt|tt|tt|tttLtt"}, "must end with the loss"),
        ({"pipeline_layout": "EEtt|tt|tt|tttttL"}, "embedding \\(E\\) exactly once"),
        ({"pipeline_layout": "Ettt|tL|tt|tttttL"}, "loss \\(L\\) exactly once"),
        ({"pipeline_layout": "Ettt|tt|tt|ttttL"}, "places 11 decoder layers"),
        ({"pipeline_layout": "Ettt|tt|tt|tttttmL"}, "places 1 MTP layers \\(m\\) but mtp_layers"),
        ({"pipeline_layout": "Etttttt||tttttt|L"}, "leaves pipeline rank 1 without"),
        ({"pipeline_layout": HAND, "virtual_stages": 3}, "conflicts with pipeline_layout"),
        ({"pipeline_layout": HAND, "first_stage_layers": 5}, "drop first_stage_layers"),
        (
            {"pipeline_layout": HAND, "account_for_loss_in_pipeline_split": True},
            "drop account_for_loss_in_pipeline_split",
        ),
        ({"pipeline_layout": "E(t|)*999999999L"}, "expands to more than"),
    ],
)
def test_layout_errors(spec_of, changes, message):
    changes = {"pp": 2, **changes}
    with pytest.raises(SpecError, match=f"key '(pipeline_layout|virtual_stages)'.*{message}"):
        spec_of("gpt2", **changes)


# ---- export --to megatron -------------------------------------------------------------------

UNEVEN_LAYOUT = "Ettt|(tttt|)*6tttttL"  # llama3-8b on p 4, v 2: 3 + 6·4 + 5 = 32 layers


def test_export_writes_the_layout_and_megatron_reads_it(spec_of):
    from megatron_args import parse, validate

    from ckplan import exports
    from ckplan.exports import megatron

    spec = spec_of("llama3-8b", pipeline_layout=UNEVEN_LAYOUT, **EVEN)
    for name in ("none", "full", "selective"):
        plan = evaluate(spec, parse_strategy(name, spec))
        text = exports.export(plan, "megatron").text
        args = validate(parse(text, spec.pp))
        assert args.pipeline_model_parallel_layout == UNEVEN_LAYOUT
        assert args.virtual_pipeline_model_parallel_size == spec.virtual_stages == 2
        for flag in (
            "--num-virtual-stages-per-pipeline-rank",
            "--num-layers-per-virtual-pipeline-stage",
            "--decoder-first-pipeline-num-layers",
            "--account-for-embedding-in-pipeline-split",
        ):
            assert flag not in text
        back = megatron.strategy_from_flags(megatron.parse_flags(text))
        again = evaluate(spec, parse_strategy(back, spec))
        assert (again.activation_bytes, again.flops) == (plan.activation_bytes, plan.flops)


def test_export_refuses_uniform_segments_a_chunk_does_not_hold(spec_of):
    from ckplan import exports

    spec = spec_of("llama3-8b", pipeline_layout=UNEVEN_LAYOUT, **EVEN)
    why = exports.why_not(evaluate(spec, parse_strategy("uniform:2", spec)), "megatron")
    assert "each model chunk of the pipeline layout (3, 4, 5 layers)" in why
    assert exports.why_not(evaluate(spec, parse_strategy("uniform:1", spec)), "megatron") is None
    assert "pipeline_layout" in exports.why_not(
        evaluate(spec, parse_strategy("full", spec)), "torchtitan"
    )


LAYOUT_CASES = [
    UNEVEN_LAYOUT,
    EVEN_LAYOUT,
    "Ettt|(tttt|)*6ttttL",  # 31 layers
    "Ettt|(tttt|)*6tttttLL",
    "tEtt|(tttt|)*6tttttL",
    "Ettt|(tttt|)*5tttttL",  # 7 chunks
    "Ettt|(tttt|)*6tttttmL",  # an MTP layer the model lacks
    "Ettt|(tttt|)*6ttt t tL",
    "E(ttt|)*2(tttt|)*5ttttttL",
]


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_ckplan_accepts_what_megatron_accepts(spec_of, layout):
    """Megatron's own rules (tests/megatron_args.py, copied from core_v0.19.0) and ckplan's agree
    on each layout."""
    from megatron_args import MegatronArgError, parse, validate

    flags = (
        "--num-layers 32 --seq-length 8 --max-position-embeddings 8 --micro-batch-size 1 "
        "--global-batch-size 8 "
        f"--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout '{layout}'"
    )
    try:
        validate(parse(flags, 4))
        megatron_accepts = True
    except MegatronArgError:
        megatron_accepts = False
    try:
        spec_of("llama3-8b", pipeline_layout=layout, **EVEN)
        ckplan_accepts = True
    except SpecError:
        ckplan_accepts = False
    assert ckplan_accepts == megatron_accepts


def test_megatron_refuses_a_layout_beside_virtual_stage_flags():
    from megatron_args import MegatronArgError, parse, validate

    base = (
        "--num-layers 32 --seq-length 8 --max-position-embeddings 8 --micro-batch-size 1 "
        "--global-batch-size 8 "
        f"--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout '{EVEN_LAYOUT}'"
    )
    assert validate(parse(base, 4)).virtual_pipeline_model_parallel_size == 2
    for extra in (
        "--num-virtual-stages-per-pipeline-rank 2",
        "--decoder-first-pipeline-num-layers 4",
        "--account-for-loss-in-pipeline-split",
    ):
        with pytest.raises(MegatronArgError):
            validate(parse(f"{base} {extra}", 4))


def test_plan_drops_a_model_files_layout_and_its_check_command_runs(cli, tmp_path, monkeypatch):
    """plan lays out its own splits: the model file's pipeline_layout is dropped, and the
    command that checks the best layout drops it too (pipeline_layout=null)."""
    import shlex

    monkeypatch.chdir(tmp_path)
    (tmp_path / "g.yaml").write_text(
        "name: g\nlayers: 12\nhidden: 768\nheads: 12\nvocab: 50257\nseq: 1024\n"
        f"micro_batch: 1\npp: 2\npipeline_layout: '{HAND}'\n"
    )
    code, out, err = cli(
        "plan", "g.yaml", "--gpus", "4", "--gpu", "h100-sxm", "--global-batch", "16"
    )
    assert code == 0, err
    check = next(line for line in out.splitlines() if line.startswith("Check it: "))
    argv = shlex.split(check.removeprefix("Check it: "))
    assert argv[:2] == ["ckplan", "estimate"] and "pipeline_layout=null" in argv
    code, _, err = cli(*argv[1:])
    assert code == 0, err
