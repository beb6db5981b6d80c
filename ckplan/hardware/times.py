"""The times one chain stage and one micro-batch take, as records: what the step-time model
(`ckplan.hardware.step_time`) composes and its array form (`ckplan.hardware.stage_table`) adds."""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware.roofline import OpTime

ZERO = OpTime(0.0, 0.0)


@dataclass(frozen=True)
class StageTime:
    """One chain stage (embedding, a layer, output and loss), one micro-batch."""

    forward: OpTime = ZERO
    backward: OpTime = ZERO
    forward_comm: float = 0.0  # exposed seconds, in the forward and in every re-forward
    backward_comm: float = 0.0
    # selective recomputation: the attention core's re-forward in the backward (layers only)
    core_forward: OpTime = ZERO
    core_comm: float = 0.0
    # of the communication above, the expert-parallel share (MoE layers)
    expert_forward_comm: float = 0.0
    expert_backward_comm: float = 0.0
    core_expert_comm: float = 0.0


@dataclass(frozen=True)
class MicroBatchTime:
    forward: OpTime
    backward: OpTime
    recompute: OpTime
    forward_comm: float
    backward_comm: float
    recompute_comm: float
    expert_comm: float = 0.0  # the expert-parallel share of the three above
    # of expert_comm, the first forward's (the rest runs in the backward: its own collectives
    # and the re-forwards'); what a DualPipe forward chunk sends (hardware.dualpipe)
    expert_forward_comm: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.forward.total
            + self.backward.total
            + self.recompute.total
            + self.forward_comm
            + self.backward_comm
            + self.recompute_comm
        )
