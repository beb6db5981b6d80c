"""torchtitan's activation checkpointing and layout for a plan, for the release the user runs:
0.3 (the default, torchtitan 0.3.0) or 0.2 (torchtitan 0.2.x).

torchtitan 0.2.x (torchtitan/config/job_config.py, torchtitan/distributed/
activation_checkpoint.py at v0.2.2) reads a TOML job file; ckplan writes its
`[activation_checkpoint]` section: `mode` is "none", "full" or "selective"; `full` wraps every
transformer block in `checkpoint_wrapper`; `selective` with `selective_ac_option = "N"` (a
positive integer) wraps every N-th block, counting from 1 (`_layer_sac_count % ac_freq == 0`),
and stores the others; `selective_ac_option = "op"` is op-level SAC that saves the outputs of
matmuls (all but every second one), attention (SDPA) and reduce-scatters and recomputes the rest
of each block: ckplan's `sac` (ckplan.model.op_policy), not its selective, which recomputes the
attention core and saves the rest.

torchtitan 0.3.0 (the wheel torchtitan-0.3.0-py3-none-any.whl: torchtitan/config/manager.py,
config/configs.py, trainer.py, distributed/activation_checkpoint.py,
distributed/pipeline_parallel.py) has no job file: `--module M --config C` names a Python
`config_registry` function and tyro reads the rest of the command line as overrides
(`--parallelism.tensor-parallel-degree 2`). `Trainer.Config.activation_checkpoint` is a union
chosen by a subcommand, `activation-checkpoint:selective` (the default), `:full`,
`:memory-budget` or `:none`, which comes after every other option. `FullAC` and `SelectiveAC`
wrap every block alike: no every-N-th-block option. `SelectiveAC` saves, besides `aten.mm`
(every second one, the router gate's shape excluded as in 0.2.2), SDPA, `aten.max` and
reduce-scatters, every op of PyTorch's `compute_intensive_ops` (torch 2.13: also `aten.addmm`,
`aten.bmm` and `aten._scaled_mm`) outside the every-second rule, `aten.topk` and
`all_to_all_single`; with biases (`addmm`), torchao float8 (`_scaled_mm`) or MoE routing
(`topk`) it keeps more than ckplan's `sac` (0.2.2's op SAC) models, and on a dense block without
biases too: 0.3.0's Llama 3 fuses wqkv (Q, K and V kept where 0.2.2 keeps Q and V) and saves
compiled FlexAttention's region with its inputs, so the export refuses `sac` for 0.3 and
writes it for 0.2.x. ckplan's `sac-fused` is 0.3.0's SelectiveAC on a dense block without
biases in bfloat16: the 0.3 export writes it as `activation-checkpoint:selective` and reads
that back as `sac-fused`; 0.2.x has no such policy. Which policy each release runs is
ckplan.model.torchtitan_ac's answer (`policy_reason`), which the plan search reads too.
Float8 is a converter in the config function's model spec, not an option of the command line.
torchao's float8 all-gather (`fsdp_float8_all_gather`) is 0.2.x's `[quantize.linear.float8]`
`enable_fsdp_float8_all_gather` with `precompute_float8_dynamic_scale_for_fsdp` (tensorwise
scaling, `recipe_name` unset: torchtitan/config/job_config.py and components/quantization/
float8.py at v0.2.2), which the 0.2.x export writes with `filter_fqns = ["output"]`, the output
layer in bf16 as ckplan models it; 0.3.0's `Float8LinearConverter` has the rowwise recipes only
(`recipe_name` rowwise or rowwise_with_gw_hp) and no float8 all-gather, so the 0.3 export
refuses the key. A foreach AdamW step (`optimizer_implementation: foreach`) is written as
`--optimizer.implementation foreach` (0.3.0) or `[optimizer] implementation = "foreach"`
(0.2.x); both releases default to "fused", which ckplan counts otherwise. AdamW with bf16
moments (`optimizer: adamw-bf16`) is 0.3.0's `fused_opt_states_bf16`; other optimizers are
refused (torchtitan builds Adam and AdamW).
"""

