"""The estimate and presets views: a plan's per-op, per-component and model-state breakdown."""

from __future__ import annotations

import copy
import dataclasses
from fractions import Fraction
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ckplan import __version__
from ckplan.model import frameworks
from ckplan.model.expert_layout import ExpertLayout, expert_layout
from ckplan.model.layers import distinct_kinds, format_layer_set, kind_layer_indices
from ckplan.model.memory import (
    activation_breakdown,
    activation_bytes_per_layer,
    gradient_lifetime,
    gradients_allocated_in_backward,
    gradients_kept_between_steps,
    host_gradient_bytes,
    optimizer_tensor_bytes,
    optimizer_workspace_bytes,
    parameter_count,
)
from ckplan.model.ops import layer_ops
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan
from ckplan.plan.search import Candidate
from ckplan.published.accuracy import accuracy_note, reserved_note
from ckplan.render.common import both_units, facts_table, gib
from ckplan.render.fit import declare
from ckplan.units import format_flops

if TYPE_CHECKING:  # Rich is imported where a table is built: --json needs none
    from rich.console import Group
    from rich.table import Table

    from ckplan.hardware.gpus import GPU
    from ckplan.hardware.step_time import StepTime

# ---- JSON --------------------------------------------------------------------------------


def plan_dict(plan: Plan, time: StepTime | None = None, gpu: GPU | None = None) -> dict[str, Any]:
    """A plan in `estimate --json`'s shape (tests/json_schema.py), with `per_op` and
    `model_states`, its `time` object when a GPU was given, and with a GPU its peak as
    nvidia-smi shows it (`device_bytes`, null without one; `device`, by term)."""
    states = plan.model_states
    data = {
        "strategy": plan.strategy,
        "formula": plan.formula,
        "memory": {
            "per_layer_activation_bytes": plan.per_layer_activation_bytes,
            "breakdown": dict(plan.breakdown),
            "per_op": {op.name: op.saved_bytes for op in layer_ops(plan.spec)},
            "activation_bytes": plan.activation_bytes,
            "model_state_bytes": states.total,
            "model_states": {
                "weights": states.weights,
                "gradients": states.gradients,
                "optimizer": states.optimizer,
                "buffers": states.buffers,
                "gradient_lifetime": gradient_lifetime(plan.spec),
            }
            | ({"host": states.host} if states.host else {}),
            "total_bytes": plan.total_bytes,
            "optimizer_step_bytes": plan.optimizer_step_bytes,
            "reserved_bytes": plan.reserved_bytes,
            "device_bytes": None,
            "budgeted_bytes": plan.budgeted_bytes,
        },
        "parameters": {
            "total": plan.parameters_total,
            "per_gpu": plan.parameters_per_gpu,
            "trainable": parameter_count(plan.spec).trained,
        },
        "flops": {
            "forward": plan.flops.forward,
            "backward": plan.flops.backward,
            "recompute": plan.flops.recompute,
            "total": plan.flops.total,
        },
        "overhead": plan.overhead,
        "notes": list(plan.notes),
    }
    if time is not None:
        data["time"] = time.to_dict()
    if gpu is not None:
        device = plan.device_memory(gpu)
        data["memory"]["device_bytes"] = device.total
        data["memory"]["device"] = {
            "reserved_bytes": device.reserved,
            "cuda_context_bytes": device.cuda_context,
            "nccl_bytes": device.nccl,
            "paged_optimizer_bytes": device.paged_optimizer,
        }
        if device.symmetric_memory:
            data["memory"]["device"]["symmetric_memory_bytes"] = device.symmetric_memory
    if plan.stage_offloads:
        data["offload"] = offload_dict(plan, time)
    if plan.model_states.host:
        data["state_offload"] = state_offload_dict(plan, time)
    spec = plan.spec
    if spec.kind == "transformer" and spec.vocab:
        data["memory"]["loss"] = loss_terms(spec)
    policy = policy_terms(plan)
    if policy is not None:
        data["memory"]["policy"] = policy
    if plan.pipeline_buffer_bytes:
        data["memory"]["pipeline_buffer_bytes"] = plan.pipeline_buffer_bytes
    if len(distinct_kinds(spec)) > 1:
        data["memory"]["layer_kinds"] = layer_kinds_list(spec)
    layout = expert_layout(spec)
    if layout is not None:
        data["memory"]["model_states"]["experts"] = {
            "weights": states.expert_weights,
            "gradients": states.expert_gradients,
            "optimizer": states.expert_optimizer,
            "total": states.expert_total,
        }
        data["memory"]["expert_parallel"] = expert_layout_dict(layout)
        data["parameters"]["active"] = parameter_count(spec).active
    return data


