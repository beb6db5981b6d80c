"""Checkpointing schedules for a chain of stages.

chain (the stages and the exact memory replay) -> segments (store-all, Chen's segments,
Megatron's block) -> revolve (binomial, fixed slots) -> rotor (optimal under a budget) ->
brute_force (the oracle the DP is tested against).
"""

from ckplan.schedules.brute_force import (
    BRUTE_FORCE_MAX_STAGES,
    brute_force_optimal,
    enumerate_persistent_schedules,
)
from ckplan.schedules.chain import (
    BACKWARD,
    FORWARD_DROP,
    FORWARD_KEEP_ALL,
    FORWARD_KEEP_INPUT,
    FORWARD_KINDS,
    STEP_KINDS,
    Chain,
    MemoryPoint,
    Replay,
    Schedule,
    ScheduleResult,
    Step,
    held_after_forward_bytes,
    pipeline_peak_bytes,
    simulate,
)
from ckplan.schedules.revolve import (
    beta,
    revolve_dp_min_forwards,
    revolve_dp_table,
    revolve_min_forwards,
    revolve_schedule,
)
from ckplan.schedules.rotor import optimal_schedule
from ckplan.schedules.segments import (
    SegmentReplay,
    SegmentSteps,
    segment_replay,
    segment_schedule,
    store_all_schedule,
)

__all__ = [
    "BACKWARD",
    "BRUTE_FORCE_MAX_STAGES",
    "FORWARD_DROP",
    "FORWARD_KEEP_ALL",
    "FORWARD_KEEP_INPUT",
    "FORWARD_KINDS",
    "STEP_KINDS",
    "Chain",
    "MemoryPoint",
    "Replay",
    "Schedule",
    "ScheduleResult",
    "SegmentReplay",
    "SegmentSteps",
    "Step",
    "beta",
    "brute_force_optimal",
    "enumerate_persistent_schedules",
    "held_after_forward_bytes",
    "optimal_schedule",
    "pipeline_peak_bytes",
    "revolve_dp_min_forwards",
    "revolve_dp_table",
    "revolve_min_forwards",
    "revolve_schedule",
    "segment_replay",
    "segment_schedule",
    "simulate",
    "store_all_schedule",
]
