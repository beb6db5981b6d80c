"""DualPipe's overlapped forward-and-backward chunks: what a pair hides, and how many pairs a
rank runs.

DeepSeek-V3 Technical Report (arXiv 2412.19437) §3.2.1: "The key idea of DualPipe is to overlap
the computation and communication within a pair of individual forward and backward chunks"; a
pair's attention, all-to-all dispatch, MLP and all-to-all combine are rearranged so that "both
all-to-all and PP communication can be fully hidden during execution" (Figure 4), the
communication of one chunk running while the other chunk computes. §3.2.2: the communication
kernels run on "20 SMs", partitioned "into 10 communication channels", of the H800's 132, so
the compute beside them has the rest.

The reference implementation (deepseek-ai/DualPipe at 3da1bbe, dualpipe/dualpipe.py) pairs a
forward chunk of one direction with a backward chunk of the other in `_forward_backward_chunk`
(`_forward_backward_compute_chunk`, which calls the stage module's `overlapped_forward_backward`
where the module provides one); the chunks `DualPipe.step` runs alone (`_forward_chunk`,
`_backward_chunk`: the warm-up of steps 1-3, the cool-down of steps 5-7, and the middle ranks'
first chunks of step 4, "We don't overlap these two chunks to further reduce bubble size") keep
their communication exposed. The reference itself posts a chunk's pipeline sends and receives
at the next chunk's start and waits for them (`_commit_and_wait_comm`); ckplan follows the
report, whose Figure 4 runs them beside the paired chunk's compute.

ckplan's pair (derived, physically bounded): each chunk's hideable communication (its
expert-parallel all-to-alls and etp collectives as the layer model leaves them exposed, and its
pipeline send) runs beside the other chunk's compute only, and adds what
`communication.overlapped` charges: its excess over that compute, or, when the compute outlasts
it, the compute's slowdown on the SMs the communication holds. Other collectives (tensor and
context parallel) stay on the chunk's critical path, as under 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware import communication as comm

# DeepSeek-V3 report §3.2.2: "we employ the warp specialization technique ... and partition
# 20 SMs into 10 communication channels"; of the H800's 132 SMs.
COMMUNICATION_SMS = 20


@dataclass(frozen=True)
class Chunk:
    """One micro-batch's forward or backward chunk on one stage, in seconds: its compute, the
    communication a paired chunk can hide (`expert`: expert-parallel, `pipeline`: its pipeline
    send) and the rest (`other`)."""

    compute: float
    expert: float = 0.0
    pipeline: float = 0.0
    other: float = 0.0

    @property
    def hideable(self) -> float:
        return self.expert + self.pipeline

    @property
    def alone(self) -> float:
        """The chunk run by itself: everything exposed (as under 1F1B)."""
        return self.compute + self.hideable + self.other


def paired_chunks(pp: int, microbatches: int, rank: int) -> int:
    """How many overlapped forward-and-backward pairs pipeline rank `rank` runs in one
    iteration of `microbatches` (both directions together), from deepseek-ai/DualPipe at
    3da1bbe, `DualPipe.step`: step 4 runs two `_forward_backward_chunk` per iteration, over
    half_num_chunks - num_ranks + half_rank + 1 iterations, but a middle rank's first is two
    chunks alone; step 5 one per iteration, over num_half_ranks - half_rank - 1; with
    half_rank = min(rank, pp - 1 - rank). The rank runs `microbatches` forward and backward
    chunks in all; the rest run alone."""
    half, h = pp // 2, min(rank, pp - 1 - rank)
    middle = rank in (half - 1, half)
    step_4 = 2 * (microbatches // 2 - pp + h + 1) - (1 if middle else 0)
    step_5 = half - h - 1
    return step_4 + step_5


def exposed_beside(seconds: float, compute: float, sm_count: int, taken: int) -> float:
    """Seconds a chunk's hideable communication adds beside the other chunk's `compute`:
    `communication.overlapped`, with the compute slowed to sm_count / (sm_count - taken) of its
    time while the communication holds `taken` SMs (derived: the rate is per SM); no slowdown
    where the GPU has no SMs to spare (sm_count <= taken). max(0, seconds - compute) at the
    least, never more than `seconds`."""
    if seconds <= 0:
        return 0.0
    contended = compute * sm_count / (sm_count - taken) if sm_count > taken else compute
    if compute <= 0:
        return seconds
    return comm.overlapped(seconds, compute, contended)


def forward_backward_seconds(
    forward: Chunk, backward: Chunk, sm_count: int, taken: int = COMMUNICATION_SMS
) -> float:
    """F&B, Table 2's "execution time of two mutually overlapped forward and backward chunks"
    (module docstring): both chunks' compute and unhidden collectives, and each chunk's
    hideable communication as it shows beside the other chunk's compute (`exposed_beside`)."""
    return (
        forward.compute
        + backward.compute
        + forward.other
        + backward.other
        + exposed_beside(forward.hideable, backward.compute, sm_count, taken)
        + exposed_beside(backward.hideable, forward.compute, sm_count, taken)
    )