def device_note(plan: Plan, gpu: GPU) -> str:
    """What the "on the device" row adds to the reserved peak (hardware.device_memory)."""
    device = plan.device_memory(gpu)
    terms = [f"CUDA context {gib(device.cuda_context)}"]
    reserved = "reserved"
    if device.total > gpu.memory_bytes:
        reserved = f"the allocated peak's blocks ({gib(device.reserved)}, more than the GPU holds)"
    elif device.reserved < plan.reserved_bytes:
        # the allocator frees its cache before it fails (model.allocator `reserved_within`)
        reserved = f"reserved within the GPU's memory ({gib(device.reserved)}, its cache freed)"
    if device.nccl:
        terms.append(f"NCCL buffers {gib(device.nccl)} (dp {plan.spec.dp})")
    if device.paged_optimizer:
        terms.append(f"paged optimizer {gib(device.paged_optimizer)}")
    if device.symmetric_memory:
        terms.append(f"async TP workspace {gib(device.symmetric_memory)}")
    return f"as nvidia-smi shows it: {reserved} + " + " + ".join(terms)


def layer_kinds_list(spec: ModelSpec) -> list[dict[str, Any]]:
    """Each kind of layer of a mixed model: which layers, and what one of them saves."""
    return copy.deepcopy(_layer_kinds_rows(spec))


@lru_cache(maxsize=32)  # a sweep describes the same model for each of its plans
def _layer_kinds_rows(spec: ModelSpec) -> list[dict[str, Any]]:
    rows = []
    for kind, found in kind_layer_indices(spec).items():
        indices = set(found)
        rows.append(
            {
                "kind": kind.name,
                "moe": kind.moe,
                "window": kind.window,
                "layers": format_layer_set(indices, spec.layers),
                "count": len(indices),
                "per_layer_activation_bytes": activation_bytes_per_layer(spec, kind),
                "breakdown": activation_breakdown(spec, kind),
                "per_op": {op.name: op.saved_bytes for op in layer_ops(spec, kind)},
            }
        )
    return rows


def expert_layout_dict(layout: ExpertLayout) -> dict[str, Any]:
    return {
        "experts": layout.experts,
        "top_k": layout.top_k,
        "ep": layout.ep,
        "etp": layout.etp,
        "expert_data_parallel": layout.expert_data_parallel,
        "experts_per_gpu": layout.experts_per_gpu,
        "expert_ffn_per_gpu": layout.expert_ffn_per_gpu,
        "moe_layers_per_gpu": layout.moe_layers_per_gpu,
        "tokens_per_gpu": layout.tokens_per_gpu,
        "routed_rows_per_gpu": layout.routed_rows_per_gpu,
        "average_rows_per_gpu": layout.average_rows_per_gpu,
        "expert_parameters_per_gpu": layout.expert_parameters_per_gpu,
        "moe_imbalance": layout.moe_imbalance,
        "capacity_factor": layout.capacity_factor,
    }


def expert_layout_line(layout: ExpertLayout, states_total: int, expert_states: int) -> str:
    """One line: the expert-parallel layout and what it puts on a GPU."""
    routing = {"average": "balanced routing", "worst": "worst-case routing"}.get(
        layout.moe_imbalance, f"{layout.moe_imbalance}x imbalance"
    )
    if layout.capacity_factor:
        routing = f"capacity factor {layout.capacity_factor:g}, padded"
    return (
        f"Experts: {layout.experts} (top-{layout.top_k}) over ep={layout.ep}: "
        f"{layout.experts_per_gpu} per GPU, each {layout.expert_ffn_per_gpu} wide "
        f"(etp={layout.etp}); expert data parallel {layout.expert_data_parallel}; "
        f"{layout.moe_layers_per_gpu} MoE layers per GPU, each routing "
        f"{layout.routed_rows_per_gpu:,} token copies to this GPU's experts per micro-batch "
        f"({routing}; {layout.tokens_per_gpu:,} tokens in); expert states "
        f"{gib(expert_states)} of {gib(states_total)}."
    )


