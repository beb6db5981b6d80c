"""Offload plans: one pipeline stage's chain with stored tapes on host memory.

`offload` stores every tape and offloads every one but the last stage's (its backward follows
at once); `full+offload` and the other segment strategies' `+offload` run their segment
schedule and offload what its first pass stores, the checkpointed inputs and the stored
stages' tapes;
`offload+optimal` runs the joint DP over keep, offload and recompute
(ckplan.schedules.offload, Beaumont et al. 2021) on the stage times of a GPU, with the host
link's copy times and the GPU's share of its node's host memory as the host budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from ckplan.hardware.gpus import GPU
from ckplan.hardware.host_link import copy_seconds, host_memory_per_gpu
from ckplan.model.spec import ModelSpec
from ckplan.plan.strategies import Strategy, StrategyError
from ckplan.schedules import (
    BACKWARD,
    FORWARD_KEEP_INPUT,
    Chain,
    Schedule,
    held_after_forward_bytes,
)
from ckplan.schedules.offload import (
    OffloadReplay,
    offload_all,
    offload_stored,
    offload_window,
    offload_windows,
    simulate_offload,
)

NANOSECOND = 1e-9  # the DP's integer time unit


@dataclass(frozen=True)
class OffloadStage:
    """One pipeline stage's offload schedule with ``in_flight`` micro-batches: the device peak
    (the waiting micro-batches hold their device items only), host bytes (theirs too), bytes
    moved per micro-batch and the offloaded (stage, tape bytes)."""

    peak_bytes: int
    steps: Schedule
    replay: OffloadReplay
    host_bytes: int
    bytes_moved: int
    offloaded: tuple[tuple[int, int], ...]
    # the chain stage whose backward each offloaded item's copy back overlaps
    prefetch: tuple[int, ...] = ()


def pipelined_offload_bytes(
    chain: Chain, replay: OffloadReplay, in_flight: Fraction
) -> tuple[int, int]:
    """(device peak, host peak) of a pipeline stage with ``in_flight`` micro-batches.

    derived (1F1B, as ``schedules.pipeline_peak_bytes``): each of the ``in_flight - 1``
    waiting micro-batches holds what its forward left, its offloaded tapes on host and the
    rest on device; rounded up to whole bytes.
    """
    on_host = sum(replay.offloaded_bytes)
    held = held_after_forward_bytes(chain, replay.replay) - on_host
    waiting = in_flight - 1
    return (
        replay.device_peak_bytes + math.ceil(waiting * held),
        replay.host_peak_bytes + math.ceil(waiting * on_host),
    )


def stage_time_chain(
    chain: Chain, forward_seconds, backward_seconds, tape_copy_seconds
) -> tuple[Chain, tuple[int, ...]]:
    """The chain with its FLOPs replaced by whole nanoseconds of forward and backward, and the
    copy time of each tape in nanoseconds: the joint DP's costs.

    derived: the DP minimises the step's compute plus exposed copy time; stage times and copy
    times rounded to the nearest nanosecond.
    """
    ns = [round(t / NANOSECOND) for t in forward_seconds]
    nb = [round(t / NANOSECOND) for t in backward_seconds]
    copies = tuple(round(t / NANOSECOND) for t in tape_copy_seconds)
    timed = Chain(
        ns,
        nb,
        chain.input_bytes,
        chain.tape_bytes,
        chain.forward_workspace_bytes,
        chain.backward_workspace_bytes,
    )
    return timed, copies


def offload_stage(
    spec: ModelSpec,
    chain: Chain,
    strategy: Strategy,
    stage: int,
    in_flight: Fraction,
    budget: int | None,
    slots: int,
    gpu: GPU | None,
    steps: Schedule | None = None,
) -> OffloadStage | None:
    """The offload schedule of one pipeline stage; None when `offload+optimal` finds none
    within `budget` activation bytes and the GPU's host memory. `steps`: the segment schedule
    of `full+offload` (`uniform:K+offload`, ...), whose stored tapes and checkpointed inputs move
    (schedules.offload.offload_stored)."""
    if strategy.kind == "optimal":
        if budget is None:
            raise StrategyError(f"strategy {strategy.name!r} needs a memory budget (--budget)")
        if gpu is None:
            raise StrategyError(
                f"strategy {strategy.name!r} needs a GPU (--gpu): it weighs host copies "
                "against compute time"
            )
        if in_flight != 1:
            raise StrategyError(
                f"strategy {strategy.name!r} plans one micro-batch in flight: pipeline "
                "parallelism (pp > 1) is not supported; use offload"
            )
        from ckplan.hardware.step_time import chain_compute_seconds
        from ckplan.schedules.offload import (
            JOINT_MAX_STAGES,
            MAX_EXACT_COST,
            optimal_offload_schedule,
        )

        if chain.length > JOINT_MAX_STAGES:
            raise StrategyError(
                f"strategy {strategy.name!r} plans chains of at most {JOINT_MAX_STAGES} stages, "
                f"this one has {chain.length}: use offload, or fewer layers per pipeline stage"
            )

        forward, backward = chain_compute_seconds(spec, gpu, stage, strategy.groups)
        copies = [copy_seconds(tape, gpu) for tape in chain.tape_bytes]
        timed, copy_ns = stage_time_chain(chain, forward, backward, copies)
        if budget < 0:
            return None
        total_ns = sum(timed.forward_flops) + sum(timed.backward_flops)
        if chain.length * total_ns + 2 * sum(copy_ns) >= MAX_EXACT_COST:
            raise StrategyError(
                f"strategy {strategy.name!r}: this GPU's rates make the step's times, in "
                "nanoseconds, too long for the exact offload DP (n x total + copies >= 2**60); "
                "use offload"
            )
        result = optimal_offload_schedule(
            timed, budget, copy_ns, host_budget_bytes=host_memory_per_gpu(gpu), slots=slots
        )
        if result is None:
            return None
        steps, stages = result.steps, result.offloaded
    elif steps is not None:
        stages = offload_stored(steps, chain.length)
    else:
        steps, stages = offload_all(chain)
    replay = simulate_offload(chain, steps, stages)
    peak, host = pipelined_offload_bytes(chain, replay, in_flight)
    offloaded = tuple(zip(stages, replay.offloaded_bytes, strict=True))
    return OffloadStage(
        peak, steps, replay, host, replay.bytes_moved, offloaded, prefetch_stages(steps, stages)
    )


def prefetch_stages(steps: Schedule, stages) -> tuple[int, ...]:
    """The chain stage of the step each offloaded stage's copy back overlaps
    (schedules.offload.offload_window): the backward of stage i + 1 for a tape or a one-layer
    segment's input, of the stage after the segment for a longer one."""
    steps = tuple(steps)
    windows = offload_windows(steps, max(st.stage for st in steps) + 1)
    return tuple(steps[offload_window(steps, windows.n, i, windows)[1]].stage for i in stages)


