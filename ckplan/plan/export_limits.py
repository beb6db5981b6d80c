"""What the launcher exports refuse in a plan, known where plans are made.

A launcher cannot run a schedule step by step: it wraps ranges of transformer layers in a
checkpoint, one level deep, and applies one recompute setting to every pipeline stage. So an
export recovers the layer segments of the plan's replayed steps (`layer_segments`) and refuses a
schedule that has none. The same functions decide both: ckplan.exports writes from these
segments, and `launcher_ranges.unwritten_reason` gives the plan its note
(`model.op_policy.NO_EXPORT`).

Each launcher then runs only some segments: Megatron-LM's --recompute-method uniform or block,
torchtitan's every block or every N-th, the Trainer's and torchtune's every layer or none.
`target_reason` mirrors those rules of each export (`ckplan.exports.TARGETS`), each citing the
export function it follows, for what depends on the plan (its segments, modules, policy,
offloaded layers); an export's refusals that depend on the model and layout alone (an
architecture, a parallel degree, a precision) are the same for every plan of a job and are not
repeated here. `framework_reason` says whether any of the targets of the job's framework
(`FRAMEWORK_TARGETS`) writes a plan, so that `search.choose` names only such a plan and keeps
the others as references (tests/test_export_limits.py checks the verdicts against the exports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckplan.model.op import DENSE_MLP
from ckplan.model.op_policy import (
    TORCHTITAN_03_POLICY,
    TORCHTITAN_POLICY,
    is_policy,
    kept_units,
    op_recognised,
    parse_policy,
    scope_wrap_reason,
    unit_ops,
)
from ckplan.model.torchtitan_ac import policy_reason, spec_release
from ckplan.plan.launcher_ranges import is_layer, layer_positions, layer_ranges, pipeline_reason
from ckplan.plan.strategies import MODULES

if TYPE_CHECKING:
    from ckplan.model.spec import ModelSpec
    from ckplan.plan.evaluate import Plan


@dataclass(frozen=True)
class LayerSegments:
    """The layers of one pipeline stage as half-open `(start, end, recompute)` ranges over
    0..layers-1 (indices within the stage), whether the attention core is recomputed on top
    (selective), whether the dense MLP is (`mlp`), and which MoE group is (`moe`: the whole MoE
    block, `experts`: the routed expert MLPs; None), and the stored layers whose tapes go to host
    memory (`offloaded`, indices within the stage: ckplan.schedules.offload)."""

    layers: int
    segments: tuple[tuple[int, int, bool], ...]
    selective: bool
    moe: str | None = None
    mlp: bool = False
    policy: str | None = None  # a per-op policy (`sac:...`) in every stored layer
    offloaded: tuple[int, ...] = ()
    # Megatron-Core's other --recompute-modules (layernorm, moe_act, mla_up_proj,
    # shared_experts: strategies.MODULES), in its order
    extra: tuple[str, ...] = ()
    # `POLICY+mixed` (plan.policy_mix): the stored layers that store the policy's tape, the
    # others their full tape; None: the policy in every stored layer
    policy_layers: tuple[int, ...] | None = None
    # the layers of each model chunk of an interleaved stage, in order (empty: one chunk)
    chunks: tuple[int, ...] = ()

    @property
    def modules(self) -> bool:
        """Whether a module of the layer (attention core, MLP, MoE) is recomputed on top, or a
        per-op policy decides what the layer keeps."""
        return (
            self.selective
            or self.mlp
            or self.moe is not None
            or self.policy is not None
            or bool(self.extra)
        )

    @property
    def recomputed(self) -> tuple[tuple[int, int], ...]:
        return tuple((start, end) for start, end, recompute in self.segments if recompute)

    @property
    def stores_all(self) -> bool:
        return not self.recomputed

    def uniform_size(self) -> int | None:
        """K when every layer is recomputed in segments of K from the first layer of each
        model chunk (the stage's, without interleaving), the last of each possibly shorter
        (Megatron `uniform`, Chen et al.'s segments)."""
        if not self.segments or not all(recompute for *_, recompute in self.segments):
            return None
        size = max(end - start for start, end, _ in self.segments)
        chunks = self.chunks if sum(self.chunks) == self.layers else (self.layers,)
        segments, chunk_end = iter(self.segments), 0
        for chunk in chunks:
            chunk_end += chunk
            end, sizes = None, []
            while end != chunk_end:
                start, end, _ = next(segments, (0, chunk_end + 1, True))
                if end > chunk_end:  # a segment across the chunk's end
                    return None
                sizes.append(end - start)
            if any(n != size for n in sizes[:-1]):
                return None
        return size

    def block_count(self) -> int | None:
        """N when the first N layers are each recomputed alone and the rest stored (Megatron
        `block`); 0 when nothing is recomputed."""
        count = 0
        for start, end, recompute in self.segments:
            if not recompute:
                break
            if end - start != 1:
                return None
            count += 1
        stored = self.segments[count:]
        return count if len(stored) <= 1 and not any(r for *_, r in stored) else None

    def every_nth(self) -> int | None:
        """N when exactly the layers N-1, 2N-1, ... are each recomputed alone and every other
        layer is stored (torchtitan's `selective_ac_option = N`)."""
        recomputed = {start for start, end in self.recomputed if end - start == 1}
        if len(recomputed) != len(self.recomputed) or not recomputed:
            return None
        step = min(recomputed) + 1
        return step if recomputed == set(range(step - 1, self.layers, step)) else None


def layer_segments(plan: Plan) -> LayerSegments | str:
    """The plan's layer segments, or the reason (one phrase) why it has none."""
    spec = plan.spec
    selective = plan.strategy.startswith("selective")
    moe = {"moe": "moe", "moe/experts": "experts"}
    moe_group = next((moe[g] for g in plan.recompute_groups if g in moe), None)
    names = plan.stage_names
    if not plan.steps:
        return "it has no schedule (the simple formula set)"
    flags = None  # per layer of the stage: whether it stores the policy's tape (sac+mixed)
    for _, mask in plan.stage_policy:
        flags = [on for on, name in zip(mask, names, strict=True) if is_layer(name)]
    if why := pipeline_reason(spec.pp, plan.strategy, bool(plan.stage_offloads)):
        return why
    result = layer_ranges(plan.steps, names)
    if isinstance(result, str):
        return result
    positions, _ = layer_positions(tuple(names))
    layers, first_layer = len(positions), positions[0] if positions else 0
    merged: list[tuple[int, int, bool]] = []
    for start, end, recompute in result:
        if merged and not recompute and not merged[-1][2]:
            merged[-1] = (merged[-1][0], end, False)
        else:
            merged.append((start, end, recompute))
    policy = next((group for group in plan.recompute_groups if is_policy(group)), None)
    policy_layers = None
    if flags is not None and not all(flags):
        if any(flags[i] for start, end, again in merged if again for i in range(start, end)):
            # measured on torch 2.13 (tests/test_export_torch.py): the caches of a selective
            # checkpoint inside an enclosing checkpoint stay alive through the forward
            return (
                "a recomputed layer stores the per-op policy's tape when it re-runs, and a "
                "selective checkpoint inside an enclosing checkpoint keeps its caches alive "
                "through the forward"
            )
        policy_layers = tuple(i for i, on in enumerate(flags) if on)
    offloaded = dict(plan.stage_offloads).get(plan.peak_stage, ())
    return LayerSegments(
        layers,
        tuple(merged),
        selective,
        moe_group,
        DENSE_MLP in plan.recompute_groups,
        policy,
        tuple(i - first_layer for i, _ in offloaded if is_layer(names[i])),
        tuple(word for word, group in MODULES.items() if group in plan.recompute_groups),
        policy_layers,
        _chunks(spec, plan.peak_stage),
    )


def _chunks(spec: ModelSpec, stage: int) -> tuple[int, ...]:
    """The layers of each model chunk of pipeline stage `stage`; () without interleaving."""
    from ckplan.model.layers import stage_chunk_layers

    if spec.virtual_stages <= 1:
        return ()
    return tuple(n for n in stage_chunk_layers(spec, stage) if n)


# The element-wise units of Hugging Face transformers' LlamaDecoderLayer (modeling_llama.py,
# transformers 5.x) by the aten op that writes their output and its count in a layer, as torch
# 2.13 runs it (traced on CPU; the bf16 casts are aten._to_copy, not counted): LlamaRMSNorm
# runs pow, mean, add (+ eps), rsqrt, mul, mul; apply_rotary_pos_emb q·cos + rotate_half(q)·sin
# (mul, neg, cat, mul, add) for q, then k; the residual adds are adds; LlamaMLP runs silu and
# the product mul. A norm whose backward reads tensors of its own (`Unit.internal`) is not
# among them: its output alone spares nothing.
_HF_ELEMENTWISE = {
    "norm1": (("mul", 2),),
    "rope": (("add", 2), ("add", 3)),
    "out_proj_add": (("add", 4),),
    "norm2": (("mul", 8),),
    "gate_act": (("silu", 1),),
    "act": (("mul", 9),),
    "fc2_add": (("add", 6),),
}


def elementwise_ops(spec: ModelSpec) -> dict[str, tuple[tuple[str, int], ...]]:
    """The element-wise units a policy_fn can name on `spec`'s layers, with their (aten op,
    count in the layer): Hugging Face's dense Llama layers (no QK-norm, a gated MLP), units
    without internal tensors; none elsewhere."""
    if spec.framework != "hf" or spec.mla or spec.experts or spec.qk_norm or spec.mlp == "gelu":
        return {}
    internal = {unit.name for unit in unit_ops(spec) if unit.internal}
    return {name: ops for name, ops in _HF_ELEMENTWISE.items() if name not in internal}


# The launcher targets of `ckplan export` that run each framework's jobs (docs/exports.md): its
# own configuration, and the torch snippet where the job's code wraps its layers itself
# (torchtitan's blocks, DeepSpeed's engine, Hugging Face's Trainer and torchtune's recipes).
FRAMEWORK_TARGETS = {
    "megatron": ("megatron",),
    "torchtitan": ("torchtitan", "torch"),
    "deepspeed": ("deepspeed", "torch"),
    "hf": ("torch", "peft", "torchtune"),
}
# The launcher targets `target_reason` judges (ckplan.exports.TARGETS less `yaml`, which
# writes any plan), in the order a note names one that writes a plan: the torch snippet first,
# which refuses no layout.
LAUNCHERS = ("torch", "deepspeed", "torchtitan", "torchtune", "peft", "megatron")
# Targets that write offloaded tapes (exports.why_not), and how a note names the others
OFFLOAD_TARGETS = ("torch", "deepspeed", "torchtune")
NO_OFFLOAD = {
    "megatron": "no Megatron-LM flag",  # exports.megatron.offload_reason
    "torchtitan": "no torchtitan option",
    "peft": "no Trainer argument",
}


def target_reason(
    target: str,
    spec: ModelSpec,
    layers: LayerSegments | str,
    offloads: bool = False,
    release: str | None = None,
) -> str | None:
    """Why launcher `target` (`LAUNCHERS`) does not write a plan of `spec` with layer segments
    `layers` (`layer_segments`, or its reason for having none) that offloads tapes to host on
    some stage or not (`offloads`), one phrase, or None where it does given that it runs
    `spec`'s model and layout. `release`: torchtitan's (default: the one `spec` runs,
    `torchtitan_ac.spec_release`). Mirrors ckplan.exports.why_not and the target's `reason`,
    less the refusals that depend on the model and layout alone."""
    if isinstance(layers, str):
        return layers
    if why := _common_reason(target, spec, layers, offloads):
        return why
    rules = {
        "megatron": _megatron_reason,
        "torch": _torch_reason,
        "deepspeed": _deepspeed_reason,
        "peft": _peft_reason,
        "torchtune": _torchtune_reason,
    }
    if target == "torchtitan":
        return _torchtitan_reason(spec, layers, release or spec_release(spec))
    return rules[target](spec, layers)


def _common_reason(
    target: str, spec: ModelSpec, layers: LayerSegments, offloads: bool
) -> str | None:
    """The refusals of ckplan.exports.why_not before a target's own `reason`: offloaded tapes
    outside `OFFLOAD_TARGETS`, TiledMLP, Megatron-Core's MTP layers outside Megatron-LM, a
    mixed plan outside the torch snippet, DeepSpeed's cpu_checkpointing
    (exports.deepspeed.offload_reason)."""
    if offloads and target not in OFFLOAD_TARGETS:
        return f"{NO_OFFLOAD[target]} offloads these tapes to host"
    if spec.mlp_tiles > 1:
        return "TiledMLP replaces the MLP's forward in the model's code; no config key runs it"
    if spec.mtp_layers and target != "megatron":
        return "MTP layers are Megatron-Core's; no other target runs them"
    if layers.policy_layers is not None and target != "torch":
        return "it stores the full tape in some layers and the per-op policy's in others"
    if target == "deepspeed" and offloads:
        starts = {start for start, _ in layers.recomputed}
        if set(layers.offloaded) != starts or not starts:
            return "DeepSpeed's cpu_checkpointing moves the inputs of checkpointed layers only"
    return None


def _module_reason(layers: LayerSegments) -> str | None:
    """exports.segments.module_reason: every target but Megatron-LM recomputes no module (the
    dense MLP, an MoE group, Megatron-Core's others) and, but for the torch snippet and
    torchtitan, runs no per-op policy."""
    if layers.policy:
        return "it runs a per-op policy"
    if layers.moe or layers.mlp or layers.extra:
        return "it recomputes a module of the layer, which only Megatron-LM's flags name"
    return None


def _megatron_reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """ckplan.exports.megatron.reason: Megatron-LM's --recompute-granularity selective (the
    modules of --recompute-modules, no method) or full with --recompute-method uniform (equal
    segments from each model chunk's first layer) or block (its first layers one by one),
    megatron/training/arguments.py and transformer_block.py `_checkpointed_forward` at
    core_v0.19.0; MTP layers only with uniform 1 (multi_token_prediction.py, core_v0.14.0)."""
    if layers.policy:
        return "it runs a per-op policy; Megatron-LM recomputes whole layers or modules"
    if layers.moe == "experts":
        return "Megatron-LM's --recompute-modules has no experts-only module"
    discarding = [word for word in layers.extra if word in ("layernorm", "moe_act")]
    if discarding and spec.precision == "fp8" and spec.fp8_recipe == "delayed":
        return f"Megatron-Core refuses {discarding[0]} recomputation under FP8 delayed scaling"
    if (layers.moe or layers.mlp or layers.extra or layers.selective) and layers.recomputed:
        return (
            "it recomputes modules and whole layers, and Megatron-LM's selective granularity "
            "takes no --recompute-method"
        )
    if layers.stores_all or layers.selective:
        return None
    size = layers.uniform_size()
    if spec.mtp_layers and size not in (None, 1):
        return "Megatron-Core recomputes MTP layers only with --recompute-num-layers 1"
    if spec.mtp_layers and size is None and layers.block_count() is not None:
        return "Megatron-Core skips the MTP layers under the block method"
    if size is not None:
        return _megatron_chunk_reason(spec, size)
    if layers.block_count() is not None:
        if spec.virtual_stages > 1:
            return "Megatron-LM's block method recomputes the first layers of each model chunk"
        return None
    return (
        "its recomputed segments are neither Megatron-LM's --recompute-method uniform (equal "
        "segments from the first layer) nor block (the first layers one by one)"
    )


def _megatron_chunk_reason(spec: ModelSpec, size: int) -> str | None:
    """exports.megatron.reason for uniform segments of `size`: Megatron-LM segments each model
    chunk (a pipeline stage, or a virtual stage when interleaving), so `size` must divide each
    one's layers where there are virtual stages."""
    from ckplan.model.layers import stage_chunk_layers

    if spec.virtual_stages <= 1:
        return None
    if spec.parsed_layout is not None:
        chunks = {n for k in range(spec.pp) for n in stage_chunk_layers(spec, k) if n}
    else:
        chunks = {spec.layers_per_stage // spec.virtual_stages}
    if any(n % size for n in chunks):
        return f"uniform segments of {size} layers do not divide Megatron-LM's model chunks"
    return None


def _torch_reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """ckplan.exports.torch_snippet.reason: torch.utils.checkpoint wraps any one-level
    segments; a per-op policy runs where a policy_fn recognises every unit it keeps (by aten
    op: `op_policy.op_recognised`, or Hugging Face's element-wise units, `elementwise_ops`) and
    its layers run q, k, v and attention as the snippet does; a scoped one alone, around
    submodules (`op_policy.scope_wrap_reason`)."""
    if not layers.policy:
        return _module_reason(layers)
    policy = parse_policy(layers.policy)
    if policy.scopes:
        if layers.offloaded or layers.policy_layers is not None or layers.recomputed:
            return "the snippet wraps a scoped policy's regions in every layer and nothing else"
        return scope_wrap_reason(spec, policy)
    if layers.offloaded:
        return "the snippet runs a per-op policy or offloaded layers, not both"
    if policy.fused_qkv or policy.flex:
        return "the snippet's layer runs q, k, v as three linears and attention as SDPA"
    elementwise = elementwise_ops(spec)
    kept = kept_units(spec, policy)
    named = sorted(
        name
        for name in policy.names
        if name in kept and name not in elementwise and not op_recognised(spec, name)
    )
    if named:
        return f"no policy_fn recognises {', '.join(named)} by its aten op"
    return None


def _deepspeed_reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """ckplan.exports.deepspeed.reason: DeepSpeed's activation checkpointing runs any one-level
    segments (deepspeed.checkpointing.checkpoint around each), no module nor policy."""
    return _module_reason(layers)


def _whole_layers_reason(layers: LayerSegments, launcher: str) -> str | None:
    """Where `launcher` checkpoints every layer or none: no module, no attention core alone
    (the Trainer's gradient_checkpointing, transformers modeling_utils.py; torchtune's
    enable_activation_checkpointing, torchtune/training/_activation_checkpointing.py v0.6.1)."""
    if why := _module_reason(layers):
        return why
    if layers.selective:
        return f"{launcher} wraps whole layers, not the attention core"
    if layers.stores_all or layers.uniform_size() == 1:
        return None
    return f"{launcher} recomputes every layer (one per checkpoint) or none"


def _peft_reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """ckplan.exports.peft.reason: Hugging Face's Trainer (`_whole_layers_reason`)."""
    return _whole_layers_reason(layers, "the Trainer")


def _torchtune_reason(spec: ModelSpec, layers: LayerSegments) -> str | None:
    """ckplan.exports.torchtune.reason: torchtune's recipes (`_whole_layers_reason`), and its
    enable_activation_offloading offloads every layer or none."""
    if why := _whole_layers_reason(layers, "torchtune"):
        return why
    if layers.offloaded and set(layers.offloaded) != set(range(layers.layers)):
        return "torchtune's enable_activation_offloading offloads every layer or none"
    return None


def _torchtitan_reason(spec: ModelSpec, layers: LayerSegments, release: str) -> str | None:
    """ckplan.exports.torchtitan.reason: torchtitan's activation_checkpoint applies one mode
    to every block: none, full, 0.2.x's every N-th block (selective_ac_option = N,
    torchtitan/config/job_config.py at v0.2.2) or its per-op policy in every block
    (`torchtitan_ac.policy_reason`), which 0.3.0 applies to the whole model
    (torchtitan/distributed/activation_checkpoint.py at v0.3.0)."""
    if layers.policy:
        torchtitan_policy = layers.policy in (TORCHTITAN_POLICY, TORCHTITAN_03_POLICY)
        if torchtitan_policy and not layers.stores_all:
            return "torchtitan applies one activation-checkpoint mode to every block"
        return policy_reason(spec, layers.policy, release)
    if why := _module_reason(layers):
        return why
    if layers.selective:
        return "torchtitan's selective AC saves attention, the opposite of recomputing its core"
    if layers.stores_all or layers.uniform_size() == 1:
        return None
    if release == "0.2" and layers.every_nth() is not None:
        return None
    return "torchtitan wraps every block alike (or, in 0.2.x, every N-th block)"


def plan_target_reason(plan: Plan, target: str, release: str | None = None) -> str | None:
    """`target_reason` for `plan`; None for a plan without steps (the simple formula set),
    which is not judged here."""
    if not plan.steps:
        return None
    offloads = bool(plan.stage_offloads)
    return target_reason(target, plan.spec, layer_segments(plan), offloads, release)


def _reasons(plan: Plan, targets: Sequence[str]) -> list[str | None]:
    """`target_reason` of each of `targets` for `plan`, its segments recovered once."""
    layers = layer_segments(plan)
    offloads = bool(plan.stage_offloads)
    return [target_reason(target, plan.spec, layers, offloads) for target in targets]


def framework_reason(plan: Plan) -> str | None:
    """Why none of the targets of the plan's framework writes it (the first target's reason),
    or None where one does; None for a plan without steps (the simple formula set)."""
    if not plan.steps:
        return None
    reasons = _reasons(plan, FRAMEWORK_TARGETS[plan.spec.framework])
    return None if any(why is None for why in reasons) else reasons[0]


def framework_note(plan: Plan) -> str | None:
    """The note of a plan that no target of its framework writes (`framework_reason`): why,
    and which other export (`LAUNCHERS`, in order) writes it; None where one of its
    framework's targets does, or the plan has no steps."""
    if not plan.steps:
        return None
    framework = plan.spec.framework
    reasons = dict(zip(LAUNCHERS, _reasons(plan, LAUNCHERS), strict=True))
    own = FRAMEWORK_TARGETS[framework]
    if any(reasons[target] is None for target in own):
        return None
    targets = ", ".join(f"--to {t}" for t in own)
    other = [t for t in LAUNCHERS if reasons[t] is None]
    writes = f"--to {other[0]} writes it" if other else "no other export writes it"
    return (
        f"{plan.strategy}: no {framework} export ({targets}) writes it; {reasons[own[0]]}; {writes}"
    )
