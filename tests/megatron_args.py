"""Megatron-LM's own argument rules, mirrored for the export tests (not used by ckplan).

The flag definitions are Megatron-LM's own, generated from megatron/training/arguments.py and the
config dataclasses its ArgumentGroupFactory reads, at a named release (tests/megatron_flags.py, by
tests/megatron_mirror.py: core_v0.19.0); the checks copy `validate_args` and
`TransformerConfig.__post_init__` (megatron/core/transformer/transformer_config.py): those of
pipeline stages, recomputation and recompute modules as core_v0.15.0 states them and as
core_v0.19.0 still does, and the activation offload checks, the interleaved schedule's
micro-batch group checks and the custom pipeline layout's (--pipeline-model-parallel-layout:
validate_args, TransformerConfig.__post_init__ and megatron/core/transformer/
pipeline_parallel_layer_layout.py) of core_v0.19.0. Parsing uses
argparse with `allow_abbrev=False` as Megatron does, so an unknown flag fails like it would there.
"""

import argparse
import math
import re
import shlex

import megatron_flags


class MegatronArgError(ValueError):
    pass


def parser() -> argparse.ArgumentParser:
    """Megatron-LM's own flags at a named release (tests/megatron_flags.py, generated)."""
    return megatron_flags.parser()


RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
    "gdn_norm_out",
)
# TransformerConfig.__post_init__, core_v0.19.0: the allowed offload_modules
OFFLOAD_MODULES = (
    "core_attn",
    "attn_proj",
    "expert_fc1",
    "fused_group_mlp",
    "moe_act",
    "attn_norm",
    "mlp_norm",
    "qkv_linear",
)


def parse(text: str, world_size: int) -> argparse.Namespace:
    try:
        args = parser().parse_args(shlex.split(text))
    except (argparse.ArgumentError, SystemExit) as error:
        raise MegatronArgError(f"argparse: {error}") from None
    args.world_size = world_size
    return args


