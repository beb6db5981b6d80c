"""Exports: a plan in a launcher's own terms (`ckplan export MODEL --plan S --to TARGET`).

Each target module has `reason(spec, layers)` (why it cannot run these layer segments, None
when it can), `render(plan, layers)` (the artifact, text) and `notes(plan, layers)` (how to wire
it in). The layer segments come from the plan's own replayed schedule (`segments.py`), so an
export never describes a schedule other than the one ckplan measured. A plan that a target
cannot express is an `ExportError` that names the part and offers the nearest plan the target
can express: the cheapest (least FLOPs) whose peak is no higher, else the smallest peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.errors import InputError
from ckplan.exports import (
    deepspeed,
    megatron,
    peft,
    torch_snippet,
    torchtitan,
    torchtune,
    yaml_plan,
)
from ckplan.exports.segments import LayerSegments, layer_segments
from ckplan.model.spec import ModelSpec
from ckplan.plan import Plan, evaluate
from ckplan.quoting import quote
from ckplan.units import format_bytes_auto

TARGETS = {
    module.NAME: module
    for module in (megatron, torch_snippet, deepspeed, torchtitan, yaml_plan, peft, torchtune)
}


class ExportError(InputError):
    """A plan the target cannot express; the message offers the nearest one it can."""


@dataclass(frozen=True)
class Export:
    text: str  # the artifact, exactly as it goes into a file or a command line
    notes: tuple[str, ...] = ()  # how to wire it in, for people


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ExportError(f"--to {quote(target)}: expected one of {', '.join(TARGETS)}")
    return target


def check_version(target: str, version: str | None) -> str | None:
    """The release to write for: torchtitan's `version` (default torchtitan.DEFAULT_VERSION);
    None for the other targets, which take no version."""
    if target != torchtitan.NAME:
        if version is not None:
            raise ExportError(f"--torchtitan-version {quote(version)} applies to --to torchtitan")
        return None
    if version is None:
        return torchtitan.DEFAULT_VERSION
    if version not in torchtitan.VERSIONS:
        raise ExportError(
            f"--torchtitan-version {quote(version)}: expected " + " or ".join(torchtitan.VERSIONS)
        )
    return version


def why_not(plan: Plan, target: str, version: str | None = None) -> str | None:
    """Why `target` cannot express `plan` (None when it can); `version`: the target's release
    where it has several (torchtitan: `torchtitan.VERSIONS`), None for its default."""
    if plan.stage_offloads and target not in (torch_snippet.NAME, deepspeed.NAME, torchtune.NAME):
        return f"plan {plan.strategy}: {_offload_reason(plan, target)}"
    if target == yaml_plan.NAME:
        return None
    if plan.spec.mlp_tiles > 1:
        return (
            f"plan {plan.strategy}: mlp_tiles ({plan.spec.mlp_tiles}) is TiledMLP, which "
            "replaces the MLP's forward in the model's code (DeepSpeed's "
            "deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP); no config key runs it"
        )
    if plan.spec.mtp_layers and target != megatron.NAME:
        return (
            f"plan {plan.strategy}: mtp_layers ({plan.spec.mtp_layers}) are Megatron-Core's "
            "multi-token prediction layers (--mtp-num-layers); no other target runs them"
        )
    layers = layer_segments(plan)
    if isinstance(layers, str):
        return f"plan {plan.strategy}: {layers}"
    if layers.policy_layers is not None and target != torch_snippet.NAME:
        return f"plan {plan.strategy}: {_mixed_reason(target)}"
    if target == deepspeed.NAME and plan.stage_offloads:
        because = deepspeed.offload_reason(layers)
        if because is not None:
            return f"plan {plan.strategy}: {because}"
    if target == torchtitan.NAME:
        because = torchtitan.reason(plan.spec, layers, version or torchtitan.DEFAULT_VERSION)
    else:
        because = TARGETS[target].reason(plan.spec, layers)
    return None if because is None else f"plan {plan.strategy}: {because}"


def _mixed_reason(target: str) -> str:
    """Why `target` cannot run a plan storing the full tape in some layers and a per-op
    policy's in others (one phrase)."""
    if target == torchtitan.NAME:
        return (
            "it stores the full tape in some layers and the per-op policy's in others, and "
            "torchtitan's activation_checkpoint section applies one mode to every layer "
            "(--to torch wraps each layer)"
        )
    return (
        f"it stores the full tape in some layers and the per-op policy's in others, and {target} "
        "has no per-op policies (--to torch wraps each layer)"
    )


