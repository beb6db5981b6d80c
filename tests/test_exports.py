"""`ckplan export`: each launcher's own rules, flags read back into the same plan, refusals that
name the part and offer the nearest expressible plan."""

import ast
import itertools
import json

import pytest
import tomllib
import yaml
from megatron_args import MegatronArgError, parse, validate

from ckplan import exports
from ckplan.exports import deepspeed, megatron, torchtitan
from ckplan.exports.segments import LayerSegments, layer_segments
from ckplan.model.layers import parse_layer_set
from ckplan.model.spec import spec_from_mapping
from ckplan.plan import evaluate, parse_strategy
from ckplan.plan.search import activation_budget, candidate_strategies
from ckplan.schedules import revolve_schedule, schedule_segments, segment_schedule
from ckplan.schedules.chain import Chain


def plan_of(spec, name, **kwargs):
    return evaluate(spec, parse_strategy(name, spec), **kwargs)


def world_size(spec):
    return spec.tp * spec.pp * spec.cp * spec.dp


def megatron_args(plan):
    text = exports.export(plan, "megatron").text
    return text, validate(parse(text, world_size(plan.spec)))


# ---- the must-shows ---------------------------------------------------------------------


def test_uniform_2_flags_megatron_accepts(cli):
    code, out, err = cli("export", "llama3-8b", "--plan", "uniform:2", "--to", "megatron")
    assert code == 0, err
    args = validate(parse(out, 1))
    assert (args.recompute_granularity, args.recompute_method) == ("full", "uniform")
    assert args.recompute_num_layers == 2 and args.num_layers == 32


def test_selective_flags_have_no_method(cli):
    code, out, _ = cli("export", "llama3-8b", "--plan", "selective", "--to", "megatron")
    assert code == 0
    assert "--recompute-granularity selective" in out.splitlines()
    assert "--recompute-method" not in out and "--recompute-num-layers" not in out
    args = validate(parse(out, 1))
    assert args.recompute_modules == ["core_attn"]
    code, out, _ = cli(
        "export",
        "llama3-8b",
        "--plan",
        "selective",
        "--to",
        "megatron",
        "--no-recompute-modules",
    )
    assert code == 0 and "--recompute-modules" not in out
    assert validate(parse(out, 1)).recompute_granularity == "selective"


# ---- the validator mirrors Megatron: it refuses what Megatron refuses --------------------


@pytest.mark.parametrize(
    "flags",
    [
        "--recompute-granularity selective --recompute-method uniform",
        "--recompute-granularity full --recompute-num-layers 2",
        "--recompute-granularity full --recompute-method block",
        "--recompute-granularity selective --recompute-num-layers 2",
        "--recompute-granularity partial",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 33",
        "--sequence-parallel",
        "--context-parallel-size 4 --seq-length 4100",
        "--num-layers-per-virtual-pipeline-stage 4",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
        "--recompute-modules core_attn",
        "--recompute-everything",
    ],
)
def test_validator_refuses_what_megatron_refuses(flags):
    text = "--num-layers 32 --seq-length 8192 --micro-batch-size 1 " + flags
    with pytest.raises(MegatronArgError):
        validate(parse(text, 4))


# ---- every exportable plan: flags valid, and read back into the same plan ----------------