def estimate_dict(
    plan: Plan,
    candidate: Candidate | None = None,
    time: StepTime | None = None,
    gpu: GPU | None = None,
) -> dict[str, Any]:
    data = {
        "ckplan_version": __version__,
        "model": plan.spec.to_dict(),
        **plan_dict(plan, time, gpu),
    }
    if candidate is not None:
        data |= {
            "usable_bytes": candidate.budget_bytes,
            "fits": candidate.fits,
            "headroom_bytes": candidate.headroom_bytes,
        }
    return data


# Architecture keys of one feature, shown as their own row when the model uses it.
ARCHITECTURE_FEATURES = {
    "attention+": (
        "head_dim",
        "qkv_bias",
        "qk_norm",
        "qk_norm_width",
        "post_norms",
        "parallel_residual",
        "attention_sinks",
        "sliding_window",
        "sliding_window_layers",
    ),
    "mla": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    "moe": (
        "experts",
        "top_k",
        "moe_ffn_hidden",
        "shared_experts",
        "shared_ffn_hidden",
        "shared_expert_gate",
        "expert_bias",
        "capacity_factor",
        "moe_layers",
    ),
    "moe routing": ("moe_router_num_groups", "moe_router_group_topk"),
    "mtp": ("mtp_layers",),
}
# Keys of the other parts that only MoE models, uneven, interleaved or DualPipe pipelines, model
# states on the host, hf's gradient sync, a torchtitan release or its context-parallel
# attention, Megatron's fused MoE kernels, Transformer Engine's FP8, torchao's float8 all-gather
# or an older bitsandbytes use, or checkpointing's reentrancy: shown when not default (the two
# once-a-step data-parallel overlaps when they differ from dp_comm_overlap).
QUIET_KEYS = frozenset(
    {
        "moe_imbalance",
        "ep",
        "etp",
        "first_stage_layers",
        "last_stage_layers",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "pipeline_layout",
        "microbatch_group_size",
        "pipeline_schedule",
        "optimizer_offload",
        "param_offload",
        "mlp_tiles",
        "moe_permute_fusion",
        "moe_router_fusion",
        "moe_act_input_fp8",
        "moe_token_dispatcher_type",
        "moe_dispatch_fp8",
        "overlap_moe_expert_parallel_comm",
        "overlap_grad_reduce",
        "overlap_param_gather",
        "fp8_recipe",
        "fp8_param_gather",
        "grad_sync",
        "cp_attention",
        "cp_a2a_size",
        "framework_version",
        "bitsandbytes_version",
        "fsdp_float8_all_gather",
        "deallocate_pipeline_outputs",
        "checkpoint_reentrant",
        "fsdp_backward_prefetch",
        "fsdp_reduce_dtype",
        "fsdp_version",
        "optimizer_implementation",
    }
)
PART_TITLES = {
    "shape": "run shape",
    "parallel": "parallel",
    "data_parallel": "data parallel",
    "states": "bytes/param",
    "execution": "execution",
    "finetune": "fine-tuning",
}


def model_rows(spec: ModelSpec) -> list[tuple[str, list[str]]]:
    """The resolved keys as (row title, keys) in the model's parts: the architecture (and a row
    per feature it uses), the run shape, parallelism, data parallelism, bytes per parameter and
    the execution (framework, kernels, precision, profile)."""
    parts = {name: getattr(spec, name) for name in PART_TITLES} | {
        "architecture": spec.architecture
    }
    featured = {key for keys in ARCHITECTURE_FEATURES.values() for key in keys}
    core = [f.name for f in dataclasses.fields(spec.architecture) if f.name not in featured]
    rows = [("architecture", core)]
    if spec.kind == "transformer":
        used = {
            "attention+": spec.head_dim * spec.heads != spec.hidden
            or spec.qkv_bias != spec.bias
            or spec.qk_norm
            or spec.post_norms
            or spec.parallel_residual
            or spec.attention_sinks
            or bool(spec.sliding_window),
            "mla": spec.mla,
            "moe": bool(spec.experts),
            "moe routing": bool(spec.moe_router_num_groups),
            "mtp": bool(spec.mtp_layers),
        }
        rows += [(name, list(keys)) for name, keys in ARCHITECTURE_FEATURES.items() if used[name]]
    for name, title in PART_TITLES.items():
        if name == "finetune" and spec.training == "full":
            continue  # the default: every weight trains
        part = parts[name]
        keys = [
            f.name
            for f in dataclasses.fields(part)
            if f.name not in QUIET_KEYS or _shown(spec, f.name, getattr(part, f.name), f.default)
        ]
        if name == "execution":
            keys.append("profile")
        rows.append((title, keys))
    return rows