from __future__ import annotations

import re

from ckplan.exports.segments import LayerSegments, module_reason
from ckplan.model.frameworks import optimizer_implementation
from ckplan.model.op_policy import TORCHTITAN_03_POLICY, TORCHTITAN_03_WORD, TORCHTITAN_POLICY
from ckplan.model.spec import ModelSpec
from ckplan.model.torchtitan_ac import DEFAULT_RELEASE, RELEASES, policy_reason
from ckplan.plan import Plan

NAME = "torchtitan"
VERSIONS = RELEASES  # torchtitan 0.3.0 (command line), 0.2.x (TOML job file)
DEFAULT_VERSION = DEFAULT_RELEASE
SUBCOMMAND = "activation-checkpoint:"  # 0.3.0's tyro subcommand for the AC policy
# torch.distributed.pipelining's schedules that ckplan's pipeline memory follows: 1F1B
# (Narayanan et al. 2021, PipeDream-Flush) and its interleaved form over virtual stages.
SCHEDULES = {False: "1F1B", True: "Interleaved1F1B"}


def torch_interleaved_group(pp: int, microbatches: int) -> int:
    """Micro-batches per round of PyTorch's ScheduleInterleaved1F1B, the group each local stage
    runs back to back: m // max(1, m // pp) (torch/distributed/pipelining/schedules.py,
    `number_of_rounds`, `microbatches_per_round`, torch 2.13); no torchtitan option sets it."""
    return microbatches // max(1, microbatches // pp)


def reason(spec: ModelSpec, layers: LayerSegments, version: str = DEFAULT_VERSION) -> str | None:
    if spec.precision == "fp32":
        return (
            "precision fp32: the export leaves torchtitan's training.mixed_precision_param at "
            "its bfloat16 default"
        )
    if version == "0.3" and (why := _layout_reason_03(spec)):
        return why
    if why := _optimizer_reason(spec, version):
        return why
    if spec.pipeline_schedule == "dualpipe":
        # --parallelism.pipeline-parallel-schedule names PyTorch's schedules
        # (torchtitan/distributed/pipeline_parallel.py): DualPipeV is the V-shaped variant on
        # p/2 ranks, not DualPipe's two directions over p ranks
        return (
            "pipeline_schedule dualpipe: torchtitan runs PyTorch's schedules (1F1B, "
            "Interleaved1F1B, DualPipeV on p/2 ranks), not DualPipe"
        )
    group = torch_interleaved_group(spec.pp, spec.microbatches)
    if spec.microbatch_group_size not in (None, group) and spec.virtual_stages > 1:
        return (
            f"microbatch_group_size {spec.microbatch_group_size}: PyTorch's Interleaved1F1B "
            f"runs rounds of microbatches // max(1, microbatches // pp) = {group}, which no "
            "torchtitan option changes"
        )
    if layers.policy:
        if layers.policy in (TORCHTITAN_POLICY, TORCHTITAN_03_POLICY) and not layers.stores_all:
            return (
                "its per-op policy beside fully recomputed layers: torchtitan applies one "
                "activation-checkpoint mode to every block"
            )
        return policy_reason(spec, layers.policy, version)
    if why := module_reason(layers, "torchtitan"):
        return why
    if spec.kind != "transformer":
        return f"torchtitan trains transformers, not model kind {spec.kind!r}"
    if layers.selective:
        return (
            "selective recomputation of the attention core: torchtitan's op-level selective "
            "AC saves attention and recomputes the rest, the opposite"
        )
    option = _option(layers)
    if layers.stores_all or option == "full":
        return None
    if version == "0.3":
        return (
            "these layer segments: torchtitan 0.3.0 wraps every block alike (FullAC, "
            "SelectiveAC); every N-th block is 0.2.x's selective_ac_option = N "
            "(--torchtitan-version 0.2)"
            if option is not None
            else "these layer segments: torchtitan 0.3.0 wraps every block alike (FullAC)"
        )
    if option is not None:
        return None
    return (
        "these layer segments: torchtitan wraps every block (full) or every N-th block "
        "(selective_ac_option = N), one block per checkpoint"
    )