LAYOUTS = [
    {},
    {"tp": 8, "sp": True, "pp": 4, "microbatches": 8, "dp": 2, "zero": 1},
    {"tp": 2, "cp": 2, "pp": 2, "microbatches": 4},
    {"pp": 4, "virtual_stages": 2, "microbatches": 8},
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_round_trip(spec_of, layout):
    spec = spec_of("llama3-8b", **layout)
    names = {s.name for s in candidate_strategies(spec)} | {"sqrt", "full"}
    exported = refused = 0
    for name in sorted(names):
        plan = plan_of(spec, name)
        if exports.why_not(plan, "megatron") is not None:
            refused += 1  # (the refusal itself: test_refusal_names_the_part_and_the_nearest_plan)
            continue
        text, args = megatron_args(plan)
        assert args.tensor_model_parallel_size == spec.tp
        assert args.pipeline_model_parallel_size == spec.pp
        assert args.context_parallel_size == spec.cp
        assert args.sequence_parallel == spec.sp
        assert args.data_parallel_size == spec.dp
        assert args.use_distributed_optimizer == (spec.zero == 1)
        assert args.micro_batch_size == spec.micro_batch
        assert args.global_batch_size // (spec.micro_batch * spec.dp) == spec.microbatches
        assert (args.virtual_pipeline_model_parallel_size or 1) == spec.virtual_stages
        back = plan_of(spec, megatron.strategy_from_flags(megatron.parse_flags(text)))
        assert (back.activation_bytes, back.flops) == (plan.activation_bytes, plan.flops), name
        exported += 1
    assert exported > 10 and refused > 10


def test_uniform_with_virtual_stages_needs_k_to_divide_the_chunk(spec_of):
    spec = spec_of("llama3-8b", pp=4, virtual_stages=2, microbatches=8)  # chunks of 4 layers
    assert exports.why_not(plan_of(spec, "uniform:2"), "megatron") is None
    assert "must divide 4" in exports.why_not(plan_of(spec, "uniform:3"), "megatron")
    assert "model chunk" in exports.why_not(plan_of(spec, "block:2"), "megatron")


def test_megatron_refuses_layouts_it_has_no_flag_for(spec_of):
    sharded = spec_of("gpt2", zero=3, dp=8, pp=2, framework="torchtitan")
    assert "Megatron-FSDP" in exports.why_not(plan_of(sharded, "none"), "megatron")
    assert "geglu" in exports.why_not(plan_of(spec_of("gemma2-9b"), "none"), "megatron")
    odd = spec_of("gpt2", seq=1026, cp=2)  # a multiple of cp, not of 2·cp
    assert "2·cp" in exports.why_not(plan_of(odd, "none"), "megatron")


@pytest.mark.parametrize("training", ["lora", "qlora"])
def test_megatron_refuses_adapters_which_its_arguments_do_not_have(spec_of, training):
    """Megatron-LM's arguments (core_v0.19.0) have no adapter: a LoRA plan is refused for it,
    with the targets that write it, rather than written as full training."""
    plan = plan_of(spec_of("llama3-8b", training=training), "full")
    why = exports.why_not(plan, "megatron")
    assert f"training {training}" in why and "no adapters" in why
    assert exports.why_not(plan, "peft") is None
    with pytest.raises(exports.ExportError):
        exports.export(plan, "megatron")


# ---- refusals: which part, and the nearest expressible plan ------------------------------


@pytest.mark.parametrize(
    ("target", "name", "part"),
    [
        ("megatron", "sequential:4", "last segment stored"),
        ("megatron", "selective+uniform:4", "takes no --recompute-method"),
        ("megatron", "revolve:3", "more than once"),
        ("torch", "revolve:3", "more than once"),
        ("torchtitan", "selective", "attention core"),
        ("torchtitan", "uniform:4", "wraps every block alike"),
    ],
)
def test_refusal_names_the_part_and_the_nearest_plan(spec_of, target, name, part):
    spec = spec_of("llama3-8b")
    plan = plan_of(spec, name)
    with pytest.raises(exports.ExportError) as error:
        exports.export(plan, target)
    message = str(error.value)
    assert part in message and "\n" not in message
    near = exports.nearest(plan, target)
    assert f"--plan {near.strategy}" in message
    assert exports.why_not(near, target) is None
    expressible = [
        p
        for p in (evaluate(spec, s) for s in candidate_strategies(spec))
        if exports.why_not(p, target) is None
    ]
    within = [p for p in expressible if p.activation_bytes <= plan.activation_bytes]
    if within:  # the cheapest that needs no more memory
        assert near.activation_bytes <= plan.activation_bytes
        assert near.flops.total == min(p.flops.total for p in within)
    else:  # else the least memory
        assert near.activation_bytes == min(p.activation_bytes for p in expressible)


def test_optimal_megatron_refused_torch_exported(spec_of, cli):
    argv = ["export", "gpt2", "--plan", "optimal", "--budget", "7GB", "--batch", "8"]
    code, out, err = cli(*argv, "--to", "megatron")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no Megatron-LM flag" in err and "--plan " in err
    code, out, _ = cli(*argv, "--to", "torch")
    assert code == 0 and "SEGMENTS = [" in out


def test_cli_errors(cli):
    code, out, err = cli("export", "gpt2", "--plan", "none", "--to", "jax")
    assert code == 2 and out == "" and "--to 'jax'" in err
    code, out, err = cli("export", "gpt2", "--plan", "optimal", "--to", "torch")
    assert code == 2 and "needs --budget" in err
    code, out, err = cli("export", "gpt2", "--plan", "auto", "--to", "torch")
    assert code == 2 and "needs --budget" in err


def test_auto_picks_the_cheapest_the_target_can_express(cli, spec_of):
    code, out, _ = cli(
        "export",
        "gpt2",
        "--plan",
        "auto",
        "--budget",
        "7GB",
        "--batch",
        "8",
        "--to",
        "megatron",
        "-q",
    )
    assert code == 0
    args = validate(parse(out, 1))
    spec = spec_of("gpt2", micro_batch=8)
    back = plan_of(spec, megatron.strategy_from_flags(megatron.parse_flags(out)))
    usable = 7 * 10**9 - 2 * 2**30
    assert back.total_bytes <= usable
    cheaper = [
        p
        for p in (evaluate(spec, s) for s in candidate_strategies(spec))
        if p.total_bytes <= usable and exports.why_not(p, "megatron") is None
    ]
    assert back.flops.total == min(p.flops.total for p in cheaper)
    assert args.recompute_granularity in (None, "full", "selective")
    code, _, err = cli(
        "export", "llama3-70b", "--plan", "auto", "--budget", "80GB", "--to", "torch"
    )
    assert code == 1 and "no plan" in err


@pytest.mark.parametrize(
    ("name", "overrides", "budget"),
    [
        ("gpt2", {"micro_batch": 8}, 7 * 10**9),
        ("gpt2", {"micro_batch": 8}, 14 * 10**9),
        ("llama3-8b", {"dp": 8, "zero": 3}, 40 * 10**9),
        ("llama3-8b", {"dp": 8, "zero": 3}, 80 * 10**9),
    ],
)
def test_auto_is_the_sweeps_best_wherever_the_target_writes_it(spec_of, name, overrides, budget):
    """--plan auto picks by the sweep's rule (`search.choose`): the sweep's best plan wherever
    the target writes it, so that sweep, check and export name one plan."""
    from ckplan.plan.search import sweep

    spec = spec_of(name, **overrides)
    result = sweep(spec, budget)
    assert result.best is not None
    written = 0
    for target in ("torch", "megatron", "deepspeed"):
        if exports.why_not(result.best.plan, target) is None:
            written += 1
            assert exports.best_expressible(spec, result.candidates, target) is result.best
    assert written


# ---- segments recovered from the replayed schedule ----------------------------------------


def test_segments_round_trip_through_the_schedule():
    chain = Chain.uniform(9, forward_flops=1, backward_flops=2, input_bytes=1, tape_bytes=3)
    for segments in (
        [(0, 9, False)],
        [(0, 1, False), (1, 4, True), (4, 6, True), (6, 9, False)],
        [(0, 2, True), (2, 3, False), (3, 9, True)],
    ):
        steps = segment_schedule(chain, segments)
        assert schedule_segments(steps, 9) == segments
    assert schedule_segments(revolve_schedule(chain, 2), 9) is None


def test_layer_segments_of_named_strategies(spec_of):
    spec = spec_of("gpt2")  # 12 layers
    assert layer_segments(plan_of(spec, "uniform:5")).segments == (
        (0, 5, True),
        (5, 10, True),
        (10, 12, True),
    )
    block = layer_segments(plan_of(spec, "selective+block:3"))
    assert block.selective and block.block_count() == 3 and block.uniform_size() is None
    assert layer_segments(plan_of(spec, "sequential:4")).segments[-1] == (8, 12, False)
    every_third = LayerSegments(
        12,
        (
            (0, 2, False),
            (2, 3, True),
            (3, 5, False),
            (5, 6, True),
            (6, 8, False),
            (8, 9, True),
            (9, 11, False),
            (11, 12, True),
        ),
        False,
    )
    assert every_third.every_nth() == 3 and every_third.block_count() is None


# ---- the other targets ----------------------------------------------------------------------


def test_torchtitan_sections(spec_of):
    """0.2.x: the [activation_checkpoint] section; 0.3.0: the subcommand after the options.
    Each reads back as a strategy with the same activation bytes."""
    spec = spec_of("llama3-8b")
    for name, expected in (("none", "none"), ("full", "full"), ("block:32", "full")):
        text = exports.export(plan_of(spec, name), "torchtitan", version="0.2").text
        assert "[activation_checkpoint]" in text
        arguments = exports.export(plan_of(spec, name), "torchtitan").text
        assert arguments.split()[-1] == f"activation-checkpoint:{expected}"
        for back in (
            torchtitan.strategy_from_toml(text),
            torchtitan.strategy_from_arguments(arguments),
        ):
            assert back == expected
            assert plan_of(spec, back).activation_bytes == plan_of(spec, name).activation_bytes
    every_fourth = LayerSegments(
        8, ((0, 3, False), (3, 4, True), (4, 7, False), (7, 8, True)), False
    )
    assert torchtitan.section(every_fourth) == {"mode": "selective", "selective_ac_option": "4"}
    assert torchtitan.reason(spec, every_fourth, "0.2") is None
    assert "0.2.x's selective_ac_option = N" in torchtitan.reason(spec, every_fourth, "0.3")
    # 0.3.0's default subcommand, none given, is SelectiveAC
    assert torchtitan.strategy_from_arguments("--training.seq-len 8192") == "sac-fused"


def _annotation_accepts(annotation: str, value) -> bool:
    """Whether a value TOML gives is of a torchtitan 0.2.x field's type (its annotation as
    written in job_config.py): a Literal's choices, str, int, bool, float, list[str]."""
    node = ast.parse(annotation, mode="eval").body
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal":
        elements = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return value in [ast.literal_eval(element) for element in elements]
    kinds = {"str": str, "int": int, "bool": bool, "float": (int, float), "list[str]": list}
    return isinstance(value, kinds[annotation]) and (annotation != "int" or value is not True)


def _check_table(fields: dict, keys: dict, classes: dict) -> None:
    """Every key of a TOML table is a field of its torchtitan 0.2.x dataclass, every value of
    the field's type; a nested table is checked against the field's own dataclass."""
    for key, value in keys.items():
        assert key in fields, key
        annotation = fields[key][0]
        if isinstance(value, dict):
            assert annotation in classes, (key, annotation)
            _check_table(classes[annotation], value, classes)
        else:
            assert _annotation_accepts(annotation, value), (key, value)


def test_torchtitan_02_toml_has_only_the_release_keys(spec_of):
    """The 0.2.x TOML, read as TOML, against torchtitan v0.2.2's JobConfig sections and keys
    (tests/torchtitan_02_keys.py, from its job_config.py by tests/torchtitan_mirror.py): every
    section and key exists there and every value is of the key's type. selective_ac_option is
    "op" or a number (torchtitan/distributed/activation_checkpoint.py at v0.2.2: `== "op"`,
    `.isdigit()`, else ValueError)."""
    from torchtitan_02_keys import CLASSES, RELEASE, SECTIONS

    assert RELEASE == "v0.2.2"
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3)
    tables = [
        tomllib.loads(exports.export(plan_of(spec, name), "torchtitan", version="0.2").text)
        for name in ("none", "full", "sac", "block:32")
    ]
    for gather in (False, True):  # torchao float8, with and without its FSDP all-gather
        float8 = spec.replace(precision="float8", fsdp_float8_all_gather=gather)
        text = exports.export(plan_of(float8, "full"), "torchtitan", version="0.2").text
        tables.append(tomllib.loads(text))
        float8_keys = tables[-1]["quantize"]["linear"]["float8"]
        assert float8_keys["enable_fsdp_float8_all_gather"] is gather
        assert float8_keys["precompute_float8_dynamic_scale_for_fsdp"] is gather
        assert float8_keys["filter_fqns"] == ["output"]
        assert tables[-1]["model"]["converters"] == ["quantize.linear.float8"]
    foreach = spec.replace(optimizer_implementation="foreach")  # "fused", its default, unsaid
    tables.append(
        tomllib.loads(exports.export(plan_of(foreach, "full"), "torchtitan", version="0.2").text)
    )
    assert tables[-1]["optimizer"] == {"implementation": "foreach"}
    assert "optimizer" not in tables[1]
    every_fourth = LayerSegments(
        8, ((0, 3, False), (3, 4, True), (4, 7, False), (7, 8, True)), False
    )
    tables.append({"activation_checkpoint": torchtitan.section(every_fourth)})
    modes = set()
    for table in tables:
        for section, keys in table.items():
            assert section in SECTIONS, section
            _check_table(SECTIONS[section], keys, CLASSES)
        option = table["activation_checkpoint"].get("selective_ac_option", "op")
        assert option == "op" or option.isdigit()
        modes.add(table["activation_checkpoint"]["mode"])
    assert modes == {"none", "full", "selective"}
    # the mirror's check bites: a key or a value that release does not take
    assert "offload" not in SECTIONS["activation_checkpoint"]
    with pytest.raises(AssertionError):
        _check_table(SECTIONS["quantize"], {"linear": {"float8": {"scaling": 1}}}, CLASSES)
    assert not _annotation_accepts(SECTIONS["activation_checkpoint"]["mode"][0], "op")


