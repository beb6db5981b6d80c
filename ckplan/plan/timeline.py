"""The memory timeline of a plan's step: live activation bytes before and during each step of
its replayed schedule, for `ckplan estimate --plot`.

The replay is `schedules.simulate` on the chain the plan was evaluated on (the fuller pipeline
stage); with micro-batches in flight, the others waiting for their backward hold what their
forward left (`schedules.pipeline_peak_bytes`), a constant added to every point, as are the
pipeline runtime's buffers (`Plan.pipeline_buffer_bytes`). So the
timeline's maximum is exactly the plan's `activation_bytes`. An offload plan's timeline is the
device side of `schedules.offload.simulate_offload` (its tapes on host between their copies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckplan.plan.evaluate import Plan, in_flight_microbatches
from ckplan.plan.layer_chain import layer_chain, stage_names
from ckplan.schedules import held_after_forward_bytes, simulate


@dataclass(frozen=True)
class Timeline:
    labels: tuple[str, ...]  # one per step: "forward layer 3", "backward output+loss", ...
    during_bytes: tuple[int, ...]  # live while the step runs
    after_bytes: tuple[int, ...]  # live once it has finished
    initial_bytes: int
    waiting_bytes: int  # held by the other micro-batches in flight, included above
    buffer_bytes: int = 0  # the pipeline runtime's buffers, all step, included above

    @property
    def peak_bytes(self) -> int:
        return max(self.initial_bytes, *self.during_bytes, *self.after_bytes)

    @property
    def peak_step(self) -> int:
        """Index of the first step whose during-figure is the peak (-1: the initial state)."""
        return next((i for i, b in enumerate(self.during_bytes) if b == self.peak_bytes), -1)


STEP_VERBS = {
    "forward_drop": "forward",
    "forward_keep_input": "forward",
    "forward_keep_all": "forward",
    "backward": "backward",
}


def memory_timeline(plan: Plan) -> Timeline | None:
    """The plan's timeline, or None when it has no schedule (the simple formula set)."""
    if not plan.steps:
        return None
    spec = plan.spec
    if spec.pipeline_schedule == "dualpipe":
        return _dualpipe_timeline(plan)
    first_stage = spec.pp == 1 or "layer 0" in plan.stage_names  # which stage the steps run
    chain = layer_chain(spec, plan.strategy.startswith("selective"), first_stage)
    replay = simulate(chain, plan.steps)
    trace = [(point.during_bytes, point.after_bytes) for point in replay.trace]
    on_host = 0
    offloaded = dict(plan.stage_offloads).get(plan.peak_stage, ())
    if offloaded:
        from ckplan.schedules.offload import simulate_offload

        trace = simulate_offload(chain, plan.steps, [i for i, _ in offloaded]).device_trace
        on_host = sum(nbytes for _, nbytes in offloaded)
    waiting = 0
    if spec.pp > 1 and first_stage:
        in_flight = in_flight_microbatches(spec)
        held = held_after_forward_bytes(chain, replay) - on_host
        waiting = math.ceil((in_flight - 1) * held)
    return _shifted(plan, trace, replay.initial_bytes, waiting, plan.pipeline_buffer_bytes)


def _shifted(plan: Plan, trace, initial: int, waiting: int, buffers: int) -> Timeline:
    """The running micro-batch's trace (during, after each step) with what waits beside it all
    step, the other micro-batches' tapes and the pipeline's buffers, added at every point."""
    labels = tuple(f"{STEP_VERBS[step.kind]} {plan.stage_names[step.stage]}" for step in plan.steps)
    constant = waiting + buffers
    return Timeline(
        labels,
        tuple(during + constant for during, _ in trace),
        tuple(after + constant for _, after in trace),
        initial + constant,
        waiting,
        buffers,
    )


def _dualpipe_timeline(plan: Plan) -> Timeline:
    """The timeline of a DualPipe rank (`plan.peak_stage`): the steps of the stage whose schedule
    runs at the rank's peak (`evaluate.dualpipe_rank_peaks`), with its own other micro-batches
    and the other stage's (`evaluate.dualpipe_in_flight`) waiting beside it: a constant over the
    running micro-batch's steps, the plan's peak less the replay's."""
    spec = plan.spec
    rank, mirror = plan.peak_stage, spec.pp - 1 - plan.peak_stage
    side = rank if tuple(stage_names(spec, stage=rank)) == tuple(plan.stage_names) else mirror
    chain = layer_chain(spec, plan.recompute_groups, stage=side)
    replay = simulate(chain, plan.steps)
    waiting = plan.activation_bytes - replay.peak_bytes
    trace = [(point.during_bytes, point.after_bytes) for point in replay.trace]
    return _shifted(plan, trace, replay.initial_bytes, waiting, 0)