def check(condition: bool, message: str) -> None:
    if not condition:
        raise MegatronArgError(message)


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """validate_args + TransformerConfig.__post_init__, the checks these flags reach."""
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    model_size = tp * pp * cp
    check(args.world_size % model_size == 0, "world size is not divisible by tp·pp·cp")
    args.data_parallel_size = args.world_size // model_size
    check(args.micro_batch_size is not None and args.micro_batch_size > 0, "micro batch size")
    # validate_args, core_v0.19.0 (the same at core_v0.14.0): FP8 primary weights need a
    # sharded optimizer (training mode)
    check(
        not args.fp8_param_gather or args.use_distributed_optimizer or args.use_megatron_fsdp,
        "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron "
        "fsdp, or inference mode",
    )
    # validate_args, core_v0.19.0: hierarchical context parallelism's sizes
    if args.hierarchical_context_parallel_sizes:
        check(
            cp == math.prod(args.hierarchical_context_parallel_sizes),
            "context_parallel_size == prod(hierarchical_context_parallel_sizes)",
        )
    check(
        "a2a+p2p" not in args.cp_comm_type or args.hierarchical_context_parallel_sizes is not None,
        "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm",
    )
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    check(args.global_batch_size > 0, "global batch size")
    # the microbatch calculator: global = micro * dp * number of micro-batches
    check(
        args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) == 0,
        "global batch size is not divisible by micro batch size times data parallel size",
    )
    # validate_args at core_v0.15.0: virtual stages, uneven stages, the embedding and loss
    # counted as layers
    layers = args.num_layers + args.account_for_embedding_in_pipeline_split
    layers += args.account_for_loss_in_pipeline_split
    uneven = (
        args.decoder_first_pipeline_num_layers is not None
        or args.decoder_last_pipeline_num_layers is not None
    )
    args.virtual_pipeline_model_parallel_size = None
    check(
        (args.num_layers_per_virtual_pipeline_stage is not None)
        + (args.num_virtual_stages_per_pipeline_rank is not None)
        + (args.pipeline_model_parallel_layout is not None)
        <= 1,
        "No more than one of the following arguments can be set at the same time: "
        "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank,"
        "--pipeline-model-parallel-layout.",
    )
    if args.pipeline_model_parallel_layout is not None:
        _validate_layout(args)
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        vpp = args.num_virtual_stages_per_pipeline_rank
        args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        check(
            not uneven,
            "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline "
            "parallel degree when enable uneven pipeline parallelism",
        )
        check(layers % pp == 0, "number of layers of the model must be divisible by pp")
        per_stage = layers // pp
        check(
            per_stage % args.num_layers_per_virtual_pipeline_stage == 0,
            "number of layers per pipeline stage must be divisible by layers per virtual stage",
        )
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
        args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    elif not uneven:
        check(layers % pp == 0, "Number of layers should be divisible by the pp size")
    if uneven:  # TransformerConfig: the rest split evenly over the middle stages
        first = args.decoder_first_pipeline_num_layers or 0
        last = args.decoder_last_pipeline_num_layers or 0
        middle = pp - (first > 0) - (last > 0)
        rest = args.num_layers - first - last
        even = rest == 0 if middle == 0 else rest % middle == 0
        check(rest >= 0 and even, "the layers left for the middle stages must split evenly")
    if args.overlap_param_gather:
        check(
            args.use_distributed_optimizer or args.use_megatron_fsdp,
            "--overlap-param-gather only supported with distributed optimizer or megatron fsdp",
        )
        check(
            args.overlap_grad_reduce, "Must use --overlap-param-gather with --overlap-grad-reduce"
        )
    if args.position_embedding_type == "learned_absolute" or args.max_position_embeddings:
        check(
            args.max_position_embeddings is not None
            and args.max_position_embeddings >= args.seq_length,
            "max_position_embeddings must be greater than or equal to seq_length",
        )
    if args.virtual_pipeline_model_parallel_size is not None:
        if args.overlap_p2p_comm:
            check(pp > 1, "interleaved schedule needs pipeline-model-parallel size > 1")
        else:
            check(pp > 2, "interleaved schedule without p2p overlap needs pp > 2")
        _validate_microbatch_group(args)
    if cp > 1:
        check(args.seq_length % (cp * 2) == 0, "seq-length must be a multiple of 2·cp")
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.distribute_saved_activations:
        check(tp > 1, "distribute saved activations needs tp > 1")
        check(args.recompute_granularity == "full", "distributed needs full granularity")
        check(args.recompute_method is not None, "distributed needs a recompute method")
    if args.recompute_granularity == "selective":
        check(
            args.recompute_method is None,
            "recompute method is not yet supported for selective recomputing granularity",
        )
    if tp == 1:
        # Megatron switches it off with a warning; an export that asks for it is wrong.
        check(not args.sequence_parallel, "sequence parallelism needs tp > 1")
    # TransformerConfig.__post_init__
    if args.recompute_granularity is not None:
        if args.recompute_method is None:
            check(
                args.recompute_granularity == "selective",
                f"Using recompute_granularity: {args.recompute_granularity} so recompute_method "
                'must be "block" or "uniform"',
            )
        if args.recompute_granularity != "selective":
            check(
                args.recompute_num_layers is not None,
                "recompute_num_layers must be between 1 and num_layers_per_pipeline_rank",
            )
            # the range the message states
            check(
                1 <= args.recompute_num_layers <= args.num_layers // pp,
                "recompute_num_layers must be between 1 and num_layers_per_pipeline_rank",
            )
        else:
            check(args.recompute_num_layers is None, "selective: recompute_num_layers must be None")
    else:
        check(args.recompute_method is None, "a recompute method without a granularity is ignored")
    if args.recompute_modules is not None:
        check(args.recompute_granularity == "selective", "recompute modules need selective")
        check(
            all(module in RECOMPUTE_MODULES for module in args.recompute_modules),
            "unknown recompute module",
        )
        # TransformerConfig.__post_init__ (transformer_config.py, core_v0.15.0 and core_v0.19.0)
        modules = set(args.recompute_modules)
        check(
            "moe_act" not in modules or bool(getattr(args, "moe_grouped_gemm", False)),
            "moe_act in recompute_modules is only supported with moe_grouped_gemm.",
        )
        check(
            "mla_up_proj" not in modules or bool(getattr(args, "multi_latent_attention", False)),
            "mla_up_proj in recompute_modules is only supported with multi_latent_attention.",
        )
        check(
            not (modules & {"moe_act", "layernorm"})
            or getattr(args, "fp8", None) is None
            or getattr(args, "fp8_recipe", "delayed") != "delayed",
            "Delayed scaling does not support moe_act and layernorm recompute for fp8.",
        )
        check(
            "shared_experts" not in modules
            or getattr(args, "moe_shared_expert_intermediate_size", None) is None
            or not getattr(args, "moe_shared_expert_overlap", False),
            "shared_experts recompute cannot work with --moe-shared-expert-overlap.",
        )
    _validate_offload(args)
    return args


LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


def parse_layout_str(layout_str: str) -> list[list[str]]:
    """PipelineParallelLayerLayout.parse_str_to_list
    (megatron/core/transformer/pipeline_parallel_layer_layout.py, core_v0.19.0), as written
    there; its LayerType members by name."""
    layout_str = layout_str.replace(",", "")
    patterns = [r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"]
    for pattern in patterns:
        layout_str = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), layout_str)
    layout_list = []
    for stage in layout_str.split("|"):
        layout_list.append([])
        for layer_char in stage:
            check(layer_char in LAYER_CHARS, f"Invalid layer character: {layer_char}")
            layout_list[-1].append(LAYER_CHARS[layer_char])
    return layout_list