@pytest.mark.parametrize(
    ("layout", "strategy", "fragment"),
    [
        ({"bias": True, "attention": "flash", "dropout": 0}, "sac", "aten.addmm"),
        ({"precision": "float8"}, "sac", "aten._scaled_mm"),
        ({"precision": "fp16"}, "full", "precision fp16"),
        ({"pp": 3, "microbatches": 3, "first_stage_layers": 10}, "full", "uneven pipeline"),
        (
            {"precision": "float8", "dp": 8, "zero": 3, "fsdp_float8_all_gather": True},
            "full",
            "no float8 all-gather",
        ),
        ({"optimizer": "adamw-8bit"}, "full", "torchtitan builds torch.optim.Adam or AdamW"),
        (
            {"optimizer": "adamw-bf16", "optimizer_implementation": "foreach"},
            "full",
            "fused kernel only",
        ),
    ],
)
def test_torchtitan_03_refuses_what_its_options_cannot_say(spec_of, layout, strategy, fragment):
    spec = spec_of("llama3-8b", framework="torchtitan", **layout)
    plan = plan_of(spec, strategy)
    assert fragment in exports.why_not(plan, "torchtitan")
    # a policy has a nearest plan; a layout or precision none on 0.3.0
    offer = "nearest expressible plan" if strategy == "sac" else "no plan of this model"
    with pytest.raises(exports.ExportError, match=offer):
        exports.export(plan, "torchtitan")
    if strategy == "sac":  # 0.2.x's op SAC is ckplan's sac
        assert exports.why_not(plan, "torchtitan", "0.2") is None