def _shown(spec: ModelSpec, key: str, value: Any, default: Any) -> bool:
    if spec.experts and key in ("moe_imbalance", "ep", "etp"):
        return True
    if key in ("overlap_grad_reduce", "overlap_param_gather"):
        return value != spec.dp_comm_overlap
    if key == "optimizer_implementation":  # shown where set, or where its default is foreach
        return value is not None or frameworks.optimizer_implementation(spec) == "foreach"
    return value != (spec.tp if key == "etp" else default)


def model_table(spec: ModelSpec, title: str | None = None) -> Table:
    """Every resolved key, in the model's parts; the source as the caption."""
    from rich.table import Table

    table = Table(
        title=title or f"Model {spec.name}",
        show_header=False,
        title_justify="left",
        caption=f"source: {spec.source}" if spec.source else None,
        caption_justify="left",
    )
    table.add_column("part", style="bold")
    table.add_column("values")
    values = spec.to_dict()
    values["optimizer_implementation"] = frameworks.optimizer_implementation(spec)
    for name, keys in model_rows(spec):
        table.add_row(name, "  ".join(f"{key}={values[key]}" for key in keys))
    return table


def _sbh_coefficient(spec: ModelSpec, saved: int) -> str:
    """Bytes as a multiple of s·b·h, the unit of Korthikanti Table 2."""
    if spec.kind == "mlp":
        unit = spec.micro_batch * spec.hidden
    else:
        unit = spec.seq * spec.micro_batch * spec.hidden
    ratio = Fraction(saved, unit)
    return str(ratio) if ratio.denominator == 1 else f"{float(ratio):,.3f}"


def per_op_tables(spec: ModelSpec) -> list[Table]:
    """The per-op table of each kind of layer (one table for a uniform model)."""
    kinds = distinct_kinds(spec)
    if len(kinds) == 1:
        return [per_op_table(spec)]
    tables = []
    for kind, found in kind_layer_indices(spec).items():
        indices = set(found)
        where = format_layer_set(indices, spec.layers)
        title = f"{kind.name} layer ({len(indices)} of {spec.layers}: {where})"
        tables.append(per_op_table(spec, kind, title))
    return tables


def per_op_table(spec: ModelSpec, kind=None, title: str | None = None) -> Table:
    from rich.table import Table

    unit = "b·d" if spec.kind == "mlp" else "s·b·h"
    heading = "One layer, one micro-batch, one GPU, no recompute"
    table = Table(title=f"{title}: {heading}" if title else heading, title_justify="left")
    declare(table, f"x {unit}", "component", "recompute group", "forward FLOPs")
    table.add_column("op")
    table.add_column("component")
    table.add_column("saved", justify="right")
    table.add_column(f"x {unit}", justify="right")
    table.add_column("recompute group")
    table.add_column("forward FLOPs", justify="right")
    for op in layer_ops(spec, kind):
        table.add_row(
            op.name,
            op.component,
            gib(op.saved_bytes),
            _sbh_coefficient(spec, op.saved_bytes),
            op.group or "",
            format_flops(op.forward_flops),
        )
    total = sum(op.saved_bytes for op in layer_ops(spec, kind))
    table.add_row("total", "", gib(total), _sbh_coefficient(spec, total), "", "", style="bold")
    return table