def _offload_reason(plan: Plan, target: str) -> str:
    """Why `target` cannot write an offload plan (one phrase)."""
    if target == megatron.NAME:
        return megatron.offload_reason(plan.flops.recompute > 0)
    if target == torchtitan.NAME:
        return (
            "torchtitan's activation_checkpoint section has no offloading key (--to torch "
            "writes torch.autograd.graph.save_on_cpu around the layers)"
        )
    return (
        "offloading to host memory is exported to PyTorch (--to torch), torchtune (offload, "
        "full+offload) and, for the checkpointed inputs of full+offload, DeepSpeed "
        "(--to deepspeed)"
    )


def export(
    plan: Plan, target: str, recompute_modules: bool = True, version: str | None = None
) -> Export:
    """The plan written for `target` (at `version`, see why_not), or ExportError with the
    nearest expressible plan."""
    module = TARGETS[check_target(target)]
    version = check_version(target, version)
    because = why_not(plan, target, version)
    if because is not None:
        raise ExportError(f"{target} cannot express {because}; {_offer(plan, target, version)}")
    layers = layer_segments(plan)
    if module is yaml_plan:
        return Export(yaml_plan.render(plan, None if isinstance(layers, str) else layers))
    assert isinstance(layers, LayerSegments)
    if module is megatron:
        if layers.extra and not recompute_modules:
            raise ExportError(
                f"{target} without --recompute-modules cannot express plan {plan.strategy}: "
                f"Megatron-Core's {layers.extra[0]} module is named only by that flag"
            )
        text = megatron.render(plan, layers, recompute_modules)
    elif module is torchtitan:
        text = torchtitan.render(plan, layers, version)
    else:
        text = module.render(plan, layers)
    if module is torchtitan:
        notes = torchtitan.notes(plan, layers, version)
    else:
        notes = list(module.notes(plan, layers))
    if plan.spec.training != "full" and module not in (peft, torchtune):
        notes.append(
            f"training: {plan.spec.training}: the plan's memory assumes frozen base weights"
            + (
                f" and LoRA r={plan.spec.lora_rank} on {plan.spec.lora_targets}"
                if plan.spec.finetune.adapters
                else ""
            )
            + "; set them up in the training code (these settings carry only the recomputation)"
        )
    return Export(text, tuple(notes))


def nearest(plan: Plan, target: str, version: str | None = None) -> Plan | None:
    """The target's nearest plan to `plan` among the sweep's strategies: the cheapest whose
    peak is no higher than `plan`'s, else the one with the smallest peak; None if none."""
    from ckplan.plan.search import candidate_strategies  # the sweep's candidates

    spec = plan.spec
    expressible = []
    for strategy in candidate_strategies(spec):
        candidate = evaluate(spec, strategy)
        if candidate is not None and why_not(candidate, target, version) is None:
            expressible.append(candidate)
    if not expressible:
        return None
    within = [c for c in expressible if c.activation_bytes <= plan.activation_bytes]
    if within:
        return min(within, key=lambda c: (c.flops.total, c.activation_bytes))
    return min(expressible, key=lambda c: (c.activation_bytes, c.flops.total))


def _offer(plan: Plan, target: str, version: str | None = None) -> str:
    near = nearest(plan, target, version)
    if near is None:
        return f"no plan of this model is expressible for {target}"
    return (
        f"nearest expressible plan: {near.strategy} (peak activations "
        f"{format_bytes_auto(near.activation_bytes)} vs {format_bytes_auto(plan.activation_bytes)}"
        f", recompute overhead {near.overhead:.2%} vs {plan.overhead:.2%}); "
        f"run with --plan {near.strategy}"
    )


def best_expressible(spec: ModelSpec, candidates, target: str, version: str | None = None):
    """For `--plan auto`: the cheapest fitting candidate (search.Candidate) the target can
    express (at `version`), else None: the sweep's rule (`search.choose` in FLOPs order) among
    the plans the target writes, first those an export of the job's framework writes too
    (`Candidate.exported`), so that it is the sweep's best wherever the target writes that;
    then any the target writes (a target outside the job's framework, such as --to torch for a
    Megatron-LM job, may write a plan where the framework's own targets write none that fits)."""
    from ckplan.plan.search import choose, cost_key

    written = [c for c in candidates if why_not(c.plan, target, version) is None]
    if not written:
        return None
    best = choose(written, cost_key("flops")).best
    return best or choose(written, cost_key("flops"), lambda c: True).best


__all__ = [
    "TARGETS",
    "Export",
    "ExportError",
    "best_expressible",
    "check_target",
    "check_version",
    "export",
    "nearest",
    "why_not",
]