def test_torchtitan_bf16_moments_are_03s_fused_opt_states_bf16(spec_of):
    """AdamW with bf16 moments: 0.3.0's `fused_opt_states_bf16` (fp32 parameters, bf16 states,
    the fused kernel); 0.2.x has no such implementation."""
    spec = spec_of("llama3-8b", framework="torchtitan", dp=8, zero=3, optimizer="adamw-bf16")
    plan = plan_of(spec, "full")
    text = exports.export(plan, "torchtitan").text
    assert "--optimizer.implementation fused_opt_states_bf16" in text.splitlines()
    assert "keeps AdamW's moments in fp32" in exports.why_not(plan, "torchtitan", "0.2")


def test_torchtitan_03_refuses_sac_on_moe_and_experts_beside_tp(spec_of):
    moe = spec_of("mixtral-8x7b", framework="torchtitan", dp=8, zero=3)
    assert "aten.topk" in exports.why_not(plan_of(moe, "sac"), "torchtitan")
    assert exports.why_not(plan_of(moe, "sac"), "torchtitan", "0.2") is None
    assert exports.why_not(plan_of(moe, "full"), "torchtitan") is None
    beside = spec_of("mixtral-8x7b", framework="torchtitan", tp=2, sp=True, dp=4, zero=3)
    assert "expert tensor-parallel" in exports.why_not(plan_of(beside, "full"), "torchtitan")