def plan_summary_table(plan: Plan, gpu: GPU | None = None) -> Table:
    spec = plan.spec
    table = facts_table(f"Plan: strategy {plan.strategy}, formula {plan.formula}")
    table.add_row(
        "activations, one layer",
        gib(plan.per_layer_activation_bytes),
        "no recompute, one micro-batch",
    )
    for component, value in plan.breakdown.items():
        table.add_row(f"  {component}", gib(value), "")
    table.add_row("activations, step peak", both_units(plan.activation_bytes), _peak_note(spec))
    policy = policy_terms(plan)
    if policy is not None:
        unread = policy["compile_unread_bytes"]
        note = f"its input and the kept outputs of {', '.join(policy['kept']) or 'none'}"
        if policy["regions"]:
            note = (
                f"checkpointed {', '.join(policy['regions'])}: their inputs and the kept "
                f"outputs of {', '.join(policy['kept']) or 'none'}; the rest as autograd saves it"
            )
        if unread:
            note += f"; compiled, {gib(unread)} of them no backward reads is not saved"
        table.add_row("  stored layer (policy)", gib(policy["tape_bytes"]), note)
    if spec.kind == "transformer" and spec.vocab:
        terms = loss_terms(spec)
        table.add_row(
            f"  output + loss ({spec.loss})",
            gib(terms["saved_bytes"]),
            f"saved; its backward peaks at {gib(terms['backward_peak_bytes'])}",
        )
    if plan.pipeline_buffer_bytes:
        table.add_row(
            "  pipeline buffers",
            gib(plan.pipeline_buffer_bytes),
            "torch.distributed.pipelining: receive buffers of every micro-batch, kept outputs",
        )
    states = plan.model_states
    table.add_row("model states", both_units(states.total), _state_note(spec))
    frozen = spec.training != "full"
    base = spec.weight_format or f"{spec.weight_bytes} B/param"
    frozen_note = f"frozen linears {base}, the rest {spec.weight_bytes} B/param" + (
        f"; adapters {spec.weight_bytes} B/param" if spec.finetune.adapters else ""
    )
    if frozen and spec.param_offload != "none":
        kept = "the 4-bit statistics" if spec.weight_format in ("nf4", "fp4") else "none"
        frozen_note = f"frozen weights: {kept}; their shards on the host (param_offload)"
    table.add_row(
        "  weights",
        gib(states.weights),
        frozen_note if frozen else _weights_note(spec),
    )
    on_host = spec.optimizer_offload != "none"
    table.add_row(
        "  gradients",
        gib(states.gradients),
        (
            f"{spec.grad_bytes} B/param, unsharded until the last micro-batch (no_sync); "
            "then on the host (optimizer_offload)"
            if states.gradients
            else "on the host (optimizer_offload)"
        )
        if on_host
        else f"{spec.grad_bytes} B/param"
        + (" (trainable parameters only)" if frozen else "")
        + ("; one layer's at a time (optimizer_in_backward)" if spec.optimizer_in_backward else "")
        + (
            "; those the backward has written by the peak"
            if gradients_allocated_in_backward(spec)
            else ""
        )
        + (
            "; all of them all step, kept zeroed between steps (zero_grad: zeros)"
            if gradients_kept_between_steps(spec)
            else ""
        ),
    )
    name = "Adam" if spec.optimizer == "adamw" else spec.optimizer
    held = f"master + {name}" if spec.master_bytes else f"{name}; the weights are the master copy"
    per_tensor = " + per-tensor states" if optimizer_tensor_bytes(spec, 0) else ""
    table.add_row(
        "  optimizer",
        gib(states.optimizer),
        "on the host (optimizer_offload)"
        if on_host
        else f"{spec.master_bytes + spec.optimizer_bytes} B/param{per_tensor} ({held})",
    )
    if states.buffers:
        owner = f"{spec.framework}'s"
        if spec.framework == "hf" and spec.zero >= 2 and spec.dp > 1:  # the Trainer's FSDP
            owner = f"hf's FSDP{frameworks.fsdp_version(spec)}"
        table.add_row("  buffers", gib(states.buffers), f"{owner} (docs/memory.md)")
    if states.host:
        table.add_row(
            "model states on host", both_units(states.host), host_state_note(spec), style="bold"
        )
    if spec.experts:
        table.add_row(
            "  of which experts",
            gib(states.expert_total),
            f"E/ep = {spec.experts // spec.ep} experts per GPU, ZeRO-{spec.zero} over "
            f"expert-DP {spec.expert_data_parallel}",
        )
    if plan.optimizer_step_bytes:
        workspace = optimizer_workspace_bytes(spec, plan.peak_stage)
        what = (
            "Adafactor's fp32 temporaries of its largest tensor"
            if spec.optimizer == "adafactor"
            else "foreach AdamW's copy of exp_avg_sq"
        )
        fused = (
            ""
            if spec.optimizer == "adafactor"
            else "; optimizer_implementation: fused allocates none"
        )
        table.add_row(
            "optimizer step",
            both_units(plan.optimizer_step_bytes),
            f"weights, every gradient and the optimizer states, with {what} ({gib(workspace)})"
            + fused,
        )
    total_note = "the optimizer step's" if plan.step_sets_peak else "activations + model states"
    table.add_row("total per GPU", both_units(plan.total_bytes), total_note, style="bold")
    table.add_row(
        "  reserved",
        both_units(plan.reserved_bytes),
        "the CUDA caching allocator's peak with memory to spare (max_memory_reserved)"
        + reserved_note(
            spec.framework,
            spec.training,
            spec.zero,
            spec.dp,
            spec.expandable_segments,
            frameworks.fsdp_version(spec),
        ),
    )
    if gpu is not None:
        table.add_row(
            "  on the device", both_units(plan.device_memory(gpu).total), device_note(plan, gpu)
        )
    table.add_row(
        "parameters",
        f"{plan.parameters_total:,}",
        f"{plan.parameters_per_gpu:,} on the busiest GPU",
    )
    if spec.experts:
        table.add_row("  active", f"{parameter_count(spec).active:,}", "per token (top-k experts)")
    if spec.training != "full":
        trained = parameter_count(spec).trained
        share = trained / plan.parameters_total if plan.parameters_total else 0.0
        what = (
            f"{'DoRA' if spec.finetune.use_dora else 'LoRA'} r={spec.lora_rank} on "
            f"{spec.lora_targets}, beside the total"
            if spec.finetune.adapters
            else "every weight frozen"
        )
        table.add_row("  trainable", f"{trained:,}", f"{share:.4%} of the total; {what}")
    flops = plan.flops
    table.add_row("forward", format_flops(flops.forward), "per iteration, one GPU")
    table.add_row("backward", format_flops(flops.backward), "")
    table.add_row("recompute", format_flops(flops.recompute), "")
    table.add_row(
        "overhead", f"{plan.overhead:.2%}", "recompute / (forward + backward)", style="bold"
    )
    for note in plan.notes:
        table.add_row("note", "", note)
    return table