def _layout_reason_03(spec: ModelSpec) -> str | None:
    """Why torchtitan 0.3.0's command line cannot run this layout and precision, or None."""
    if spec.fsdp_float8_all_gather:
        return (
            "fsdp_float8_all_gather: torchtitan 0.3.0's Float8LinearConverter has the rowwise "
            "recipes only, no float8 all-gather; 0.2.x's [quantize.linear.float8] sets it "
            "(--torchtitan-version 0.2)"
        )
    if spec.precision in ("fp16", "fp8"):
        return (
            f"precision {spec.precision}: torchtitan 0.3.0 trains in bfloat16 mixed precision "
            "(training.mixed_precision_param) or torchao float8 (precision float8)"
        )
    if spec.pipeline_layout is not None:
        return (
            "pipeline_layout: Megatron-Core's --pipeline-model-parallel-layout; the export "
            "writes torchtitan 0.3.0's even split (pipeline_parallel_layers_per_stage)"
        )
    if len(set(spec.stage_layer_counts)) > 1:
        return (
            f"uneven pipeline stages {spec.stage_layer_counts}: the export writes torchtitan "
            "0.3.0's even split (pipeline_parallel_layers_per_stage)"
        )
    if spec.experts and spec.tp > 1:
        return (
            "experts beside tensor parallelism: torchtitan 0.3.0 has no expert tensor-parallel "
            "degree (its expert parallelism borrows the FSDP and TP ranks)"
        )
    return None


def _option(layers: LayerSegments) -> str | None:
    """'full', or the layer frequency N of selective layer AC, or None."""
    if layers.uniform_size() == 1:
        return "full"
    every = layers.every_nth()
    return None if every is None else str(every)


def section(layers: LayerSegments) -> dict[str, str]:
    """torchtitan 0.2.x's `[activation_checkpoint]` keys."""
    if layers.policy == TORCHTITAN_POLICY:
        return {"mode": "selective", "selective_ac_option": "op"}
    if layers.stores_all:
        return {"mode": "none"}
    option = _option(layers)
    if option == "full":
        return {"mode": "full"}
    return {"mode": "selective", "selective_ac_option": option}


def float8_tables(spec: ModelSpec) -> dict[str, dict]:
    """torchtitan 0.2.x's float8 keys for precision float8, as TOML tables: the converter
    (`[model] converters`) and `[quantize.linear.float8]` with the float8 all-gather and its
    precomputed scales as `fsdp_float8_all_gather` says, the output layer filtered (module
    docstring); none for the other precisions."""
    if spec.precision != "float8":
        return {}
    gather = spec.fsdp_float8_all_gather
    return {
        "model": {"converters": ["quantize.linear.float8"]},
        "quantize": {
            "linear": {
                "float8": {
                    "enable_fsdp_float8_all_gather": gather,
                    "precompute_float8_dynamic_scale_for_fsdp": gather,
                    "filter_fqns": ["output"],
                }
            }
        },
    }


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return f'"{value}"'