def test_torchtitan_03_options_follow_the_layout(spec_of):
    """The batch, the even pipeline split and the schedule, by hand for Llama 3 8B on pp 4 x
    2 virtual stages, 8 micro-batches of 2, dp 2: 32 layers / (4·2) = 4 per stage; the local
    batch 2·8 = 16 (one optimizer step per rank), the global 16·2 = 32."""
    spec = spec_of(
        "llama3-8b", framework="torchtitan", pp=4, virtual_stages=2, microbatches=8,
        micro_batch=2, dp=2, zero=3,
    )  # fmt: skip
    words = exports.export(plan_of(spec, "full"), "torchtitan").text.split()
    given = dict(itertools.pairwise(words))
    assert given["--parallelism.pipeline-parallel-layers-per-stage"] == "4"
    assert given["--parallelism.pipeline-parallel-schedule"] == "Interleaved1F1B"
    assert given["--training.local-batch-size"] == "16"
    assert given["--training.global-batch-size"] == "32"
    assert given["--parallelism.data-parallel-shard-degree"] == "2"
    assert "--training.disable-cuda-graphs" in words
    assert words[-1] == "activation-checkpoint:full"
    flat = spec_of("llama3-8b", framework="torchtitan", microbatches=4, dp=8, zero=0)
    words = exports.export(plan_of(flat, "none"), "torchtitan").text.split()
    given = dict(itertools.pairwise(words))
    assert given["--training.local-batch-size"] == "1"  # accumulated 4 times
    assert given["--training.global-batch-size"] == "32"
    assert given["--parallelism.data-parallel-replicate-degree"] == "8"
    assert given["--parallelism.data-parallel-shard-degree"] == "1"