def policy_terms(plan) -> dict[str, Any] | None:
    """A per-op policy's stored layer (the representative kind), per term: the policy, the
    units whose outputs it keeps, the layer's tape (its input and those outputs) and, under
    torch.compile, the kept outputs not saved because no backward reads them (already out of
    the tape); None when the plan runs no policy."""
    from ckplan.model import op_policy

    policies = [group for group in plan.recompute_groups if op_policy.is_policy(group)]
    if not policies:
        return None
    chain, policy = plan.spec.chain, op_policy.parse_policy(policies[0])
    return {
        "policy": policies[0],
        "kept": list(op_policy.kept_units(chain, policy)),
        "regions": [name for name, _ in policy.scopes],
        "tape_bytes": op_policy.policy_tape_bytes(chain, policy),
        "compile_unread_bytes": op_policy.compile_unread_bytes(chain, policy),
    }


def loss_terms(spec: ModelSpec) -> dict[str, Any]:
    """The output stage (final norm, output layer, loss) as the chosen loss holds it, per term:
    its tape, what its forward holds beyond its input, its backward's peak."""
    from ckplan.model import loss

    chain = spec.chain
    return {
        "kind": spec.loss,
        "saved_bytes": loss.output_saved_bytes(chain),
        "forward_workspace_bytes": loss.output_forward_workspace_bytes(chain),
        "backward_peak_bytes": loss.output_backward_peak_bytes(chain),
    }


def _peak_note(spec: ModelSpec) -> str:
    if spec.pp > 1:
        return f"busiest pipeline stage, {spec.layers_per_stage} layers, micro-batches in flight"
    return "live at the peak of one training step"


def _weights_note(spec: ModelSpec) -> str:
    if spec.fp8_param_gather:
        return f"FP8 linear weights 1 B/param, the rest {spec.weight_bytes} B/param"
    return f"{spec.weight_bytes} B/param"


def _state_note(spec: ModelSpec) -> str:
    if spec.training != "full":
        zero = f", ZeRO-{spec.zero} over dp={spec.dp}" if spec.zero else ""
        return f"training: {spec.training}: frozen weights, trainable parameters' states{zero}"
    per_param = spec.weight_bytes + spec.grad_bytes + spec.master_bytes + spec.optimizer_bytes
    zero = f", ZeRO-{spec.zero} over dp={spec.dp}" if spec.zero else ""
    if spec.optimizer_offload != "none":
        return f"{per_param} B/param{zero}; on the device: what is not on the host"
    return f"{per_param} B/param{zero}"


