"""A forward chunk and a backward chunk of two micro-batches run together, each one's
communication beside the other's compute: what such a pair takes and what it hides.

Two schedules pair chunks this way. DeepSeek-V3's DualPipe (Technical Report, arXiv
2412.19437, §3.2.1-§3.2.2; `hardware.dualpipe`) and Megatron-Core's combined 1F1B
(`--overlap-moe-expert-parallel-comm`; `hardware.combined_1f1b`): in both, one chunk's
expert-parallel all-to-alls run on a communication stream while the other chunk computes,
and the communication kernels hold some of the GPU's SMs meanwhile. The schedules differ in
which chunks they pair and how many SMs the communication takes; the pair itself is the same.

ckplan's pair (derived, physically bounded): each chunk's hideable communication runs beside
the other chunk's compute only, and adds what `communication.overlapped` charges: its excess
over that compute, or, when the compute outlasts it, the compute's slowdown on the SMs the
communication holds. The rest of a chunk's collectives (`Chunk.other`) stays on its critical
path.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckplan.hardware import communication as comm


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

    def scaled(self, factor: float) -> Chunk:
        """The chunk's share `factor` of every part (a virtual stage's share of a stage)."""
        return Chunk(
            self.compute * factor,
            self.expert * factor,
            self.pipeline * factor,
            self.other * factor,
        )


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


def forward_backward_seconds(forward: Chunk, backward: Chunk, sm_count: int, taken: int) -> float:
    """The two chunks run overlapped (DeepSeek-V3 Table 2's F&B, "execution time of two
    mutually overlapped forward and backward chunks"): both chunks' compute and unhidden
    collectives, and each chunk's hideable communication as it shows beside the other
    chunk's compute (`exposed_beside`), the communication holding `taken` of `sm_count` SMs."""
    return (
        forward.compute
        + backward.compute
        + forward.other
        + backward.other
        + exposed_beside(forward.hideable, backward.compute, sm_count, taken)
        + exposed_beside(backward.hideable, forward.compute, sm_count, taken)
    )


def hidden_in_pair(
    forward: Chunk, backward: Chunk, sm_count: int, taken: int
) -> tuple[float, float]:
    """(communication, expert-parallel communication) one pair hides against its two chunks
    run alone: the pair's saving, split over each chunk's expert-parallel and pipeline share
    in proportion (derived: both wait on the same compute). Never negative: beside compute
    that outlasts it, a communication adds taken / sm_count of itself at most
    (`communication.overlapped`)."""
    saved = (
        forward.alone
        + backward.alone
        - forward_backward_seconds(forward, backward, sm_count, taken)
    )
    hideable = forward.hideable + backward.hideable
    expert = forward.expert + backward.expert
    return saved, saved * expert / hideable if hideable > 0 else 0.0