def test_torchtitan_version_is_checked(spec_of):
    plan = plan_of(spec_of("gpt2"), "full")
    with pytest.raises(exports.ExportError, match=r"expected 0\.3 or 0\.2"):
        exports.export(plan, "torchtitan", version="0.3.0")
    with pytest.raises(exports.ExportError, match="applies to --to torchtitan"):
        exports.export(plan, "megatron", version="0.3")


def test_deepspeed_block_has_exactly_its_documented_keys(spec_of):
    data = json.loads(exports.export(plan_of(spec_of("gpt2"), "uniform:3"), "deepspeed").text)
    assert set(data["activation_checkpointing"]) == {
        "partition_activations",
        "contiguous_memory_optimization",
        "cpu_checkpointing",
        "number_checkpoints",
        "synchronize_checkpoint_boundary",
        "profile",
    }
    assert data["activation_checkpointing"]["number_checkpoints"] == 4
    piped = spec_of("gpt2", pp=2, zero=2, dp=2, microbatches=4, framework="torchtitan")
    assert "ZeRO 0-1" in deepspeed.reason(piped, layer_segments(plan_of(piped, "none")))


def test_yaml_holds_the_resolved_model_and_any_plan(spec_of):
    spec = spec_of("gpt2", seq=512)
    for name in ("uniform:3", "revolve:2"):
        plan = plan_of(spec, name)
        data = yaml.safe_load(exports.export(plan, "yaml").text)
        assert spec_from_mapping(data["model"]) == spec
        assert data["plan"]["strategy"] == name
        assert data["plan"]["total_bytes"] == plan.total_bytes
        assert data["plan"]["flops"]["recompute"] == plan.flops.recompute
    budget = activation_budget(spec, 7 * 10**9)
    assert exports.export(plan_of(spec, "optimal", budget=budget), "yaml").text


# ---- MoE recomputation (Megatron-Core's --recompute-modules moe) ---------------------------

MIXTRAL_LAYOUT = {"tp": 2, "sp": True, "ep": 2, "etp": 1, "dp": 2}


@pytest.mark.parametrize(
    ("name", "modules"), [("moe", ["moe"]), ("selective+moe", ["core_attn", "moe"])]
)
def test_moe_recompute_exports_as_recompute_modules_and_round_trips(spec_of, name, modules):
    """TransformerConfig.recompute_modules has "moe" (the whole MoE layer, normal
    checkpointing); the flags read back give the same plan."""
    spec = spec_of("mixtral-8x7b", **MIXTRAL_LAYOUT)
    plan = plan_of(spec, name)
    text, args = megatron_args(plan)
    assert args.recompute_granularity == "selective" and args.recompute_modules == modules
    assert args.recompute_method is None
    back = megatron.strategy_from_flags(megatron.parse_flags(text))
    assert back == name
    again = plan_of(spec, back)
    assert (again.activation_bytes, again.flops) == (plan.activation_bytes, plan.flops)