def state_offload_dict(plan: Plan, time: StepTime | None = None) -> dict[str, Any]:
    """The JSON `state_offload` object of a plan with model states on the host
    (docs/offloading.md, "Model states on the host"): host bytes per GPU, one step's copies
    each way and the CPU step's bytes (`hardware.host_states.state_traffic`), and with a GPU
    the CPU step's and the exposed copies' seconds."""
    from ckplan.hardware.host_states import state_traffic

    traffic = state_traffic(plan.spec)
    data: dict[str, Any] = {
        "host_bytes": plan.model_states.host,
        "gradients_to_host_bytes": traffic.gradients_to_host,
        "gathers_to_device_bytes": traffic.gathers_to_device,
        "after_step_to_device_bytes": traffic.after_step_to_device,
        "cpu_step_bytes": traffic.cpu_bytes,
    }
    if time is not None:
        data["cpu_step_seconds"] = time.optimizer_seconds
        data["exposed_seconds"] = time.state_copy_seconds
    return data


def host_state_note(spec) -> str:
    """What the host holds per GPU under optimizer_offload (memory.offloaded_states)."""
    ds = spec.framework == "deepspeed"
    gradients = {4: "fp32", 2: "bf16"}.get(host_gradient_bytes(spec), "")
    parts = ["master + Adam" if spec.master_bytes or ds else "Adam", f"{gradients} gradients"]
    if not ds or spec.param_offload != "none":
        parts.insert(0, "weights")
    elif spec.zero < 3:
        parts.append(f"a {spec.weight_bytes} B/param copy and staging")
    name = "ZeRO-Offload" if ds else "FSDP CPU offload"
    if spec.training != "full":
        adapters = "the adapters' " + ", ".join(parts)
        frozen = "the frozen weights' shard; " if spec.param_offload != "none" else ""
        return f"per GPU, {name}: {frozen}{adapters}"
    return f"per GPU, {name}: " + ", ".join(parts)


def offload_dict(plan: Plan, time: StepTime | None = None) -> dict[str, Any]:
    """The JSON `offload` object of a plan with tapes on host (docs/offloading.md)."""
    peak = dict(plan.stage_offloads).get(plan.peak_stage, ())
    data: dict[str, Any] = {
        "host_bytes": plan.host_bytes,
        "bytes_moved": plan.bytes_moved,
        "offloaded_stages": [plan.stage_names[i] for i, _ in peak],
    }
    if time is not None:
        data["exposed_seconds"] = time.offload_exposed_seconds
    return data


def _offloaded(plan: Plan, peak) -> str:
    """'33 tapes', or '32 checkpointed inputs and 1 tape' for full+offload."""
    from ckplan.plan.offload import offloaded_input_count, offloaded_words

    stages = [i for i, _ in peak]
    return offloaded_words(len(stages), offloaded_input_count(plan.steps, stages))


def offload_comparison(offload, recompute, gpu, scope: str) -> str:
    """One sentence: an offload plan's step against the best recomputation `scope` (two timed
    candidates), how much of it is exposed copies, and why (the largest copy beside the
    layer compute it overlaps, plan.offload.largest_copy)."""
    from ckplan.plan.offload import largest_copy
    from ckplan.render.time import seconds

    fast, slow = offload.time.step_seconds, recompute.time.step_seconds
    gap = abs(slow - fast)
    if fast == slow:  # the copies hide and the recomputation it replaces costs nothing here
        text = (
            f"{offload.plan.strategy} takes {seconds(fast)}, as long as the best recomputation "
            f"{scope}, {recompute.plan.strategy}, which needs no host memory"
        )
    else:
        text = (
            f"{offload.plan.strategy} takes {seconds(fast)}, {seconds(gap)} ({gap / slow:.1%}) "
            f"{'less' if fast < slow else 'more'} than the best recomputation {scope}, "
            f"{recompute.plan.strategy} ({seconds(slow)})"
        )
    copy = largest_copy(offload.plan, gpu)
    if copy is None:
        return text + "; it offloads nothing here"
    return text + (
        f"; copies exposed {seconds(offload.time.offload_exposed_seconds)}: a "
        f"{gib(copy.nbytes)} copy takes {seconds(copy.copy_seconds)} beside a layer's forward "
        f"{seconds(copy.forward_seconds)} and backward {seconds(copy.backward_seconds)}, "
        f"{gib(offload.plan.host_bytes)} pinned per GPU"
    )


