"""Which schedules a launcher can run at all, from the schedule alone: a launcher wraps ranges of
transformer layers in a checkpoint, one level deep, and applies one recompute setting to every
pipeline stage. `unwritten_reason` gives a plan its note where no launcher export writes it
(`model.op_policy.NO_EXPORT`); ckplan.plan.export_limits builds each launcher's own rules on
these ranges."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ckplan.schedules import schedule_segments

LAYER_PREFIX = "layer "
# A multi-token prediction depth: a transformer block that Megatron-Core recomputes with the
# layers (multi_token_prediction.py `_checkpointed_forward`, core_v0.14.0), so it counts as one.
MTP_PREFIX = "mtp "


def is_layer(name: str) -> bool:
    """Whether chain stage `name` (`layer_chain.stage_names`) is a transformer layer."""
    return name.startswith((LAYER_PREFIX, MTP_PREFIX))


@lru_cache(maxsize=64)
def layer_positions(names: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the chain stages of `names` that are transformer layers, in order; for each i in
    0..len(names), how many of them come before stage i): built once per chain and read per
    plan, as a sweep asks it of a thousand plans over one stage of thousands of layers."""
    positions, before, count = [], [0], 0
    for i, name in enumerate(names):
        if is_layer(name):
            positions.append(i)
            count += 1
        before.append(count)
    return tuple(positions), tuple(before)


def pipeline_reason(pp: int, strategy: str, offloads: bool) -> str | None:
    """Why no launcher runs plan `strategy` on `pp` pipeline stages, or None: each stage's
    schedule is its own (an offload schedule, or the optimal DP run per stage), and every
    target applies one setting to every stage: Megatron-LM's --recompute-method and
    --recompute-num-layers are one value for every model chunk (megatron/training/arguments.py
    at core_v0.19.0, mirrored in tests/megatron_flags.py), torchtitan's activation_checkpoint
    section one mode for every block (torchtitan/config/job_config.py at v0.2.2; at 0.3.0 one
    policy applied to the whole model, torchtitan/distributed/activation_checkpoint.py),
    DeepSpeed's activation_checkpoint_interval one interval for the whole PipelineModule
    (deepspeed/runtime/pipe/module.py at v0.19.8), and the torch snippet runs one stage's ranges
    on each stage (exports.torch_snippet)."""
    if pp <= 1:
        return None
    if offloads:
        return (
            "each pipeline stage offloads its own layers and a launcher applies one setting to "
            "every stage"
        )
    if strategy.endswith("optimal"):
        return (
            "each pipeline stage has its own optimal schedule and a launcher applies one "
            "recompute setting to every stage"
        )
    return None


def layer_ranges(steps, names: Sequence[str]) -> tuple[tuple[int, int, bool], ...] | str:
    """The layer ranges of one pipeline stage's schedule `steps` over chain stages `names`:
    half-open `(start, end, recompute)` over the stage's layers (0..layers-1), the chain's other
    stages (embedding, output) dropped where stored, in order and not merged; or the reason (one
    phrase) why a launcher cannot run it: a range re-run more than once (nested
    recomputation), or a recomputed range that holds a stage other than layers (a launcher
    checkpoints ranges of transformer layers only)."""
    segments = schedule_segments(steps, len(names))
    if segments is None:
        return "its schedule re-runs some layers more than once (nested recomputation)"
    positions, before = layer_positions(tuple(names))
    first_layer = positions[0] if positions else 0
    ranges = []
    for start, end, recompute in segments:
        inside = before[end] - before[start]  # the layers among stages start..end-1
        if recompute and inside != end - start:
            extra = next(names[i] for i in range(start, end) if not is_layer(names[i]))
            return f"it recomputes the {extra} stage together with layers"
        if inside:
            first, last = positions[before[start]], positions[before[end] - 1]
            ranges.append((first - first_layer, last + 1 - first_layer, recompute))
    return tuple(ranges)


def unwritten_reason(pp: int, strategy: str, steps, names, offloads: bool) -> str | None:
    """Why no launcher export writes a plan (its pipeline stages `pp`, strategy name, the
    replayed `steps` over chain stages `names` of its peak stage, whether it offloads), or
    None; a plan without steps (the simple formula set) is not judged here."""
    if not steps:
        return None
    if why := pipeline_reason(pp, strategy, offloads):
        return why
    ranges = layer_ranges(steps, names)
    return ranges if isinstance(ranges, str) else None