@pytest.mark.parametrize(
    ("name", "part"),
    [("experts", "no experts-only module"), ("moe+block:2", "together with whole layers")],
)
def test_moe_plans_megatron_cannot_express_are_refused(spec_of, name, part):
    spec = spec_of("mixtral-8x7b", **MIXTRAL_LAYOUT)
    with pytest.raises(exports.ExportError, match=part):
        exports.export(plan_of(spec, name), "megatron")
    with pytest.raises(exports.ExportError, match="MoE layers"):
        exports.export(plan_of(spec, "moe"), "torch")


# ---- the whole model in Megatron-LM's flags, read back by its own parser -------------------

MEGATRON_MODELS = [
    ("llama3-8b", {"tp": 2, "sp": True, "dp": 4, "zero": 1, "dp_comm_overlap": True}),
    ("llama3-70b", {"tp": 8, "pp": 4, "sp": True, "virtual_stages": 5, "microbatches": 16}),
    (
        "llama3-405b",
        {
            "tp": 8,
            "pp": 16,
            "sp": True,
            "microbatches": 16,
            "virtual_stages": 2,
            "account_for_embedding_in_pipeline_split": True,
            "account_for_loss_in_pipeline_split": True,
        },
    ),
    ("deepseek-v3", {"ep": 64, "dp": 128, "pp": 16, "first_stage_layers": 1, "zero": 1}),
    ("mixtral-8x7b", {"tp": 2, "sp": True, "ep": 8, "dp": 8, "precision": "fp8"}),
    ("qwen3-30b-a3b", {"ep": 8, "dp": 8, "zero": 2}),
    ("megatron-175b", {}),
    ("gpt2", {"dp": 8, "zero": 3}),
]


@pytest.mark.parametrize(("name", "layout"), MEGATRON_MODELS, ids=[m for m, _ in MEGATRON_MODELS])
def test_megatron_flags_describe_the_whole_model(spec_of, name, layout):
    """Every flag is Megatron-LM's own (core_v0.19.0's parser), validate_args accepts them, and
    they read back into the same model, layout and precision."""
    spec = spec_of(name, **layout)
    plan = plan_of(spec, "selective")
    text = exports.export(plan, "megatron").text
    gpus = spec.tp * spec.pp * spec.cp * spec.dp
    args = validate(parse(text, gpus))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        spec.layers, spec.hidden, spec.heads,
    )  # fmt: skip
    assert args.ffn_hidden_size == spec.ffn_hidden and args.seq_length == spec.seq
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    assert groups == spec.kv_heads
    assert args.normalization == ("RMSNorm" if spec.norm == "rmsnorm" else "LayerNorm")
    assert args.swiglu == (spec.mlp == "swiglu")
    assert args.untie_embeddings_and_output_weights == (not spec.tied_embeddings)
    assert args.data_parallel_size == spec.dp
    assert args.use_distributed_optimizer == (spec.zero == 1)
    assert args.bf16 and (args.fp8 == "hybrid") == (spec.precision == "fp8")
    assert args.decoder_first_pipeline_num_layers == spec.first_stage_layers
    assert (args.virtual_pipeline_model_parallel_size or 1) == spec.virtual_stages
    if spec.experts:
        pattern = eval(args.moe_layer_freq)  # Megatron's moe_freq_type evaluates it so
        moe = [i for i, flag in enumerate(pattern) if flag]
        assert len(pattern) == spec.layers and moe == sorted(
            parse_layer_set(spec.moe_layers, spec.layers)
        )
        assert (args.num_experts, args.moe_router_topk) == (spec.experts, spec.top_k)
        assert args.expert_model_parallel_size == spec.ep
    if spec.mla:
        assert args.multi_latent_attention and args.kv_lora_rank == spec.kv_lora_rank
    assert megatron.strategy_from_flags(megatron.parse_flags(text)) == "selective"


def test_megatron_recompute_modules_mlp_round_trip(spec_of):
    """selective+mlp is Megatron-Core's --recompute-modules core_attn mlp, accepted by
    core_v0.19.0's rules and read back; the other targets refuse it with the reason."""
    spec = spec_of("llama3-8b", tp=2, sp=True, dp=4)
    plan = plan_of(spec, "selective+mlp")
    text = exports.export(plan, "megatron").text
    args = validate(parse(text, 8))
    assert args.recompute_granularity == "selective"
    assert args.recompute_modules == ["core_attn", "mlp"]
    assert megatron.strategy_from_flags(megatron.parse_flags(text)) == "selective+mlp"
    for target in ("torch", "deepspeed", "torchtitan"):
        assert "dense MLP" in exports.why_not(plan_of(spec, "mlp"), target)