def offload_text(plan: Plan, time: StepTime | None = None, host_budget: int | None = None) -> str:
    """One line on a plan's offloaded tapes: how many, host bytes, bytes moved, exposed copies."""
    peak = dict(plan.stage_offloads).get(plan.peak_stage, ())
    text = (
        f"{plan.strategy}: {_offloaded(plan, peak)} on host, {gib(plan.host_bytes)} pinned per GPU"
        + (f" (of {gib(host_budget)} host memory per GPU)" if host_budget is not None else "")
        + f", {gib(plan.bytes_moved)} moved per step"
    )
    if time is not None:
        from ckplan.render.time import seconds

        text += f", copies exposed {seconds(time.offload_exposed_seconds)}"
    return text + "."


def estimate_view(
    plan: Plan,
    candidate: Candidate | None = None,
    time: StepTime | None = None,
    gpu: GPU | None = None,
) -> Group:
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [
        model_table(plan.spec),
        *per_op_tables(plan.spec),
        plan_summary_table(plan, gpu),
    ]
    layout = expert_layout(plan.spec)
    if layout is not None:
        states = plan.model_states
        parts.append(Text(expert_layout_line(layout, states.total, states.expert_total)))
    if plan.stage_offloads:
        host = None
        if gpu is not None:
            from ckplan.hardware.host_link import host_memory_per_gpu

            host = host_memory_per_gpu(gpu)
        parts.append(Text("Offload: " + offload_text(plan, time, host)))
    if time is not None:
        from ckplan.render.time import step_time_table

        parts.append(step_time_table(plan, time, gpu))
        if gpu is not None:
            parts.append(Text(f"Accuracy: {accuracy_note(gpu.name, plan.spec.framework)}."))
    elif gpu is not None:
        parts.append(
            Text(
                f"No step time on {gpu.name}: the simple formula set has no schedule to time "
                "(use --formula derived).",
                style="dim",
            )
        )
    if candidate is not None:
        verdict = "fits" if candidate.fits else "does not fit"
        tight = ""
        if candidate.fits and plan.reserved_bytes > candidate.budget_bytes:
            # the allocator releases its cached blocks rather than fail (model.allocator)
            tight = (
                f"; the allocator frees its cache to fit (it reserves {gib(plan.reserved_bytes)} "
                "with memory to spare)"
            )
        parts.append(
            Text(
                f"{verdict}: {gib(plan.total_bytes)} of {gib(candidate.budget_bytes)} usable "
                f"(budget less reserve), headroom {gib(candidate.headroom_bytes)}{tight}"
                + (
                    f"; host {gib(plan.host_total_bytes)} of "
                    f"{gib(candidate.host_budget_bytes)} host memory per GPU"
                    if plan.model_states.host and candidate.host_budget_bytes is not None
                    else ""
                ),
                style="bold green" if candidate.fits else "bold red",
            )
        )
    return Group(*parts)


def presets_table(rows: list[tuple[str, ModelSpec, int]]) -> Table:
    from rich.table import Table

    table = Table(title="Presets", title_justify="left")
    for column in (
        "name",
        "params",
        "layers",
        "hidden",
        "heads/kv",
        "ffn",
        "seq",
        "vocab",
        "arch",
        "tp/pp",
    ):
        table.add_column(column, justify="left" if column in ("name", "arch") else "right")
    for name, spec, params in rows:
        arch = f"{spec.norm}, {spec.mlp}, {spec.attention}"
        if spec.mla:
            arch += ", mla"
        if spec.experts:
            arch += f", moe {spec.experts}x top-{spec.top_k}"
        if spec.sliding_window:
            arch += f", window {spec.sliding_window}"
        table.add_row(
            name,
            f"{params / 1e9:,.2f} B" if params >= 10**9 else f"{params / 1e6:,.1f} M",
            str(spec.layers),
            str(spec.hidden),
            f"{spec.heads}/{spec.kv_heads}",
            str(spec.ffn_hidden),
            str(spec.seq),
            str(spec.vocab),
            arch,
            f"{spec.tp}/{spec.pp}",
        )
    return table