def _toml_lines(tables: dict[str, dict], prefix: str = "") -> list[str]:
    """Nested tables as TOML `[a.b.c]` sections of plain keys."""
    lines: list[str] = []
    for name, table in tables.items():
        plain = {key: value for key, value in table.items() if not isinstance(value, dict)}
        nested = {key: value for key, value in table.items() if isinstance(value, dict)}
        if plain:
            lines.append(f"[{prefix}{name}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in plain.items()]
        lines += _toml_lines(nested, f"{prefix}{name}.")
    return lines


def subcommand(layers: LayerSegments) -> str:
    """torchtitan 0.3.0's activation-checkpoint subcommand: none, full or selective."""
    if layers.policy in (TORCHTITAN_POLICY, TORCHTITAN_03_POLICY):
        return SUBCOMMAND + "selective"
    return SUBCOMMAND + ("none" if layers.stores_all else "full")


def _optimizer_reason(spec: ModelSpec, version: str) -> str | None:
    """Why torchtitan cannot step the plan's optimizer, or None: it builds torch.optim.Adam or
    AdamW (`[optimizer] name`; 0.3.0 also DistMuon, which ckplan does not model), with fp32
    moments, or bf16 ones under 0.3.0's `implementation = "fused_opt_states_bf16"` (the fused
    kernel's mixed-precision path: components/optimizer/optimizer.py at v0.3.0; 0.2.2's
    implementations are for-loop, foreach and fused)."""
    if spec.optimizer not in ("adamw", "adamw-bf16"):
        return (
            f"optimizer {spec.optimizer}: torchtitan builds torch.optim.Adam or AdamW "
            "([optimizer] name); use optimizer adamw"
        )
    if spec.optimizer == "adamw-bf16" and version != "0.3":
        return (
            "optimizer adamw-bf16: torchtitan 0.2.x keeps AdamW's moments in fp32; 0.3.0's "
            "fused_opt_states_bf16 keeps them in bf16 (--torchtitan-version 0.3)"
        )
    if spec.optimizer == "adamw-bf16" and optimizer_implementation(spec) == "foreach":
        return (
            "optimizer adamw-bf16 with optimizer_implementation foreach: torchtitan keeps bf16 "
            "moments with its fused kernel only (fused_opt_states_bf16)"
        )
    return None


def options(spec: ModelSpec) -> list[tuple[str, str | None]]:
    """torchtitan 0.3.0's overrides for the batch and layout, (option, value or None for a
    flag), from its TrainingConfig and ParallelismConfig (config/configs.py): the local batch
    is one data-parallel rank's per optimizer step under pipeline parallelism (split into
    micro-batches of pipeline_parallel_microbatch_size), else per accumulation step; ZeRO 3 is
    FSDP (`fsdp_reshard_after_forward` default: reshard unless pipelined), 2 FSDP without
    resharding after forward, 0 replication (DDP); the pipeline split is even, with the
    embedding and output counted as no layers. CUDA graphs are off: 0.3.0 captures the step in
    one by default, with a memory pool of its own that ckplan's eager-execution memory does not
    model, and its Trainer.Config refuses them with pipeline parallelism and with expert
    parallelism over the all-to-all token dispatcher."""
    global_batch = spec.micro_batch * spec.microbatches * spec.dp
    local = spec.micro_batch * (spec.microbatches if spec.pp > 1 else 1)
    shard, replicate = (spec.dp, 1) if spec.zero >= 2 else (1, spec.dp)
    out: list[tuple[str, str | None]] = [
        ("--training.local-batch-size", str(local)),
        ("--training.global-batch-size", str(global_batch)),
        ("--training.seq-len", str(spec.seq)),
        ("--parallelism.data-parallel-replicate-degree", str(replicate)),
        ("--parallelism.data-parallel-shard-degree", str(shard)),
        ("--parallelism.fsdp-reshard-after-forward", "never" if spec.zero == 2 else "default"),
        ("--parallelism.tensor-parallel-degree", str(spec.tp)),
    ]
    if spec.tp > 1:
        sp = "enable-sequence-parallel" if spec.sp else "no-enable-sequence-parallel"
        out.append((f"--parallelism.{sp}", None))
    out += [
        ("--parallelism.context-parallel-degree", str(spec.cp)),
        ("--parallelism.pipeline-parallel-degree", str(spec.pp)),
    ]
    if spec.pp > 1:
        out += [
            ("--parallelism.pipeline-parallel-schedule", SCHEDULES[spec.virtual_stages > 1]),
            ("--parallelism.pipeline-parallel-microbatch-size", str(spec.micro_batch)),
            ("--parallelism.pipeline-parallel-layers-per-stage",
             str(spec.layers // (spec.pp * spec.virtual_stages))),
            ("--parallelism.pipeline-parallel-first-stage-less-layers", "0"),
            ("--parallelism.pipeline-parallel-last-stage-less-layers", "0"),
        ]  # fmt: skip
    if spec.experts:
        out.append(("--parallelism.expert-parallel-degree", str(spec.ep)))
    if spec.optimizer_offload != "none":
        out.append(("--training.enable-cpu-offload", None))
    if spec.optimizer == "adamw-bf16":  # fp32 parameters, bf16 moments, the fused kernel
        out.append(("--optimizer.implementation", "fused_opt_states_bf16"))
    elif optimizer_implementation(spec) == "foreach":  # "fused" is its default
        out.append(("--optimizer.implementation", "foreach"))
    out.append(("--training.disable-cuda-graphs", None))
    return out


def arguments(plan: Plan, layers: LayerSegments) -> list[str]:
    """torchtitan 0.3.0's command-line overrides, the activation-checkpoint subcommand last."""
    words = []
    for option, value in options(plan.spec):
        words += [option] if value is None else [option, value]
    return [*words, subcommand(layers)]


def render(plan: Plan, layers: LayerSegments, version: str = DEFAULT_VERSION) -> str:
    if version == "0.3":
        lines = [
            f"{option} {value}" if value is not None else option
            for option, value in options(plan.spec)
        ]
        return "\n".join([*lines, subcommand(layers)]) + "\n"
    lines = [f"# ckplan: plan {plan.strategy} for {plan.spec.name}", "[activation_checkpoint]"]
    lines += [f'{key} = "{value}"' for key, value in section(layers).items()]
    lines += _toml_lines(float8_tables(plan.spec))
    if optimizer_implementation(plan.spec) == "foreach":  # "fused" is its default
        lines += _toml_lines({"optimizer": {"implementation": "foreach"}})
    return "\n".join(lines) + "\n"


def notes(plan: Plan, layers: LayerSegments, version: str = DEFAULT_VERSION) -> list[str]:
    spec = plan.spec
    if version == "0.3":
        said = [
            "torchtitan 0.3.0: append to `--module MODULE --config CONFIG` (the model's "
            "config_registry function, e.g. --module llama3 --config llama3_8b); the "
            "activation-checkpoint subcommand stays last"
        ]
        if spec.precision == "float8":
            said.append(
                "precision float8: pick a config function whose model spec has "
                "Float8LinearConverter (e.g. llama3_debugmodel_float8); no option sets it"
            )
        return said
    return [
        "merge into the job's TOML (torchtitan 0.2.x); set "
        f"[parallelism] to tp={spec.tp} pp={spec.pp} cp={spec.cp} and the batch to "
        f"{spec.micro_batch} x seq {spec.seq}"
    ]


def strategy_from_toml(text: str) -> str:
    """The ckplan strategy that an `[activation_checkpoint]` section selects: none, full or
    sac (op-level selective AC). Every-N-th-layer selective AC (N > 1) has no ckplan strategy
    name: ValueError."""
    values = dict(re.findall(r'^\s*(\w+)\s*=\s*"([^"]*)"', text, flags=re.MULTILINE))
    mode = values.get("mode", "none")
    if mode == "none":
        return "none"
    if mode == "full" or values.get("selective_ac_option") == "1":
        return "full"
    if values.get("selective_ac_option") == "op":
        return "sac"
    option = values.get("selective_ac_option")
    raise ValueError(f"selective_ac_option {option!r} has no ckplan strategy name")


def strategy_from_arguments(text: str) -> str:
    """The ckplan strategy torchtitan 0.3.0's arguments select: none, full or sac-fused
    (SelectiveAC, also the default subcommand when none is given; exact on a dense block
    without biases, ckplan.model.torchtitan_ac.fused_reason_03)."""
    chosen = [word for word in text.split() if word.startswith(SUBCOMMAND)]
    name = chosen[-1].removeprefix(SUBCOMMAND) if chosen else "selective"
    strategies = {"none": "none", "full": "full", "selective": TORCHTITAN_03_WORD}
    if name not in strategies:
        raise ValueError(f"{SUBCOMMAND}{name} has no ckplan strategy name")
    return strategies[name]