def offloaded_input_count(steps: Schedule, stages) -> int:
    """How many of the offloaded `stages` move their checkpointed input rather than a tape:
    those whose first forward keeps the input only (schedules.offload.offload_window)."""
    wanted = set(stages)
    count, seen = 0, set()
    for st in steps:
        if st.stage in wanted and st.stage not in seen and st.kind != BACKWARD:
            seen.add(st.stage)
            count += st.kind == FORWARD_KEEP_INPUT
    return count


def offloaded_words(count: int, inputs: int) -> str:
    """'33 tapes', '32 checkpointed inputs' or '32 checkpointed inputs and 1 tape'."""

    def plural(n: int, word: str) -> str:
        return f"{n} {word}{'' if n == 1 else 's'}"

    tapes = count - inputs
    if not inputs:
        return plural(tapes, "tape")
    words = plural(inputs, "checkpointed input")
    return words + (f" and {plural(tapes, 'tape')}" if tapes else "")


@dataclass(frozen=True)
class CopyOverlap:
    """The largest copy of a plan's offloads beside the compute that hides it: one copy's
    seconds, the forward its copy out overlaps and the backward its copy back overlaps."""

    nbytes: int
    copy_seconds: float
    forward_seconds: float
    backward_seconds: float


def largest_copy(plan, gpu: GPU) -> CopyOverlap | None:
    """The largest offloaded item of the plan's peak pipeline stage with the stage times it
    overlaps (rules O1, O2 of ckplan.schedules.offload: stage ``i + 1``'s forward and
    backward); None without offloads.

    derived: `hardware.host_link.copy_seconds` and `hardware.step_time.chain_compute_seconds`,
    the figures `exposed_copy_seconds` weighs.
    """
    offloaded = dict(plan.stage_offloads).get(plan.peak_stage, ())
    if not offloaded:
        return None
    from ckplan.hardware.step_time import chain_compute_seconds

    forward, backward = chain_compute_seconds(
        plan.spec, gpu, plan.peak_stage, plan.recompute_groups
    )
    prefetch = dict(plan.stage_prefetch).get(plan.peak_stage) or [i + 1 for i, _ in offloaded]
    k = max(range(len(offloaded)), key=lambda k: (offloaded[k][1], -offloaded[k][0]))
    stage, nbytes = offloaded[k]
    return CopyOverlap(nbytes, copy_seconds(nbytes, gpu), forward[stage + 1], backward[prefetch[k]])