@pytest.mark.parametrize("group", [None, 4, 8, 16])
def test_megatron_microbatch_group_round_trips(spec_of, group):
    spec = spec_of("llama3-8b", pp=4, virtual_stages=2, microbatches=16)
    if group is not None:
        spec = spec.replace(microbatch_group_size=group)
    text, args = megatron_args(plan_of(spec, "none"))
    flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    assert (flag in text) == (group is not None)
    assert args.microbatch_group_size_per_vp_stage == spec.microbatch_group == (group or 4)


def test_megatron_refuses_the_groups_ckplan_refuses(spec_of):
    """Megatron's interleaved schedule (core_v0.19.0) refuses N outside [p, m] and a last
    group shorter than p; ckplan's spec refuses the same with one line naming the key."""
    spec = spec_of("llama3-8b", pp=4, virtual_stages=2, microbatches=16)
    text = exports.export(plan_of(spec, "none"), "megatron").text
    flag = "--microbatch-group-size-per-virtual-pipeline-stage"
    for group in (3, 5, 17):
        with pytest.raises(MegatronArgError):
            validate(parse(f"{text} {flag} {group}", world_size(spec)))
        with pytest.raises(ValueError, match="microbatch_group_size"):
            spec.replace(microbatch_group_size=group)


def test_torchtitan_refuses_a_group_torch_does_not_run(spec_of):
    """PyTorch's Interleaved1F1B groups m // max(1, m // pp) micro-batches (16 of 16 over pp 4:
    4; 6 over pp 4: one round of 6); another microbatch_group_size is not expressible."""
    assert torchtitan.torch_interleaved_group(4, 16) == 4
    assert torchtitan.torch_interleaved_group(4, 6) == 6
    assert torchtitan.torch_interleaved_group(16, 32) == 16  # Llama 3 405B's N = 16
    spec = spec_of("llama3-8b", framework="torchtitan", pp=4, virtual_stages=2, microbatches=16)
    assert (
        exports.why_not(plan_of(spec.replace(microbatch_group_size=4), "none"), "torchtitan")
        is None
    )
    why = exports.why_not(plan_of(spec.replace(microbatch_group_size=8), "none"), "torchtitan")
    assert "microbatch_group_size 8" in why and "= 4" in why


def test_megatron_attention_sinks_are_its_learnable_softmax_offset():
    """gpt-oss's sinks are Megatron-Core's softmax_type learnable (core_v0.19.0), and its
    windows on the even layers the `--window-attn-skip-freq` pattern, 1 where a layer is
    windowed (transformer/utils.py is_layer_window_attention reads `pattern[layer_number - 1]`,
    1-based)."""
    from ckplan.inputs.presets import load_spec

    spec = load_spec("tests/fixtures/hf/gpt-oss-20b/config.json", {"ep": 8, "dp": 8})
    _, args = megatron_args(plan_of(spec, "none"))
    assert args.softmax_type == "learnable" and args.add_bias_linear
    assert (args.num_experts, args.moe_router_topk, args.kv_channels) == (32, 4, 64)
    assert args.window_size == "128,0"
    pattern = eval(args.window_attn_skip_freq)  # Megatron's moe_freq_type evaluates it so
    assert pattern == [1, 0] * 12
    windowed = [number for number in range(1, 25) if pattern[number - 1]]
    assert windowed == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]  # layers 0, 2, ... 0-based
    full = load_spec("tests/fixtures/hf/gpt-oss-20b/config.json", {"ep": 8, "dp": 8})
    full = full.replace(sliding_window_layers="all")
    assert "--window-attn-skip-freq" not in exports.export(plan_of(full, "none"), "megatron").text


def test_megatron_refuses_qk_norms_over_all_heads():
    from ckplan.inputs.presets import load_spec

    spec = load_spec("tests/fixtures/hf/OLMo-2-1124-13B/config.json", {"dp": 8})
    with pytest.raises(exports.ExportError, match="qk_norm_width full"):
        exports.export(plan_of(spec, "none"), "megatron")
    _, args = megatron_args(plan_of(spec.replace(qk_norm_width="head"), "none"))
    assert args.qk_layernorm
