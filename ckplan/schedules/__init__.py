"""Checkpointing schedules for a chain of stages.

chain (the stages and the exact memory replay) -> segments (store-all, Chen's segments,
Megatron's block) -> revolve (binomial, fixed slots) -> rotor (optimal under a budget) ->
offload (tapes on host memory: their replay and the joint DP with recomputation).
The oracles the DP is tested against live with the tests (tests/oracles/).
"""

from ckplan.lazy_names import lazy_getattr
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
from ckplan.schedules.segment_replay import (
    SegmentReplay,
    replay_runs,
    run_forwards,
    segment_replay,
    segment_runs,
)
from ckplan.schedules.segments import (
    SegmentSteps,
    schedule_segments,
    segment_schedule,
    store_all_schedule,
)

# Imported on first use, so that a command that never builds them starts faster.
_LAZY = {
    "beta": "revolve",
    "revolve_dp_min_forwards": "revolve",
    "revolve_dp_table": "revolve",
    "revolve_min_forwards": "revolve",
    "revolve_schedule": "revolve",
    "optimal_schedule": "rotor",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "BACKWARD",
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
    "held_after_forward_bytes",
    "optimal_schedule",
    "pipeline_peak_bytes",
    "replay_runs",
    "revolve_dp_min_forwards",
    "revolve_dp_table",
    "revolve_min_forwards",
    "revolve_schedule",
    "run_forwards",
    "schedule_segments",
    "segment_replay",
    "segment_runs",
    "segment_schedule",
    "simulate",
    "store_all_schedule",
]
