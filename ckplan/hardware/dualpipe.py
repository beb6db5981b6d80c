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

The pair itself, what its chunks hide of each other, is `hardware.chunk_pairs`'s; the
communication holds the 20 SMs of §3.2.2 here.
"""

from __future__ import annotations

from ckplan.hardware import chunk_pairs
from ckplan.hardware.chunk_pairs import Chunk, exposed_beside

__all__ = [
    "COMMUNICATION_SMS",
    "Chunk",
    "exposed_beside",
    "forward_backward_seconds",
    "paired_chunks",
]

# DeepSeek-V3 report §3.2.2: "we employ the warp specialization technique ... and partition
# 20 SMs into 10 communication channels"; of the H800's 132 SMs.
COMMUNICATION_SMS = 20


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


def forward_backward_seconds(
    forward: Chunk, backward: Chunk, sm_count: int, taken: int = COMMUNICATION_SMS
) -> float:
    """F&B, Table 2's "execution time of two mutually overlapped forward and backward chunks":
    `chunk_pairs.forward_backward_seconds` with the communication on §3.2.2's 20 SMs."""
    return chunk_pairs.forward_backward_seconds(forward, backward, sm_count, taken)