def _validate_layout(args: argparse.Namespace) -> None:
    """validate_args (the vpp size from the layout) and TransformerConfig.__post_init__ (no
    other pipeline split argument beside it; PipelineParallelLayerLayout.__init__ and
    validate_layer_layout), core_v0.19.0."""
    layout = parse_layout_str(args.pipeline_model_parallel_layout)
    pp = args.pipeline_model_parallel_size
    check(
        len(layout) % pp == 0,
        "The length of pipeline_model_parallel_layout must be divisible by "
        "pipeline_model_parallel_size",
    )
    vpp = len(layout) // pp
    args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    check(
        args.decoder_first_pipeline_num_layers is None
        and args.decoder_last_pipeline_num_layers is None
        and not args.account_for_embedding_in_pipeline_split
        and not args.account_for_loss_in_pipeline_split,
        "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments.",
    )
    grid = [[layout[v * pp + k] for v in range(vpp)] for k in range(pp)]
    flat = [item for v in range(vpp) for row in grid for item in row[v]]
    check(bool(flat) and flat[0] == "embedding", "The first layer must be embedding")
    check(flat[-1] == "loss", "The last layer must be loss")
    check(flat.count("embedding") == 1, "Embedding must be specified exactly once")
    check(flat.count("loss") == 1, "Loss must be specified exactly once")
    check(
        flat.count("decoder") == args.num_layers,
        "Number of decoder layers must match num_layers",
    )
    mtp = args.mtp_num_layers
    check(
        flat.count("mtp") == mtp or (mtp is None and flat.count("mtp") == 0),
        "Number of mtp layers in layout must match mtp_num_layers",
    )
    if "mtp" in flat:
        check(
            "decoder" not in flat[flat.index("mtp") :],
            "decoder layers must be placed before MTP layers",
        )
    for row in grid:
        for chunk in row[:-1]:
            check("mtp" not in chunk, "the MTP should be always in the last virtual stage")
        if "mtp" in row[-1]:
            check(
                row[-1].count("mtp") == mtp,
                "All of the MTP layers must be in the same one virtual pipeline stage",
            )


def _validate_microbatch_group(args: argparse.Namespace) -> None:
    """core_v0.19.0: ModelParallelConfig.__post_init__ defaults the group to pp
    (megatron/core/model_parallel_config.py); forward_backward_pipelining_with_interleaving
    (megatron/core/pipeline_parallel/schedules.py) wants it in [pp, m] and m mod N to be 0 or
    at least pp."""
    pp = args.pipeline_model_parallel_size
    if args.microbatch_group_size_per_vp_stage is None:
        args.microbatch_group_size_per_vp_stage = pp
    group = args.microbatch_group_size_per_vp_stage
    m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    check(
        pp <= group <= m,
        "The number of contiguous micro-batches in a virtual pipeline stage should range in "
        f"[PP={pp} , M={m}]",
    )
    check(
        not 0 < m % group < pp,
        "The remainder of M (the total micro-batches) divided by N (number of contiguous "
        "micro-batches in a virtual pipeline stage) should be 0, or larger than or equal to "
        "the pipeline-parallel size",
    )


def _validate_offload(args: argparse.Namespace) -> None:
    """The activation offload checks of core_v0.19.0: validate_args sets `cpu_offloading` when
    --cpu-offloading-num-layers > 0 (megatron/training/arguments.py), then
    TransformerConfig.__post_init__ (megatron/core/transformer/transformer_config.py)."""
    args.cpu_offloading = args.cpu_offloading_num_layers > 0
    if args.cpu_offloading:
        check(
            0 <= args.cpu_offloading_num_layers < args.num_layers,
            f"CPU offloading can be done only for layers less than {args.num_layers}",
        )
        check(
            args.pipeline_model_parallel_size == 1,
            "Currently there is no support for Pipeline parallelism with CPU offloading",
        )
        check(
            args.recompute_granularity is None,
            "CPU offloading does not work when activation recomputation is enabled",
        )
    if args.fine_grained_activation_offloading:
        modules = set(args.offload_modules or ())
        check(
            not args.cpu_offloading,
            "fine_grained_activation_offloading cannot be enabled with cpu_offloading.",
        )
        check(bool(modules), "fine_grained_activation_offloading needs offload_modules")
        check(modules <= set(OFFLOAD_MODULES), "Invalid choices for offload_modules")
        check(
            "attn_proj" not in modules or "core_attn" in modules,
            "attn_proj cannot be set to offload_modules alone without core_attn",
        )
        if args.recompute_granularity == "selective" and "moe" in (args.recompute_modules or ()):
            check(
                not modules & {"moe_act", "expert_fc1", "fused_group_mlp"},
                "Cannot offload inside a MoE layer while recomputing the entire MoE layer",
            )
        if "fused_group_mlp" in modules:
            check(
                bool(args.use_transformer_engine_op_fuser),
                "fused_group_mlp requires use_transformer_engine_op_fuser.",
            )
            check(
                not modules & {"expert_fc1", "moe_act"},
                "fused_group_mlp cannot be combined with expert_fc1 or moe_act",
            )
